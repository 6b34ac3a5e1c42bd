"""The device's own limits, measured in the benchmark's run: the copy bandwidth a decode step's
floor divides by, the bf16 matmul rate a prefill's efficiency is a fraction of, and the CUDA event
timer both are read with."""

from __future__ import annotations

import torch

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
