"""CPU cores of a worker process: prefill and decode on disjoint cores by default."""

from __future__ import annotations

import os

import torch

from shared.config.schema import parse_cores


def pin_to_cores(spec: str, half: str) -> list[int]:
    """Pins the calling thread to `spec`, or to the lower/upper half of its allowed cores when empty.

    Prefill and decode default to disjoint halves so a long prefill never steals the decode's
    cores; torch's thread pool is sized to match. Linux affinity is per thread and inherited by
    the threads started afterwards: a worker process calls this before it starts any thread, the
    colocated process from each worker's own thread.
    """
    allowed = sorted(os.sched_getaffinity(0))
    cores = parse_cores(spec)
    if not cores:
        middle = max(1, len(allowed) // 2)
        cores = allowed[:middle] if half == "lower" else allowed[middle:] or allowed[-1:]
    os.sched_setaffinity(0, cores)
    # A thread's first parallel op resets its OpenMP pool to the count any thread set last; have
    # it happen now, so the count set next stays this thread's.
    torch.get_num_threads()
    torch.set_num_threads(len(cores))
    return cores
