"""A worker's connection to the router: registration, heartbeats and typed messages.

The worker's main thread owns the DEALER socket: it sends its results straight onto it and
reads its tasks from it between forward passes. No thread sits between the worker and the
socket, because every thread on the path costs a wake-up per message, and the KV handoff
crosses the link twice. Heartbeats must still go out while the main thread is inside a long
forward pass, so a heartbeat thread borrows the socket then: a lock hands the socket from one
thread to the other (a mutex is the full memory barrier ZeroMQ asks for when a socket changes
threads). While the main thread holds the socket, waiting for messages, it sends the heartbeats
itself. A frame that does not decode is logged and dropped; the worker keeps running. If the
router restarts it answers our heartbeat with Reregister and we register again, without a
restart of the worker.
"""

from __future__ import annotations

import threading
import time
from typing import Callable

import structlog
import zmq

from shared import wire
from shared.config import WorkerConfig
from shared.messages import Deregister, Heartbeat, Register, Registered, Reregister
from shared.zmq_security import secure_client

log = structlog.get_logger()


class RouterLink:
    def __init__(self, endpoint: str, worker_id: str, registration: Callable[[], Register],
                 heartbeat: Callable[[], Heartbeat], settings: WorkerConfig):
        self._worker_id = worker_id
        self._registration = registration
        self._heartbeat = heartbeat
        self._interval = settings.heartbeat_interval_s
        self._next_beat = 0.0
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.IDENTITY, worker_id.encode())
        self._socket.setsockopt(zmq.MAXMSGSIZE, wire.MAX_FRAME_BYTES)
        # Tasks wait in the socket while the main thread computes; the router bounds how many.
        self._socket.setsockopt(zmq.RCVHWM, 0)
        secure_client(self._socket, endpoint, settings)  # CURVE key files, used on tcp:// only
        self._endpoint = endpoint
        self._poller = zmq.Poller()
        self._poller.register(self._socket, zmq.POLLIN)
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._beater = threading.Thread(target=self._beat_while_open, name="heartbeat", daemon=True)

    def start(self) -> None:
        self._socket.connect(self._endpoint)
        self.send(self._registration())
        self._next_beat = time.monotonic() + self._interval
        self._beater.start()

    def send(self, message: object) -> None:
        frame = wire.encode(message)
        with self._lock:
            self._socket.send(frame)

    def receive(self, timeout_s: float) -> list[object]:
        """Every message that has arrived, waiting up to timeout_s for the first. Heartbeats due
        meanwhile go out from here; the router's own replies (Registered, Reregister) are
        handled here and not returned."""
        frames = []
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while True:
                self._beat_if_due()
                if self._poller.poll(max(0.0, min(deadline, self._next_beat) - time.monotonic()) * 1000):
                    try:
                        while True:
                            frames.append(self._socket.recv(zmq.NOBLOCK))
                    except zmq.Again:
                        break
                if time.monotonic() >= deadline:
                    break
        return [m for m in map(self._decode, frames) if m is not None]

    def dispatch(self, handlers: dict[type, Callable[[object], None]], timeout_s: float) -> None:
        """Runs the handler of every message that has arrived, waiting up to timeout_s for the first."""
        for message in self.receive(timeout_s):
            handler = handlers.get(type(message))
            if handler is None:
                log.warning("unexpected message", kind=type(message).__name__)
            else:
                handler(message)

    def close(self, linger_s: float = 1.0) -> None:
        """Deregisters, flushes what was sent (up to linger_s) and closes the socket."""
        self._closing.set()
        if self._beater.ident is not None:  # started
            self._beater.join()
        self.send(Deregister(self._worker_id))
        self._socket.close(linger=int(linger_s * 1000))
        self._context.term()

    def _beat_while_open(self) -> None:
        structlog.contextvars.bind_contextvars(worker_id=self._worker_id)  # one of two in services.colocated
        while not self._closing.wait(max(0.0, self._next_beat - time.monotonic())):
            # A main thread waiting in receive() holds the socket, and beats itself meanwhile.
            if self._lock.acquire(timeout=self._interval):
                try:
                    self._beat_if_due()
                finally:
                    self._lock.release()

    def _beat_if_due(self) -> None:
        """Called with the lock held."""
        if time.monotonic() >= self._next_beat:
            self._socket.send(wire.encode(self._heartbeat()))
            self._next_beat = time.monotonic() + self._interval

    def _decode(self, frame: bytes) -> object | None:
        try:
            message = wire.decode(frame)
        except wire.WireError as exc:
            log.warning("dropped malformed frame from router", error=str(exc), size=len(frame))
            return None
        if isinstance(message, Reregister):
            log.info("router asked to register again")
            self.send(self._registration())
            return None
        if isinstance(message, Registered):
            log.info("registered with router", router_started_at=message.router_started_at)
            return None
        return message
