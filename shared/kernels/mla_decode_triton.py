"""Paged decode attention for DeepSeek's multi-head latent attention (MLA), absorbed form, in Triton.

Computes, for every sequence b and head h, over the tokens t < seq_lens[b] (with a sliding window,
window > 0, only those from seq_lens[b] - window on):

    score[t] = scale * (q_latent[b, h] . c_t + q_rope[b, h] . k_rope_t)
    out[b, h] = sum_t softmax(score)[t] * c_t

q_latent [B, H, R] is the caller's q_nope already multiplied by each head's W_uk (R = kv_lora_rank),
q_rope [B, H, Dr] its rotated RoPE part; out [B, H, R] is in latent space, W_uv comes after.

Layout: the pool keeps one vector of R + Dr values per token and layer, c then k_rope (see
shared/model/mla.py); a layer's shard is cache [num_pages, page_size, 1, R + Dr], each page
contiguous, token t of sequence b in page page_table[b, t // page_size], slot t % page_size.
Quantized pools (int8 or float8_e4m3fn) keep one float32 scale per token beside it, cache_scale
[num_pages, page_size, 1], as shared/kernels/kv_quant.py writes them.

Why the heads share tiles: every head reads the same latent, so a program takes a block of heads
(the products' M) and each [BLOCK_N, R + Dr] tile of tokens it loads serves them all:
scores [heads, BLOCK_N] = q_latent @ c^T + q_rope @ k_rope^T, then acc [heads, R] += p @ c, the same
c tile in both products. A program per head would read the pages H times. Quantized values are
converted exactly to fp16 on the tile as loaded (every int8 and e4m3 value is an fp16 value), the
paged kernel's convert_on_load, which that kernel measured slower than Triton's own placement; for
the latent kernel neither is timed. Their scales stay outside the products: each
token's scale multiplies its column of scores and its column of probabilities (inside the online
softmax, so the fp16 weights are at most 1), H * BLOCK_N multiplies a tile
rather than BLOCK_N * (R + Dr).

Split and merge (flash-decoding): the grid is (head blocks, num_splits, B). Each sequence's context
is cut into num_splits chunks (sized from its own length); a program runs an online softmax over its
chunk and writes fp32 partials (max, sum, unnormalised acc) to scratch, and the last of a head
block's programs to finish merges them (shared/kernels/split_merge_triton.py). The grid and
num_splits depend only on shapes (B, H, page_table's width), so nothing syncs with the host and a
CUDA graph can capture the call.

Why a small batch's long context splits in up to a wave: at batch 1 the heads are one head block,
so only the splits spread a sequence's latent over the SMs. Capped at the paged kernel's 64, one
sequence at 524K read its 604 MB a layer with 64 programs on 132 SMs, at 4.9 times the step's
floor (docs/BENCHMARKS.md). Past MERGE_HERE_SPLITS, the partials (32 KB a split at 16 heads x
512) are merged by a launch of their own rather than by the last program alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from shared.kernels import kv_quant
from shared.kernels.paged_attention_triton import (
    _LOG2E,
    _NO_WINDOW,
    _choose_num_splits,
    _num_sms,
    _scaled_softmax_tile,
    _to_fp16,
)
from shared.kernels.split_merge_triton import (
    MERGE_HERE_SPLITS,
    finish_split,
    merge_splits,
    split_counters,
    split_range,
)
from shared.kernels.triton_support import (
    compiled,
    pdl_options,
    require_triton,
    tl,
    triton,
    wait_for_previous_kernel,
)


# Columns of the latent the merge takes at a time: wider ones made the 16-head kernel spill (sm_90).
_MERGE_COLUMNS = 64
# The products' dtype (the kernel's PRODUCTS): q's own (bf16 or fp16 queries over pages of their
# dtype), fp32, or fp16 over quantized pages, whose values are converted exactly to fp16 on the tile as
# loaded (paged_attention_triton's "fp16" mode: bf16 took 1,624 instructions a 32-token iteration
# for int8 pages and 1,595 for e4m3, twice the 817 of bf16 pages, docs/BENCHMARKS.md).
_PRODUCTS = {"native": 0, "fp32": 1, "fp16": 2}


@dataclass(frozen=True)
class MlaTiling:
    """Heads per program (the products' M), tokens per loop iteration, the program's warps and
    pipeline depth."""
    block_h: int
    block_n: int
    num_warps: int
    num_stages: int


def default_tiling(num_heads: int, quantized: bool = False) -> MlaTiling:
    """16 heads (V2-Lite) fill a block of their own; more take 64 a program, whose [64, R] fp32
    accumulator already holds half the register file at R = 512 (8 warps, 128 registers a thread).
    Quantized pages of 16 heads double-buffer their tiles (5 stages): 0.95-0.97x the time of one
    buffer at batch 64 x 1K and 1 x 32K (int8, H100), where bf16 pages ran 1.01x and 1.57x."""
    if num_heads <= 16:
        return MlaTiling(16, 32, 4, 5 if quantized else 2)
    return MlaTiling(64, 32, 8, 2)


if triton is not None:

    @triton.jit
    def _mla_split_kernel(
        q_latent_ptr, q_rope_ptr, cache_ptr, scale_ptr, page_table_ptr, seq_lens_ptr,
        m_ptr, l_ptr, acc_ptr, out_ptr, counters_ptr,
        qk_scale, num_splits, window, num_heads,
        stride_lb, stride_lh, stride_rb, stride_rh,
        stride_p, stride_t, stride_sp, stride_st, stride_pt, stride_ob, stride_oh,
        RANK: tl.constexpr, ROPE: tl.constexpr, PAGE_SIZE: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, QUANTIZED: tl.constexpr,
        PRODUCTS: tl.constexpr, DOT_PRECISION: tl.constexpr, INLINE_PTX: tl.constexpr, SPLIT: tl.constexpr,
        MERGE_COLUMNS: tl.constexpr, MERGE_HERE: tl.constexpr, USE_PDL: tl.constexpr,
    ):
        wait_for_previous_kernel(USE_PDL)
        heads = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
        split = tl.program_id(1)
        b = tl.program_id(2)
        head_mask = heads < num_heads

        begin, lo, hi, used = split_range(seq_lens_ptr, b, split, num_splits, window, BLOCK_N)

        r = tl.arange(0, RANK)
        e = tl.arange(0, ROPE)
        n = tl.arange(0, BLOCK_N)
        # The products are in PRODUCTS' dtype (see _PRODUCTS); the pages are converted to it.
        q_latent = tl.load(q_latent_ptr + b * stride_lb + heads[:, None] * stride_lh + r[None, :],
                           mask=head_mask[:, None], other=0.0)
        q_rope = tl.load(q_rope_ptr + b * stride_rb + heads[:, None] * stride_rh + e[None, :],
                         mask=head_mask[:, None], other=0.0)
        table_row = page_table_ptr + b * stride_pt
        if PRODUCTS == 1:
            q_latent = q_latent.to(tl.float32)
            q_rope = q_rope.to(tl.float32)
        elif PRODUCTS == 2:
            # fp16 queries carry the softmax scale; the probabilities are weighed by the token
            # scales inside the online softmax, so that the fp16 weights are at most 1.
            q_latent = (q_latent.to(tl.float32) * qk_scale).to(tl.float16)
            q_rope = (q_rope.to(tl.float32) * qk_scale).to(tl.float16)

        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, RANK], tl.float32)
        for start in range(lo, hi, BLOCK_N):
            tok = start + n
            valid = (tok >= begin) & (tok < hi)
            # int64: page * stride_p overflows int32 for pools above 2**31 elements.
            page = tl.load(table_row + tok // PAGE_SIZE, mask=valid, other=0).to(tl.int64)
            slot = tok % PAGE_SIZE
            rows = cache_ptr + page * stride_p + slot * stride_t
            # Masked slots read as 0: past seq_len a page may hold anything, NaN included.
            c = tl.load(rows[:, None] + r[None, :], mask=valid[:, None], other=0.0)
            k_rope = tl.load(rows[:, None] + RANK + e[None, :], mask=valid[:, None], other=0.0)
            if PRODUCTS == 2:
                c = _to_fp16(c, 1, INLINE_PTX)
                k_rope = _to_fp16(k_rope, 1, INLINE_PTX)
            else:
                c = c.to(q_latent.dtype)
                k_rope = k_rope.to(q_latent.dtype)
            qk = tl.dot(q_latent, tl.trans(c), input_precision=DOT_PRECISION)
            qk = tl.dot(q_rope, tl.trans(k_rope), qk, input_precision=DOT_PRECISION)
            if QUANTIZED:
                token_scale = tl.load(scale_ptr + page * stride_sp + slot * stride_st, mask=valid, other=0.0)
                qk *= token_scale[None, :]
            # Scores in the log2 domain (qk_scale carries log2 e) for exp2.
            if PRODUCTS != 2:  # else the queries carry it
                qk *= qk_scale
            qk = tl.where(valid[None, :], qk, float("-inf"))
            if QUANTIZED:
                p, alpha, m_new, l_i = _scaled_softmax_tile(qk, token_scale, m_i, l_i)
            else:
                m_new = tl.maximum(m_i, tl.max(qk, axis=1))
                alpha = tl.exp2(m_i - m_new)
                p = tl.exp2(qk - m_new[:, None])
                l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = tl.dot(p.to(q_latent.dtype), c, acc * alpha[:, None], input_precision=DOT_PRECISION)
            m_i = m_new
        finish_split(m_i, l_i, acc, m_ptr, l_ptr, acc_ptr, out_ptr + b * stride_ob + heads * stride_oh,
                     counters_ptr + b * tl.num_programs(0) + tl.program_id(0), (b * num_heads + heads) * num_splits,
                     split, num_splits, used, head_mask, SPLIT, BLOCK_H, RANK, MERGE_COLUMNS, MERGE_HERE)


def mla_decode_reference(q_latent: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor,
                         cache_scale: torch.Tensor | None, page_table: torch.Tensor, seq_lens: torch.Tensor,
                         scale: float, window: int = 0) -> torch.Tensor:
    """The same in PyTorch, in fp32 over every sequence's pages gathered to page_table's width: the
    CPU path, and the kernel's reference."""
    batch, rank = q_latent.shape[0], q_latent.shape[2]
    pages = page_table.long()
    latent = cache[pages].reshape(batch, -1, cache.shape[-1])
    if cache_scale is None:
        latent = latent.float()
    else:
        latent = kv_quant.dequantize(latent, cache_scale[pages].reshape(batch, -1), torch.float32)
    positions = torch.arange(latent.shape[1], device=latent.device)
    valid = positions < seq_lens[:, None]
    if window > 0:
        valid &= positions >= seq_lens[:, None] - window
    # Zeroed, not only masked: a slot past seq_len may hold NaN, and 0 * NaN is NaN.
    latent = latent.masked_fill(~valid[..., None], 0.0)
    c, k_rope = latent.split([rank, latent.shape[-1] - rank], dim=-1)
    scores = (q_latent.float() @ c.transpose(1, 2) + q_rope.float() @ k_rope.transpose(1, 2)) * scale
    probs = torch.softmax(scores.masked_fill(~valid[:, None, :], float("-inf")), dim=-1)
    return (probs @ c).to(q_latent.dtype)


def mla_decode_attention(q_latent: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor,
                         cache_scale: torch.Tensor | None, page_table: torch.Tensor, seq_lens: torch.Tensor,
                         scale: float, window: int = 0, num_splits: int | None = None,
                         tiling: MlaTiling | None = None, merge_here: bool | None = None,
                         products: str | None = None) -> torch.Tensor:
    """q_latent [B, H, R] and q_rope [B, H, Dr] (bf16, fp16 or fp32) over the latent pages cache
    [num_pages, page_size, 1, R + Dr], in q's dtype or int8/float8_e4m3fn with cache_scale float32
    [num_pages, page_size, 1]; returns [B, H, R] in q's dtype. page_table [B, max_pages] and seq_lens
    [B] are int32 on q's device, seq_lens >= 1. window > 0: only each sequence's last `window`
    tokens. num_splits=None picks it from the shapes; tiling=None, default_tiling's for H;
    merge_here=None, the last split program's merge up to MERGE_HERE_SPLITS splits, a launch of its
    own past them; products=None, _products' choice of a _PRODUCTS key (benchmarks sweep all four)."""
    require_triton("mla_decode_attention")
    _check(q_latent, q_rope, cache, cache_scale, page_table, seq_lens)
    if window < 0:
        raise ValueError(f"window must be >= 0, got {window}")
    batch, num_heads, rank = q_latent.shape
    page_size = cache.shape[1]
    tiling = tiling or default_tiling(num_heads, cache_scale is not None)
    head_blocks = triton.cdiv(num_heads, tiling.block_h)
    if num_splits is None:
        num_splits = auto_num_splits(batch, head_blocks, page_table.shape[1] * page_size, window, tiling,
                                     q_latent.device)
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")

    device = q_latent.device
    m = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=device)
    l = torch.empty_like(m)
    acc = torch.empty((batch, num_heads, num_splits, rank), dtype=torch.float32, device=device)
    out = torch.empty((batch, num_heads, rank), dtype=q_latent.dtype, device=device)
    if products is not None and products not in _PRODUCTS:
        raise ValueError(f"products must be one of {sorted(_PRODUCTS)}, not {products!r}")
    products = _PRODUCTS[products] if products else _products(q_latent, cache_scale is not None)
    scales = cache_scale if cache_scale is not None else cache  # unread when unquantized
    if merge_here is None:
        merge_here = num_splits <= MERGE_HERE_SPLITS
    _mla_split_kernel[(head_blocks, num_splits, batch)](
        q_latent, q_rope, cache, scales, page_table, seq_lens,
        m, l, acc, out, split_counters(device, batch * head_blocks),
        scale * _LOG2E, num_splits, window or _NO_WINDOW, num_heads,
        q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1),
        cache.stride(0), cache.stride(1), scales.stride(0), scales.stride(1), page_table.stride(0),
        out.stride(0), out.stride(1),
        RANK=rank, ROPE=q_rope.shape[2], PAGE_SIZE=page_size,
        BLOCK_H=tiling.block_h, BLOCK_N=tiling.block_n, QUANTIZED=cache_scale is not None,
        # fp32 inputs would otherwise be rounded to tf32 by the tensor cores.
        PRODUCTS=products, DOT_PRECISION="ieee" if products == _PRODUCTS["fp32"] else "tf32",
        INLINE_PTX=compiled(device),
        SPLIT=num_splits > 1, MERGE_COLUMNS=min(rank, _MERGE_COLUMNS), MERGE_HERE=merge_here,
        num_warps=tiling.num_warps, num_stages=tiling.num_stages, **pdl_options(device),
    )
    if not merge_here:
        merge_splits(m, l, acc, out, seq_lens, window or _NO_WINDOW, tiling.block_n, min(rank, _MERGE_COLUMNS))
    return out


