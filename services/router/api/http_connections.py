"""The router's HTTP connections: uvicorn's h11 protocol with three bounds that uvicorn lacks.

- Idle. uvicorn starts its keep-alive timer only after a first answer and stops it at any byte, so a
  connection that sends nothing, or a request head one byte at a time, stays open for good. Here
  the timer runs from the connection's start and from each answer until a whole request head has
  arrived (router.connection_idle_timeout_s; h11 bounds a head's size).
- Count. uvicorn's limit_concurrency counts connections and requests together and answers plain-text
  503 to everything, /health included, once idle connections reach it. Here at most
  router.http_max_connections are open: a new one beyond closes the connection idle longest, and
  only when every one has a request in flight is the newcomer's request answered 503 with OpenAI's
  error object, and the connection closed. Requests in flight have their own bound (http_gate.py).
- Stalled readers. A connection whose client stopped reading keeps its unsent bytes, and closing it
  waits for them forever. Here one whose writes stay paused for router.stall_timeout_s is aborted:
  the app sees its client gone, so the request is cancelled and its slot and connection come back.
"""

from __future__ import annotations

import asyncio
import functools

import structlog
from uvicorn.protocols.http.h11_impl import H11Protocol

from services.router.api import openai_errors as errors

log = structlog.get_logger()


class Connections:
    """The connections counted against the bound; those waiting for a request head, longest first."""

    def __init__(self, limit: int, stall_timeout_s: float):
        self.limit = limit
        self.stall_timeout_s = stall_timeout_s
        self._open: set[BoundedH11Protocol] = set()
        self._idle: dict[BoundedH11Protocol, None] = {}  # insertion order: since when each waits

    def __len__(self) -> int:
        return len(self._open)

    def admit(self, connection: BoundedH11Protocol) -> bool:
        """Counts a new connection, closing the one idle longest to make room; False if none is idle."""
        if len(self._open) >= self.limit and self._idle:
            oldest = next(iter(self._idle))
            self.forget(oldest)
            oldest.close_idle()
        if len(self._open) >= self.limit:
            return False
        self._open.add(connection)
        return True

    def idle(self, connection: BoundedH11Protocol) -> None:
        if connection in self._open:
            self._idle.pop(connection, None)
            self._idle[connection] = None

    def busy(self, connection: BoundedH11Protocol) -> None:
        self._idle.pop(connection, None)

    def forget(self, connection: BoundedH11Protocol) -> None:
        self._open.discard(connection)
        self._idle.pop(connection, None)


class BoundedH11Protocol(H11Protocol):
    """A connection waits for a request head exactly while uvicorn's keep-alive timer is armed:
    the timer is armed at its start and after each answer, and stopped by a whole request head."""

    def __init__(self, *args, connections: Connections, **kwargs):
        super().__init__(*args, **kwargs)
        self.table = connections  # uvicorn's own `connections` is the server's set of all of them
        self.write_stall: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if not self.table.admit(self):
            log.warning("http connection refused: every connection has a request in flight",
                        limit=self.table.limit)
            self.app = errors.overloaded(
                f"{self.table.limit} connections open, each with a request in flight, the most this router "
                "keeps (router.http_max_connections); try again later")
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)
        self.table.idle(self)

    def data_received(self, data: bytes) -> None:
        # uvicorn's stops the timer at any byte; handle_events stops it at a whole request head.
        self.conn.receive_data(data)
        self.handle_events()

    def _unset_keepalive_if_required(self) -> None:
        super()._unset_keepalive_if_required()
        self.table.busy(self)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.timeout_keep_alive_task is not None:  # armed again: it waits for the next request
            self.table.idle(self)

    def timeout_keep_alive_handler(self) -> None:
        self.close_idle()

    def close_idle(self) -> None:
        """Closes a connection that waits for a request head; at once if its client has not even
        taken the last answer, for a close would wait for that."""
        if self.timeout_keep_alive_task is not None:
            self.timeout_keep_alive_task.cancel()
            self.timeout_keep_alive_task = None
        if self.transport.get_write_buffer_size():
            self.transport.abort()
        else:
            self.transport.close()

    def pause_writing(self) -> None:
        super().pause_writing()
        self._stop_stall_timer()
        self.write_stall = self.loop.call_later(self.table.stall_timeout_s, self._abort_stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._stop_stall_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        super().connection_lost(exc)
        self._stop_stall_timer()
        self.table.forget(self)

    def _abort_stalled(self) -> None:
        log.warning("closing an http connection whose client read nothing for router.stall_timeout_s",
                    stall_timeout_s=self.table.stall_timeout_s)
        self.transport.abort()

    def _stop_stall_timer(self) -> None:
        if self.write_stall is not None:
            self.write_stall.cancel()
            self.write_stall = None


def protocol_factory(connections: Connections):
    """What uvicorn.Config(http=...) takes: it builds each connection's protocol with its own arguments."""
    return functools.partial(BoundedH11Protocol, connections=connections)
