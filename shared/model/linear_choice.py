"""Per matmul shape of the decode step: cuBLAS or a Triton GEMV config, whichever reads the weight fastest.

Which one wins depends on the GPU, the shape and the batch size, so rather than guess, the first
call with a new (rows, N, K, dtype) times cuBLAS and every usable GEMV config on the GPU and keeps
the winner for the life of the process. The GEMV has to win by a margin, so a choice is never
slower than cuBLAS beyond timing noise. The timing reproduces a decode step: the calls run back
to back in a CUDA graph (no host launch gaps, PDL between GEMV launches) and rotate over copies
of the weight that overflow the L2 cache (in a step, every other layer's weights pass through L2
between two reads of this one). Triton's own autotuner, which times a lone launch after flushing
L2, ranks the configs differently, and took slower ones (docs/BENCHMARKS.md, "Decode step").

Timing synchronises the device, so a shape's first call must come before any CUDA-graph capture:
the warm-up steps of services/decode/cuda_graphs.py make every choice (and compile every chosen
config) before it captures. A shape first seen during a capture takes cuBLAS.

Timed alone, a shape can favour cuBLAS by a little, and yet the step be faster on the GEMV: a
cuBLAS kernel breaks the chain of programmatic dependent launches (shared/kernels/triton_support.py), so
the kernels on either side of it wait for full drains. Which effect wins differs between batch
sizes, so for a batch size where some shape chose cuBLAS, the decode times its whole graphed step
both ways and may put every matmul of that size on the GEMV (gemv_rows).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import structlog
import torch
import torch.nn.functional as F

from shared.kernels import gemv_triton
from shared.kernels.triton_support import triton
from shared.model.quantization import Fp8Rows, fp8_linear

log = structlog.get_logger()

MODES = ("auto", "cublas", "gemv")
# The GEMV is chosen only when at least this much faster than cuBLAS.
_MIN_GAIN = 0.03
# The weight copies a timing rotates over add up to this many L2 caches.
_L2_MULTIPLE = 2
# Calls per graph replay, at least: enough GPU time per replay for the event timer's resolution.
_MIN_CALLS = 16
_REPLAYS = 5
# What a config's first call raises when its tiles do not fit this device (nothing to catch without triton).
_DOES_NOT_FIT = triton.runtime.errors.OutOfResources if triton is not None else ()


@dataclass(frozen=True)
class Choice:
    rows: int
    n: int
    k: int
    dtype: str
    cublas_ms: float
    gemv_ms: float  # the fastest GEMV config's
    gemv_config: object  # that config, a triton.Config from gemv_triton.CONFIGS
    use_gemv: bool


def prefer_gemv(cublas_ms: float, gemv_ms: float, mode: str) -> bool:
    return mode == "gemv" or (mode == "auto" and gemv_ms < (1 - _MIN_GAIN) * cublas_ms)


def fastest_config(configs: list, times_ms: list[float]) -> int:
    """Index of the GEMV config to use: the fastest one-kernel config, unless a split-K config (a
    second kernel adds the partial sums) beats it by the margin: a split about as fast timed alone
    made the whole step slower, since its extra kernel per layer costs more in the step than in
    the timing (docs/BENCHMARKS.md, "Decode step")."""
    def fastest(split: bool) -> int | None:
        indices = [i for i, c in enumerate(configs) if (c.kwargs["SPLIT_K"] > 1) == split]
        return min(indices, key=times_ms.__getitem__) if indices else None

    single, split = fastest(False), fastest(True)
    if single is None or (split is not None and times_ms[split] < (1 - _MIN_GAIN) * times_ms[single]):
        return split
    return single


class LinearChooser:
    """F.linear(x, weight, bias) through cuBLAS or gemv_triton.gemv, chosen per shape.

    mode "auto" times both once per shape; "cublas" and "gemv" force one (tests, benchmarks; the
    GEMV's config is still the fastest one). A bias, the CPU and batches above gemv_triton.MAX_ROWS
    always take F.linear (cuBLAS adds the bias in its epilogue before rounding, which the GEMV does
    not reproduce)."""

    def __init__(self, mode: str = "auto"):
        if mode not in MODES:
            raise ValueError(f"linear mode must be one of {MODES}, got {mode!r}")
        self.mode = mode
        self.choices: dict[tuple, Choice] = {}
        # Batch sizes whose graphed step timed faster with every matmul on the GEMV
        # (services/decode/cuda_graphs.py): their shapes take it even where cuBLAS was chosen.
        self.gemv_rows: set[int] = set()

    def apply(self, x: torch.Tensor | Fp8Rows, weight: torch.Tensor, bias: torch.Tensor | None = None,
              scale: torch.Tensor | None = None) -> torch.Tensor:
        """scale: an FP8 weight's per-channel scale. Up to MAX_ROWS rows such a weight takes whichever
        of the GEMV and shared/model/quantization.fp8_linear (torch._scaled_mm) timed faster, x
        quantized by the kernel before or not (Fp8Rows); other shapes take fp8_linear."""
        if scale is not None:
            return self._apply_fp8(x, weight, bias, scale)
        if bias is not None or self.mode == "cublas" or not gemv_triton.supports(x, weight):
            return F.linear(x, weight, bias)
        choice = self.choice(x, weight)
        if choice is not None and (choice.use_gemv or x.shape[0] in self.gemv_rows):
            return gemv_triton.gemv(x, weight, choice.gemv_config)
        return F.linear(x, weight)

    def _apply_fp8(self, x: torch.Tensor | Fp8Rows, weight: torch.Tensor, bias: torch.Tensor | None,
                   scale: torch.Tensor) -> torch.Tensor:
        gemv_x, quantized = _gemv_input(x)
        choice = self.choice(x, weight, scale) if gemv_triton.supports(gemv_x, weight, scale) else None
        if choice is None or not (choice.use_gemv or len(gemv_x) in self.gemv_rows):
            return fp8_linear(x, weight, scale, bias)
        out = gemv_triton.gemv(gemv_x, weight, choice.gemv_config, weight_scale=scale, **quantized)
        return out if bias is None else out + bias

    def uses_cublas(self, rows: int) -> bool:
        """Whether some shape chosen for this many rows takes cuBLAS (in mode "auto", only then can
        forcing the GEMV on them change a step)."""
        return self.mode == "auto" and any(not c.use_gemv for c in self.choices.values() if c.rows == rows)

    def choice(self, x: torch.Tensor | Fp8Rows, weight: torch.Tensor,
               scale: torch.Tensor | None = None) -> Choice | None:
        """The choice for this shape, timed at its first call; None when that call is in a capture. Rows
        quantized before (Fp8Rows) share the key of the same rows unquantized: either way the choice is
        between the GEMV's W8A8 and torch._scaled_mm for that shape."""
        rows = len(_gemv_input(x)[0])
        key = (rows, *weight.shape, weight.dtype)
        choice = self.choices.get(key)
        if choice is None:
            if torch.cuda.is_current_stream_capturing():
                log.warning("linear shape first seen in a CUDA graph capture, not timed: cuBLAS, or for an FP8 "
                            "weight quantization.fp8_linear", rows=rows, n=weight.shape[0], k=weight.shape[1])
                return None
            choice = self.choices[key] = self._time_all(x, weight, scale)
        return choice

    def _time_all(self, x: torch.Tensor | Fp8Rows, weight: torch.Tensor, scale: torch.Tensor | None) -> Choice:
        gemv_x, quantized = _gemv_input(x)
        rows, device = len(gemv_x), gemv_x.device.index
        configs = gemv_triton.usable_configs(rows, *weight.shape, gemv_triton.num_sms(device),
                                             gemv_triton.shared_memory_per_program(device),
                                             *gemv_triton.tile_element_bytes(gemv_x, weight, scale))
        if scale is None:
            candidates = {"cublas": lambda w: F.linear(x, w)}
        else:  # the library's FP8 product is torch._scaled_mm (cuBLASLt)
            candidates = {"cublas": lambda w: fp8_linear(x, w, scale)}
        for i, config in enumerate(configs):
            candidates[i] = functools.partial(gemv_triton.gemv, gemv_x, config=config, weight_scale=scale, **quantized)
        times = time_per_call_ms(candidates, weight)
        best = fastest_config(configs, [times[i] for i in range(len(configs))])
        choice = Choice(rows, *weight.shape, str(weight.dtype), times["cublas"], times[best], configs[best],
                        use_gemv=prefer_gemv(times["cublas"], times[best], self.mode))
        log.info("linear backend chosen", rows=choice.rows, n=choice.n, k=choice.k,
                 cublas_us=round(choice.cublas_ms * 1e3, 1), gemv_us=round(choice.gemv_ms * 1e3, 1),
                 gemv_config=str(configs[best].kwargs),
                 backend="triton-gemv" if choice.use_gemv else "cublas")
        return choice


def _gemv_input(x: torch.Tensor | Fp8Rows) -> tuple[torch.Tensor, dict]:
    """The rows the GEMV reads, and the arguments that say they come quantized (gemv_triton.gemv)."""
    if isinstance(x, Fp8Rows):
        return x.values, {"x_scale": x.scale, "out_dtype": x.dtype}
    return x, {}


def time_per_call_ms(candidates: dict[object, Callable[[torch.Tensor], torch.Tensor]],
                     weight: torch.Tensor) -> dict[object, float]:
    """Median milliseconds of one fn(weight) per candidate, as a decode step sees it: back to back in
    a CUDA graph, the weight cold in L2; infinite for a candidate whose first call does not fit the
    device (a config that gemv_triton.fits_shared_memory let through wrongly), so that it is never
    chosen instead of stopping the decode's start. Must run outside any capture."""
    l2_bytes = torch.cuda.get_device_properties(weight.device).L2_cache_size
    weight_bytes = weight.numel() * weight.element_size()
    copies = [weight] + [weight.clone() for _ in range(math.ceil(_L2_MULTIPLE * l2_bytes / weight_bytes) - 1)]
    calls = len(copies) * math.ceil(_MIN_CALLS / len(copies))
    times = {}
    for name, fn in candidates.items():
        try:
            times[name] = _time_graphed(fn, copies, calls)
        except _DOES_NOT_FIT as exc:
            log.warning("linear candidate does not fit this device, not chosen", candidate=str(name), error=str(exc))
            times[name] = math.inf
    return times


def _time_graphed(fn: Callable[[torch.Tensor], torch.Tensor], copies: list[torch.Tensor], calls: int) -> float:
    fn(copies[0])  # compiles and sets up cuBLAS, neither of which may happen in a capture
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
