"""Process plumbing shared by the services: CPU pinning, stop signals, dying with the parent."""

from __future__ import annotations

import ctypes
import os
import signal
import threading
import time
from dataclasses import dataclass

import sdnotify
import torch

from shared.config import parse_cores

PR_SET_PDEATHSIG = 1


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


@dataclass(frozen=True)
class StopSignals:
    """How a worker is told to stop. drain: SIGTERM (systemd's stop, a rolling restart) or the
    router's Drain: take no new work, finish what it holds, then go. now: SIGINT, or SIGTERM a
    second time: fail what it holds and go."""
    drain: threading.Event
    now: threading.Event


def stop_signals() -> StopSignals:
    stop = StopSignals(threading.Event(), threading.Event())

    def on_sigterm(*_) -> None:
        (stop.now if stop.drain.is_set() else stop.drain).set()

    signal.signal(signal.SIGTERM, on_sigterm)
    signal.signal(signal.SIGINT, lambda *_: stop.now.set())
    return stop


def die_with_parent() -> None:
    """The kernel sends this process SIGTERM when its parent dies, so a service started by the
    launcher or a test never outlives it. Each service calls it first thing, rather than its parent
    in a preexec_fn: forking a parent that runs gRPC threads and then running Python in the child
    can abort in gRPC's fork handlers. Under systemd the parent is PID 1, which never goes."""
    parent = os.getppid()
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # the parent died before the call took effect
        os.kill(os.getpid(), signal.SIGTERM)


class SystemdNotify:
    """systemd's notify protocol for Type=notify units: READY=1 once the service serves, a
    WATCHDOG=1 ping from its main loop at half of WatchdogSec (so a hung loop gets the service
    restarted), STOPPING=1 on the way out. Does nothing when not started by systemd."""

    def __init__(self) -> None:
        self._notifier = sdnotify.SystemdNotifier()
        if self._notifier.socket is not None:
            # A datagram queue that nobody drains fills up; a blocking send would then hang the
            # service's loop (the router's event loop included). Drop the notification instead.
            self._notifier.socket.setblocking(False)
        watchdog_usec = int(os.environ.get("WATCHDOG_USEC", "0") or 0)
        self._interval_s = watchdog_usec / 2e6
        self._last_ping = 0.0

    def ready(self) -> None:
        self._notifier.notify("READY=1")

    def watchdog(self) -> None:
        now = time.monotonic()
        if self._interval_s and now - self._last_ping >= self._interval_s:
            self._notifier.notify("WATCHDOG=1")
            self._last_ping = now

    def stopping(self) -> None:
        self._notifier.notify("STOPPING=1")
