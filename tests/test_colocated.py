"""The colocated mode (services/colocated): the prefill and decode workers in one process, on one
model. Its helpers in-process first, then the real processes over real gRPC, checked as the
disaggregated stack is: greedy tokens against transformers, ListWorkers, SIGTERM, the notify protocol.
"""

from __future__ import annotations

import os
import signal
import socket
import struct
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from services.colocated.notify import JointNotify
from services.colocated.threads import run_together
from shared.config.schema import parse_cores
from shared.control.messages import EXIT_REFUSED
from shared.control.router_link import RegistrationRefused, WorkerLoad
from shared.kv.pool import make_layout
from shared.kv.transfer import export_pool
from shared.kv.transfer.local_exports import SameProcessMapping
from shared.kv.transfer.shm import ShmBackend
from shared.runtime import metrics
from tests.conftest import CACHE_DIR
from tests.reference import assert_matches_reference, reference_greedy
from tests.stack import ServiceStack
from tests.test_e2e_generation import MAX_TOKENS, _cases, _generate, _prompt_ids, _request
from tests.test_metrics import scrape, value

COLOCATED = ("router", "colocated")


def _few_cases(tokenizer) -> list[tuple]:
    """A chat, a plain prompt and token ids, of the end-to-end tests' cases."""
    return _cases(tokenizer)[::3]


# ---- in-process ----

class RecordingNotify:
    def __init__(self) -> None:
        self.sent: list[str] = []

    def ready(self) -> None:
        self.sent.append("READY=1")

    def watchdog(self) -> None:
        self.sent.append("WATCHDOG=1")

    def stopping(self) -> None:
        self.sent.append("STOPPING=1")


def test_joint_notify_speaks_for_the_process_only_while_every_loop_is_alive():
    recorded = RecordingNotify()
    joint = JointNotify(recorded, ("prefill", "decode"))
    prefill, decode = joint.member("prefill"), joint.member("decode")
    prefill.ready()
    prefill.ready()
    assert recorded.sent == []
    decode.ready()
    assert recorded.sent == ["READY=1"]
    for _ in range(5):  # a stuck prefill: the decode's pings alone keep nothing alive
        decode.watchdog()
    assert recorded.sent == ["READY=1"]
    prefill.watchdog()
    assert recorded.sent == ["READY=1", "WATCHDOG=1"]
    decode.stopping()
    prefill.stopping()
    assert recorded.sent == ["READY=1", "WATCHDOG=1", "STOPPING=1"]


def test_one_crashed_loop_stops_the_others_and_fails_the_process():
    stopping = threading.Event()
    ended: list[str] = []

    def serving() -> None:
        stopping.wait(timeout=10)
        ended.append("serving")

    def crashing() -> None:
        raise RuntimeError("boom")

    assert run_together({"decode": serving, "prefill": crashing}, stopping) == 1
    assert ended == ["serving"] and stopping.is_set()


def test_a_refused_loop_exits_the_process_with_the_refusal_code():
    """A worker the router refused must not be restarted into the same refusal (EXIT_REFUSED)."""
    stopping = threading.Event()

    def refused() -> None:
        raise RegistrationRefused("refused by the router: protocol version 1")

    assert run_together({"decode": stopping.wait, "prefill": refused}, stopping) == EXIT_REFUSED


def test_loops_stopped_by_the_signal_end_cleanly():
    stopping = threading.Event()
    threading.Timer(0.1, stopping.set).start()  # as SIGTERM's handler does
    assert run_together({"decode": stopping.wait, "prefill": stopping.wait}, stopping) == 0


def test_a_pool_exported_by_this_process_maps_to_the_exporters_own_pool():
    exported = export_pool(make_layout(2, 4, 16, 2, 8, torch.float32), "same-process", "cpu")
    segment = Path("/dev/shm") / exported.handles[0].locator.decode()
    mapped = ShmBackend.map_pool(exported.handles[0], torch.device("cpu"))
    assert isinstance(mapped, SameProcessMapping)
    assert mapped.pool.kv.data_ptr() == exported.pool.kv.data_ptr()
    mapped.close()
    exported.close()
    assert not segment.exists()
    with pytest.raises(FileNotFoundError):  # a closed export is no longer this process's to hand out
        ShmBackend.map_pool(exported.handles[0], torch.device("cpu"))


