"""shared/kv/pool.py and shared/kv/transfer/shm.py: shard layout, page allocation, page copies, and a pool
shared with a real second process through POSIX shared memory."""

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import torch

from shared.control.messages import KvPoolHandle
from shared.kv.pages import PageAllocator, PoolExhausted, decode_pages_needed, pages_for, pulled_indices, ring_row
from shared.kv.pool import SHARD_ALIGN_BYTES, allocate_local_pool, layout_bytes, make_layout
from shared.kv.transfer import TransferError, backend_for
from shared.kv.transfer.shm import SharedMemoryExport
from tests.stack import REPO


# Shard sizes that are not multiples of 256 bytes, so a layout without padding would misalign.
LAYOUTS = {
    "float32": dict(num_layers=3, num_pages=7, page_size=5, num_kv_heads=3, head_dim=6, dtype=torch.float32),
    "bfloat16": dict(num_layers=2, num_pages=7, page_size=16, num_kv_heads=3, head_dim=10, dtype=torch.bfloat16),
    # With float32, 3 heads of 64 make every page a multiple of 256 bytes; bfloat16 does not.
    "bfloat16 hd64": dict(num_layers=2, num_pages=7, page_size=5, num_kv_heads=3, head_dim=64, dtype=torch.bfloat16),
}


def shard_bytes(spec: dict) -> int:
    item = torch.empty((), dtype=spec["dtype"]).element_size()
    return spec["num_pages"] * spec["page_size"] * spec["num_kv_heads"] * spec["head_dim"] * item


def pattern(shard: torch.Tensor, i: int) -> torch.Tensor:
    """Values unique to shard i (disjoint ranges) and exact in bfloat16 (all below 256)."""
    return torch.arange(shard.numel(), dtype=torch.float32).reshape(shard.shape) % 13 + 16 * i


def shm_path(name: str) -> Path:
    return Path("/dev/shm") / name


@pytest.fixture
def exported():
    """An exported pool, closed at teardown even when the test fails."""
    pools = []

    def export(layout):
        pool = SharedMemoryExport(layout, f"test-{uuid.uuid4().hex[:8]}")
        pools.append(pool)
        return pool

    yield export
    for pool in pools:
        pool.close()


def pools_for(kind: str, layout, exported):
    if kind == "local":
        pool, buffer = allocate_local_pool(layout, "cpu")
        return pool, buffer
    owner = exported(layout)
    return owner.pool, owner


