"""The stream each worker runs its device work on.

The decode takes the highest priority the device offers, so its small per-token kernels are
scheduled ahead of a prefill's long ones whenever both share the GPU inside one process. (Across
processes stream priorities do not reach: that is what MPS and SM shares are for.)
"""

from __future__ import annotations

import contextlib

import torch

# CUDA maps an out-of-range priority to the nearest valid one: this is "the highest there is".
HIGHEST_PRIORITY = -(1 << 10)


def worker_stream(device: torch.device, high_priority: bool) -> torch.cuda.Stream | None:
    if device.type != "cuda":
        return None
    return torch.cuda.Stream(device, priority=HIGHEST_PRIORITY if high_priority else 0)


def on_stream(stream: torch.cuda.Stream | None) -> contextlib.AbstractContextManager:
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
