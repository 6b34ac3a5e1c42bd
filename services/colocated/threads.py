"""Running the workers' loops side by side in one process: all of them, or none.

The first loop to end, by a crash or by the stop signal, stops the others, so the process never
stays half alive; the caller exits non-zero when any loop crashed and its supervisor restarts it.
"""

from __future__ import annotations

import threading
from typing import Callable

import structlog

log = structlog.get_logger()


def run_together(loops: dict[str, Callable[[], None]], stopping: threading.Event) -> bool:
    """Runs each loop in a thread of that name until all have ended; True if none crashed."""
    crashed: list[str] = []

    def run(name: str, loop: Callable[[], None]) -> None:
        try:
            loop()
        except Exception:
            log.exception("worker thread crashed", thread=name)
            crashed.append(name)
        finally:
            stopping.set()

    threads = [threading.Thread(target=run, args=item, name=item[0]) for item in loops.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return not crashed
