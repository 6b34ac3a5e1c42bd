"""The NIXL backend for real, on the CPU, over UCX on TCP loopback: a prefill's pool exported in a
child process, read into a pool of this process by the decode's own KvPuller; then the stack with
kv.transfer = "nixl", token for token against transformers, and a decode killed mid-transfer.

UCX is kept on the loopback device (UCX_NET_DEVICES=lo), so no byte goes to another address."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import grpc
import pytest
import torch

from pdserve.v1 import generation_pb2
from services.decode.kv_pull import HandoffError, KvPuller
from shared.control import wire
from shared.control.messages import DecodeTask, KvPoolHandle, SamplingParams, StopParams
from shared.config.schema import KvConfig
from shared.kv.pool import allocate_local_pool, make_layout
from shared.kv.transfer import TransferState
from shared.kv.transfer.nixl_agent import nixl_module
from tests.conftest import CACHE_DIR
from tests.listeners import listening_sockets
from tests.reference import assert_matches_reference, reference_greedy
from tests.seeded_pool import fill_seeded
from tests.stack import REPO, ServiceStack

UCX_LOOPBACK = {"UCX_TLS": "tcp", "UCX_NET_DEVICES": "lo"}
PAGE_SIZE = 4
SPEC = dict(num_layers=3, page_size=PAGE_SIZE, num_kv_heads=2, head_dim=8, dtype=torch.float32)
# An MLA pool in int8: one latent shard a layer (576 values in DeepSeek's, 40 here), scales beside.
LATENT_INT8 = dict(num_layers=3, page_size=PAGE_SIZE, num_kv_heads=1, head_dim=40, dtype=torch.int8,
                   shards_per_layer=1)
PREFILL_PAGES, DECODE_PAGES = 12, 9  # the decode's last page is its scratch page

pytestmark = pytest.mark.e2e  # every test here reads from a real exporter process, or a stack

try:
    nixl_module()
except RuntimeError as exc:
    pytest.skip(f"NIXL is not installed: {exc}", allow_module_level=True)

# A prefill's pool (the layout in argv[3]) filled from a seed, exported by NIXL; the handle goes out
# as a PoolAvailable frame on stdout, and the process serves reads until stdin closes.
_EXPORTER = textwrap.dedent("""
    import json, sys, torch
    from shared.control import wire
    from shared.kv.pool import make_layout
    from shared.kv.transfer import export_pool
    from shared.control.messages import PoolAvailable
    from tests.seeded_pool import fill_seeded
    spec = json.loads(sys.argv[3])
    spec["dtype"] = getattr(torch, spec["dtype"])
    exported = export_pool(make_layout(num_pages=12, **spec), "nixl-test", sys.argv[2], "nixl")
    fill_seeded(exported.pool, int(sys.argv[1]))
    print("handle", wire.encode(PoolAvailable("prefill-0", exported.handles)).hex())
    sys.stdout.flush()
    sys.stdin.read()
    exported.close()
""")


def expected_pool(seed: int, spec: dict = SPEC):
    """What the exporter of this seed and layout holds."""
    pool, _ = allocate_local_pool(make_layout(num_pages=PREFILL_PAGES, **spec), "cpu")  # its views hold the buffer
    fill_seeded(pool, seed)
    return pool


def start_exporter(device: str = "cpu", spec: dict = SPEC) -> tuple[subprocess.Popen, list[KvPoolHandle]]:
    layout = json.dumps({**spec, "dtype": str(spec["dtype"]).removeprefix("torch.")})
    process = subprocess.Popen([sys.executable, "-c", _EXPORTER, "7", device, layout], cwd=REPO,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, env={**os.environ, **UCX_LOOPBACK})
    line = ""
    while not line.startswith("handle "):  # NIXL's own log lines come first
        line = process.stdout.readline().decode()
        assert line, "the exporter died"
    return process, wire.decode(bytes.fromhex(line.split()[1])).pool_handles


@pytest.fixture
def spec() -> dict:
    return SPEC


@pytest.fixture
def exporter(spec):
    process, handles = start_exporter(spec=spec)
    yield process, handles
    process.send_signal(signal.SIGCONT)
    process.kill()
    process.wait()


@pytest.fixture
def decode_side(monkeypatch, spec):
    for name, value in UCX_LOOPBACK.items():
        monkeypatch.setenv(name, value)
    local, buffer = allocate_local_pool(make_layout(num_pages=DECODE_PAGES, **spec), "cpu")
    local.kv.fill_(-7)
    if local.scales is not None:
        local.scales.fill_(-7.0)
    freed: list[int] = []
    yield local, freed
    del buffer


def task(src_pages: list[int], request_id: str = "r1") -> DecodeTask:
    return DecodeTask(request_id, "prefill-0", wire.pack_page_ids(src_pages), len(src_pages) * PAGE_SIZE, 7,
                      SamplingParams(0, 1, 0, 0), StopParams(4, True))


def wait_for(puller: KvPuller, what, timeout_s: float | None = None):
    """Polls `what` until it is truthy. The puller reports every read, landed or failed, within its
    transfer_timeout_s (it cancels one that takes longer), so twice that only keeps a bug from
    hanging the test; a read that must land after its target resumes gets kv.transfer_timeout_s,
    the product's own bound for a read."""
    deadline = time.monotonic() + (timeout_s or 2 * puller.transfer_timeout_s)
    while not (found := what()):
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)
    return found


