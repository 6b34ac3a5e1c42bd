"""A request's KV handoff on a GPU: every layer's pages copied in one Triton launch.

PyTorch's `dst.kv[:, dst_ids] = src.kv[:, src_ids]` gathers into a temporary and scatters it
back: two passes over the bytes and slow index kernels, far above the copy floor
(docs/BENCHMARKS.md, "KV handoff copy"). Here program (shard, i) copies page src_ids[i] of shard `shard` straight to
page dst_ids[i] of the same shard of the other pool, which may be another process's pool
mapped through CUDA IPC; the pools may differ in page count, so each has its own shard stride.
"""

from __future__ import annotations

import math

import torch

from shared.kernels.triton_support import require_triton, tl, triton

_BLOCK = 4096

if triton is not None:

    @triton.jit
    def _copy_pages_kernel(src, dst, src_ids, dst_ids, src_shard_stride, dst_shard_stride,
                           page_elems, BLOCK: tl.constexpr):
        shard = tl.program_id(0)
        i = tl.program_id(1)
        src_page = tl.load(src_ids + i).to(tl.int64)
        dst_page = tl.load(dst_ids + i).to(tl.int64)
        src_base = src + shard.to(tl.int64) * src_shard_stride + src_page * page_elems
        dst_base = dst + shard.to(tl.int64) * dst_shard_stride + dst_page * page_elems
        for start in range(0, page_elems, BLOCK):
            idx = start + tl.arange(0, BLOCK)
            mask = idx < page_elems
            tl.store(dst_base + idx, tl.load(src_base + idx, mask=mask), mask=mask)


def as_integers(kv: torch.Tensor) -> torch.Tensor:
    """The same bytes as integers of the same size: the copy moves bits, never converts floats."""
    return kv.view({1: torch.int8, 2: torch.int16, 4: torch.int32}[kv.element_size()])


def copy_pages(src_kv: torch.Tensor, dst_kv: torch.Tensor, src_ids: torch.Tensor, dst_ids: torch.Tensor) -> None:
    """src_kv/dst_kv: pools' [2 * layers, pages, page_size, kv_heads, head_dim] views (contiguous
    pages, any shard stride) as_integers(); src_ids/dst_ids: page ids of equal length, on the
    pools' device or in pinned host memory, which the kernel reads over PCIe.

    Nothing here but the launch calls into torch: the decode calls it when a request arrives,
    when each torch call costs tens of µs (services/decode/kv_pull.py)."""
    require_triton("copy_pages")
    if src_kv.shape[0] != dst_kv.shape[0] or src_kv.shape[2:] != dst_kv.shape[2:] or src_kv.dtype != dst_kv.dtype:
        raise ValueError("pools of different layouts")
    if src_kv.dtype.is_floating_point:
        raise ValueError("pass the pools' KV as_integers()")
    if len(src_ids) != len(dst_ids):
        raise ValueError("as many source as destination pages")
    if len(src_ids) == 0:
        return
    _copy_pages_kernel[(src_kv.shape[0], len(src_ids))](
        src_kv, dst_kv, src_ids, dst_ids, src_kv.stride(0), dst_kv.stride(0), math.prod(src_kv.shape[2:]),
        BLOCK=_BLOCK,
    )
