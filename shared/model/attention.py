"""Attention over the paged pool, in plain PyTorch (the CPU path and the GPU fallback).

prefill_attention: causal attention over the prompt's own contiguous K/V (flash attention via
SDPA where the device has it). paged_decode_attention: one new token per sequence against its
pages; the pages are gathered, which is cheap on the CPU's small contexts. The GPU path reads
pages in place (shared/model/paged_attention_triton.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [T, H, D], k/v [T, KVH, D] -> [T, H, D], causal."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
        is_causal=True, scale=scale, enable_gqa=True,
    )
    return out.squeeze(0).transpose(0, 1)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           page_table: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q [B, H, D]; caches [pages, page_size, KVH, D]; page_table [B, P]; seq_lens [B] -> [B, H, D]."""
    batch, max_pages = page_table.shape
    _, page_size, kv_heads, head_dim = k_cache.shape
    length = max_pages * page_size
    k = k_cache[page_table].view(batch, length, kv_heads, head_dim).transpose(1, 2)
    v = v_cache[page_table].view(batch, length, kv_heads, head_dim).transpose(1, 2)
    valid = torch.arange(length, device=q.device)[None, :] < seq_lens[:, None]
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2), k, v, attn_mask=valid[:, None, None, :], scale=scale, enable_gqa=True,
    )
    return out.squeeze(2)
