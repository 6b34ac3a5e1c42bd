"""Paged decode attention in Triton: one new query token per sequence against its paged KV cache.

Computes, for every sequence b and query head h,
    out[b, h] = softmax(scale * q[b, h] @ K_b^T) @ V_b
where K_b / V_b are the first seq_lens[b] tokens of the sequence, read in place from the pages
listed in page_table[b] (no contiguous copy of the KV is made).

Layout: q and out are [B, H, D]; k_cache and v_cache are one layer's shard each,
[num_pages, page_size, KVH, D] (the PagedKvPool shard layout); token t of sequence b lives in page
page_table[b, t // page_size], slot t % page_size. Grouped-query attention: query head h reads
kv head h // (H // KVH).

Split strategy (flash-decoding): decode has one query row per head, so a grid of (B, KVH) programs
leaves most SMs idle for small batches with long contexts. The context of each sequence is cut into
num_splits equal chunks (sized from that sequence's own seq_len, so short sequences in a batch do not
pay for the longest one); program (b, kv_head, split) runs an online softmax over its chunk for all
query heads of the kv group at once (each K/V tile is loaded once and used by the whole group via
tl.dot) and writes fp32 partial (max, sum, unnormalised acc). A second kernel, one program per
(b, h), rescales the partials to a common max and normalises. num_splits depends only on shapes
(batch, KVH, page_table width) and the SM count, so the function never syncs with the device and
can be captured in a CUDA graph.

Quantized caches (int8 or float8_e4m3fn pages with a float32 scale per token and kv head, as
shared/kernels/kv_quant.py writes them) are dequantized in registers, without a multiply per element:
the values enter tl.dot as they are, converted to q's dtype (int8 and e4m3 values are exact in
bf16), and each token's scale multiplies its column of scores (K) or of probabilities (V).
"""

from __future__ import annotations

import functools
import math

import torch

from shared.kernels.triton_support import pdl_options, require_triton, tl, triton, wait_for_previous_kernel

_LOG2E = 1.4426950408889634
# Tokens per inner-loop iteration: several 16-token pages per tl.dot keeps the tensor cores busy.
_BLOCK_N = 64
# A split shorter than this spends more on its partial write and the reduction than it saves.
_MIN_TOKENS_PER_SPLIT = 256
# Bounds the [splits, D] tile the reduction kernel holds in registers.
_MAX_AUTO_SPLITS = 64
# Launch ~2 programs per SM so that memory latency of one is hidden behind the other.
_PROGRAMS_PER_SM = 2
_DEFAULT_NUM_SMS = 132  # H200; used when the device cannot be queried (CPU interpreter)


if triton is not None:

    @triton.jit
    def _paged_decode_split_kernel(
        q_ptr, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, page_table_ptr, seq_lens_ptr,
        m_ptr, l_ptr, acc_ptr,
        qk_scale, num_splits,
        stride_qb, stride_qh,
        stride_kp, stride_kt, stride_kh,
        stride_vp, stride_vt, stride_vh,
        stride_sp, stride_st,
        stride_pt,
        num_heads,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
        PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, QUANTIZED: tl.constexpr,
        USE_PDL: tl.constexpr,
    ):
        wait_for_previous_kernel(USE_PDL)
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)

        seq_len = tl.load(seq_lens_ptr + b)
        # Chunk boundaries on BLOCK_N multiples so only the last block of a sequence is partial.
        chunk = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
        lo = split * chunk
        hi = tl.minimum(lo + chunk, seq_len)

        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, HEAD_DIM)
        n = tl.arange(0, BLOCK_N)
        heads = kvh * GROUP + g
        head_mask = g < GROUP
        # Rows past GROUP are zero padding: tl.dot needs at least 16 rows.
        q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                    mask=head_mask[:, None], other=0.0)

        m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
        for start in range(lo, hi, BLOCK_N):
            tok = start + n
            tok_mask = tok < hi
            # int64: page * stride_kp overflows int32 for pools above 2**31 elements.
            page = tl.load(page_table_ptr + b * stride_pt + tok // PAGE_SIZE, mask=tok_mask, other=0).to(tl.int64)
            slot = tok % PAGE_SIZE
            k = tl.load(k_ptr + page[:, None] * stride_kp + slot[:, None] * stride_kt + kvh * stride_kh + d[None, :],
                        mask=tok_mask[:, None], other=0.0)
            scale_at = page * stride_sp + slot * stride_st + kvh  # unused, so compiled away, when not QUANTIZED
            # Scores in the log2 domain (scale folded with log2 e) so exp2 can be used.
            if QUANTIZED:
                k_scale = tl.load(k_scale_ptr + scale_at, mask=tok_mask, other=0.0)
                qk = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PRECISION) * (k_scale[None, :] * qk_scale)
            else:
                qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
            qk = tl.where(tok_mask[None, :], qk, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_ptr + page[:, None] * stride_vp + slot[:, None] * stride_vt + kvh * stride_vh + d[None, :],
                        mask=tok_mask[:, None], other=0.0)
            if QUANTIZED:
                v_scale = tl.load(v_scale_ptr + scale_at, mask=tok_mask, other=0.0)
                pv = tl.dot((p * v_scale[None, :]).to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
            else:
                pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
            acc = acc * alpha[:, None] + pv
            m_i = m_new

        # Partials are [B, H, num_splits(, D)]; an empty split stores max=-inf, sum=0, acc=0.
        row = (b * num_heads + heads) * num_splits + split
        tl.store(m_ptr + row, m_i, mask=head_mask)
        tl.store(l_ptr + row, l_i, mask=head_mask)
        tl.store(acc_ptr + row[:, None] * HEAD_DIM + d[None, :], acc, mask=head_mask[:, None])

    @triton.jit
    def _paged_decode_reduce_kernel(
        m_ptr, l_ptr, acc_ptr, out_ptr,
        num_splits, num_heads,
        stride_ob, stride_oh,
        HEAD_DIM: tl.constexpr, SPLITS_PAD: tl.constexpr, USE_PDL: tl.constexpr,
    ):
        wait_for_previous_kernel(USE_PDL)
        b = tl.program_id(0)
        h = tl.program_id(1)
        s = tl.arange(0, SPLITS_PAD)
        d = tl.arange(0, HEAD_DIM)
        s_mask = s < num_splits
        row = (b * num_heads + h) * num_splits + s
        m = tl.load(m_ptr + row, mask=s_mask, other=float("-inf"))
        l = tl.load(l_ptr + row, mask=s_mask, other=0.0)
        acc = tl.load(acc_ptr + row[:, None] * HEAD_DIM + d[None, :], mask=s_mask[:, None], other=0.0)
        # Split 0 always holds token 0 (seq_len >= 1), so m_max is finite and empty splits weigh 0.
        m_max = tl.max(m, axis=0)
        w = tl.exp2(m - m_max)
        out = tl.sum(acc * w[:, None], axis=0) / tl.sum(l * w, axis=0)
        tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty))


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _DEFAULT_NUM_SMS


