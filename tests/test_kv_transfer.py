"""shared/kv/transfer through the fake backend: a transfer's states, its failure, its timeout, and
unmapping, at the puller (services/decode/kv_pull.py) and in a real DecodeWorker on the CPU.
The shm backend's pulls are in tests/test_handoff.py, the cuda_ipc backend's in tests/test_gpu.py."""

from __future__ import annotations

import socket
import threading
import time
import uuid

import pytest
import torch

from services.decode.kv_pull import HandoffError, KvPuller
from shared.control import wire
from shared.control.messages import (
    Abort,
    DecodeTask,
    ErrorCode,
    Failed,
    KvPoolHandle,
    KvPulled,
    PoolAvailable,
    SamplingParams,
    StopParams,
    TokenBatch,
)
from shared.kv.pool import allocate_local_pool, make_layout
from shared.kv.transfer import TransferError, TransferState
from shared.kv.transfer.nixl_network import interface_addresses, interface_toward, nixl_net_devices
from shared.kv.transfer.fake import FakeExport, Script

PAGE_SIZE = 4
SPEC = dict(num_layers=2, page_size=PAGE_SIZE, num_kv_heads=2, head_dim=8, dtype=torch.float32)
SCRATCH = 6


def task(src_pages: list[int], request_id: str = "r1", prefill: str = "prefill-0") -> DecodeTask:
    return DecodeTask(request_id, prefill, wire.pack_page_ids(src_pages), len(src_pages) * PAGE_SIZE, 7,
                      SamplingParams(0, 1, 0, 0), StopParams(4, True))


def fake_export(script: Script, num_pages: int = 10, **spec) -> FakeExport:
    export = FakeExport(make_layout(num_pages=num_pages, **(spec or SPEC)), f"fake-{uuid.uuid4().hex[:8]}", script)
    export.pool.kv.copy_(torch.randn(export.pool.kv.shape))
    return export


@pytest.fixture
def local():
    pool, buffer = allocate_local_pool(make_layout(num_pages=SCRATCH + 1, **SPEC), "cpu")
    pool.kv.fill_(-7.0)
    yield pool
    del buffer


def puller_of(local, export: FakeExport, timeout_s: float = 30.0, freed: list[int] | None = None) -> KvPuller:
    puller = KvPuller(local, SCRATCH, (freed if freed is not None else []).extend, timeout_s)
    puller.map_pool("prefill-0", [export.handle])
    return puller


def test_states_progress_in_order_and_the_pages_land_once(local):
    export = fake_export(Script(polls_per_state=2))
    puller = puller_of(local, export)
    transfer = puller.pull(task([9, 2]), [4, 0])
    seen, landed = [], []
    while not landed:
        assert torch.all(local.kv[:, [4, 0]] == -7.0) and puller.copying
        seen.append(transfer.state)
        landed = puller.landed()  # polls it once
    assert seen == [TransferState.PREPARING] * 2 + [TransferState.TRANSFERRING] * 2
    assert landed == [transfer] and transfer.state is TransferState.DONE
    assert transfer.started_at <= transfer.landed.at <= time.perf_counter()
    assert torch.equal(local.kv[:, [4, 0]], export.pool.kv[:, [9, 2]])
    assert puller.landed() == [] and not puller.copying


def test_a_state_never_goes_back(local):
    transfer = puller_of(local, fake_export(Script())).pull(task([1]), [0])
    transfer.advance(TransferState.TRANSFERRING)
    with pytest.raises(RuntimeError, match="TRANSFERRING cannot become PREPARING"):
        transfer.advance(TransferState.PREPARING)
    transfer.fail("lost")
    with pytest.raises(RuntimeError):
        transfer.land()