@pytest.mark.parametrize("spec", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_layout_pads_shards_to_256_bytes(spec):
    layout = make_layout(**spec)
    assert shard_bytes(spec) % SHARD_ALIGN_BYTES != 0  # the padding matters for these sizes
    assert layout.shard_stride_bytes % SHARD_ALIGN_BYTES == 0
    assert shard_bytes(spec) <= layout.shard_stride_bytes < shard_bytes(spec) + SHARD_ALIGN_BYTES
    assert layout_bytes(layout) == 2 * spec["num_layers"] * layout.shard_stride_bytes
    assert layout.dtype == str(spec["dtype"]).removeprefix("torch.")


@pytest.mark.parametrize("kind", ["local", "shm"])
@pytest.mark.parametrize("spec", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_shards_are_aligned_and_shaped(kind, spec, exported):
    layout = make_layout(**spec)
    pool, _keep = pools_for(kind, layout, exported)
    shards = pool.shards()
    assert len(shards) == 2 * spec["num_layers"]
    shape = (spec["num_pages"], spec["page_size"], spec["num_kv_heads"], spec["head_dim"])
    for shard in shards:
        assert shard.data_ptr() % SHARD_ALIGN_BYTES == 0
        assert tuple(shard.shape) == shape and shard.dtype == spec["dtype"] and shard.is_contiguous()
    for layer in range(spec["num_layers"]):
        assert pool.key(layer).data_ptr() == shards[2 * layer].data_ptr()
        assert pool.value(layer).data_ptr() == shards[2 * layer + 1].data_ptr()


@pytest.mark.parametrize("kind", ["local", "shm"])
@pytest.mark.parametrize("spec", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_shards_do_not_overlap(kind, spec, exported):
    layout = make_layout(**spec)
    pool, _keep = pools_for(kind, layout, exported)
    shards = pool.shards()
    for i, shard in enumerate(shards):
        shard.copy_(pattern(shard, i))
    for i, shard in enumerate(shards):
        assert torch.equal(shard.float(), pattern(shard, i)), f"shard {i} was overwritten"
    starts = sorted(s.data_ptr() for s in shards)
    assert all(b - a == layout.shard_stride_bytes for a, b in zip(starts, starts[1:]))


def test_allocator_hands_out_and_takes_back():
    alloc = PageAllocator(8)
    first = alloc.allocate(3)
    second = alloc.allocate(5)
    assert len(set(first + second)) == 8 and set(first + second) == set(range(8))
    assert alloc.num_free == 0
    with pytest.raises(PoolExhausted):
        alloc.allocate(1)
    alloc.free(first)
    assert alloc.num_free == 3
    assert sorted(alloc.allocate(3)) == sorted(first)
    alloc.free(first)
    alloc.free(second)
    assert alloc.num_free == 8
    assert alloc.allocate(0) == []


def test_exhaustion_leaves_the_allocator_unchanged():
    alloc = PageAllocator(4)
    held = alloc.allocate(3)
    with pytest.raises(PoolExhausted):
        alloc.allocate(2)
    assert alloc.num_free == 1
    assert alloc.allocate(1) not in held


def test_double_free_and_bad_ids_raise_without_freeing_anything():
    alloc = PageAllocator(6)
    pages = alloc.allocate(4)
    alloc.free(pages[:1])
    with pytest.raises(ValueError):
        alloc.free(pages[:1])  # freed twice
    with pytest.raises(ValueError):
        alloc.free([pages[1], pages[1]])  # duplicate ids in one call
    with pytest.raises(ValueError):
        alloc.free([pages[1], 6])  # out of range, after a valid id
    with pytest.raises(ValueError):
        alloc.free([pages[2], -1])
    with pytest.raises(ValueError):
        alloc.free([pages[2], pages[0]])  # a valid id, then one already free
    assert alloc.num_free == 3  # none of the refused calls freed its valid ids
    alloc.free(pages[1:])
    assert alloc.num_free == 6
    assert sorted(alloc.allocate(6)) == list(range(6))


@pytest.mark.parametrize("kind", ["local", "shm"])
def test_copy_pages_from_copies_exactly_the_listed_pages(kind, exported):
    layout = make_layout(**LAYOUTS["float32"])
    src, _keep_src = allocate_local_pool(layout, "cpu")
    dst, _keep_dst = pools_for(kind, layout, exported)
    src.kv.copy_(torch.randn(src.kv.shape))
    dst.kv.fill_(-7.0)
    src_pages, dst_pages = [4, 0, 6], [1, 5, 2]
    dst.copy_pages_from(src, torch.tensor(src_pages), torch.tensor(dst_pages))
    for shard in range(2 * layout.num_layers):
        for s, d in zip(src_pages, dst_pages):
            assert torch.equal(dst.kv[shard, d], src.kv[shard, s])
        untouched = [p for p in range(layout.num_pages) if p not in dst_pages]
        assert torch.all(dst.kv[shard, untouched] == -7.0)


CHILD = """
import sys, torch
from shared.kv.transfer.shm import SharedMemoryMapping
from shared.control.messages import KvLayout, KvPoolHandle
name, close, *fields = sys.argv[1:]
layers, pages, page_size, heads, head_dim, dtype, stride = fields
layout = KvLayout(int(layers), int(pages), int(page_size), int(heads), int(head_dim), dtype, int(stride))
mapped = SharedMemoryMapping(KvPoolHandle("shm", name.encode(), layout, 0))
kv = mapped.pool.kv
expected = torch.arange(kv[0].numel(), dtype=torch.float32).reshape(kv[0].shape) % 13
seen = [bool(torch.equal(kv[i].float(), expected + 16 * i)) for i in range(kv.shape[0])]
kv[:, 3].fill_(-42.0)  # the parent checks it sees this
print("seen", *seen, flush=True)
if close == "close":
    del kv, expected
    mapped.close()
"""


@pytest.mark.e2e
@pytest.mark.parametrize("how", ["close", "exit"], ids=["child closes its mapping", "child exits without closing"])
def test_mapped_in_another_process(how, exported):
    layout = make_layout(**LAYOUTS["bfloat16"])
    owner = exported(layout)
    kv = owner.pool.kv
    for i in range(kv.shape[0]):
        kv[i].copy_(pattern(kv[i], i))
    name = owner.handle.locator.decode()
    fields = [str(v) for v in (layout.num_layers, layout.num_pages, layout.page_size, layout.num_kv_heads,
                               layout.head_dim, layout.dtype, layout.shard_stride_bytes)]
    # capture_output waits for the child's resource tracker too (it inherits the pipes), so a
    # tracker that would unlink the segment at the child's exit has done so before we look.
    done = subprocess.run([sys.executable, "-c", CHILD, name, how, *fields], capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)}, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["seen"] + ["True"] * kv.shape[0]  # the child sees the parent's bytes
    assert torch.all(kv[:, 3] == -42.0)  # the child's writes are visible here
    assert torch.equal(kv[1, 2].float(), pattern(kv[1], 1)[2])  # pages it did not write are intact
    assert shm_path(name).exists(), "the child's mapping unlinked the exporter's segment"
    assert "leaked" not in done.stderr


def test_closing_the_export_removes_the_segment():
    layout = make_layout(**LAYOUTS["float32"])
    owner = SharedMemoryExport(layout, f"test-{uuid.uuid4().hex[:8]}")
    name = owner.handle.locator.decode()
    assert owner.handle.backend == "shm" and owner.handle.layout == layout
    try:
        assert shm_path(name).exists()
        assert shm_path(name).stat().st_size >= layout_bytes(layout)
        shards = owner.pool.shards()  # a view still held must not keep the segment's name alive
    finally:
        owner.close()
    assert not shm_path(name).exists()
    assert owner.pool is None
    owner.close()  # a second close is harmless
    del shards


def test_mapping_refuses_another_backend():
    layout = make_layout(**LAYOUTS["float32"])
    with pytest.raises(TransferError, match="cuda_ipc"):
        backend_for(KvPoolHandle("cuda_ipc", b"opaque", layout, 0), "cpu")


def test_page_arithmetic():
    assert pages_for(0, 16) == 0
    assert pages_for(1, 16) == 1
    assert pages_for(16, 16) == 1
    assert pages_for(17, 16) == 2
    assert pages_for(33, 16) == 3
    assert decode_pages_needed(10, 6, 16) == 1
    assert decode_pages_needed(10, 7, 16) == 2
    assert decode_pages_needed(100, 256, 16) == 23  # 356 tokens
    assert decode_pages_needed(1, 1, 1) == 2


def test_a_windowed_request_holds_the_pages_its_window_spans():
    assert decode_pages_needed(100, 256, 16, window=64) == 5  # 64 tokens span 4 pages, 5 where unaligned
    assert decode_pages_needed(10, 6, 16, window=64) == 1     # shorter than its window: as without one
    assert decode_pages_needed(100, 256, 16, window=20) == 3


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("window", [1, 5, 16, 20, 33])
def test_a_windows_ring_of_pages_holds_every_token_the_window_reads(page_size, window):
    """Replays a request on a ring of pages (shared/kv/pages.py), from each prompt length: the pull
    fills the ring from the prompt's last pages, then each step writes its token where ring_row puts
    it. At every step every token the window reads is still in its slot, and the pull's pages are
    distinct (two prompt pages copied to one page would race)."""
    for prompt in range(1, 4 * window + 2 * page_size):
        held = decode_pages_needed(prompt, 1 << 20, page_size, window)
        ring = list(range(100, 100 + held))
        width = pages_for(prompt + 3 * held * page_size, page_size)
        row = ring_row(ring, width)
        pulled = pulled_indices(pages_for(prompt, page_size), held)
        assert len({row[i] for i in pulled}) == len(pulled)
        slots = {(row[t // page_size], t % page_size): t for t in range(prompt) if t // page_size in pulled}
        for position in range(prompt, width * page_size):
            slots[row[position // page_size], position % page_size] = position  # the step's own token
            for token in range(max(0, position + 1 - window), position + 1):
                assert slots.get((row[token // page_size], token % page_size)) == token, (prompt, position, token)


def test_a_local_cpu_pool_costs_memory_as_it_fills_and_reads_zero():
    """A decode's pool is sized for its busiest hour: untouched pages must not be resident (the
    embedded model's default decode pool is 1.5 GB, and a test machine runs several stacks)."""
    def resident_anon_bytes() -> int:
        line = next(line for line in open("/proc/self/status") if line.startswith("RssAnon"))
        return int(line.split()[1]) * 1024

    layout = make_layout(8, 4096, 16, 4, 64, torch.float32)  # 512 MiB of K and V
    before = resident_anon_bytes()
    pool, buffer = allocate_local_pool(layout, "cpu")
    assert resident_anon_bytes() - before < layout_bytes(layout) // 8
    assert int(pool.key(7)[4095].count_nonzero()) == 0 and int(pool.value(0)[0].count_nonzero()) == 0
    pool.key(3)[100].fill_(1.0)
    assert float(pool.key(3)[100].sum()) == 16 * 4 * 64
