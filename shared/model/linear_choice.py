"""Per matmul shape of the decode step: cuBLAS or the Triton GEMV, whichever reads the weight faster.

Which one wins depends on the GPU, the shape and the batch size, so rather than guess, the first
call with a new (rows, N, K, dtype) times both on the GPU and keeps the winner for the life of the
process. The GEMV has to win by a margin, so a choice is never slower than cuBLAS beyond timing
noise. The timing reproduces a decode step: the calls run back to back in a CUDA graph (no host
launch gaps) and rotate over copies of the weight that overflow the L2 cache (in a step, every
other layer's weights pass through L2 between two reads of this one).

Timing synchronises the device, so a shape's first call must come before any CUDA-graph capture:
the warm-up steps of services/decode/cuda_graphs.py make every choice (and the GEMV's autotuning)
before it captures. A shape first seen during a capture takes cuBLAS.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import structlog
import torch
import torch.nn.functional as F

from shared.model import gemv_triton

log = structlog.get_logger()

MODES = ("auto", "cublas", "gemv")
# The GEMV is chosen only when at least this much faster than cuBLAS.
_MIN_GAIN = 0.03
# The weight copies a timing rotates over add up to this many L2 caches.
_L2_MULTIPLE = 2
# Calls per graph replay, at least: enough GPU time per replay for the event timer's resolution.
_MIN_CALLS = 16
_REPLAYS = 5


@dataclass(frozen=True)
class Choice:
    rows: int
    n: int
    k: int
    dtype: str
    cublas_ms: float
    gemv_ms: float
    use_gemv: bool


class LinearChooser:
    """F.linear(x, weight, bias) through cuBLAS or gemv_triton.gemv, chosen per shape.

    mode "auto" times both once per shape; "cublas" and "gemv" force one (tests, benchmarks).
    A bias, the CPU and batches above gemv_triton.MAX_ROWS always take F.linear (cuBLAS adds the
    bias in its epilogue before rounding, which the GEMV does not reproduce)."""

    def __init__(self, mode: str = "auto"):
        if mode not in MODES:
            raise ValueError(f"linear mode must be one of {MODES}, got {mode!r}")
        self.mode = mode
        self.choices: dict[tuple, Choice] = {}

    def apply(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if bias is not None or self.mode == "cublas" or not gemv_triton.supports(x, weight):
            return F.linear(x, weight, bias)
        if self.mode == "gemv" or self._use_gemv(x, weight):
            return gemv_triton.gemv(x, weight)
        return F.linear(x, weight)

    def _use_gemv(self, x: torch.Tensor, weight: torch.Tensor) -> bool:
        key = (x.shape[0], *weight.shape, weight.dtype)
        choice = self.choices.get(key)
        if choice is None:
            if torch.cuda.is_current_stream_capturing():
                log.warning("linear shape first seen in a CUDA graph capture, using cuBLAS", rows=x.shape[0],
                            n=weight.shape[0], k=weight.shape[1])
                return False
            choice = self.choices[key] = self._time_both(x, weight)
        return choice.use_gemv

    def _time_both(self, x: torch.Tensor, weight: torch.Tensor) -> Choice:
        cublas_ms = time_per_call_ms(lambda w: F.linear(x, w), weight)
        gemv_ms = time_per_call_ms(lambda w: gemv_triton.gemv(x, w), weight)
        choice = Choice(x.shape[0], *weight.shape, str(weight.dtype), cublas_ms, gemv_ms,
                        use_gemv=gemv_ms < (1 - _MIN_GAIN) * cublas_ms)
        log.info("linear backend chosen", rows=choice.rows, n=choice.n, k=choice.k, cublas_us=round(cublas_ms * 1e3, 1),
                 gemv_us=round(gemv_ms * 1e3, 1), backend="triton-gemv" if choice.use_gemv else "cublas")
        return choice


def time_per_call_ms(fn: Callable[[torch.Tensor], torch.Tensor], weight: torch.Tensor) -> float:
    """Median milliseconds of one fn(weight) as a decode step sees it: back to back in a CUDA graph,
    the weight cold in L2. Must run outside any capture."""
    l2_bytes = torch.cuda.get_device_properties(weight.device).L2_cache_size
    weight_bytes = weight.numel() * weight.element_size()
    copies = [weight] + [weight.clone() for _ in range(math.ceil(_L2_MULTIPLE * l2_bytes / weight_bytes) - 1)]
    calls = len(copies) * math.ceil(_MIN_CALLS / len(copies))
    fn(weight)  # compiles, autotunes and sets up cuBLAS, none of which may happen in a capture
    graph = torch.cuda.CUDAGraph()
    # thread_local: in the colocated process the prefill thread may be using the device meanwhile.
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        for i in range(calls):
            fn(copies[i % len(copies)])
    graph.replay()  # the first replay also uploads the graph
    times = []
    for _ in range(_REPLAYS):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return sorted(times)[len(times) // 2]
