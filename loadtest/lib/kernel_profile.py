"""Where a call's device time goes: its kernels read by torch.profiler, by kind and the busiest by
name, beside the device's idle time within the call's wall time."""

from __future__ import annotations

import time
from collections import defaultdict

import torch

ATTENTION_KERNELS = ("sdpa", "fmha", "flash", "attention", "merge")
MATMUL_KERNELS = ("gemm", "nvjet", "xmma", "cutlass", "gemv")
_BUSIEST = 15


def issue_and_wall_ms(fn) -> dict:
    torch.cuda.synchronize()
    started = time.perf_counter()
    fn()
    issued = time.perf_counter()
    torch.cuda.synchronize()
    return {"issue_ms": (issued - started) * 1e3, "wall_ms": (time.perf_counter() - started) * 1e3}


def kernel_breakdown(fn, calls: int = 1) -> dict:
    """Per call of fn, over `calls` calls in a row: device time by kind of kernel, the busiest kernels
    with their launches, and the device's idle time. An error is reported rather than raised
    (profiling is an extra beside the timed figures)."""
    try:
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            wall = issue_and_wall_ms(lambda: [fn() for _ in range(calls)])["wall_ms"]
        kernels = [(getattr(e, "self_device_time_total", 0.0) / 1e3 / calls, e.count / calls, e.key)
                   for e in prof.key_averages()]
    except Exception as exc:  # noqa: BLE001 - the profiler's failures vary by build
        return {"error": f"{type(exc).__name__}: {exc}"}
    kernels = [k for k in kernels if k[0] > 0]
    by_kind = defaultdict(float)
    for ms, _, name in kernels:
        by_kind[kernel_kind(name)] += ms
    busy = sum(by_kind.values())
    top = sorted(kernels, reverse=True)[:_BUSIEST]
    return {"wall_ms": wall / calls, "device_busy_ms": busy, "device_idle_ms": wall / calls - busy,
            "kernel_launches": sum(count for _, count, _ in kernels), "ms_by_kind": dict(by_kind),
            "busiest": [{"ms": ms, "launches": count, "kernel": name[:160]} for ms, count, name in top]}


def kernel_kind(name: str) -> str:
    lowered = name.lower()
    if any(word in lowered for word in ATTENTION_KERNELS):
        return "attention"
    return "matmul" if any(word in lowered for word in MATMUL_KERNELS) else "other"
