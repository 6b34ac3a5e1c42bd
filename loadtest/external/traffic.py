"""Open-loop dispatch for locust: each request in its own greenlet at its scheduled time.

What is sent and when is loadtest/lib/workload.py's (no gevent there, so the serving benchmark and the
tests can use it without locust).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import gevent
from gevent.pool import Group

from loadtest.lib.workload import Arrival, RequestSpec


def dispatch_open_loop(schedule: list[Arrival], send: Callable[[RequestSpec], object], group: Group,
                       stopped: Callable[[], bool] = lambda: False) -> None:
    """Starts each request in its own greenlet at its time; a slow reply never delays the next start.

    Returns once the last request has started (or stopped() turned true); they finish in group.
    """
    started = time.monotonic()
    for arrival in schedule:
        delay = started + arrival.at_s - time.monotonic()
        if delay > 0:
            gevent.sleep(delay)
        if stopped():
            return
        group.spawn(send, arrival.spec)
