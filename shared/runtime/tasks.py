"""Background tasks that fail loudly, and the stop of the service they belong to.

A task that nobody awaits keeps its exception to itself: asyncio at most prints "Task exception
was never retrieved" once the task is collected, and the service runs on without the loop that
died (a router without its worker socket still answers health checks). So every background task
starts through spawn(): when it raises, the exception is logged and the service is stopped as
failed, its process exits non-zero and its supervisor (systemd, the stack launcher) restarts it.
A task cancelled at shutdown has not failed.

A loop that serves everyone (the router's socket, its liveness checks) must not die of one bad
iteration either: LoopGuard logs an iteration's exception with its traceback and lets the loop go
on, and only a loop that keeps failing (MAX_FAILURES_IN_A_ROW iterations) gives up, which its
task reports as above.
"""

from __future__ import annotations

import asyncio
from contextlib import contextmanager
from typing import Callable, Coroutine, Iterator

import structlog

log = structlog.get_logger()

OnFailure = Callable[[BaseException], None]

# Failed iterations in a row after which a loop gives up: one that cannot get through a single
# iteration (4 a second for the router's timeouts) is as good as dead, and a restart may mend it.
MAX_FAILURES_IN_A_ROW = 20

# The event loop holds its tasks weakly: one that nobody else holds could vanish mid-run.
_running: set[asyncio.Task] = set()


def spawn(coroutine: Coroutine, name: str, on_failure: OnFailure) -> asyncio.Task:
    """Runs the coroutine as a task of that name; on_failure(exception) once it raises."""
    task = asyncio.create_task(coroutine, name=name)
    _running.add(task)
    task.add_done_callback(lambda done: _report_failure(done, on_failure))
    return task


def _report_failure(task: asyncio.Task, on_failure: OnFailure) -> None:
    _running.discard(task)
    if task.cancelled() or task.exception() is None:
        return
    log.error("background task failed: stopping the service", task=task.get_name(), exc_info=task.exception())
    on_failure(task.exception())


class LoopBroken(RuntimeError):
    """A loop failed MAX_FAILURES_IN_A_ROW iterations in a row: its task ends with this."""


class LoopGuard:
    """One loop's iterations: `with guard.iteration():` around each."""

    def __init__(self, name: str):
        self.name = name
        self.failures_in_a_row = 0

    @contextmanager
    def iteration(self) -> Iterator[None]:
        try:
            yield
        except Exception as exc:
            self.failures_in_a_row += 1
            log.exception("loop iteration failed", loop=self.name, failures_in_a_row=self.failures_in_a_row)
            if self.failures_in_a_row >= MAX_FAILURES_IN_A_ROW:
                raise LoopBroken(f"the {self.name} loop failed {self.failures_in_a_row} iterations in a row") from exc
        else:
            self.failures_in_a_row = 0


class ServiceStop:
    """When a service's main loop ends: at a stop signal (request), or when a background task
    failed (fail), and then the process exits 1."""

    def __init__(self) -> None:
        self.requested = asyncio.Event()
        self.failure: BaseException | None = None

    def request(self) -> None:
        self.requested.set()

    def fail(self, exception: BaseException) -> None:
        self.failure = self.failure or exception
        self.requested.set()

    @property
    def exit_code(self) -> int:
        return 0 if self.failure is None else 1
