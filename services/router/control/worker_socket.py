"""The router's one ZeroMQ ROUTER socket to every worker: bind (CURVE on tcp://), typed frames out
and in, and the loop that hands each decoded message on with who sent it.

A send to a connection that is gone (ROUTER_MANDATORY) does not raise to the sender: the worker
joins `unreachable`, which membership drops once the handler that sent is done. A message that
does not encode (wire.EncodeError) does raise to the sender: it concerns the request the sender
handles, which fails alone (token_router.py). A frame that does not decode is dropped here; when it
claims another protocol version, its sender hears Refused. The receive loop outlives a frame whose
handling raises (shared/runtime/tasks.py, LoopGuard).
"""

from __future__ import annotations

from typing import Callable

import structlog
import zmq
import zmq.asyncio

from services.router.control.registration import version_refusal
from services.router.control.worker_records import WorkerRecord
from shared.config.schema import RouterConfig
from shared.control import wire
from shared.control.curve import CurveServer, secure_server
from shared.control.messages import PROTOCOL_VERSION, Refused
from shared.runtime.binding import bind_or_refuse
from shared.runtime.tasks import LoopGuard

log = structlog.get_logger()

# Called with each decoded message, its connection's routing id and the CURVE key it proved.
OnMessage = Callable[[object, bytes, str | None], None]


class WorkerSocket:
    def __init__(self, settings: RouterConfig):
        self.settings = settings
        self.security: CurveServer | None = None  # made in bind(); None on ipc://
        self.unreachable: set[WorkerRecord] = set()
        self._context = zmq.asyncio.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        # A send to a connection that is gone raises instead of vanishing: the request fails now,
        # not after the heartbeat timeout. No send limit: admission bounds what is in flight.
        self._socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._socket.setsockopt(zmq.SNDHWM, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, wire.MAX_FRAME_BYTES)
        # Sends go through a plain (synchronous) view of the same socket, on the event loop's
        # thread: the asyncio socket would hand a send's error to a future nobody awaits.
        self._sender = zmq.Socket.shadow(self._socket.underlying)

    def bind(self) -> CurveServer | None:
        """Binds the endpoint, a CURVE server first where it needs one; returns that server.
        On the event loop: the CURVE authenticator runs on it."""
        self.security = secure_server(self._socket, self.settings)
        endpoint = self.settings.zmq_endpoint()
        bind_or_refuse("router.zmq_address", endpoint, lambda: self._socket.bind(endpoint))
        return self.security

    def close(self) -> None:
        self._socket.close(linger=500)
        if self.security is not None:
            self.security.stop()
        self._context.term()

    def send(self, worker: WorkerRecord, message: object) -> None:
        """Raises wire.EncodeError for a message that does not encode; a connection that is gone
        only marks the worker unreachable."""
        try:
            self._sender.send_multipart([worker.identity, wire.encode(message)], flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # EHOSTUNREACH: the connection is gone (ROUTER_MANDATORY)
            log.warning("worker unreachable", worker=worker.worker_id, kind=type(message).__name__, error=str(exc))
            self.unreachable.add(worker)

    def reaches(self, worker: WorkerRecord, probe: object) -> bool:
        """Whether the worker's connection is still there: a send of `probe`, a message the worker
        ignores, does not bounce (ROUTER_MANDATORY). Unlike send(), a bounce marks nothing."""
        try:
            self._sender.send_multipart([worker.identity, wire.encode(probe)], flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            return False
        return True

    def reply(self, identity: bytes, message: object) -> None:
        """To a connection that is no registered worker; if it is gone, nothing is lost."""
        try:
            self._sender.send_multipart([identity, wire.encode(message)], flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    async def receive_loop(self, on_message: OnMessage) -> None:
        guard = LoopGuard("worker socket")
        while True:
            frames = await self._socket.recv_multipart(copy=False)
            with guard.iteration():
                self._receive(frames, on_message)

    def _receive(self, frames: list[zmq.Frame], on_message: OnMessage) -> None:
        if len(frames) != 2:
            log.warning("dropped frame with unexpected envelope", parts=len(frames))
            return
        identity, payload = frames[0].bytes, frames[1].bytes
        try:
            message = wire.decode(payload)
        except wire.WireError as exc:
            log.warning("dropped malformed frame", error=str(exc), size=len(payload), peer=identity[:64])
            version = wire.claimed_protocol_version(payload)
            if version is not None and version != PROTOCOL_VERSION:
                self.reply(identity, Refused(version_refusal(version)))
            return
        on_message(message, identity, self._user_id(frames[1]))

    def _user_id(self, frame: zmq.Frame) -> str | None:
        """The CURVE key the frame came with (the ZAP User-Id); None on ipc://, which has no keys."""
        if self.security is None:
            return None
        return frame.get("User-Id")
