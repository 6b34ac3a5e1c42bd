"""Attention over the paged pool.

prefill_attention: a prompt chunk's causal attention over contiguous K/V, its own and any earlier
chunks' or cached prefix's before them (causal from the bottom right). On a Hopper GPU with
FlashInfer installed, every case is one call to its FA3 kernel (shared/kernels/flashinfer_prefill.py).
Otherwise a whole prompt (or its first chunk) is one causal SDPA call, on the backend SDPA picks: on
the H200 it ran at least as fast as cuDNN called directly, for the 8B's heads and MLA's; and on a GPU
a chunk after earlier keys is split in two and merged by log-sum-exp
(shared/model/split_attention.py), both parts through cuDNN. Where neither runs (float32, a single
key, MLA's unequal head dims for FlashInfer) and on the CPU, it is one SDPA call with the
bottom-right mask (masked_attention). Which is fastest where: docs/BENCHMARKS.md, "FlashInfer's Hopper
prefill attention".

paged_decode_attention: one new token per sequence against its pages; on a GPU the Triton kernel
reads the pages in place and dequantizes quantized ones in registers
(shared/kernels/paged_attention_triton.py); on the CPU the pages are gathered and dequantized,
which is cheap for the CPU's small contexts.

Sliding window (window > 0, 0 for none): the query at position p sees the keys at positions j with
p - window < j <= p, the window keys ending at its own, as transformers' sliding_window_overlay
(`kv_idx > q_idx - sliding_window`) masks them. A prefill whose keys all fit in the window is
unchanged; one past it runs the masked SDPA over the keys its first query can see (on a GPU too:
cuDNN's causal calls take no window). The decode reads only a sequence's last window tokens.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shared.kernels import flashinfer_prefill, kv_quant, paged_attention_triton
from shared.model import split_attention

# The GPU prefill's ways, fastest first; each falls to the next where it cannot run a case.
PREFILL_WAYS = ("flashinfer", "cudnn", "sdpa")
_ways = PREFILL_WAYS


def hold_prefill_to(way: str | None) -> None:
    """Holds the GPU's prefill attention to one of PREFILL_WAYS (and the masked SDPA where that one
    cannot run) for later calls, None for all of them: benchmarks compare them in one process."""
    global _ways
    _ways = PREFILL_WAYS if way is None else (way,)


def prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                      window: int = 0) -> torch.Tensor:
    """q [T, H, D], k/v [S, KVH, D] with S >= T (the last T keys are the queries' own) -> [T, H, D];
    window > 0: each query sees only its last `window` keys, its own included."""
    if 0 < window < k.shape[0] or not q.is_cuda:
        return masked_attention(q, k, v, scale, window)
    if "flashinfer" in _ways and flashinfer_prefill.accepts(q, k, v):
        return flashinfer_prefill.attention(q, k, v, scale)
    modes = split_attention.gqa_modes(q, k, v) if "cudnn" in _ways and k.shape[0] > q.shape[0] else None
    if modes is None:
        return masked_attention(q, k, v, scale)
    return split_attention.split_attention(q, k, v, scale, modes)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     window: int = 0) -> torch.Tensor:
    """The same through one SDPA call, whichever backend it picks, with the bottom-right causal mask."""
    length, context = q.shape[0], k.shape[0]
    if 0 < window < context:
        # Only the keys the first query sees, their heads repeated: SDPA's GQA is not promised to a
        # masked kernel on the GPU, and the math fallback would hold every score.
        first = max(0, context - length - window + 1)
        group = q.shape[1] // k.shape[1]
        k, v = (x[first:].repeat_interleave(group, dim=1) for x in (k, v))
        sdpa_args = {"attn_mask": _window_mask(length, context - first, window, q.device), "enable_gqa": False}
    else:
        # GQA only where the heads differ: on the GPU it rules out SDPA's memory-efficient kernel,
        # the one that takes MLA's keys and values of different widths (shared/model/mla.py).
        grouped = q.shape[1] != k.shape[1]
        sdpa_args = {"is_causal": True} if context == length else {"attn_mask": _bottom_right_causal(length, context, q)}
        sdpa_args["enable_gqa"] = grouped
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0),
        scale=scale, **sdpa_args,
    )
    return out.squeeze(0).transpose(0, 1)


def _bottom_right_causal(length: int, context: int, q: torch.Tensor):
    """The causal mask of T queries that follow S - T earlier keys. On the CPU as the [T, S] bool
    mask SDPA makes of causal_lower_right there, without importing torch.nn.attention.bias: that
    loads torch._dynamo, 1.8 s of every worker's start. On a GPU, causal_lower_right, which SDPA's
    fused kernels take without a mask in memory."""
    if not q.is_cuda:
        return _window_mask(length, context, context, q.device)
    from torch.nn.attention.bias import causal_lower_right

    return causal_lower_right(length, context)


def _window_mask(length: int, context: int, window: int, device: torch.device) -> torch.Tensor:
    """[T, S] bool, True where query t (at position S - T + t) sees key j: causal and within the window."""
    behind = torch.arange(context - length, context, device=device)[:, None] - torch.arange(context, device=device)
    return (behind >= 0) & (behind < window)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           page_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                           fp8_query: bool = False, window: int = 0) -> torch.Tensor:
    """q [B, H, D]; caches [pages, page_size, KVH, D]; page_table [B, P]; seq_lens [B] -> [B, H, D].
    k_scale/v_scale [pages, page_size, KVH]: the scales of quantized caches, None for unquantized.
    fp8_query: e4m3 q over float8_e4m3fn pages, a mode of the GPU kernel (the CPU path ignores it).
    window > 0: each sequence reads only its tokens at seq_len - window and after."""
    if q.is_cuda:
        return paged_attention_triton.paged_decode_attention(
            q, k_cache, v_cache, page_table.to(torch.int32), seq_lens.to(torch.int32), scale, k_scale, v_scale,
            fp8_query=fp8_query and k_cache.dtype == torch.float8_e4m3fn, window=window)
    batch, max_pages = page_table.shape
    _, page_size, kv_heads, head_dim = k_cache.shape
    length = max_pages * page_size
    k, v = k_cache[page_table], v_cache[page_table]
    if k_scale is not None:
        k, v = kv_quant.dequantize(k, k_scale[page_table], q.dtype), kv_quant.dequantize(v, v_scale[page_table], q.dtype)
    k = k.view(batch, length, kv_heads, head_dim).transpose(1, 2)
    v = v.view(batch, length, kv_heads, head_dim).transpose(1, 2)
    positions = torch.arange(length, device=q.device)[None, :]
    valid = positions < seq_lens[:, None]
    if window > 0:
        valid &= positions >= seq_lens[:, None] - window
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2), k, v, attn_mask=valid[:, None, None, :], scale=scale, enable_gqa=True,
    )
    return out.squeeze(2)
