"""Process plumbing shared by the services: stop signals, dying with the parent, the open-file limit,
systemd's notify protocol."""

from __future__ import annotations

import ctypes
import os
import resource
import signal
import threading
import time
from dataclasses import dataclass

import sdnotify

PR_SET_PDEATHSIG = 1


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


def raise_open_files_limit() -> int:
    """Raises the soft limit of open files to the hard one and returns it: a shell's soft limit
    (often 1,024) is far below what a server's connections take, and the hard one is the host's
    word (LimitNOFILE= under systemd)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


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
