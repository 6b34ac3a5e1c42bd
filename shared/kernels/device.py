"""The device a worker runs on, and the stream it runs its device work on.

A worker runs on the device its config names (`model.device = "cuda:N"`); nothing assumes GPU 0.
select_device makes it the process's current device, because Triton launches its kernels on the
current device and torch's events and streams made without a device belong to it.

The decode takes the highest priority the device offers, so its small per-token kernels are
scheduled ahead of a prefill's long ones whenever both share the GPU inside one process. (Across
processes stream priorities do not reach: that is what MPS and SM shares are for.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

# CUDA maps an out-of-range priority to the nearest valid one: this is "the highest there is".
HIGHEST_PRIORITY = -(1 << 10)


def select_device(spec: str) -> torch.device:
    """The device named by `spec` with its index ("cuda" is CUDA's current device), made current."""
    device = torch.device(spec)
    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    return device


def device_uuid(device: torch.device) -> str:
    """The GPU's UUID: one name in every process, whatever each one's CUDA_VISIBLE_DEVICES."""
    return str(torch.cuda.get_device_properties(device).uuid)


def worker_stream(device: torch.device, high_priority: bool) -> torch.cuda.Stream | None:
    if device.type != "cuda":
        return None
    return torch.cuda.Stream(device, priority=HIGHEST_PRIORITY if high_priority else 0)


@contextlib.contextmanager
def on_stream(stream: torch.cuda.Stream | None) -> Iterator[None]:
    """The stream, and its device, current in this thread: the current device is per thread, and
    the colocated process runs each worker's loop in a thread of its own."""
    if stream is None:
        yield
        return
    with torch.cuda.device(stream.device), torch.cuda.stream(stream):
        yield
