"""Decode steps as CUDA graph replays, one graph per batch-size bucket.

A decode step of a small batch is hundreds of tiny kernels; launched one by one from Python
they cost more than the bytes they move. Each bucket's step is captured once at start with
static input buffers; a step then copies its inputs in and replays one graph. A batch is
padded up to the next bucket: padding rows sit at position 0 of a scratch page that no request
owns, so they write nothing that matters. The buckets end at decode.max_batch_size
(DecodeConfig.graph_batch_sizes), so the worker's batches all fit one; a larger batch would run
eagerly.
The page table is as wide as the model's context, so one graph serves every length. Where that
width gives a bucket the decode attention's long-context tiles (decode_tiling.wide_tiles)
and a table of SHORT_CONTEXT tokens would not, the bucket is also captured with the narrow table,
and a step whose sequences all fit it replays that graph: short sequences run faster in the
narrow tiles, long ones in the wide (docs/BENCHMARKS.md, one sequence at 512K).

Where the per-shape matmul choice (shared/model/linear_choice.py) put some of a bucket's matmuls
on cuBLAS, the bucket is captured twice, as chosen and with every matmul on the Triton GEMV, and
the faster replay is kept (without tensor parallelism). Both are timed on the same inputs: every
row at a 1,024-token context whose pages are all the scratch page.
"""

from __future__ import annotations

from dataclasses import dataclass

import structlog
import torch

from services.decode.step_inputs import StepInputs
from shared.kernels.decode_tiling import wide_tiles
from shared.kv.pool import PagedKvPool
from shared.model.llama import PagedLlama

log = structlog.get_logger()

# The context and replays of the timing that picks between a bucket's two captures.
_TIMING_CONTEXT = 1024
_TIMING_WARMUP, _TIMING_REPLAYS = 3, 21
# The narrow table's tokens (see the module docstring).
SHORT_CONTEXT = 8192


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    token_ids: torch.Tensor
    positions: torch.Tensor
    page_table: torch.Tensor
    logits: torch.Tensor


class GraphedDecode:
    def __init__(self, model: PagedLlama, pool: PagedKvPool, scratch_page: int, max_pages: int,
                 batch_sizes: list[int]):
        self.model, self.pool, self.scratch_page = model, pool, scratch_page
        self.sizes = sorted(batch_sizes)
        self.captured: dict[int, _Captured] = {}
        # Buckets also captured over a table of short_pages pages (the module docstring).
        self.short: dict[int, _Captured] = {}
        page_size = pool.layout.page_size
        self.short_pages = min(max_pages, SHORT_CONTEXT // page_size)
        # Per bucket timed both ways: the step's median ms as chosen per shape and all on the GEMV.
        self.matmul_timings: dict[int, dict[str, float]] = {}
        memory_pool = torch.cuda.graph_pool_handle()
        for size in reversed(self.sizes):  # largest first: smaller graphs reuse its memory
            self.captured[size] = self._capture_fastest(size, max_pages, memory_pool)
            if model.mla is None and wide_tiles(size, max_pages * page_size) != wide_tiles(
                    size, self.short_pages * page_size):
                self.short[size] = self._capture(size, self.short_pages, memory_pool)
        log.info("captured decode graphs", batch_sizes=self.sizes, max_pages=max_pages,
                 all_gemv=sorted(model.linears.gemv_rows & set(self.sizes)),
                 short_table=sorted(self.short), short_pages=self.short_pages)

    def _capture_fastest(self, size: int, max_pages: int, memory_pool) -> _Captured:
        linears = self.model.linears
        linears.gemv_rows.discard(size)  # an earlier GraphedDecode of this model may have set it
        chosen = self._capture(size, max_pages, memory_pool)
        # Tensor-parallel ranks keep the capture as chosen: their replays run collectives, so every
        # rank must replay alike, and each rank's timings would differ.
        if not linears.uses_cublas(size) or self.model.tp.size > 1:
            return chosen
        linears.gemv_rows.add(size)
        all_gemv = self._capture(size, max_pages, memory_pool)
        timings = {"per_shape_ms": self._time(chosen, max_pages), "all_gemv_ms": self._time(all_gemv, max_pages)}
        self.matmul_timings[size] = timings
        log.info("decode graph matmuls timed", batch_size=size, **{k: round(v, 4) for k, v in timings.items()})
        if timings["all_gemv_ms"] < timings["per_shape_ms"]:
            return all_gemv
        linears.gemv_rows.discard(size)
        return chosen

    def _time(self, captured: _Captured, max_pages: int) -> float:
        captured.positions.fill_(min(_TIMING_CONTEXT, max_pages * self.pool.layout.page_size) - 1)
        captured.page_table.fill_(self.scratch_page)
        times = []
        for i in range(_TIMING_WARMUP + _TIMING_REPLAYS):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            captured.graph.replay()
            end.record()
            end.synchronize()
            if i >= _TIMING_WARMUP:
                times.append(start.elapsed_time(end))
        captured.positions.zero_()
        return sorted(times)[len(times) // 2]

    def _capture(self, size: int, max_pages: int, memory_pool) -> _Captured:
        device = self.model.device
        token_ids = torch.zeros(size, dtype=torch.long, device=device)
        positions = torch.zeros(size, dtype=torch.long, device=device)
        page_table = torch.full((size, max_pages), self.scratch_page, dtype=torch.int32, device=device)
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm-up outside the capture: matmul choices, compiles, lazy allocations
            for _ in range(2):
                self.model.decode(token_ids, positions, page_table, self.pool)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=memory_pool):
            logits = self.model.decode(token_ids, positions, page_table, self.pool)
        return _Captured(graph, token_ids, positions, page_table, logits)

    def step(self, inputs: StepInputs) -> torch.Tensor | None:
        """Logits [B, V] from one replay, or None when B exceeds every bucket (run eagerly)."""
        batch = len(inputs.token_ids)
        size = next((s for s in self.sizes if s >= batch), None)
        if size is None:
            return None
        fits_short = inputs.page_table.shape[1] <= self.short_pages
        c = self.short[size] if fits_short and size in self.short else self.captured[size]
        c.token_ids[:batch].copy_(inputs.token_ids, non_blocking=True)
        c.positions[:batch].copy_(inputs.positions, non_blocking=True)
        c.positions[batch:].zero_()
        c.page_table.fill_(self.scratch_page)
        c.page_table[:batch, : inputs.page_table.shape[1]].copy_(inputs.page_table, non_blocking=True)
        c.graph.replay()
        return c.logits[:batch]
