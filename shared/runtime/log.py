"""structlog setup shared by every service: JSON off a terminal, console on one.

Every line carries the service and worker id; lines about a request carry its request_id
(bind it with `structlog.contextvars.bound_contextvars(request_id=...)`).
"""

from __future__ import annotations

import logging
import sys

import structlog


def configure_logging(service: str, worker_id: str, fmt: str = "auto", level: str = "info") -> None:
    use_json = fmt == "json" or (fmt == "auto" and not sys.stderr.isatty())
    renderer = structlog.processors.JSONRenderer() if use_json else structlog.dev.ConsoleRenderer()
    def add_identity(_logger, _method, event: dict) -> dict:
        event.setdefault("service", service)
        event.setdefault("worker_id", worker_id)
        return event

    structlog.configure(
        processors=[
            # A thread's own identity first (the colocated process binds each worker's in its
            # thread), then the process's: a processor, as threads start with an empty context.
            structlog.contextvars.merge_contextvars,
            add_identity,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info if use_json else structlog.dev.set_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelName(level.upper())),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )
