"""Per matmul shape of the decode step: cuBLAS or the Triton GEMV, whichever reads the weight faster;
and whether the elementwise kernel before a matmul is better fused into the GEMV's prologue.

Which one wins depends on the GPU, the shape and the batch size, so rather than guess, the first
call with a new (rows, N, K, dtype) times both on the GPU and keeps the winner for the life of the
process. The GEMV has to win by a margin, so a choice is never slower than cuBLAS beyond timing
noise. The timing reproduces a decode step: the calls run back to back in a CUDA graph (no host
launch gaps) and rotate over copies of the weight that overflow the L2 cache (in a step, every
other layer's weights pass through L2 between two reads of this one).

Timing synchronises the device, so a shape's first call must come before any CUDA-graph capture:
the warm-up steps of services/decode/cuda_graphs.py make every choice (and the GEMV's autotuning)
before it captures. A shape first seen during a capture takes cuBLAS.

Fusion is chosen the same way, like with like: the fused GEMV against the elementwise kernel
followed by the matmul as apply() runs it (itself the faster of cuBLAS and the GEMV). It saves a
launch but makes every GEMV program redo the elementwise work for its block of x (and, for the
norm, read the whole rows once more for their rms), so which is faster depends on the shape.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import structlog
import torch
import torch.nn.functional as F

from shared.model import fused_triton, gemv_triton

log = structlog.get_logger()

MODES = ("auto", "cublas", "gemv")
FUSE_MODES = ("auto", "on", "off")
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


@dataclass(frozen=True)
class FusionChoice:
    kind: str  # the prologue: "silu_mul" or "add_rms_norm"
    rows: int
    n: int
    k: int
    dtype: str
    unfused_ms: float
    fused_ms: float
    fuse: bool


class LinearChooser:
    """F.linear(x, weight, bias) through cuBLAS or gemv_triton.gemv, chosen per shape.

    mode "auto" times both once per shape; "cublas" and "gemv" force one (tests, benchmarks).
    A bias, the CPU and batches above gemv_triton.MAX_ROWS always take F.linear (cuBLAS adds the
    bias in its epilogue before rounding, which the GEMV does not reproduce).
    fuse "auto" times the fused prologues once per shape; "on" and "off" force them where the GEMV
    takes the operands. Mode "cublas" never fuses: the fused kernels are GEMVs."""

    def __init__(self, mode: str = "auto", fuse: str = "auto"):
        if mode not in MODES:
            raise ValueError(f"linear mode must be one of {MODES}, got {mode!r}")
        if fuse not in FUSE_MODES:
            raise ValueError(f"fuse mode must be one of {FUSE_MODES}, got {fuse!r}")
        self.mode, self.fuse = mode, fuse
        self.choices: dict[tuple, Choice] = {}
        self.fusions: dict[tuple, FusionChoice] = {}

    def apply(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if bias is not None or self.mode == "cublas" or not gemv_triton.supports(x, weight):
            return F.linear(x, weight, bias)
        if self.mode == "gemv" or self._use_gemv(x, weight):
            return gemv_triton.gemv(x, weight)
        return F.linear(x, weight)

    def silu_mul_linear(self, gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """F.linear(silu_and_mul(gate_up), weight), gate_up [M, 2K] holding gate then up."""
        def fused(w):
            return gemv_triton.silu_mul_gemv(gate_up, w)

        def unfused(w):
            return self.apply(fused_triton.silu_and_mul(gate_up), w)

        supported = gemv_triton.supports_silu_mul(gate_up, weight)
        if self._use_fused("silu_mul", supported, gate_up, weight, fused, unfused):
            return fused(weight)
        return unfused(weight)

    def add_rms_norm_linear(self, x: torch.Tensor, residual: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                            weight: torch.Tensor, bias: torch.Tensor | None = None):
        """(F.linear(normed, weight, bias), summed) where normed, summed = add_rms_norm(x, residual, ...)."""
        def fused(w):
            return gemv_triton.add_rms_norm_gemv(x, residual, norm_weight, eps, w)

        def unfused(w):
            normed, summed = fused_triton.add_rms_norm(x, residual, norm_weight, eps)
            return self.apply(normed, w, bias), summed

        supported = bias is None and gemv_triton.supports_add_rms_norm(x, residual, norm_weight, weight)
        if self._use_fused("add_rms_norm", supported, x, weight, fused, unfused):
            return fused(weight)
        return unfused(weight)

    def _use_fused(self, kind: str, supported: bool, x: torch.Tensor, weight: torch.Tensor,
                   fused: Callable, unfused: Callable) -> bool:
        if not supported or self.fuse == "off" or self.mode == "cublas":
            return False
        if self.fuse == "on":
            return True
        key = (kind, x.shape[0], *weight.shape, weight.dtype)
        choice = self.fusions.get(key)
        if choice is None:
            if torch.cuda.is_current_stream_capturing():
                log.warning("fusion first seen in a CUDA graph capture, not fusing", kind=kind, rows=x.shape[0],
                            n=weight.shape[0], k=weight.shape[1])
                return False
            unfused_ms, fused_ms = time_per_call_ms(unfused, weight), time_per_call_ms(fused, weight)
            choice = self.fusions[key] = FusionChoice(kind, x.shape[0], *weight.shape, str(weight.dtype), unfused_ms,
                                                      fused_ms, fuse=fused_ms < (1 - _MIN_GAIN) * unfused_ms)
            log.info("fusion chosen", kind=kind, rows=choice.rows, n=choice.n, k=choice.k,
                     unfused_us=round(unfused_ms * 1e3, 1), fused_us=round(fused_ms * 1e3, 1), fused=choice.fuse)
        return choice.fuse

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


def time_per_call_ms(fn: Callable[[torch.Tensor], object], weight: torch.Tensor) -> float:
    """Median milliseconds of one fn(weight) as a decode step sees it: back to back in a CUDA graph,
    the weight cold in L2. Must run outside any capture."""
    l2_bytes = torch.cuda.get_device_properties(weight.device).L2_cache_size
    weight_bytes = weight.numel() * weight.element_size()
    copies = [weight] + [weight.clone() for _ in range(math.ceil(_L2_MULTIPLE * l2_bytes / weight_bytes) - 1)]
    calls = len(copies) * math.ceil(_MIN_CALLS / len(copies))
    fn(weight)  # compiles, autotunes and sets up cuBLAS, none of which may happen in a capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
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
