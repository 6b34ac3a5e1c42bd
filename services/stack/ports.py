"""Ports for stacks that the tests and benchmarks start side by side on one host.

A port that bind(0) hands out comes from the kernel's ephemeral range, and once the probe socket
closes, any outgoing connection on the host may take it before the service binds it (CI lost a run
that way: "router.metrics_address ...: Address already in use"). So ports come from below that
range, where nothing picks them at random; each pytest-xdist worker takes its own share and walks
it round, so that a port comes back only after its share has gone round once. Each port comes with
the BLOCK - 1 after it, which `python -m services.stack` gives worker i of a role (its port + i,
services/stack/topology.py).
"""

from __future__ import annotations

import itertools
import os
import random
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

BLOCK = 8
LOWEST = 20000  # above the default ports that `make run` serves on below the range (8000, 9400-9402)
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def _share() -> range:
    """This process's share of the ports between LOWEST and the ephemeral range, in BLOCK steps."""
    ephemeral_low = int(EPHEMERAL_RANGE.read_text().split()[0]) if EPHEMERAL_RANGE.exists() else 32768
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw"))
    size = (ephemeral_low - LOWEST) // workers // BLOCK * BLOCK
    if size < 16 * BLOCK:
        raise RuntimeError(f"too few ports below the ephemeral range ({EPHEMERAL_RANGE}) for {workers} workers")
    start = LOWEST + worker * size
    return range(start, start + size, BLOCK)


def _bindable(port: int) -> bool:
    try:
        for offset in range(BLOCK):
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", port + offset))
    except OSError:
        return False
    return True


class _Ports:
    def __init__(self):
        self._lock = threading.Lock()
        self._cycle: Iterator[int] | None = None
        self._size = 0

    def next(self) -> int:
        with self._lock:
            if self._cycle is None:
                share = _share()
                # A random start, so that two processes outside xdist (a benchmark beside the
                # tests) are unlikely to walk the same ports in step.
                first = random.randrange(len(share))
                self._cycle, self._size = itertools.cycle([*share[first:], *share[:first]]), len(share)
            for port in itertools.islice(self._cycle, self._size):
                if _bindable(port):
                    return port
        raise RuntimeError("no free port block left below the ephemeral range")


_PORTS = _Ports()


def free_port() -> int:
    """A port, with the BLOCK - 1 after it, that no one on this host is listening on."""
    return _PORTS.next()
