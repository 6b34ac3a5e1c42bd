"""The GPU handoff's page copy, checked on the CPU under the Triton interpreter."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
pytest.importorskip("triton")

from shared.kernels.kv_copy_triton import copy_pages  # noqa: E402
from shared.kv.pool import allocate_local_pool, make_layout  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copy_pages_matches_torch_and_touches_nothing_else(dtype):
    src_layout = make_layout(3, 11, 16, 3, 64, dtype)
    dst_layout = make_layout(3, 7, 16, 3, 64, dtype)  # other page count: other shard stride
    src, _ = allocate_local_pool(src_layout, DEVICE)
    dst, _ = allocate_local_pool(dst_layout, DEVICE)
    src.kv.copy_(torch.randn(src.kv.shape, dtype=dtype))
    dst.kv.fill_(float("nan"))
    src_ids = torch.tensor([9, 2, 5, 0], device=DEVICE)
    dst_ids = torch.tensor([6, 0, 3, 1], device=DEVICE)
    copy_pages(src.kv_bits, dst.kv_bits, src_ids, dst_ids)
    assert torch.equal(dst.kv[:, dst_ids], src.kv[:, src_ids])  # bit-identical
    untouched = [p for p in range(dst_layout.num_pages) if p not in dst_ids.tolist()]
    assert torch.isnan(dst.kv[:, untouched].float()).all()


def test_copy_pages_refuses_other_layouts():
    a, _ = allocate_local_pool(make_layout(2, 4, 16, 2, 64, torch.float32), DEVICE)
    b, _ = allocate_local_pool(make_layout(2, 4, 16, 2, 128, torch.float32), DEVICE)
    with pytest.raises(ValueError, match="different layouts"):
        copy_pages(a.kv_bits, b.kv_bits, torch.tensor([0]), torch.tensor([0]))
    with pytest.raises(ValueError, match="as_integers"):
        copy_pages(a.kv, a.kv, torch.tensor([0]), torch.tensor([1]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_copy_pages_reads_page_ids_from_pinned_host_memory():
    """The decode's pull passes its ids in pinned host memory, which the kernel reads over PCIe."""
    layout = make_layout(2, 8, 16, 2, 64, torch.bfloat16)
    src, _ = allocate_local_pool(layout, "cuda")
    dst, _ = allocate_local_pool(layout, "cuda")
    src.kv.copy_(torch.randn(src.kv.shape, dtype=torch.bfloat16))
    dst.kv.zero_()
    ids = torch.tensor([7, 1, 4, 2, 5, 6], dtype=torch.int64).pin_memory()
    copy_pages(src.kv_bits, dst.kv_bits, ids[:3], ids[3:])
    torch.cuda.synchronize()
    assert torch.equal(dst.kv[:, [2, 5, 6]], src.kv[:, [7, 1, 4]])
