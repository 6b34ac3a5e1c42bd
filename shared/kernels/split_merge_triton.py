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
"""

from __future__ import annotations

import torch

from shared.kernels.triton_support import tl, triton

_COUNTERS = 1 << 16  # groups a call may have: batch 256 x 256 head blocks
_counters: dict[torch.device, torch.Tensor] = {}


def split_counters(device: torch.device, groups: int) -> torch.Tensor:
    """Each group's count of finished splits, zero between calls: one buffer a device, made once."""
    if groups > _COUNTERS:
        raise ValueError(f"{groups} groups of splits, above {_COUNTERS}")
    if device not in _counters:
        _counters[device] = torch.zeros(_COUNTERS, dtype=torch.int32, device=device)
    return _counters[device]


if triton is not None:

    @triton.jit
    def finish_split(m_i, l_i, acc, m_ptr, l_ptr, acc_ptr, out_rows, counter, first_row, split, num_splits,
                     row_mask, SPLIT: tl.constexpr, ROWS: tl.constexpr, WIDTH: tl.constexpr,
                     CHUNK: tl.constexpr):
        """A program's end: its rows' output, normalised, where unsplit; else its partials, and
        the merge if it counts last. out_rows [ROWS]: each row's output (width WIDTH, contiguous);
        first_row [ROWS]: each row's split 0 in the partials; counter: the group's count."""
        cols = tl.arange(0, WIDTH)
        if not SPLIT:
            out = acc / _at_least_one(l_i)[:, None]
            tl.store(out_rows[:, None] + cols[None, :], out.to(out_rows.dtype.element_ty), mask=row_mask[:, None])
        else:
            # An empty split stores max=-inf, sum=0, acc=0: it weighs nothing in the merge.
            row = first_row + split
            tl.store(m_ptr + row, m_i, mask=row_mask)
            tl.store(l_ptr + row, l_i, mask=row_mask)
            tl.store(acc_ptr + row[:, None] * WIDTH + cols[None, :], acc, mask=row_mask[:, None])
            tl.debug_barrier()
            if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == num_splits - 1:
                _merge(m_ptr, l_ptr, acc_ptr, out_rows, first_row, num_splits, row_mask, ROWS, WIDTH, CHUNK)
                tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")

    @triton.jit
    def _merge(m_ptr, l_ptr, acc_ptr, out_rows, first_row, num_splits, row_mask,
               ROWS: tl.constexpr, WIDTH: tl.constexpr, CHUNK: tl.constexpr):
        """The rows' outputs from their splits' partials, merged by their log-sum-exps, CHUNK
        columns at a time (a [64, 512] fp32 tile twice over would not fit in registers). Split 0
        holds each row's first token read, so the running max is finite from it on."""
        for start in tl.static_range(0, WIDTH, CHUNK):
            cols = start + tl.arange(0, CHUNK)
            m_run = tl.full([ROWS], float("-inf"), tl.float32)
            l_run = tl.zeros([ROWS], tl.float32)
            acc_run = tl.zeros([ROWS, CHUNK], tl.float32)
            for s in range(0, num_splits):
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
