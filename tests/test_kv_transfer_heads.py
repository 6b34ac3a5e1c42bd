"""Tensor-parallel handoff: each decode rank pulls its own KV heads from the prefill ranks that hold
them (services/decode/kv_pull.py, shared/kv/transfer/choice.py heads_from), bit for bit, with
scales where the pages are quantized; a kind that misses a head falls through, and a backend that
moves whole pages only pairs rank to rank. Prefill ranks are pools of this process, exported as a
rank would export its own, pulled by the host's kind and by NIXL; on a GPU (marked gpu) the host's
kind is cuda_ipc."""

from __future__ import annotations

import importlib.util
import uuid

import pytest
import torch

from services.decode.kv_pull import HandoffError, KvPuller
from services.router.control.membership import first_offer, nixl_withheld
from shared.control import wire
from shared.control.messages import DecodeTask, KvPoolHandle, SamplingParams, StopParams
from shared.kv.pool import PagedKvPool, allocate_local_pool, make_layout
from shared.kv.transfer import ExportedPool, TransferError, export_pool, handles_of_ranks
from shared.kv.transfer.choice import HOST_KIND
from shared.kv.transfer.fake import FakeExport, Script
from shared.kv.transfer.base import AllOf, Transfer, TransferState
from shared.kv.transfer.local_copy import JointCopy, LocalCopy
from shared.kv.transfer.nixl import NixlRead

PAGE_SIZE = 4
KV_HEADS = 3  # of the model
SCRATCH = 6  # the decode pool's last page; pulls use pages 0-5
SPEC = {"num_layers": 2, "page_size": PAGE_SIZE, "head_dim": 8}
SRC, DST = [9, 2, 5], [4, 0, 3]
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                                   reason="needs CUDA")])]
WHOLE_PAGES_ONLY = "FAKE moves whole pages: a prefill and a decode of different tensor_parallel sizes cannot pair over it"
# "host": the host's own kind, shared memory or CUDA IPC (local copies on the decode's stream);
# "nixl": NIXL reads, in this process over UCX, one per prefill rank of a run of heads per token.
KINDS = ["host", pytest.param("nixl", marks=pytest.mark.skipif(importlib.util.find_spec("nixl_cu12") is None
                                                                and importlib.util.find_spec("nixl_cu13") is None,
                                                                reason="the NIXL package is not installed"))]
JOINT = {"host": JointCopy, "nixl": AllOf}  # what a pull from several prefill ranks is
ALONE = {"host": LocalCopy, "nixl": NixlRead}


def layout(num_pages: int, heads: int, dtype: torch.dtype = torch.bfloat16):
    return make_layout(num_pages=num_pages, num_kv_heads=heads, dtype=dtype, **SPEC)


def scramble(pool: PagedKvPool, seed: int) -> None:
    """Random bits in every page and scale: what a rank wrote, compared bit for bit."""
    generator = torch.Generator().manual_seed(seed)
    for bits in (pool.kv_bits, pool.scale_bits):
        if bits is not None:
            info = torch.iinfo(bits.dtype)
            bits.copy_(torch.randint(info.min, info.max, bits.shape, generator=generator, dtype=bits.dtype))


def heads_of(pool: PagedKvPool, pages: list[int], heads: slice = slice(None)) -> list[torch.Tensor]:
    """The pages' bits of those heads, values and scales, on the CPU."""
    return [bits[:, pages, :, heads].cpu() for bits in (pool.kv_bits, pool.scale_bits) if bits is not None]


def assert_same(pieces: list[torch.Tensor], expected: list[torch.Tensor]) -> None:
    assert len(pieces) == len(expected) and all(torch.equal(a, b) for a, b in zip(pieces, expected))


@pytest.fixture
def exports():
    made: list[ExportedPool | FakeExport] = []
    yield made
    for export in made:
        export.close()


def rank_exports(exports: list, device: str, first_heads: list[int], heads: int = 1,
                 dtype: torch.dtype = torch.bfloat16, kind: str = "host") -> list[ExportedPool]:
    """A prefill rank's pool per first head, each with bits of its own."""
    for first in first_heads:
        exported = export_pool(layout(10, heads, dtype), f"test-tp-{uuid.uuid4().hex[:8]}", device,
                               transfer_of(kind, device), first_kv_head=first)
        scramble(exported.pool, seed=len(exports))
        exports.append(exported)
    return exports[-len(first_heads):]


def transfer_of(kind: str, device: str) -> str:
    return HOST_KIND[torch.device(device).type] if kind == "host" else kind


def decode_pool(device: str, heads: int, dtype: torch.dtype = torch.bfloat16) -> PagedKvPool:
    pool, _ = allocate_local_pool(layout(SCRATCH + 1, heads, dtype), device)  # its views hold the buffer
    for bits in (pool.kv_bits, pool.scale_bits):
        if bits is not None:
            bits.fill_(-7)
    return pool