def stop(process: subprocess.Popen) -> None:
    """SIGSTOP, returning once the process is stopped: a read issued earlier could still be served."""
    process.send_signal(signal.SIGSTOP)
    deadline = time.monotonic() + KvConfig.transfer_timeout_s
    while Path(f"/proc/{process.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
        assert time.monotonic() < deadline, "the exporter did not stop"
        time.sleep(0.01)


@pytest.mark.parametrize("spec", [SPEC, LATENT_INT8], ids=["kv-float32", "latent-int8"])
def test_a_read_moves_exactly_the_requests_pages_of_every_shard(exporter, decode_side, spec):
    """Every shard's pages, and where the pages are quantized their scales: per-head K and V, and
    an MLA pool's one latent shard a layer."""
    process, handles = exporter
    local, freed = decode_side
    puller = KvPuller(local, DECODE_PAGES - 1, freed.extend, transfer="nixl")
    puller.map_pool("prefill-0", handles)
    assert [source.handle.backend for source in puller.pools["prefill-0"].sources] == ["nixl"]
    transfer = puller.pull(task([11, 0, 5]), [2, 7, 3])
    [landed] = wait_for(puller, puller.landed)
    assert landed is transfer and transfer.state is TransferState.DONE
    expected = expected_pool(7, spec)
    untouched = [p for p in range(DECODE_PAGES) if p not in (2, 7, 3)]
    for got, sent in ((local.kv, expected.kv), (local.scales, expected.scales)):
        if sent is None:
            continue
        assert torch.equal(got[:, [2, 7, 3]], sent[:, [11, 0, 5]])
        assert torch.all(got[:, untouched] == -7)
    with pytest.raises(HandoffError, match="outside"):
        puller.pull(task([12]), [0])
    puller.close()
    assert puller.backends[next(iter(puller.backends))].remote_users == {}  # the prefill's agent removed


def test_a_read_from_a_stopped_prefill_times_out_and_its_pages_wait_until_it_settles(exporter, decode_side):
    """Cancelled NIXL reads go on writing (nixl.py): the pages come back only once the read is over."""
    process, handles = exporter
    local, freed = decode_side
    puller = KvPuller(local, DECODE_PAGES - 1, freed.extend, transfer="nixl")
    puller.map_pool("prefill-0", handles)
    puller.pull(task([1], "warm-up"), [0])  # connects, at the product's timeout: a loaded machine is slow at it
    wait_for(puller, puller.landed)
    puller.transfer_timeout_s = 1.0
    stop(process)
    puller.pull(task([4, 9]), [5, 6])
    [failed] = wait_for(puller, puller.failed)
    assert failed.error == "not done within 1 s (transferring)"
    puller.drop("r1", [5, 6, 1])
    time.sleep(0.5)
    puller.landed()
    assert freed == [] and len(puller.settling) == 1  # the read may still land: the pages stay out
    process.send_signal(signal.SIGCONT)
    wait_for(puller, lambda: puller.landed() == [] and freed, timeout_s=KvConfig.transfer_timeout_s)
    assert freed == [5, 6, 1] and puller.settling == []
    assert torch.equal(local.kv[:, [5, 6]], expected_pool(7).kv[:, [4, 9]])  # it did land, after its cancel


def test_a_read_from_a_killed_prefill_fails_and_settles_at_once(exporter, decode_side):
    process, handles = exporter
    local, freed = decode_side
    puller = KvPuller(local, DECODE_PAGES - 1, freed.extend, transfer_timeout_s=30.0, transfer="nixl")
    puller.map_pool("prefill-0", handles)
    stop(process)
    puller.pull(task([2, 3]), [0, 1])
    time.sleep(0.3)
    process.kill()
    [failed] = wait_for(puller, puller.failed)
    assert failed.error.startswith("NIXL read failed")
    puller.drop("r1", [0, 1])
    assert freed == [0, 1] and puller.settling == []


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_read_between_two_gpu_pools_moves_exactly_the_requests_pages(monkeypatch):
    """The same read with both pools in device memory (UCX's CUDA transports, or its TCP lane)."""
    for name, value in UCX_LOOPBACK.items():
        monkeypatch.setenv(name, value)
    process, handles = start_exporter("cuda:0")
    try:
        local, _buffer = allocate_local_pool(make_layout(num_pages=DECODE_PAGES, **SPEC), "cuda:0")
        puller = KvPuller(local, DECODE_PAGES - 1, [].extend, transfer="nixl")
        puller.map_pool("prefill-0", handles)
        puller.pull(task([11, 0, 5]), [2, 7, 3])
        wait_for(puller, puller.landed)
        assert torch.equal(local.kv[:, [2, 7, 3]].cpu(), expected_pool(7).kv[:, [11, 0, 5]])
        puller.close()
    finally:
        process.kill()
        process.wait()


def test_a_malformed_nixl_handle_is_refused(decode_side):
    local, freed = decode_side
    layout = make_layout(num_pages=PREFILL_PAGES, **SPEC)
    with pytest.raises(HandoffError, match="malformed NIXL pool handle"):
        KvPuller(local, DECODE_PAGES - 1, freed.extend).map_pool("prefill-0", [KvPoolHandle("nixl", b"\x01", layout, 0)])


# ---- the stack ----

# UCX_NET_DEVICES is left out: the agents listen where the product puts them (kv.nixl_net_devices).
NIXL_STACK = {"PDSERVE_KV_TRANSFER": "nixl", "UCX_TLS": "tcp"}
PROMPTS = ["What is the capital of France?", "Write a short poem about the sea.", "Count from one to ten:",
           "Explain why the sky is blue in one sentence."]
MAX_TOKENS = 12


def _ids(stub, prompt_ids: list[int], max_tokens: int, timeout: float = 120.0) -> list[int]:
    request = generation_pb2.GenerateRequest(max_tokens=max_tokens, temperature=0)
    request.prompt_token_ids.extend(prompt_ids)
    return [t for chunk in stub.Generate(request, timeout=timeout) for t in chunk.token_ids]


@pytest.fixture(scope="module")
def nixl_stack(tmp_path_factory, checkpoint):
    with pytest.MonkeyPatch.context() as patch:
        patch.delenv("UCX_NET_DEVICES", raising=False)  # the stack's services take this environment
        stack = ServiceStack(tmp_path_factory.mktemp("nixl"), CACHE_DIR, **NIXL_STACK)
    with stack:
        yield stack
        stack.stop_drained()


def test_the_nixl_agents_listen_on_loopback_alone(nixl_stack):
    """An ipc:// stack is on one host: UCX, which would listen on every interface, is given loopback
    (kv.nixl_net_devices empty, no UCX_NET_DEVICES), so NIXL's unauthenticated data plane is off the
    network. Each worker listens for its metrics and, once the decode has mapped the prefill's pool,
    for its NIXL agent."""
    deadline = time.monotonic() + nixl_stack.start_timeout_s
    while '"event": "mapped prefill pool"' not in nixl_stack.log_path("decode").read_text():
        assert time.monotonic() < deadline, "the decode never mapped the prefill's pool"
        time.sleep(0.2)
    for name in ("prefill", "decode"):
        sockets = listening_sockets(nixl_stack.processes[name].pid)
        assert len(sockets) >= 2 and all(address.is_loopback for address, _ in sockets), (name, sockets)


def test_the_stack_on_nixl_matches_transformers_concurrently(nixl_stack, tokenizer, reference_model):
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    got: dict[int, list[int]] = {}
    threads = [threading.Thread(target=lambda i=i: got.__setitem__(i, _ids(nixl_stack.stub, prompts[i], MAX_TOKENS)))
               for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for i, prompt in enumerate(prompts):
        expected, logits = reference_greedy(reference_model, prompt, MAX_TOKENS)
        assert_matches_reference(got[i], expected, logits, f"prompt {i} over NIXL")
    log = nixl_stack.log_path("decode").read_text()
    assert '"backend": "nixl"' in log and '"event": "mapped prefill pool"' in log


@pytest.mark.slow
def test_a_decode_killed_mid_transfer_loses_no_page(nixl_stack, tokenizer):
    """A client's first token comes with the router's DecodeTask, so the decode is killed as it
    starts reading a long prompt (125 pages of 60 shards, about 90 MB over TCP); the prefill's
    pages come back all the same (the router's ReleaseKv) and a restarted decode serves."""
    prompt = tokenizer("The history of the sea, told slowly and with care. " * 160)["input_ids"][:2000]
    handing_off = threading.Event()
    outcomes: list[str] = []

    def call(i: int) -> None:
        request = generation_pb2.GenerateRequest(max_tokens=4, temperature=0, ignore_eos=True)
        request.prompt_token_ids.extend([*prompt, i])
        try:
            for _ in nixl_stack.stub.Generate(request, timeout=120):
                handing_off.set()
            outcomes.append("ok")
        except grpc.RpcError as exc:
            outcomes.append(exc.code().name)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    assert handing_off.wait(timeout=120), "no prompt was prefilled"
    nixl_stack.signal("decode", signal.SIGKILL)
    for thread in threads:
        thread.join()
    assert set(outcomes) <= {"ok", "UNAVAILABLE"} and "UNAVAILABLE" in outcomes, outcomes
    nixl_stack.start("decode")
    nixl_stack.wait_serving()
    nixl_stack.assert_pools_drained(timeout_s=30)
    assert len(_ids(nixl_stack.stub, prompt, 3)) == 3
