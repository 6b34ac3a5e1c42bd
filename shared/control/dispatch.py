"""One dispatch of decoded messages to their handlers, with one error policy for every service.

A message of a type nobody handles is logged and dropped. A handler that raises is logged and
its message dropped: one bad message must not take down a router that serves everyone else, nor
a worker with a batch of other requests. The exception is FatalError, which a handler raises
when the service cannot go on (the router refused the worker, the weights it maps are gone): it
propagates and ends the process, whose supervisor decides what comes next.
"""

from __future__ import annotations

from typing import Callable

import structlog

log = structlog.get_logger()


class FatalError(RuntimeError):
    """Ends the service: raised through the dispatch instead of being logged and dropped."""

    exit_code = 1


class Dispatcher:
    def __init__(self, handlers: dict[type, Callable[..., None]]):
        self.handlers = handlers

    def __call__(self, message: object, *context: object) -> None:
        """Runs message's handler as handler(*context, message); context is e.g. the sender."""
        handler = self.handlers.get(type(message))
        if handler is None:
            log.warning("dropped unexpected message", kind=type(message).__name__)
            return
        try:
            handler(*context, message)
        except FatalError:
            raise
        except Exception:
            log.exception("handler failed; message dropped", kind=type(message).__name__)
