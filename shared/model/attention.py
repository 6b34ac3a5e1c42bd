"""Attention over the paged pool.

prefill_attention: a prompt chunk's causal attention over contiguous K/V, its own and any earlier
chunks' or cached prefix's before them (causal from the bottom right). On a GPU it goes through
cuDNN, a chunk after earlier keys split in two and merged by log-sum-exp
(shared/model/split_attention.py); where cuDNN cannot run a part (float32, a single key) and on
the CPU, through SDPA with the bottom-right mask (masked_attention).

paged_decode_attention: one new token per sequence against its pages; on a GPU the Triton kernel
reads the pages in place and dequantizes quantized ones in registers
(shared/kernels/paged_attention_triton.py); on the CPU the pages are gathered and dequantized,
which is cheap for the CPU's small contexts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

from shared.kernels import kv_quant, paged_attention_triton
from shared.model import split_attention

_split_allowed = True


def allow_split(allowed: bool) -> None:
    """Switches the GPU's cuDNN split off or on for later calls (benchmarks compare it with the masked SDPA)."""
    global _split_allowed
    _split_allowed = allowed


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [T, H, D], k/v [S, KVH, D] with S >= T (the last T keys are the queries' own) -> [T, H, D]."""
    modes = split_attention.gqa_modes(q, k, v) if q.is_cuda and _split_allowed else None
    if modes is None:
        return masked_attention(q, k, v, scale)
    return split_attention.split_attention(q, k, v, scale, modes)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """The same through one SDPA call, whichever backend it picks, with the bottom-right causal mask."""
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
