"""Paged decode attention in Triton: one new query token per sequence against its paged KV cache.

Computes, for every sequence b and query head h,
    out[b, h] = softmax(scale * q[b, h] @ K_b^T) @ V_b
where K_b / V_b are the first seq_lens[b] tokens of the sequence, read in place from the pages
listed in page_table[b] (no contiguous copy of the KV is made). With a sliding window (window > 0)
they are only its tokens from seq_lens[b] - window on: the loop starts at the tile holding the
first of them, the tokens before it in that tile masked, and the splits cover only the window.

Layout: q and out are [B, H, D]; k_cache and v_cache are one layer's shard each,
[num_pages, page_size, KVH, D] (the PagedKvPool shard layout); token t of sequence b lives in page
page_table[b, t // page_size], slot t % page_size. Grouped-query attention: query head h reads
kv head h // (H // KVH).

Split strategy (flash-decoding): decode has one query row per head, so a grid of (B, KVH) programs
leaves most SMs idle for small batches with long contexts. The context of each sequence is cut into
num_splits equal chunks (sized from that sequence's own seq_len, so short sequences in a batch do not
pay for the longest one); program (b, kv_head, split) runs an online softmax over its chunk for all
query heads of the kv group at once (each K/V tile is loaded once and used by the whole group via
tl.dot) and writes fp32 partial (max, sum, unnormalised acc); up to MERGE_HERE_SPLITS splits the
last of a (b, kv_head)'s programs to finish merges them for the group's heads, past them a merge
launch does (shared/kernels/split_merge_triton.py); unsplit, a program writes its heads' output
itself. num_splits depends only on shapes
(batch, KVH, page_table width) and the SM count, so the function never syncs with the device and
can be captured in a CUDA graph: a graph's page table is as wide as its bucket's longest context.

The kernel is bound by the instructions it issues per byte, not by the tensor cores: on an H200 a
program must consume 16 bytes per SM cycle to keep up with HBM. So the loop over full tiles carries
no masks (only a chunk's last tile does), each row's address is its page's base plus an offset
computed once, and quantized pages (int8 or float8_e4m3fn values with a float32 scale per token and
kv head, as shared/kernels/kv_quant.py writes them) cost as few instructions per value as possible:

- "fp16" (float8_e4m3fn pages): the values are converted exactly to fp16 (every e4m3 value is an
  fp16 value), q is rounded to fp16 once with the softmax scale folded in, and the scales stay
  outside the products: each token's K scale multiplies its column of scores, its V scale its
  column of probabilities, as the log2 of the scale added to the score before the online softmax's
  running maximum (_scaled_softmax_tile): the weights that go to fp16 are at most 1 whatever the
  scales' size, with no pass over the scales before the loop.
- "int8_query" (int8 pages): q is written as two int8 terms with one scale per head, q ~ s * (hi +
  lo / 127), within 2**-15 of its largest value (fp16 keeps 11 bits of each), and the scores come
  from integer tensor cores (IMMA) on the K tile as it is stored, hi * 127 + lo exact in int32: no
  K value is converted, which leaves a fifth fewer instructions per byte (count_attention_sass).
  V is converted to fp16 exactly (every int8 value is an fp16 value) by an integer add under an
  fp16 exponent and one subtraction rather than the quarter-rate int-to-float instruction; the
  scales stay outside the products as in "fp16". On an H100 the attention ran in 0.95x the time of
  the fp16 conversion of both tiles, no less accurate (docs/BENCHMARKS.md).
- "fp8_query" (float8_e4m3fn pages, a choice): q and the probabilities are quantized to e4m3 too and
  both products run on FP8 tensor cores. Triton (3.6 to 3.9) emits FP8 MMAs on Hopper only for its
  warpgroup instructions, which take 64 rows: the 4 query heads of a group are padded to 64.
"""

from __future__ import annotations

import functools

import torch

from shared.kernels.decode_tiling import Tiling, default_tiling
from shared.kernels.split_merge_triton import (
    MERGE_HERE_SPLITS,
    finish_split,
    merge_splits,
    split_counters,
    split_range,
)
from shared.kernels.triton_support import compiled, pdl_options, require_triton, tl, triton, wait_for_previous_kernel