def _choose_num_splits(batch: int, num_kv_heads: int, max_context: int, num_sms: int) -> int:
    """Splits per (sequence, kv head) so that batch * num_kv_heads * splits covers the GPU ~twice,
    without cutting the longest possible context into chunks under _MIN_TOKENS_PER_SPLIT tokens."""
    wanted = math.ceil(_PROGRAMS_PER_SM * num_sms / (batch * num_kv_heads))
    by_length = max(1, max_context // _MIN_TOKENS_PER_SPLIT)
    return max(1, min(wanted, by_length, _MAX_AUTO_SPLITS))


def _check_cache_dtypes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> None:
    if k_scale is None and v_scale is None:
        if q.dtype != k_cache.dtype or q.dtype != v_cache.dtype:
            raise ValueError(f"dtype mismatch: q {q.dtype}, k {k_cache.dtype}, v {v_cache.dtype}")
        return
    if k_cache.dtype not in (torch.int8, torch.float8_e4m3fn) or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"scales given for caches of {k_cache.dtype} and {v_cache.dtype}: int8 or float8_e4m3fn expected")
    expected = k_cache.shape[:3]
    for name, scales in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scales is None or scales.dtype != torch.float32 or scales.shape != expected or scales.stride(-1) != 1:
            raise ValueError(f"{name} must be float32 {tuple(expected)} with a contiguous last dim")
    if v_scale.stride() != k_scale.stride():
        raise ValueError("k_scale and v_scale need the same strides")


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           page_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                           num_splits: int | None = None) -> torch.Tensor:
    """Attention of q [B, H, D] over paged K/V [num_pages, page_size, KVH, D]; returns [B, H, D] in
    q's dtype. page_table [B, max_pages] and seq_lens [B] are int32 on q's device, seq_lens >= 1.
    k_scale/v_scale: float32 [num_pages, page_size, KVH] scales of int8 or float8_e4m3fn caches,
    None for caches in q's dtype. num_splits=None picks it from the shapes (see _choose_num_splits)."""
    require_triton("paged_decode_attention")
    batch, num_heads, head_dim = q.shape
    num_pages, page_size, num_kv_heads, kv_dim = k_cache.shape
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} differ")
    if kv_dim != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"q {tuple(q.shape)} does not match the kv cache {tuple(k_cache.shape)}")
    _check_cache_dtypes(q, k_cache, v_cache, k_scale, v_scale)
    if page_table.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise ValueError("page_table and seq_lens must be int32")
    if page_table.dim() != 2 or page_table.shape[0] != batch or seq_lens.shape != (batch,):
        raise ValueError(f"page_table {tuple(page_table.shape)} / seq_lens {tuple(seq_lens.shape)} vs batch {batch}")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache need a contiguous head_dim")
    if page_table.stride(1) != 1 or not seq_lens.is_contiguous():
        raise ValueError("page_table rows and seq_lens must be contiguous")
    q = q if q.stride(-1) == 1 else q.contiguous()

    group = num_heads // num_kv_heads
    if num_splits is None:
        num_splits = _choose_num_splits(batch, num_kv_heads, page_table.shape[1] * page_size, _num_sms(q.device))
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")

    m = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    acc = torch.empty((batch, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
    out = torch.empty((batch, num_heads, head_dim), dtype=q.dtype, device=q.device)

    quantized = k_scale is not None
    _paged_decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, k_scale if quantized else k_cache, v_scale if quantized else v_cache, page_table, seq_lens,
        m, l, acc,
        scale * _LOG2E, num_splits,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        k_scale.stride(0) if quantized else 0, k_scale.stride(1) if quantized else 0,
        page_table.stride(0),
        num_heads,
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=head_dim,
        PAGE_SIZE=page_size, BLOCK_N=_BLOCK_N,
        # fp32 inputs would otherwise be rounded to tf32 by the tensor cores.
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", QUANTIZED=quantized,
        num_warps=4, num_stages=2, **pdl_options(q.device),
    )
    _paged_decode_reduce_kernel[(batch, num_heads)](
        m, l, acc, out,
        num_splits, num_heads,
        out.stride(0), out.stride(1),
        HEAD_DIM=head_dim, SPLITS_PAD=triton.next_power_of_2(num_splits),
        num_warps=4, **pdl_options(q.device),
    )
    return out
