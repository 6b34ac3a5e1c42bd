"""The merge of a flash-decoding split, done by the last of its programs to finish (Triton).

A decode attention kernel cuts each sequence's context into num_splits chunks, one program each,
which leave fp32 partials (the max and sum of their scores' exponentials, in the log2 domain, and
the unnormalised output) in scratch [B, H, num_splits(, width)]. Rather than a second kernel that
merges them, each program of a group (a sequence and a block of heads) adds 1 to the group's count
once its partials are stored; the one that counts last merges the group's partials into the output
and puts the count back to zero, so that the next call, or the next replay of a CUDA graph, starts
from zero: one launch a layer fewer, where a small batch's step is mostly launches. Unsplit, a
program writes its output itself.

Memory order: a barrier makes every thread's partials precede the count, the count is an atomic
with release and acquire semantics on the GPU's scope, and the merging program reads the others'
partials past its L1 (.cg), where nothing stale of them can be.

Many splits: the last program alone reads every split's partials (splits x rows x width x 4 bytes,
8.6 MB for DeepSeek's 16 heads x 512 latent values at 264 splits), one SM's worth of bandwidth for
what the split spread over all of them. A kernel that splits that much leaves its partials, and
merge_splits merges them in a launch of its own, a program per row and CHUNK columns.
"""

from __future__ import annotations

import torch

from shared.kernels.triton_support import pdl_options, tl, triton, wait_for_previous_kernel

_COUNTERS = 1 << 16  # groups a call may have: batch 256 x 256 head blocks
# The most splits whose partials the last program of a group merges; past them the kernels leave
# the merge to merge_splits. The last program reads the splits one after another, alone: at batch 1
# and 1K of context the paged kernel's 32 layers (33 splits, 16 holding tokens) took 0.33 ms on an
# H100 merged so, 0.23 ms by a launch, which reads 32 splits at once (docs/BENCHMARKS.md); for the
# latent kernel 16 splits of 16 heads x 512 values are 512 KB for one SM.
MERGE_HERE_SPLITS = 16
# merge_splits: the splits a program takes in at a time ([32, CHUNK] fp32 partials, one load).
_SPLITS_PER_LOAD = 32
_counters: dict[torch.device, torch.Tensor] = {}


def split_counters(device: torch.device, groups: int) -> torch.Tensor:
    """Each group's count of finished splits, zero between calls: one buffer a device, made once."""
    if groups > _COUNTERS:
        raise ValueError(f"{groups} groups of splits, above {_COUNTERS}")
    if device not in _counters:
        _counters[device] = torch.zeros(_COUNTERS, dtype=torch.int32, device=device)
    return _counters[device]