@pytest.mark.parametrize("fail_at", [TransferState.PREPARING, TransferState.TRANSFERRING])
def test_a_failed_transfer_is_reported_once_and_writes_nothing(local, fail_at):
    puller = puller_of(local, fake_export(Script(fail_at=fail_at)))
    transfer = puller.pull(task([3, 5]), [1, 2])
    for _ in range(3):
        assert puller.landed() == []
    assert puller.failed() == [transfer] and puller.failed() == [] and not puller.copying
    assert transfer.error == f"scripted failure while {fail_at.name.lower()}"
    assert torch.all(local.kv[:, :SCRATCH] == -7.0)


def test_a_stalled_transfer_fails_at_its_timeout(local):
    puller = puller_of(local, fake_export(Script(stall_at=TransferState.TRANSFERRING)), timeout_s=0.2)
    transfer = puller.pull(task([3]), [1])
    assert puller.failed() == [] and transfer.poll() is TransferState.TRANSFERRING
    time.sleep(0.25)
    assert puller.failed() == [transfer]
    assert transfer.error == "not done within 0.2 s (transferring)"


def test_unmapping_waits_for_the_transfers_reading_the_pool(local):
    export = fake_export(Script(polls_per_state=3))
    puller = puller_of(local, export)
    transfer = puller.pull(task([8, 1]), [3, 5])
    puller.unmap_pool("prefill-0")
    assert transfer.state is TransferState.DONE
    assert torch.equal(local.kv[:, [3, 5]], export.pool.kv[:, [8, 1]])
    assert puller.landed() == [transfer]
    with pytest.raises(HandoffError, match="no mapped pool for prefill prefill-0"):
        puller.pull(task([1]), [0])


def test_a_dropped_transfer_is_not_reported_and_its_pages_are_freed(local):
    freed = []
    puller = puller_of(local, fake_export(Script(stall_at=TransferState.PREPARING)), freed=freed)
    transfer = puller.pull(task([2]), [0])
    puller.drop("r1", [0, 1])
    assert transfer.state is TransferState.FAILED and freed == [0, 1]
    assert puller.landed() == [] and puller.failed() == [] and not puller.copying


@pytest.mark.parametrize("stall_at", [TransferState.PREPARING, TransferState.TRANSFERRING])
def test_the_pages_of_a_read_that_goes_on_after_its_cancel_wait_until_it_settles(local, stall_at):
    """As a NIXL read does: cancelled, it fails at once, yet its pages are freed only once it settled."""
    freed = []
    puller = puller_of(local, fake_export(Script(stall_at=stall_at, lingers_polls=3)), timeout_s=0.1, freed=freed)
    aborted = puller.pull(task([2], "aborted"), [0])
    timed_out = puller.pull(task([3], "timed-out"), [1])
    puller.drop("aborted", [0, 4])
    assert aborted.state is TransferState.FAILED and freed == []
    time.sleep(0.15)
    assert puller.failed() == [timed_out] and timed_out.error.startswith("not done within 0.1 s")
    puller.drop("timed-out", [1, 5])
    assert freed == [] and len(puller.settling) == 2
    for _ in range(3):
        puller.landed()  # each poll of the puller asks each once
    assert sorted(freed) == [0, 1, 4, 5] and puller.settling == [] and not puller.copying


def test_a_pool_no_backend_here_can_pull_is_refused_with_its_reason(local):
    puller = KvPuller(local, SCRATCH, [].extend)
    with pytest.raises(HandoffError, match="a decode on cpu cannot pull a 'rdma' pool"):
        puller.map_pool("prefill-0", [KvPoolHandle("rdma", b"agent", make_layout(num_pages=4, **SPEC), 0)])
    with pytest.raises(HandoffError, match=r"no mapped pool for prefill prefill-0 \(rdma: a decode on cpu cannot pull"):
        puller.pull(task([0]), [0])