def test_load_gauges_add_up_the_workers_of_one_process():
    metrics.watch_workers([lambda: WorkerLoad(8, 2, 3, []), lambda: WorkerLoad(8, 5, 1, [])])
    assert metrics.NUM_REQUESTS_RUNNING.collect()[0].samples[0].value == 7
    assert metrics.NUM_REQUESTS_WAITING.collect()[0].samples[0].value == 4


# ---- the real processes ----

@pytest.fixture(scope="module")
def colocated(checkpoint, tmp_path_factory):
    """The router and the colocated process; at teardown both pools drained and both exit 0."""
    with ServiceStack(tmp_path_factory.mktemp("colocated"), CACHE_DIR, services=COLOCATED) as stack:
        yield stack
        stack.stop_drained()


@pytest.fixture(scope="module")
def references(tokenizer, reference_model):
    return [reference_greedy(reference_model, _prompt_ids(tokenizer, kind, value), MAX_TOKENS)
            for kind, value in _few_cases(tokenizer)]


@pytest.mark.e2e
def test_greedy_matches_transformers_one_by_one(colocated, tokenizer, references):
    for i, case in enumerate(_few_cases(tokenizer)):
        ids, text, _ = _generate(colocated.stub, _request(*case))
        expected, logits = references[i]
        assert_matches_reference(ids, expected, logits, f"colocated {case[0]} #{i}")
        assert text == tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.e2e
def test_greedy_matches_transformers_concurrently(colocated, tokenizer, references):
    cases = _few_cases(tokenizer)
    with ThreadPoolExecutor(len(cases)) as pool:
        results = list(pool.map(lambda case: _generate(colocated.stub, _request(*case)), cases))
    for i, (ids, _, _) in enumerate(results):
        expected, logits = references[i]
        assert_matches_reference(ids, expected, logits, f"colocated concurrent #{i}")
    colocated.assert_pools_drained()


@pytest.mark.e2e
def test_router_sees_a_prefill_and_a_decode_of_one_process_and_one_model(colocated):
    assert sorted(w.role for w in colocated.workers()) == ["decode", "prefill"]
    registered = colocated.logged("router", "worker registered")
    pid = colocated.processes["colocated"].pid
    assert {(e["role"], e["pid"]) for e in registered} == {("prefill", pid), ("decode", pid)}
    assert len(colocated.logged("colocated", "model loaded")) == 1


@pytest.mark.e2e
def test_each_worker_thread_runs_on_its_own_half_of_the_cores(colocated):
    allowed = sorted(os.sched_getaffinity(0))  # the services inherit the test's cores
    middle = max(1, len(allowed) // 2)
    pinned = {e["worker_id"]: e["cores"] for e in colocated.logged("colocated", "pinned")}
    assert pinned == {"prefill-0": allowed[:middle], "decode-0": allowed[middle:] or allowed[-1:]}
    pid = colocated.processes["colocated"].pid
    masks = {line.split(":", 1)[1].strip()
             for task in Path(f"/proc/{pid}/task").iterdir()
             for line in (task / "status").read_text().splitlines() if line.startswith("Cpus_allowed_list")}
    for cores in pinned.values():  # each worker's threads really run there, not just say so
        assert cores in [parse_cores(mask) for mask in masks], (cores, masks)


@pytest.mark.e2e
def test_one_metrics_endpoint_serves_both_workers(colocated):
    samples = scrape(colocated.metrics_url("decode"))
    for worker in colocated.workers():
        assert value(samples, "kv_pages_free", worker_id=worker.worker_id, role=worker.role) is not None
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(colocated.metrics_url("prefill"), timeout=2)


def _notifications(listener: socket.socket, done: threading.Event, into: list[tuple[int, str]]) -> None:
    """Drains the notify socket as systemd does, keeping each datagram's sender pid."""
    ucred = struct.calcsize("3i")
    while not done.is_set():
        try:
            data, ancillary, _, _ = listener.recvmsg(256, socket.CMSG_SPACE(ucred))
        except TimeoutError:
            continue
        pid = next(struct.unpack("3i", cdata[:ucred])[0] for level, kind, cdata in ancillary
                   if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS)
        into.append((pid, data.decode()))


@pytest.mark.e2e
@pytest.mark.slow
def test_sigterm_deregisters_both_workers_and_the_process_notifies_as_one(checkpoint, tmp_path):
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
    listener.bind(str(tmp_path / "notify.sock"))
    listener.settimeout(0.2)
    received: list[tuple[int, str]] = []
    done = threading.Event()
    drainer = threading.Thread(target=_notifications, args=(listener, done, received))
    drainer.start()
    # A long heartbeat timeout: only the workers' Deregister can drop them from the router quickly.
    settings = {"NOTIFY_SOCKET": str(tmp_path / "notify.sock"), "WATCHDOG_USEC": "1000000",
                "PDSERVE_ROUTER_HEARTBEAT_TIMEOUT_S": "60"}
    try:
        with ServiceStack(tmp_path, CACHE_DIR, services=COLOCATED, **settings) as stack:
            process = stack.processes["colocated"]
            assert stack.shm_segments(), "the prefill exports its pool in shared memory"
            ids, _, _ = _generate(stack.stub, _request("prompt", "Hello", max_tokens=4, ignore_eos=True))
            assert len(ids) == 4
            stack.assert_pools_drained()
            time.sleep(2.5)
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=30) == 0
            stack.wait_worker_gone("prefill", timeout_s=5)
            stack.wait_worker_gone("decode", timeout_s=5)
            codes = stack.stop()  # fails on a segment left behind
        assert codes == {"router": 0, "colocated": 0}
        time.sleep(0.5)
        sent = [message for pid, message in received if pid == process.pid]
        assert sent.count("READY=1") == 1 and sent.count("STOPPING=1") == 1
        assert sent.index("READY=1") < sent.index("WATCHDOG=1") < sent.index("STOPPING=1")
        assert sent.count("WATCHDOG=1") >= 3  # every 0.5 s while both loops run
    finally:
        done.set()
        drainer.join()
        listener.close()


