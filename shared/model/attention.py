"""Attention over the paged pool.

prefill_attention: causal attention over a prompt chunk's contiguous K/V (flash attention via
SDPA where the device has it); a later chunk also sees the earlier chunks' K/V, with the causal
mask aligned to the bottom right. paged_decode_attention: one new token per sequence against
its pages; on a GPU the Triton kernel reads the pages in place and dequantizes quantized ones in
registers (shared/kernels/paged_attention_triton.py); on the CPU the pages are gathered and
dequantized, which is cheap for the CPU's small contexts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from shared.kernels import kv_quant, paged_attention_triton


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [T, H, D], k/v [S, KVH, D] with S >= T (the last T keys are the queries' own) -> [T, H, D]."""
    length, context = q.shape[0], k.shape[0]
    mask = {"is_causal": True} if context == length else {"attn_mask": causal_lower_right(length, context)}
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
        scale=scale, enable_gqa=True, **mask,
    )
    return out.squeeze(0).transpose(0, 1)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           page_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                           fp8_query: bool = False) -> torch.Tensor:
    """q [B, H, D]; caches [pages, page_size, KVH, D]; page_table [B, P]; seq_lens [B] -> [B, H, D].
    k_scale/v_scale [pages, page_size, KVH]: the scales of quantized caches, None for unquantized.
    fp8_query: e4m3 q over float8_e4m3fn pages, a mode of the GPU kernel (the CPU path ignores it)."""
    if q.is_cuda:
        return paged_attention_triton.paged_decode_attention(
            q, k_cache, v_cache, page_table.to(torch.int32), seq_lens.to(torch.int32), scale, k_scale, v_scale,
            fp8_query=fp8_query and k_cache.dtype == torch.float8_e4m3fn)
    batch, max_pages = page_table.shape
    _, page_size, kv_heads, head_dim = k_cache.shape
    length = max_pages * page_size
    k, v = k_cache[page_table], v_cache[page_table]
    if k_scale is not None:
        k, v = kv_quant.dequantize(k, k_scale[page_table], q.dtype), kv_quant.dequantize(v, v_scale[page_table], q.dtype)
    k = k.view(batch, length, kv_heads, head_dim).transpose(1, 2)
    v = v.view(batch, length, kv_heads, head_dim).transpose(1, 2)
    valid = torch.arange(length, device=q.device)[None, :] < seq_lens[:, None]
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2), k, v, attn_mask=valid[:, None, None, :], scale=scale, enable_gqa=True,
    )
    return out.squeeze(2)
