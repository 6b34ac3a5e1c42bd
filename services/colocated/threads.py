"""Running the workers' loops side by side in one process: all of them, or none.

The first loop to end, by a crash or by the stop signal, stops the others, so the process never
stays half alive; the caller exits non-zero when any loop crashed and its supervisor restarts it.
"""

from __future__ import annotations

import threading
from typing import Callable

import structlog

from shared.control.dispatch import FatalError

log = structlog.get_logger()


def run_together(loops: dict[str, Callable[[], None]], stopping: threading.Event) -> int:
    """Runs each loop in a thread of that name until all have ended; returns the process's exit
    code: 0 if none crashed, a FatalError's own code (a refused worker's), else 1."""
    exit_codes: list[int] = []

    def run(name: str, loop: Callable[[], None]) -> None:
        try:
            loop()
        except FatalError as exc:
            log.error("worker thread stopped", thread=name, reason=str(exc), exit_code=exc.exit_code)
            exit_codes.append(exc.exit_code)
        except Exception:
            log.exception("worker thread crashed", thread=name)
            exit_codes.append(1)
        finally:
            stopping.set()

    threads = [threading.Thread(target=run, args=item, name=item[0]) for item in loops.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return exit_codes[0] if exit_codes else 0
