"""services/decode/kv_pull.py on the CPU: a decode's pull from a prefill's shared-memory pool.
The GPU's asynchronous copy and its dating are in tests/test_gpu.py."""

import time
import uuid

import pytest
import torch

from services.decode.kv_pull import HandoffError, KvPuller
from shared.control import wire
from shared.control.messages import DecodeTask, SamplingParams, StopParams
from shared.kv.pool import allocate_local_pool, make_layout
from shared.kv.transfer import export_pool

PAGE_SIZE = 4
SCRATCH = 6  # the local pool's last page; pulls use pages 0-5
SPEC = dict(num_layers=2, page_size=PAGE_SIZE, num_kv_heads=2, head_dim=8, dtype=torch.float32)


@pytest.fixture
def prefill():
    exported = export_pool(make_layout(num_pages=10, **SPEC), f"test-{uuid.uuid4().hex[:8]}", "cpu")
    exported.pool.kv.copy_(torch.randn(exported.pool.kv.shape))
    yield exported
    exported.close()


@pytest.fixture
def puller(prefill):
    local, buffer = allocate_local_pool(make_layout(num_pages=SCRATCH + 1, **SPEC), "cpu")
    local.kv.fill_(-7.0)
    puller = KvPuller(local, SCRATCH, lambda pages: None)
    puller.map_pool("prefill-0", prefill.handles)
    yield puller
    puller.close()
    del buffer


def task(src_pages: list[int] | bytes, num_tokens: int, request_id: str = "r1") -> DecodeTask:
    packed = src_pages if isinstance(src_pages, bytes) else wire.pack_page_ids(src_pages)
    return DecodeTask(request_id, "prefill-0", packed, num_tokens, 7, SamplingParams(0, 1, 0, 0), StopParams(4, True))


def test_pull_copies_the_prompt_pages_and_lands_once(prefill, puller):
    started = time.perf_counter()
    puller.pull(task([9, 2, 5, 0], num_tokens=3 * PAGE_SIZE - 1), [4, 0, 3, 1])  # the prompt fills 3 pages
    [landed] = puller.landed()
    assert landed.request_id == "r1" and landed.prefill_worker_id == "prefill-0"
    assert started <= landed.landed.at <= time.perf_counter()
    assert 0 < landed.pull_s <= landed.landed.at - started  # from the transfer's own start, after ours
    for src, dst in ((9, 4), (2, 0), (5, 3)):
        assert torch.equal(puller.local.kv[:, dst], prefill.pool.kv[:, src])
    assert torch.all(puller.local.kv[:, [1, 2, 5]] == -7.0)  # the 4th page is beyond the prompt
    assert puller.landed() == [] and not puller.copying


@pytest.mark.parametrize("src_pages", [[3, -1], [3, 10], wire.pack_page_ids([3, 1])[:-1], [3]],
                         ids=["negative", "past the pool", "not whole int32s", "fewer than the prompt fills"])
def test_page_ids_outside_the_prefill_pool_are_refused(puller, src_pages):
    with pytest.raises(HandoffError):
        puller.pull(task(src_pages, num_tokens=2 * PAGE_SIZE), [0, 1])
    assert puller.landed() == []
    assert torch.all(puller.local.kv[:, :SCRATCH] == -7.0)


def test_mapping_a_pool_copies_one_page_into_the_scratch_page_only(prefill, puller):
    assert torch.equal(puller.local.kv[:, SCRATCH], prefill.pool.kv[:, 0])
    assert torch.all(puller.local.kv[:, :SCRATCH] == -7.0)


def test_a_prefill_that_is_not_mapped_is_refused(puller):
    puller.unmap_pool("prefill-0")
    with pytest.raises(HandoffError, match="no mapped pool"):
        puller.pull(task([0], num_tokens=1), [0])


def test_pulls_past_the_staging_buffer_wrap_around(prefill, puller):
    """The ids of a pull take the next slice of a reused buffer (room for 16 ids here, 4 taken by
    the copy at mapping)."""
    for i, (src, dst) in enumerate([([1, 2, 3], [0, 1, 2]), ([4, 5], [3, 4]), ([6, 7, 8, 9], [5, 0, 1, 2])]):
        puller.pull(task(src, num_tokens=len(src) * PAGE_SIZE, request_id=f"r{i}"), dst)
        assert torch.equal(puller.local.kv[:, dst], prefill.pool.kv[:, src])
    assert [landed.request_id for landed in puller.landed()] == ["r0", "r1", "r2"]