_LOG2E = 1.4426950408889634
# A split shorter than this spends more on its partial write and the merge than it saves.
_MIN_TOKENS_PER_SPLIT = 256
# Bounds the merge's loop over the splits.
_MAX_AUTO_SPLITS = 64
# The window the kernel takes for none: longer than any int32 sequence.
_NO_WINDOW = 2**31 - 1
# Programs per SM the splits aim at: 2 hide one program's memory latency behind the other's.
_PROGRAMS_PER_SM = 2
_DEFAULT_NUM_SMS = 132  # H200; used when the device cannot be queried (CPU interpreter)

# How the products are computed (the kernel's MODE).
MODES = {"native": 0, "fp16": 1, "fp8_query": 2, "int8_query": 3}
# The warpgroup MMA that runs FP8 products takes 64 rows at least.
_WGMMA_ROWS = 64


if triton is not None:
    # e4m3's largest value: the FP8-query mode's probabilities are weighed up to it.
    _E4M3_MAX = tl.constexpr(448.0)
    # int8's largest magnitude: the int8-query mode's q is weighed up to it, its low term by it.
    _INT8_MAX = tl.constexpr(127)
    # A V scale of 0 (a row of zeros) counts as this in the softmax: its log2 and inverse stay finite.
    _SMALLEST_SCALE = tl.constexpr(2.0 ** -100)

    @triton.jit
    def _to_fp16(x, MODE: tl.constexpr, INLINE_PTX: tl.constexpr):
        """Page values as the products take them: fp16 for "fp16" and "int8_query" (exact for int8
        and e4m3), as they are otherwise.

        Compiled (INLINE_PTX), the conversion is an inline assembly marked impure, which Triton
        keeps where it stands: on the tile as loaded, 16 contiguous bytes a thread, whose fp16 copy
        the products then read with ldmatrix. A pure conversion Triton sinks into the products'
        operand layout, where an 8-bit V tile is read byte by byte (the V operand runs along the
        tokens): 771 instructions per 64 int8 tokens against 516, 598 against 419 for e4m3
        (loadtest/engine/count_attention_sass.py). Yet it ran slower (Tiling.convert_on_load says
        why), so it is a choice. The interpreter runs no assembly: there the same numbers come
        from Triton's own operations."""
        if MODE != 1 and MODE != 3:
            y = x
        elif x.dtype == tl.int8:
            # 0x64XX is 1024.0 + XX (fp16's unit in the last place is 1 from 1024 to 2048): with
            # the byte's sign bit flipped, XX = x + 128, and one subtraction of 1152 leaves x.
            if INLINE_PTX:
                y = tl.inline_asm_elementwise(
                    """{
                    .reg .b32 biased, offset;
                    xor.b32 biased, $2, 0x80808080;
                    mov.b32 offset, 0x64806480;
                    prmt.b32 $0, biased, 0x64646464, 0x4140;
                    prmt.b32 $1, biased, 0x64646464, 0x4342;
                    sub.f16x2 $0, $0, offset;
                    sub.f16x2 $1, $1, offset;
                    }""", "=r,=r,r", [x], dtype=tl.float16, is_pure=False, pack=4)
            else:
                y = (x.to(tl.int16) + 0x6480).to(tl.float16, bitcast=True) - 1152.0
        else:
            y = x.to(tl.float16)
            if INLINE_PTX:  # the same conversion, held on the tile as loaded
                y = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [y], dtype=tl.float16, is_pure=False,
                                              pack=2)
        return y

    @triton.jit
    def _load(pointers, mask, MASKED: tl.constexpr):
        if MASKED:
            values = tl.load(pointers, mask=mask, other=0.0)
        else:
            values = tl.load(pointers)
        return values

    @triton.jit
    def _tile(acc, m_i, l_i, q, q_low, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, table_row, start, begin, hi, n, d,
              row_at, scale_row_at, qk_scale, q_descale, stride_p, stride_t, stride_sp, stride_st,
              PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MODE: tl.constexpr, MASKED: tl.constexpr,
              DOT_PRECISION: tl.constexpr, INLINE_PTX: tl.constexpr):
        """One BLOCK_N-token tile of the online softmax, from token `start`; MASKED only for a
        chunk's last, partial tile and a window's first (tokens before `begin` or at or past `hi`
        are left out)."""
        tok = start + n
        tok_mask = (tok >= begin) & (tok < hi)
        if BLOCK_N % PAGE_SIZE == 0:  # whole pages: a row's slot part of the address is loop-invariant
            page_at = start // PAGE_SIZE + n // PAGE_SIZE
        else:
            page_at = tok // PAGE_SIZE
            row_at += (tok % PAGE_SIZE) * stride_t
            scale_row_at += (tok % PAGE_SIZE) * stride_st
        # int64: page * stride_p overflows int32 for pools above 2**31 elements.
        page = _load(table_row + page_at, tok_mask, MASKED).to(tl.int64)
        rows = page * stride_p + row_at
        scale_rows = page * stride_sp + scale_row_at
        k = _load(k_ptr + rows[:, None] + d[None, :], tok_mask[:, None], MASKED)
        # Scores in the log2 domain (scale folded with log2 e) so exp2 can be used.
        if MODE == 0:
            qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
        else:  # q already carries qk_scale
            k_scale = _load(k_scale_ptr + scale_rows, tok_mask, MASKED)
            if MODE == 3:  # q's two int8 terms against the int8 tile as stored, exact in int32
                high = tl.dot(q, tl.trans(k), out_dtype=tl.int32) * _INT8_MAX
                qk = tl.dot(q_low, tl.trans(k), acc=high, out_dtype=tl.int32).to(tl.float32)
            else:
                qk = tl.dot(q, tl.trans(_to_fp16(k, MODE, INLINE_PTX)))
            qk *= k_scale[None, :]
            if MODE >= 2:
                qk *= q_descale[:, None]
        if MASKED:
            qk = tl.where(tok_mask[None, :], qk, float("-inf"))
        if MODE == 0:
            m_new = tl.maximum(m_i, tl.max(qk, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = _load(v_ptr + rows[:, None] + d[None, :], tok_mask[:, None], MASKED)
            pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        else:
            v_scale = _load(v_scale_ptr + scale_rows, tok_mask, MASKED)
            weights, alpha, m_new, l_i = _scaled_softmax_tile(qk, v_scale, m_i, l_i)
            if MODE == 2:
                weights *= _E4M3_MAX
            v = _load(v_ptr + rows[:, None] + d[None, :], tok_mask[:, None], MASKED)
            pv = tl.dot(weights.to(tl.float8e4nv if MODE == 2 else tl.float16), _to_fp16(v, MODE, INLINE_PTX))
        return acc * alpha[:, None] + pv, m_new, l_i

    @triton.jit
    def _scaled_softmax_tile(qk, value_scale, m_i, l_i):
        """One tile of the online softmax whose probabilities come out multiplied by each token's V
        scale: the scale's log2 joins the score before the running maximum, so the largest weight
        is 1 (fp16 keeps the weights' precision) and the merge of splits sees an ordinary maximum.
        The sum divides each weight by its scale again: l is the plain softmax's. Returns the
        weights, the rescale of the earlier tiles, the new maximum and sum."""
        scale = tl.maximum(value_scale, _SMALLEST_SCALE)
        weighted = qk + tl.log2(scale)[None, :]
        m_new = tl.maximum(m_i, tl.max(weighted, axis=1))
        alpha = tl.exp2(m_i - m_new)
        weights = tl.exp2(weighted - m_new[:, None])
        l_new = l_i * alpha + tl.sum(weights * (1.0 / scale)[None, :], axis=1)
        return weights, alpha, m_new, l_new

    @triton.jit
    def _paged_decode_split_kernel(
        q_ptr, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, page_table_ptr, seq_lens_ptr,
        m_ptr, l_ptr, acc_ptr, out_ptr, counters_ptr,
        qk_scale, num_splits, window,
        stride_qb, stride_qh,
        stride_p, stride_t, stride_h,
        stride_sp, stride_st,
        stride_pt, stride_ob, stride_oh,
        num_heads, num_kv_heads,
        GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
        PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MODE: tl.constexpr, DOT_PRECISION: tl.constexpr,
        SPLIT: tl.constexpr, MERGE_HERE: tl.constexpr, INLINE_PTX: tl.constexpr, USE_PDL: tl.constexpr,
    ):
        wait_for_previous_kernel(USE_PDL)
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)

        begin, lo, hi, used = split_range(seq_lens_ptr, b, split, num_splits, window, BLOCK_N)

        g = tl.arange(0, GROUP_PAD)
        d = tl.arange(0, HEAD_DIM)
        n = tl.arange(0, BLOCK_N)
        heads = kvh * GROUP + g
        head_mask = g < GROUP
        # Rows past GROUP are zero padding: tl.dot needs at least 16 rows.
        q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                    mask=head_mask[:, None], other=0.0)
        table_row = page_table_ptr + b * stride_pt
        row_at = kvh * stride_h + 0 * n
        scale_row_at = kvh + 0 * n
        if BLOCK_N % PAGE_SIZE == 0:
            row_at += (n % PAGE_SIZE) * stride_t
            scale_row_at += (n % PAGE_SIZE) * stride_st

        q_descale = tl.full([GROUP_PAD], 1.0, tl.float32)
        q_low = q  # the int8-query mode's second term; unused by the others
        if MODE != 0:
            q = q.to(tl.float32) * qk_scale
            if MODE == 2:
                # One e4m3 scale per query head, as the pages have per token; its product with the
                # K scale multiplies the scores.
                q_descale = tl.maximum(tl.max(tl.abs(q), axis=1), 1e-30) / _E4M3_MAX
                q = (q / q_descale[:, None]).to(tl.float8e4nv)
            elif MODE == 3:
                # One scale per query head; each term rounded to nearest (the cast truncates). The
                # scores come out 127 times too large: the descale takes it back.
                high_descale = tl.maximum(tl.max(tl.abs(q), axis=1), 1e-30) / _INT8_MAX
                q = q / high_descale[:, None]
                high = tl.where(q >= 0, q + 0.5, q - 0.5).to(tl.int32)
                low = (q - high) * _INT8_MAX
                q_low = tl.where(low >= 0, low + 0.5, low - 0.5).to(tl.int32).to(tl.int8)
                q = high.to(tl.int8)
                q_descale = high_descale / _INT8_MAX
            else:
                q = q.to(tl.float16)

        m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
        l_i = tl.zeros([GROUP_PAD], tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
        first = lo
        if lo < begin:  # split 0 of a window that starts inside a tile: hi > begin, so a token is seen
            acc, m_i, l_i = _tile(acc, m_i, l_i, q, q_low, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, table_row, lo, begin,
                                  hi, n, d, row_at, scale_row_at, qk_scale, q_descale, stride_p, stride_t,
                                  stride_sp, stride_st, PAGE_SIZE, BLOCK_N, MODE, True, DOT_PRECISION,
                                  INLINE_PTX)
            first = lo + BLOCK_N
        full_end = first + tl.maximum(hi - first, 0) // BLOCK_N * BLOCK_N
        for start in range(first, full_end, BLOCK_N):
            acc, m_i, l_i = _tile(acc, m_i, l_i, q, q_low, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, table_row, start, 0,
                                  hi, n, d, row_at, scale_row_at, qk_scale, q_descale, stride_p, stride_t,
                                  stride_sp, stride_st, PAGE_SIZE, BLOCK_N, MODE, False, DOT_PRECISION,
                                  INLINE_PTX)
        if full_end < hi:
            acc, m_i, l_i = _tile(acc, m_i, l_i, q, q_low, k_ptr, v_ptr, k_scale_ptr, v_scale_ptr, table_row, full_end,
                                  0, hi, n, d, row_at, scale_row_at, qk_scale, q_descale, stride_p, stride_t,
                                  stride_sp, stride_st, PAGE_SIZE, BLOCK_N, MODE, True, DOT_PRECISION,
                                  INLINE_PTX)
        if MODE == 2:
            acc /= _E4M3_MAX
        finish_split(m_i, l_i, acc, m_ptr, l_ptr, acc_ptr, out_ptr + b * stride_ob + heads * stride_oh,
                     counters_ptr + b * num_kv_heads + kvh, (b * num_heads + heads) * num_splits, split, num_splits,
                     used, head_mask, SPLIT, GROUP_PAD, HEAD_DIM, HEAD_DIM, MERGE_HERE)


@functools.lru_cache(maxsize=None)
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _DEFAULT_NUM_SMS


def _choose_num_splits(batch: int, num_kv_heads: int, max_context: int, num_sms: int,
                       max_splits: int | None = _MAX_AUTO_SPLITS) -> int:
    """Splits per (sequence, kv head): as many as fit in one wave of _PROGRAMS_PER_SM programs per
    SM, at least one, no chunk of the longest context under _MIN_TOKENS_PER_SPLIT tokens, and at
    most max_splits (None: the wave alone bounds them). One wave, not more: the programs of a
    second, partial wave would run on few SMs. On an H200 batch 32 x 8 kv heads is unsplit (256
    programs), batch 8 splits in 4, one sequence at 512K in 33."""
    one_wave = _PROGRAMS_PER_SM * num_sms // (batch * num_kv_heads)
    by_length = max_context // _MIN_TOKENS_PER_SPLIT
    return max(1, min(one_wave, by_length, max_splits or one_wave))


def _check_cache_dtypes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> None:
    if k_scale is None and v_scale is None:
        if q.dtype != k_cache.dtype or q.dtype != v_cache.dtype:
            raise ValueError(f"dtype mismatch: q {q.dtype}, k {k_cache.dtype}, v {v_cache.dtype}")
        return
    if k_cache.dtype not in (torch.int8, torch.float8_e4m3fn) or v_cache.dtype != k_cache.dtype:
        raise ValueError(f"scales given for caches of {k_cache.dtype} and {v_cache.dtype}: "
                         "int8 or float8_e4m3fn expected")
    expected = k_cache.shape[:3]
    for name, scales in (("k_scale", k_scale), ("v_scale", v_scale)):
        if scales is None or scales.dtype != torch.float32 or scales.shape != expected or scales.stride(-1) != 1:
            raise ValueError(f"{name} must be float32 {tuple(expected)} with a contiguous last dim")
    if v_scale.stride() != k_scale.stride():
        raise ValueError("k_scale and v_scale need the same strides")


def _check_layout(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, page_table: torch.Tensor,
                  seq_lens: torch.Tensor) -> None:
    batch, num_heads, head_dim = q.shape
    if v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride():
        raise ValueError(f"k_cache {tuple(k_cache.shape)} {k_cache.stride()} and v_cache {tuple(v_cache.shape)} "
                         f"{v_cache.stride()} differ")
    if k_cache.shape[3] != head_dim or num_heads % k_cache.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} does not match the kv cache {tuple(k_cache.shape)}")
    if page_table.dtype != torch.int32 or seq_lens.dtype != torch.int32:
        raise ValueError("page_table and seq_lens must be int32")
    if page_table.dim() != 2 or page_table.shape[0] != batch or seq_lens.shape != (batch,):
        raise ValueError(f"page_table {tuple(page_table.shape)} / seq_lens {tuple(seq_lens.shape)} vs batch {batch}")
    if k_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache need a contiguous head_dim")
    if page_table.stride(1) != 1 or not seq_lens.is_contiguous():
        raise ValueError("page_table rows and seq_lens must be contiguous")