def pull(puller: KvPuller, request_id: str = "r1", src: list[int] = SRC, dst: list[int] = DST):
    task = DecodeTask(request_id, "prefill-0", wire.pack_page_ids(src), len(src) * PAGE_SIZE, 7,
                      SamplingParams(0, 1, 0, 0), StopParams(4, True))
    transfer = puller.pull(task, dst)
    while not (landed := puller.landed()):
        assert not puller.failed()
    assert landed == [transfer] and not puller.copying
    return transfer


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8, torch.float8_e4m3fn])
def test_a_decode_of_all_heads_pulls_each_from_the_prefill_rank_that_holds_it(exports, device, dtype, kind):
    ranks = rank_exports(exports, device, [0, 1, 2], dtype=dtype, kind=kind)
    local = decode_pool(device, KV_HEADS, dtype)
    puller = KvPuller(local, SCRATCH, [].extend, transfer=transfer_of(kind, device))
    puller.map_pool("prefill-0", handles_of_ranks([rank.handles for rank in ranks]))
    assert [source.handle.first_kv_head for source in puller.pools["prefill-0"].sources] == [0, 1, 2]
    assert isinstance(pull(puller), JOINT[kind])
    for head, rank in enumerate(ranks):
        assert_same(heads_of(local, DST, slice(head, head + 1)), heads_of(rank.pool, SRC))
    assert all(torch.all(bits == -7) for bits in heads_of(local, [1, 2, 5]))  # pages beyond the request
    puller.close()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8])