@pytest.mark.e2e
@pytest.mark.slow
def test_a_crashed_worker_thread_takes_the_whole_process_down(checkpoint, tmp_path):
    """The decode's thread fails to pin itself: the prefill stops too, and the process exits 1."""
    stack = ServiceStack(tmp_path, CACHE_DIR, services=("colocated",), PDSERVE_DECODE_CPU_CORES="4095")
    stack.start("colocated")
    try:
        assert stack.processes["colocated"].wait(timeout=120) == 1
    finally:
        stack.stop()  # fails on a segment left behind
    assert [e["thread"] for e in stack.logged("colocated", "worker thread crashed")] == ["decode"]
    assert stack.logged("colocated", "prefill worker stopped")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_colocated_on_gpu_matches_the_disaggregated_stack(tmp_path):
    """Both stacks on cuda:0 in float32 (a random-weight Llama, built from the same seed in every
    process), long prompts in chunks: the same greedy tokens, and transformers' within its ties."""
    from pdserve.v1 import generation_pb2
    from shared.model.presets import random_hf_model
    from shared.model.weight_share import weights_file

    model_path = "random:llama-tiny"
    prompts = [[1, 5, 9, 200, 31, 7], list(range(10, 90)), [3] * 40 + [17, 19, 23]]
    settings = {"PDSERVE_MODEL_PATH": model_path, "PDSERVE_MODEL_DEVICE": "cuda:0", "PDSERVE_MODEL_DTYPE": "float32",
                "PDSERVE_PREFILL_CHUNK_TOKENS": "32"}
    tokens = {}
    for services in (("router", "prefill", "decode"), COLOCATED):
        (tmp_path / services[-1]).mkdir()
        with ServiceStack(tmp_path / services[-1], CACHE_DIR, services=services, **settings) as stack:
            tokens[services[-1]] = [
                [t for chunk in stack.stub.Generate(generation_pb2.GenerateRequest(
                    prompt_token_ids=prompt, max_tokens=16, temperature=0), timeout=120) for t in chunk.token_ids]
                for prompt in prompts]
            stack.assert_pools_drained()
            if services == COLOCATED:  # one copy of the weights, published to nobody
                assert not weights_file(stack.env["PDSERVE_ROUTER_RUNTIME_DIR"], "prefill-0").exists()
                ready = stack.logged("colocated", "decode worker ready")
                assert ready[0]["stream_priority"] < 0, "the decode's stream has a raised priority"
            codes = stack.stop()
        assert codes == {name: 0 for name in codes}, codes
    assert tokens["colocated"] == tokens["decode"]
    reference = random_hf_model(model_path, torch.float32, "cuda:0")
    for prompt, ids in zip(prompts, tokens["colocated"]):
        expected, logits = reference_greedy(reference, prompt, 16)
        assert_matches_reference(ids, expected, logits, f"colocated gpu prompt of {len(prompt)}")