def compute_mode(q: torch.Tensor, k_cache: torch.Tensor, fp8_query: bool) -> str:
    """The products' mode for these pages: "native" in q's dtype, "int8_query" for int8 pages, "fp16"
    for float8_e4m3fn pages, "fp8_query" where asked for them."""
    if k_cache.dtype == q.dtype:
        return "native"
    if k_cache.dtype == torch.int8:
        if fp8_query:
            raise ValueError("fp8_query needs float8_e4m3fn pages, not int8")
        return "int8_query"
    return "fp8_query" if fp8_query else "fp16"


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           page_table: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                           num_splits: int | None = None, fp8_query: bool = False,
                           tiling: Tiling | None = None, window: int = 0,
                           merge_here: bool | None = None) -> torch.Tensor:
    """Attention of q [B, H, D] over paged K/V [num_pages, page_size, KVH, D]; returns [B, H, D] in
    q's dtype. page_table [B, max_pages] and seq_lens [B] are int32 on q's device, seq_lens >= 1.
    k_scale/v_scale: float32 [num_pages, page_size, KVH] scales of int8 or float8_e4m3fn caches,
    None for caches in q's dtype. num_splits=None picks it from the shapes (see _choose_num_splits).
    fp8_query: float8_e4m3fn pages only, q and the probabilities in e4m3 too (module docstring).
    tiling: the loop's tile and warps, default_tiling's for the mode, batch and page-table width when None
    (benchmarks sweep it).
    window > 0: each sequence reads only its tokens from seq_lens[b] - window on (a sliding window).
    merge_here: split partials merged by the last program of their group (True) or by merge_splits'
    launch (False); None: up to MERGE_HERE_SPLITS splits here."""
    require_triton("paged_decode_attention")
    _check_layout(q, k_cache, v_cache, page_table, seq_lens)
    _check_cache_dtypes(q, k_cache, v_cache, k_scale, v_scale)
    q = q if q.stride(-1) == 1 else q.contiguous()
    batch, num_heads, head_dim = q.shape
    num_kv_heads, page_size = k_cache.shape[2], k_cache.shape[1]
    mode = compute_mode(q, k_cache, fp8_query)
    tiling = tiling or default_tiling(mode, batch, page_table.shape[1] * page_size)
    if window < 0:
        raise ValueError(f"window must be >= 0, got {window}")
    if num_splits is None:
        context = page_table.shape[1] * page_size
        context = min(context, window + tiling.block_n) if window else context  # a window's reads span this at most
        num_splits = _choose_num_splits(batch, num_kv_heads, context, _num_sms(q.device))
    if num_splits < 1:
        raise ValueError(f"num_splits must be >= 1, got {num_splits}")
    if merge_here is None:
        merge_here = num_splits <= MERGE_HERE_SPLITS

    m = torch.empty((batch, num_heads, num_splits), dtype=torch.float32, device=q.device)
    l = torch.empty_like(m)
    acc = torch.empty((batch, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device)
    out = torch.empty((batch, num_heads, head_dim), dtype=q.dtype, device=q.device)

    group = num_heads // num_kv_heads
    group_pad = max(16, triton.next_power_of_2(group))
    scales = (k_scale, v_scale) if k_scale is not None else (k_cache, v_cache)  # unread when unquantized
    _paged_decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, *scales, page_table, seq_lens,
        m, l, acc, out, split_counters(q.device, batch * num_kv_heads),
        scale * _LOG2E, num_splits, window or _NO_WINDOW,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        k_scale.stride(0) if k_scale is not None else 0, k_scale.stride(1) if k_scale is not None else 0,
        page_table.stride(0), out.stride(0), out.stride(1),
        num_heads, num_kv_heads,
        GROUP=group, GROUP_PAD=max(_WGMMA_ROWS, group_pad) if mode == "fp8_query" else group_pad,
        HEAD_DIM=head_dim, PAGE_SIZE=page_size, BLOCK_N=tiling.block_n, MODE=MODES[mode],
        # fp32 inputs would otherwise be rounded to tf32 by the tensor cores.
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", SPLIT=num_splits > 1, MERGE_HERE=merge_here,
        INLINE_PTX=compiled(q.device) and tiling.convert_on_load, num_warps=tiling.num_warps,
        num_stages=tiling.num_stages, **pdl_options(q.device),
    )
    if num_splits > 1 and not merge_here:
        merge_splits(m, l, acc, out, seq_lens, window or _NO_WINDOW, tiling.block_n, head_dim)
    return out

