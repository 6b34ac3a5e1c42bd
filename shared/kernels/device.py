"""The device a worker runs on, and the stream it runs its device work on.

A worker runs on the device its config names (`model.device = "cuda:N"`); nothing assumes GPU 0.
select_device makes it the process's current device, because Triton launches its kernels on the
current device and torch's events and streams made without a device belong to it.

The decode takes the highest priority the device offers, so its small per-token kernels are
scheduled ahead of a prefill's long ones whenever both share the GPU inside one process. (Across
processes stream priorities do not reach: that is what MPS and SM shares are for.)

A Moment is a point in a worker's device work, for durations within that worker: on a GPU the host
launches work before the device runs it, so the host's clock at a launch says little of when it ran.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass

import torch

# CUDA maps an out-of-range priority to the nearest valid one: this is "the highest there is".
HIGHEST_PRIORITY = -(1 << 10)


@dataclass
class Moment:
    """When something happened in a worker's work: the host's time.perf_counter(), and on a GPU the
    timed event recorded in the stream there, whose host time date_moments gives once it has run.
    Two moments with events subtract on the device's own clock, exactly; others by their host times."""
    at: float = 0.0
    event: torch.cuda.Event | None = None

    def seconds_until(self, later: Moment) -> float:
        if self.event is not None and later.event is not None:
            return self.event.elapsed_time(later.event) / 1e3
        return later.at - self.at


def mark(device: torch.device) -> Moment:
    """Now in the current stream's work: on a GPU an event (dated by date_moments once it has run)."""
    if device.type != "cuda":
        return Moment(time.perf_counter())
    event = torch.cuda.Event(enable_timing=True)
    event.record(torch.cuda.current_stream(device))
    return Moment(event=event)


def date_moments(moments: list[Moment], device: torch.device, probe: torch.cuda.Event | None = None) -> None:
    """Gives device moments their host times, waiting for the probe: a timed event recorded after
    them (None: one recorded now, which waits for the current stream's work so far). The host clock
    is read once it has run, and each moment's device time before the probe is taken off. Never
    earlier than the moment; later only by the probe's wake-up, the same for all moments dated
    together. Moments on the CPU have theirs already."""
    if device.type != "cuda":
        return
    if probe is None:
        probe = torch.cuda.Event(enable_timing=True)
        probe.record(torch.cuda.current_stream(device))
    probe.synchronize()
    now = time.perf_counter()
    for moment in moments:
        moment.at = now - moment.event.elapsed_time(probe) / 1e3


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