def _products(q_latent: torch.Tensor, quantized: bool) -> int:
    """The products' dtype (see _PRODUCTS): fp32 for fp32 queries, and in Triton's CPU interpreter
    for unquantized pages (it multiplies bf16 operands of tl.dot as their integer bits, 3.9); fp16
    for quantized pages; else q's dtype."""
    if q_latent.dtype == torch.float32:
        return _PRODUCTS["fp32"]
    if quantized:
        return _PRODUCTS["fp16"]
    return _PRODUCTS["native"] if q_latent.is_cuda else _PRODUCTS["fp32"]


def auto_num_splits(batch: int, head_blocks: int, context: int, window: int, tiling: MlaTiling,
                    device: torch.device) -> int:
    """The splits a call takes by default: the paged kernel's rule over the tokens a sequence may
    read (page_table's width, or a window's span), without its cap (see the module's docstring)."""
    if window:
        context = min(context, window + tiling.block_n)  # a window's reads span this at most
    return _choose_num_splits(batch, head_blocks, context, _num_sms(device), max_splits=None)


def _check(q_latent: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor, cache_scale: torch.Tensor | None,
           page_table: torch.Tensor, seq_lens: torch.Tensor) -> None:
    batch, num_heads, rank = q_latent.shape
    rope = q_rope.shape[-1]
    if q_rope.shape != (batch, num_heads, rope) or q_rope.dtype != q_latent.dtype:
        raise ValueError(f"q_rope {tuple(q_rope.shape)} {q_rope.dtype} does not go with q_latent "
                         f"{tuple(q_latent.shape)} {q_latent.dtype}")
    if q_latent.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"queries must be bfloat16, float16 or float32, not {q_latent.dtype}")
    if q_latent.stride(-1) != 1 or q_rope.stride(-1) != 1:
        raise ValueError("q_latent and q_rope need a contiguous last dim")
    for name, size in (("kv_lora_rank", rank), ("qk_rope_head_dim", rope)):
        if size & (size - 1) or size < 16:
            raise ValueError(f"{name} must be a power of two >= 16, got {size}")
    if cache.dim() != 4 or cache.shape[2] != 1 or cache.shape[3] != rank + rope or cache.stride(-1) != 1:
        raise ValueError(f"cache {tuple(cache.shape)} {cache.stride()} is not [pages, page_size, 1, {rank + rope}] "
                         "with a contiguous last dim")
    if cache_scale is None:
        if cache.dtype != q_latent.dtype:
            raise ValueError(f"an unquantized cache must be in q's dtype {q_latent.dtype}, not {cache.dtype}")
    elif not kv_quant.is_quantized(cache.dtype) or cache_scale.dtype != kv_quant.SCALE_DTYPE \
            or cache_scale.shape != cache.shape[:3]:
        raise ValueError(f"cache_scale {tuple(cache_scale.shape)} {cache_scale.dtype} for a {cache.dtype} cache: "
                         f"float32 {tuple(cache.shape[:3])} scales of an int8 or float8_e4m3fn cache expected")
    if page_table.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise ValueError("page_table and seq_lens must be int32")
    if page_table.dim() != 2 or page_table.shape[0] != batch or seq_lens.shape != (batch,):
        raise ValueError(f"page_table {tuple(page_table.shape)} / seq_lens {tuple(seq_lens.shape)} vs batch {batch}")
    if page_table.stride(1) != 1 or not seq_lens.is_contiguous():
        raise ValueError("page_table rows and seq_lens must be contiguous")