def test_a_decode_takes_the_first_handle_it_may_use_that_opens(local):
    """auto: another host's shared memory does not open, so NIXL's handle is next (here a fake's)."""
    export = fake_export(Script())
    elsewhere = KvPoolHandle("shm", b"pdserve-kv-prefill-0-0badcafe-1", export.handle.layout, 0)
    puller = KvPuller(local, SCRATCH, [].extend)
    puller.map_pool("prefill-0", [elsewhere, export.handle])
    assert [source.handle for source in puller.pools["prefill-0"].sources] == [export.handle]
    only_shm = KvPuller(local, SCRATCH, [].extend, transfer="shm")
    with pytest.raises(HandoffError, match="shm: .*No such file"):
        only_shm.map_pool("prefill-0", [elsewhere, export.handle])
    with pytest.raises(HandoffError, match="kv.transfer is nixl, the pool is offered by shm, fake"):
        KvPuller(local, SCRATCH, [].extend, transfer="nixl").map_pool("prefill-0", [elsewhere, export.handle])


def test_a_pool_of_another_layout_is_refused(local):
    other = fake_export(Script(), **{**SPEC, "head_dim": 16})
    with pytest.raises(HandoffError, match="its layout is"):
        KvPuller(local, SCRATCH, [].extend).map_pool("prefill-0", [other.handle])


def test_page_ids_outside_the_pool_start_nothing(local):
    puller = puller_of(local, fake_export(Script(), num_pages=4))
    with pytest.raises(HandoffError, match="outside"):
        puller.pull(task([1, 4]), [0, 1])
    assert not puller.copying


# ---- a real DecodeWorker on the CPU, its router link replaced by a recorder ----

class SentMessages:
    def __init__(self):
        self.sent: list[object] = []

    def send(self, message: object) -> None:
        self.sent.append(message)

    def of(self, kind: type) -> list:
        return [m for m in self.sent if isinstance(m, kind)]


@pytest.fixture
def decode(tmp_path):
    from services.decode.worker import DecodeWorker
    from shared.config.loading import load_config
    from shared.runtime.process import StopSignals, SystemdNotify
    from shared.worker.main import WorkerProcess, load_model

    config = load_config(None, {"PDSERVE_MODEL_PATH": "random:llama-tiny", "PDSERVE_ROUTER_RUNTIME_DIR": str(tmp_path),
                                "PDSERVE_DECODE_METRICS_ADDRESS": "", "PDSERVE_KV_PAGE_SIZE": str(PAGE_SIZE),
                                "PDSERVE_KV_DECODE_PAGES": "16", "PDSERVE_KV_TRANSFER_TIMEOUT_S": "0.3"})
    # What start_worker builds, without its signal handlers and pinning.
    worker = DecodeWorker(WorkerProcess(config, *load_model(config), StopSignals(threading.Event(), threading.Event()),
                                        SystemdNotify()))
    worker.link.close(linger_s=0)
    worker.link = SentMessages()
    yield worker
    worker.close()


def decode_export(decode, script: Script) -> FakeExport:
    model = decode.model
    export = fake_export(script, num_layers=model.num_layers, page_size=PAGE_SIZE, num_kv_heads=model.num_kv_heads,
                         head_dim=model.head_dim, dtype=torch.float32)
    decode._on_pool_available(PoolAvailable("prefill-0", [export.handle]))
    return export


def test_a_request_steps_only_once_its_transfer_is_done(decode):
    export = decode_export(decode, Script(polls_per_state=2))
    decode._on_task(task([5, 2]))
    assert decode.load().waiting == 1 and decode.load().holding == ["r1"]
    for _ in range(10):
        if decode.link.of(KvPulled):
            break
        assert decode.link.of(TokenBatch) == []  # no step for it before its pages are there
        decode.step()
    assert torch.equal(decode.pool.kv[:, decode.running[0].pages[:2]], export.pool.kv[:, [5, 2]])
    [pulled] = decode.link.of(KvPulled)
    assert (pulled.request_id, pulled.prefill_worker_id) == ("r1", "prefill-0")
    assert decode.link.sent.index(pulled) < decode.link.sent.index(decode.link.of(TokenBatch)[0])