def merge_splits(m: torch.Tensor, l: torch.Tensor, acc: torch.Tensor, out: torch.Tensor, seq_lens: torch.Tensor,
                 window: int, block_n: int, chunk: int) -> None:
    """out [B, H, W] (a row's W values contiguous) from the partials that a split kernel left with
    MERGE_HERE off: m and l [B, H, S], acc [B, H, S, W], contiguous; seq_lens, window and block_n as
    the kernel had them (they tell which splits held tokens). A program per (b, h) and chunk of W's
    columns (chunk divides W)."""
    batch, heads, splits, width = acc.shape
    _merge_kernel[(batch * heads, width // chunk)](
        m, l, acc, out, seq_lens, splits, window, heads, out.stride(0), out.stride(1),
        WIDTH=width, CHUNK=chunk, BLOCK_N=block_n, SPLITS_PER_LOAD=_SPLITS_PER_LOAD, **pdl_options(out.device))


if triton is not None:

    @triton.jit
    def split_range(seq_lens_ptr, b, split, num_splits, window, BLOCK_N: tl.constexpr):
        """Sequence b's split `split`: the first token it reads (0 without a window, which comes as
        a window longer than any sequence), its tokens lo..hi-1, and how many of the sequence's
        splits hold a token (the splits from there on are empty). Chunks start on BLOCK_N multiples
        from the tile that holds the first token, so only the first tile of a window and the last of
        a sequence are partial, and every tile a program visits holds a token it reads."""
        seq_len = tl.load(seq_lens_ptr + b)
        begin = tl.maximum(seq_len - window, 0)
        base = begin // BLOCK_N * BLOCK_N
        chunk = tl.cdiv(tl.cdiv(seq_len - base, num_splits), BLOCK_N) * BLOCK_N
        lo = base + split * chunk
        return begin, lo, tl.minimum(lo + chunk, seq_len), tl.cdiv(seq_len - base, chunk)

    @triton.jit
    def finish_split(m_i, l_i, acc, m_ptr, l_ptr, acc_ptr, out_rows, counter, first_row, split, num_splits,
                     used, row_mask, SPLIT: tl.constexpr, ROWS: tl.constexpr, WIDTH: tl.constexpr,
                     CHUNK: tl.constexpr, MERGE_HERE: tl.constexpr):
        """A program's end: its rows' output, normalised, where unsplit; else its partials (none
        from an empty split: `used` of the group's splits hold tokens, and only theirs are merged)
        and, with MERGE_HERE, the merge if it counts last (without, merge_splits follows). out_rows
        [ROWS]: each row's output (width WIDTH, contiguous); first_row [ROWS]: each row's split 0 in
        the partials; counter: the group's count."""
        cols = tl.arange(0, WIDTH)
        if not SPLIT:
            out = acc / _at_least_one(l_i)[:, None]
            tl.store(out_rows[:, None] + cols[None, :], out.to(out_rows.dtype.element_ty), mask=row_mask[:, None])
        else:
            row = first_row + split
            stored = row_mask & (row - first_row < used)  # a vector: the interpreter masks no store by a scalar
            tl.store(m_ptr + row, m_i, mask=stored)
            tl.store(l_ptr + row, l_i, mask=stored)
            tl.store(acc_ptr + row[:, None] * WIDTH + cols[None, :], acc, mask=stored[:, None])
            if MERGE_HERE:
                _count_and_merge(m_ptr, l_ptr, acc_ptr, out_rows, counter, first_row, num_splits, used, row_mask,
                                 ROWS, WIDTH, CHUNK)

    @triton.jit
    def _count_and_merge(m_ptr, l_ptr, acc_ptr, out_rows, counter, first_row, num_splits, used, row_mask,
                         ROWS: tl.constexpr, WIDTH: tl.constexpr, CHUNK: tl.constexpr):
        """Counts this program's partials in; the last to count merges the group's."""
        tl.debug_barrier()
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == num_splits - 1:
            _merge(m_ptr, l_ptr, acc_ptr, out_rows, first_row, used, row_mask, ROWS, WIDTH, CHUNK)
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")

    @triton.jit
    def _merge(m_ptr, l_ptr, acc_ptr, out_rows, first_row, used, row_mask,
               ROWS: tl.constexpr, WIDTH: tl.constexpr, CHUNK: tl.constexpr):
        """The rows' outputs from the partials of their `used` splits, merged by their
        log-sum-exps, CHUNK columns at a time (a [64, 512] fp32 tile twice over would not fit in
        registers). Every used split holds a token read, so the running max is finite from split 0
        on."""
        for start in tl.static_range(0, WIDTH, CHUNK):
            cols = start + tl.arange(0, CHUNK)
            m_run = tl.full([ROWS], float("-inf"), tl.float32)
            l_run = tl.zeros([ROWS], tl.float32)
            acc_run = tl.zeros([ROWS, CHUNK], tl.float32)
            for s in range(0, used):
                row = first_row + s
                m_s = tl.load(m_ptr + row, mask=row_mask, other=0.0, cache_modifier=".cg")
                l_s = tl.load(l_ptr + row, mask=row_mask, other=0.0, cache_modifier=".cg")
                acc_s = tl.load(acc_ptr + row[:, None] * WIDTH + cols[None, :], mask=row_mask[:, None], other=0.0,
                                cache_modifier=".cg")
                m_new = tl.maximum(m_run, m_s)
                keep, weight = tl.exp2(m_run - m_new), tl.exp2(m_s - m_new)
                l_run = l_run * keep + l_s * weight
                acc_run = acc_run * keep[:, None] + acc_s * weight[:, None]
                m_run = m_new
            tl.store(out_rows[:, None] + cols[None, :],
                     (acc_run / _at_least_one(l_run)[:, None]).to(out_rows.dtype.element_ty), mask=row_mask[:, None])

    @triton.jit
    def _at_least_one(total):
        """A softmax's sum of weights, 1 where it is 0: a row's own sum is at least 1 (its largest
        score weighs 1); only padding rows hold 0, and they are not stored."""
        return tl.maximum(total, 1.0)

    @triton.jit
    def _merge_kernel(m_ptr, l_ptr, acc_ptr, out_ptr, seq_lens_ptr, num_splits, window, num_heads, stride_ob,
                      stride_oh, WIDTH: tl.constexpr, CHUNK: tl.constexpr, BLOCK_N: tl.constexpr,
                      SPLITS_PER_LOAD: tl.constexpr, USE_PDL: tl.constexpr):
        """One row's (b, h) output, CHUNK of its columns, from the partials of its sequence's used
        splits, merged by their log-sum-exps SPLITS_PER_LOAD at a time. Every used split holds a
        token, so the running max is finite from the first load on."""
        wait_for_previous_kernel(USE_PDL)
        row = tl.program_id(0)
        b = row // num_heads
        cols = tl.program_id(1) * CHUNK + tl.arange(0, CHUNK)
        _, _, _, used = split_range(seq_lens_ptr, b, 0, num_splits, window, BLOCK_N)
        first_row = row * num_splits
        m_run = float("-inf")
        l_run = 0.0
        acc_run = tl.zeros([CHUNK], tl.float32)
        for start in range(0, used, SPLITS_PER_LOAD):
            split = start + tl.arange(0, SPLITS_PER_LOAD)
            present = split < used
            m_s = tl.load(m_ptr + first_row + split, mask=present, other=float("-inf"))
            l_s = tl.load(l_ptr + first_row + split, mask=present, other=0.0)
            acc_s = tl.load(acc_ptr + (first_row + split)[:, None] * WIDTH + cols[None, :], mask=present[:, None],
                            other=0.0)
            m_new = tl.maximum(m_run, tl.max(m_s, axis=0))
            keep, weight = tl.exp2(m_run - m_new), tl.exp2(m_s - m_new)
            l_run = l_run * keep + tl.sum(l_s * weight, axis=0)
            acc_run = acc_run * keep + tl.sum(acc_s * weight[:, None], axis=0)
            m_run = m_new
        out = out_ptr + b * stride_ob + (row % num_heads) * stride_oh + cols
        tl.store(out, (acc_run / _at_least_one(l_run)).to(out_ptr.dtype.element_ty))
