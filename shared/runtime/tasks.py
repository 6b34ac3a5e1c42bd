"""Background tasks that fail loudly, and the stop of the service they belong to.

A task that nobody awaits keeps its exception to itself: asyncio at most prints "Task exception
was never retrieved" once the task is collected, and the service runs on without the loop that
died (a router without its worker socket still answers health checks). So every background task
starts through spawn(): when it raises, the exception is logged and the service is stopped as
failed, its process exits non-zero and its supervisor (systemd, the stack launcher) restarts it.
A task cancelled at shutdown has not failed.
"""

from __future__ import annotations

import asyncio
from typing import Callable, Coroutine

import structlog

log = structlog.get_logger()

OnFailure = Callable[[BaseException], None]

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
