"""The paged decode attention's tiling (shared/kernels/paged_attention_triton.py): the tile, warps and
pipeline depth for each of its modes by batch and page-table width, as measured (docs/BENCHMARKS.md).

A page table's width, not the batch's lengths, picks it, so a CUDA graph's tiling is fixed at
capture: the decode captures a second graph of a narrower table for the buckets whose tiling the
width changes (services/decode/cuda_graphs.py, wide_tiles).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Tiling:
    """Tokens per loop iteration, the program's warps and pipeline depth, and where quantized
    tiles become fp16: where Triton puts it, or on the tile as loaded (inline PTX, see
    paged_attention_triton._to_fp16), which issues fewer instructions but ran the attention
    1.06-1.16x slower on an H100 (batch 1 x 1K to 32 x 8K, docs/BENCHMARKS.md): Triton pipelines
    the loads of the tiles it converts itself.

    num_stages is Triton's, and the tiles' addresses come from a load of the page table, which
    Triton 3.6 schedules a stage ahead of them: 2 to 4 stages give the K/V tiles one shared-memory
    buffer (the next tile's copy starts once this one is used), 5 or 6 two (it runs under this
    tile's products), 7 or 8 three."""
    block_n: int
    num_warps: int
    num_stages: int
    convert_on_load: bool = False


# The tiles by batch and page-table width (docs/BENCHMARKS.md, decode attention per KV format). At
# batch 8 and 32 x 8K 128-token tiles ran the attention in 0.70-0.85x the time of 64-token ones (H200).
# One sequence: at 512K in 0.77-0.79x (int8, e4m3) and 0.92x (bf16), at 1K with quantized pages in 1.3x, and
# its step 1.4-1.6% slower at 1K in every format (H100). So batches 1 to 7 take 128-token tiles where the
# page table is as wide as LONG_CONTEXT tokens, where each long step gains milliseconds; the decode
# replays a step of short sequences from a narrower table (services/decode/cuda_graphs.py).
# Quantized 128-token tiles double-buffered (5 stages): at batch 8 and 32 x 8K the attention ran in
# 0.89-0.98x the time of one buffer (H100). From MANY_SEQUENCES a step's programs fill the GPU twice
# over, and one buffer ran 2-3% faster (batch 64 x 1K).
DEFAULT_TILING = {"native": Tiling(64, 4, 2), "fp16": Tiling(64, 4, 2), "fp8_query": Tiling(64, 8, 2),
                  "int8_query": Tiling(64, 4, 2)}
LARGE_BATCH_TILING = {"native": Tiling(128, 4, 2), "fp16": Tiling(128, 4, 5), "fp8_query": Tiling(64, 8, 2),
                      "int8_query": Tiling(128, 4, 5)}
MANY_SEQUENCES_TILING = {"native": Tiling(128, 4, 2), "fp16": Tiling(128, 4, 2), "fp8_query": Tiling(64, 8, 2),
                         "int8_query": Tiling(128, 4, 2)}
LARGE_BATCH = 8
MANY_SEQUENCES = 64
LONG_CONTEXT = 262144


def wide_tiles(batch: int, context: int) -> bool:
    """Whether a batch over a page table of `context` tokens reads 128-token tiles."""
    return batch >= LARGE_BATCH or context >= LONG_CONTEXT


def default_tiling(mode: str, batch: int, context: int) -> Tiling:
    """The tiling for a batch over a page table of `context` tokens."""
    if batch >= MANY_SEQUENCES:
        return MANY_SEQUENCES_TILING[mode]
    return (LARGE_BATCH_TILING if wide_tiles(batch, context) else DEFAULT_TILING)[mode]
