"""The device's own limits, measured in the benchmark's run: the copy bandwidth a decode step's
floor divides by, the bf16 and FP8 matmul rates a prefill's efficiency is a fraction of, and the
CUDA event timers they are read with (of calls, or of a captured CUDA graph)."""

from __future__ import annotations

import torch

from loadtest.lib.percentiles import quantile

GIB = 1 << 30


def cuda_time_ms(fn, iterations: int, warmup: int = 3) -> list[float]:
    """Each call's device time, sorted; every call is synchronized, so the host's launch is inside."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iterations):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)


def graphed_time_ms(fn, replays: int = 20) -> float:
    """The median device time of fn captured in one CUDA graph (its launches cost nothing more)."""
    fn()  # compiles, outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return quantile(cuda_time_ms(graph.replay, replays), 0.5)


def copy_bandwidth_gbs() -> float:
    """Bytes read + written per second of a 4 GiB device-to-device copy, best of 10."""
    src = torch.empty(4 * GIB, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    best = cuda_time_ms(lambda: dst.copy_(src), 10)[0]
    return 2 * 4 * GIB / (best / 1e3) / 1e9


def matmul_tflops() -> float:
    """A bf16 8192^3 matmul, best of 10."""
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn_like(a)
    best = cuda_time_ms(lambda: a @ b, 10)[0]
    return 2 * 8192 ** 3 / (best / 1e3) / 1e12


def sustained_matmul_tflops(seconds: float = 2.0) -> float:
    """The same matmul back to back for `seconds` after as long again to reach the board's power limit:
    a burst (matmul_tflops) runs at the top clock, while a prefill long enough to draw the limit runs
    at the clock the limit leaves (an H100 at 700 W: 1,980 MHz falls to about 1,320,
    docs/results/h100_linears_sustained_clocks.json). Bounds at both rates bracket what a prompt can take."""
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b, c = torch.randn_like(a), torch.empty_like(a)

    def back_to_back_ms(calls: int) -> float:  # timed after as many calls again
        return cuda_time_ms(lambda: [torch.matmul(a, b, out=c) for _ in range(calls)], 1, warmup=1)[0]
    calls = max(1, int(seconds * 1e3 / back_to_back_ms(1)))
    return 2 * 8192 ** 3 * calls / (back_to_back_ms(calls) / 1e3) / 1e12


def fp8_matmul_tflops() -> float:
    """An e4m3 8192^3 torch._scaled_mm with a scale per row and per column, bf16 out, best of 10."""
    a = torch.randn(8192, 8192, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(8192, 8192, device="cuda").to(torch.float8_e4m3fn).t()
    scale_a = torch.ones(8192, 1, device="cuda")
    scale_b = torch.ones(1, 8192, device="cuda")
    best = cuda_time_ms(lambda: torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b,  # noqa: SLF001
                                                 out_dtype=torch.bfloat16), 10)[0]
    return 2 * 8192 ** 3 / (best / 1e3) / 1e12