def test_decode_ranks_of_one_head_each_pull_their_head_of_one_prefill_pool(exports, device, dtype, kind):
    [prefill] = rank_exports(exports, device, [0], heads=KV_HEADS, dtype=dtype, kind=kind)
    for head in range(KV_HEADS):
        local = decode_pool(device, 1, dtype)
        puller = KvPuller(local, SCRATCH, [].extend, kv_heads=range(head, head + 1), transfer=transfer_of(kind, device))
        puller.map_pool("prefill-0", prefill.handles)
        assert isinstance(pull(puller), ALONE[kind])
        assert_same(heads_of(local, DST), heads_of(prefill.pool, SRC, slice(head, head + 1)))
        puller.close()


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("device", DEVICES)
def test_ranks_pair_across_sizes_that_split_the_heads_unevenly_and_many_pulls_wrap_the_id_staging(exports, device,
                                                                                                   kind):
    """A 6-head model from prefill TP 3 (heads 0-1, 2-3, 4-5) into decode TP 2 (heads 0-2, 3-5):
    each decode rank takes part of one prefill rank's heads and all of another's."""
    ranks = rank_exports(exports, device, [0, 2, 4], heads=2, kind=kind)
    handles = handles_of_ranks([rank.handles for rank in ranks])
    for decode_rank, expected in enumerate([[(0, 0, 2), (0, 2, 1)], [(1, 0, 1), (0, 1, 2)]]):
        heads = range(3 * decode_rank, 3 * decode_rank + 3)
        local = decode_pool(device, 3)
        puller = KvPuller(local, SCRATCH, [].extend, kv_heads=heads, transfer=transfer_of(kind, device))
        puller.map_pool("prefill-0", handles)
        assert [piece for _, piece in puller.pools["prefill-0"].pieces] == expected
        for i in range(8):
            src, dst = [(i + p) % 10 for p in range(3)], [(i + p) % SCRATCH for p in range(3)]
            pull(puller, f"r{i}", src, dst)
            for ours, head in enumerate(heads):
                theirs = slice(head % 2, head % 2 + 1)
                assert_same(heads_of(local, dst, slice(ours, ours + 1)), heads_of(ranks[head // 2].pool, src, theirs))
        puller.close()


def test_a_replicated_head_comes_from_the_first_rank_that_holds_it(exports):
    """A 2-head model on prefill TP 4: ranks hold heads 0, 0, 1, 1; a decode of TP 1 reads ranks 0
    and 2, and a decode rank of head 1 alone takes rank 2's whole pages."""
    ranks = rank_exports(exports, "cpu", [0, 0, 1, 1])
    handles = handles_of_ranks([rank.handles for rank in ranks])
    local = decode_pool("cpu", 2)
    puller = KvPuller(local, SCRATCH, [].extend)
    puller.map_pool("prefill-0", handles)
    assert [source.handle for source in puller.pools["prefill-0"].sources] == [handles[0], handles[2]]
    pull(puller)
    assert_same(heads_of(local, DST, slice(0, 1)), heads_of(ranks[0].pool, SRC))
    assert_same(heads_of(local, DST, slice(1, 2)), heads_of(ranks[2].pool, SRC))
    one = KvPuller(decode_pool("cpu", 1), SCRATCH, [].extend, kv_heads=range(1, 2))
    one.map_pool("prefill-0", handles)
    assert one.pools["prefill-0"].pieces == [(one.pools["prefill-0"].sources[0], None)]
    assert one.pools["prefill-0"].sources[0].handle == handles[2]


def test_a_kind_missing_a_head_falls_through_to_the_next_and_alone_is_refused_naming_it(exports):
    ranks = rank_exports(exports, "cpu", [0, 1])  # the rank of head 2 is missing
    fake = FakeExport(layout(10, KV_HEADS), f"fake-{uuid.uuid4().hex[:8]}", Script())
    exports.append(fake)
    scramble(fake.pool, seed=9)
    shm = handles_of_ranks([rank.handles for rank in ranks])
    puller = KvPuller(decode_pool("cpu", KV_HEADS), SCRATCH, [].extend)
    puller.map_pool("prefill-0", [*shm, fake.handle])
    assert [source.handle for source in puller.pools["prefill-0"].sources] == [fake.handle]
    pull(puller)
    assert_same(heads_of(puller.local, DST), heads_of(fake.pool, SRC))
    alone = KvPuller(decode_pool("cpu", KV_HEADS), SCRATCH, [].extend)
    with pytest.raises(HandoffError, match=r"shm: no handle holds KV head 2 \(they hold heads 0-0, 1-1\)"):
        alone.map_pool("prefill-0", shm)
    with pytest.raises(HandoffError, match="no mapped pool for prefill prefill-0 .*KV head 2"):
        alone.pull(DecodeTask("r1", "prefill-0", wire.pack_page_ids(SRC), 12, 7, SamplingParams(0, 1, 0, 0),
                              StopParams(4, True)), DST)


def test_a_backend_of_whole_pages_pairs_rank_to_rank_and_refuses_other_sizes_when_mapping(exports):
    fakes = [FakeExport(layout(10, 1), f"fake-{uuid.uuid4().hex[:8]}", Script(), first_kv_head=head)
             for head in range(KV_HEADS)]
    exports.extend(fakes)
    scramble(fakes[1].pool, seed=1)
    rank = KvPuller(decode_pool("cpu", 1), SCRATCH, [].extend, kv_heads=range(1, 2))
    rank.map_pool("prefill-0", [fake.handle for fake in fakes])
    pull(rank)
    assert_same(heads_of(rank.local, DST), heads_of(fakes[1].pool, SRC))
    whole = KvPuller(decode_pool("cpu", KV_HEADS), SCRATCH, [].extend)
    with pytest.raises(HandoffError, match=f"fake: {WHOLE_PAGES_ONLY}"):
        whole.map_pool("prefill-0", [fake.handle for fake in fakes])
    assert "prefill-0" in whole.unmappable and not whole.pools
    with pytest.raises(TransferError, match=WHOLE_PAGES_ONLY):
        rank.pools["prefill-0"].sources[0].start("r2", torch.tensor(SRC).numpy(), DST, (0, 0, 1))


def test_register_lists_every_ranks_handle_of_a_kind_before_the_next_kind_and_the_router_keeps_it():
    def handle(kind: str, head: int) -> KvPoolHandle:
        return KvPoolHandle(kind, f"{kind}-{head}".encode(), layout(4, 1), head)

    ranks = [[handle("shm", head), handle("nixl", head)] for head in range(2)]
    handles = handles_of_ranks(ranks)
    assert handles == [ranks[0][0], ranks[1][0], ranks[0][1], ranks[1][1]]
    assert first_offer(handles) == handles[:2] and nixl_withheld(handles) == handles[2:]


def test_a_decode_rank_names_as_many_heads_as_its_pool_holds():
    with pytest.raises(ValueError, match="2 KV heads for a pool of 1"):
        KvPuller(decode_pool("cpu", 1), SCRATCH, [].extend, kv_heads=range(2))


class Scripted(Transfer):
    """A read from one prefill rank whose state and settling the test sets."""

    def __init__(self):
        super().__init__("r1", "prefill-0")
        self.writing = False

    def poll(self) -> TransferState:
        return self.state

    def cancel(self, reason: str) -> None:
        if not self.state.finished:
            self.fail(reason)

    def settled(self) -> bool:
        return not self.writing


def test_reads_from_several_ranks_land_together_and_fail_with_the_first_that_fails():
    first, second = Scripted(), Scripted()
    joint = AllOf([first, second])
    first.advance(TransferState.TRANSFERRING)
    assert joint.poll() is TransferState.TRANSFERRING
    first.land()
    assert joint.poll() is TransferState.TRANSFERRING  # the other rank's heads are not there yet
    second.land()
    assert joint.poll() is TransferState.DONE and joint.landed is max(first.landed, second.landed, key=lambda m: m.at)

    first, second = Scripted(), Scripted()
    joint = AllOf([first, second])
    second.writing = True
    first.fail("NIXL read failed: ERR")
    assert joint.poll() is TransferState.FAILED and joint.error == "NIXL read failed: ERR"
    assert second.state is TransferState.FAILED  # cancelled with it
    assert not joint.settled()  # the other read's bytes still come: its pages wait
    second.writing = False
    assert joint.settled()