def test_a_requests_first_step_reports_how_long_its_pages_waited_and_later_steps_do_not(decode):
    """Durations of the decode's own clock, for the router to take out of its own (StageTimings):
    the wait runs from the pages landing (the transfer's DONE) to the step's start."""
    decode_export(decode, Script(polls_per_state=2))
    decode._on_task(task([5, 2]))
    before = time.perf_counter()
    while not decode.link.of(TokenBatch):
        decode.step()
    after = time.perf_counter()
    first = decode.link.of(TokenBatch)[0]
    [joined] = first.joined
    assert joined.request_id == "r1" and 0 <= joined.queued_s and 0 < first.step_s
    assert joined.queued_s + first.step_s <= after - before
    assert decode.running[0].handoff is None  # let go of at its first step
    decode.step()
    later = decode.link.of(TokenBatch)[1]
    assert (later.step_s, later.joined) == (0.0, []) and len(later.tokens) == 1


@pytest.mark.parametrize("script, reason", [
    (Script(fail_at=TransferState.TRANSFERRING), "scripted failure while transferring"),
    (Script(stall_at=TransferState.TRANSFERRING), "not done within 0.3 s"),
], ids=["fails", "times out"])
def test_a_failed_transfer_frees_the_decodes_pages_and_fails_the_request(decode, script, reason):
    decode_export(decode, script)
    free = decode.allocator.num_free
    decode._on_task(task([1, 3, 0]))
    assert decode.allocator.num_free < free
    deadline = time.monotonic() + 5
    while not decode.link.of(Failed) and time.monotonic() < deadline:
        decode.step()
        time.sleep(0.02)
    [failed] = decode.link.of(Failed)
    assert (failed.request_id, failed.code) == ("r1", ErrorCode.UNAVAILABLE) and reason in failed.message
    assert decode.allocator.num_free == free
    assert decode.load().holding == [] and not decode.puller.copying
    assert decode.link.of(KvPulled) == [] and decode.link.of(TokenBatch) == []


def test_an_abort_during_the_transfer_ends_it_and_frees_the_pages(decode):
    decode_export(decode, Script(stall_at=TransferState.PREPARING))
    free = decode.allocator.num_free
    decode._on_task(task([1]))
    decode._on_abort(Abort("r1"))
    decode.step()
    assert decode.allocator.num_free == free and decode.load().holding == []
    assert decode.link.sent == [] and not decode.puller.copying


def test_auto_offers_nixl_beside_the_hosts_kind_only_where_decodes_may_be_elsewhere():
    from shared.kv.transfer.choice import offered_kinds

    assert offered_kinds("auto", "cpu", cross_host=False) == ["shm"]
    assert offered_kinds("auto", "cuda", cross_host=True) == ["cuda_ipc", "nixl"]
    assert offered_kinds("nixl", "cpu", cross_host=False) == ["nixl"]
    assert offered_kinds("shm", "cpu", cross_host=True) == ["shm"]


def test_nixl_agents_get_the_configured_network_else_loopback_or_the_route_to_the_router():
    """shared/kv/transfer/nixl_network.py: the setting, then UCX's own variable, then loopback on a
    one-host (ipc://) stack, then the interface this host reaches the router's host by."""
    assert nixl_net_devices("mlx5_0:1", "ipc:///run/pdserve/router.ipc", {"UCX_NET_DEVICES": "eth9"}) == "mlx5_0:1"
    assert nixl_net_devices("", "tcp://10.0.0.1:5555", {"UCX_NET_DEVICES": "eth9"}) == "eth9"
    assert nixl_net_devices("", "ipc:///run/pdserve/router.ipc", {}) == "lo"
    assert nixl_net_devices("", "tcp://127.0.0.1:5555", {}) == "lo"
    assert nixl_net_devices("", "tcp://[::1]:5555", {}) == "lo"
    for _, name in socket.if_nameindex():  # a router at one of this host's own addresses
        for address in interface_addresses(name):
            if not (address.is_loopback or address.is_link_local):
                host = f"[{address}]" if address.version == 6 else str(address)
                assert nixl_net_devices("", f"tcp://{host}:5555", {}) == name
    with pytest.raises(TransferError, match="set kv.nixl_net_devices"):
        interface_toward("no-such-host.invalid")
