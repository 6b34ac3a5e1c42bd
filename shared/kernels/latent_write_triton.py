"""MLA's latent write in one Triton launch: from the kv_a projection's output to the token's slot in
the latent pages.

A row of kv_a's output is [c, k_rope] (kv_lora_rank, then qk_rope_head_dim values). The pool keeps
[RMSNorm(c) * kv_a_norm, RoPE(k_rope)] (shared/model/mla.py); in PyTorch ops that is a norm, a
RoPE, a concatenation and an indexed write (four more with quantized pages), in each MLA layer of
each decode step. One program a row does all of it, with the numbers of the kernels it replaces:
fused_triton's RMSNorm and RoPE, kv_quant's one scale per token and layer.
"""

from __future__ import annotations

import torch

from shared.kernels import kv_quant
from shared.kernels.fused_triton import _rotated, _store_quantized
from shared.kernels.triton_support import pdl_options, require_triton, tl, triton, wait_for_previous_kernel

if triton is not None:

    @triton.jit
    def _norm_rope_write_latent_kernel(
        x_ptr, norm_ptr, cos_ptr, sin_ptr, pos_ptr, page_ptr, offset_ptr, cache_ptr, scale_ptr,
        eps, stride_x, stride_cos, stride_sin, stride_cp, stride_ct, stride_sp, stride_st,
        RANK: tl.constexpr, ROPE: tl.constexpr, BLOCK: tl.constexpr, QUANTIZED: tl.constexpr,
        QMAX: tl.constexpr, ROUND: tl.constexpr, USE_PDL: tl.constexpr,
    ):
        wait_for_previous_kernel(USE_PDL)
        n = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        is_c = cols < RANK
        mask = cols < RANK + ROPE
        row = x_ptr + n * stride_x
        x = tl.load(row + cols, mask=mask, other=0.0)
        # c: LlamaRMSNorm's numbers (fused_triton's _rms_norm_kernel), over the first RANK columns.
        h = tl.where(is_c, x.to(tl.float32), 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(h * h, axis=0) / RANK + eps)
        w = tl.load(norm_ptr + cols, mask=is_c, other=0.0).to(tl.float32)
        normed = ((h * rstd).to(x.dtype).to(tl.float32) * w).to(x.dtype)
        # k_rope: rotate-half RoPE, each element d of the key paired with d +- half.
        d = tl.where(is_c, 0, cols - RANK)
        half = ROPE // 2
        partner = tl.where(d < half, d + half, d - half)
        rope_mask = mask & ~is_c
        x_pair = tl.load(row + RANK + partner, mask=rope_mask, other=0.0).to(tl.float32)
        pos = tl.load(pos_ptr + n).to(tl.int64)
        cos = tl.load(cos_ptr + pos * stride_cos + d, mask=rope_mask, other=0.0).to(tl.float32)
        sin = tl.load(sin_ptr + pos * stride_sin + d, mask=rope_mask, other=0.0).to(tl.float32)
        latent = tl.where(is_c, normed, _rotated(x, x_pair, cos, sin, d < half))
        # int64: page * stride_cp overflows int32 for pools above 2**31 elements.
        page = tl.load(page_ptr + n).to(tl.int64)
        slot = tl.load(offset_ptr + n).to(tl.int64)
        at = cache_ptr + page * stride_cp + slot * stride_ct
        if QUANTIZED:
            _store_quantized(at + cols[None, :], scale_ptr + page * stride_sp + slot * stride_st + tl.arange(0, 1),
                             latent[None, :], mask[None, :], tl.full([1], 1, tl.int1), QMAX, ROUND)
        else:
            tl.store(at + cols, latent.to(cache_ptr.dtype.element_ty), mask=mask)


def norm_rope_write_latent(kv_a_out: torch.Tensor, norm_weight: torch.Tensor, eps: float, cos: torch.Tensor,
                           sin: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor, pages: torch.Tensor,
                           offsets: torch.Tensor, scale: torch.Tensor | None = None) -> None:
    """kv_a_out [N, rank + rope] (a contiguous last dim) -> cache[pages[n], offsets[n], 0] =
    [rms_norm(c, norm_weight, eps), rope(k_rope) at positions[n]], quantized with its scale in
    scale [pages, page_size, 1] where the cache [pages, page_size, 1, rank + rope] is int8 or FP8.
    cos/sin [max_positions, rope] in kv_a_out's dtype."""
    require_triton("norm_rope_write_latent")
    rows, width = kv_a_out.shape
    rank = norm_weight.shape[0]
    rope = width - rank
    if kv_a_out.stride(1) != 1 or rope <= 0 or rope % 2 or cache.shape[2:] != (1, width) or cache.stride(-1) != 1:
        raise ValueError(f"kv_a_out {tuple(kv_a_out.shape)} strides {kv_a_out.stride()}, norm {rank} and cache "
                         f"{tuple(cache.shape)}: not a latent of {rank} values and an even RoPE key")
    if cos.shape[1] != rope or sin.shape[1] != rope or cos.stride(1) != 1 or sin.stride(1) != 1:
        raise ValueError(f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} do not rotate {rope} dims")
    if any(t.shape != (rows,) for t in (positions, pages, offsets)):
        raise ValueError(f"positions, pages and offsets must be ({rows},)")
    quantized = kv_quant.is_quantized(cache.dtype)
    if quantized != (scale is not None) or (quantized and (scale.shape != cache.shape[:3] or scale.stride(-1) != 1)):
        raise ValueError(f"a {cache.dtype} cache with scales {None if scale is None else tuple(scale.shape)}")
    if rows == 0:
        return
    _norm_rope_write_latent_kernel[(rows,)](
        kv_a_out, norm_weight, cos, sin, positions, pages, offsets, cache, scale if quantized else cache,
        eps, kv_a_out.stride(0), cos.stride(0), sin.stride(0), cache.stride(0), cache.stride(1),
        scale.stride(0) if quantized else 0, scale.stride(1) if quantized else 0,
        RANK=rank, ROPE=rope, BLOCK=triton.next_power_of_2(width), QUANTIZED=quantized,
        QMAX=kv_quant.QMAX.get(cache.dtype, 0.0), ROUND=cache.dtype == torch.int8,
        # As fused_triton's RoPE: no fma contraction, so each product rounds as PyTorch's does.
        num_warps=4, enable_fp_fusion=False, **pdl_options(kv_a_out.device),
    )
