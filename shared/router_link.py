"""A worker's connection to the router: registration, heartbeats and typed messages.

An I/O thread owns the DEALER socket, so heartbeats go out even while the worker's main thread
is inside a long forward pass. The main thread reads decoded messages from a queue and sends
through an inproc socket that the I/O thread forwards. A frame that does not decode is logged
and dropped; the worker keeps running. If the router restarts it answers our heartbeat with
Reregister and we register again, without a restart of the worker.

The I/O thread needs the GIL for a moment per message. A main thread that keeps taking it back
(a step drops it around each kernel launch and retakes it before a waiting thread wakes) makes
the I/O thread wait out the whole switch interval, 5 ms by default: more than a whole KV
handoff, on each of the prefill's send and the decode's receive. start() shortens it for the
process.
"""

from __future__ import annotations

import queue
import sys
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

GIL_SWITCH_INTERVAL_S = 0.0005


class RouterLink:
    def __init__(self, endpoint: str, worker_id: str, registration: Callable[[], Register],
                 heartbeat: Callable[[], Heartbeat], settings: WorkerConfig):
        self._endpoint = endpoint
        self._settings = settings  # heartbeat interval; CURVE key files, used on tcp:// only
        self._worker_id = worker_id
        self._registration = registration
        self._heartbeat = heartbeat
        self._interval = settings.heartbeat_interval_s
        self._context = zmq.Context()
        self._inbox: queue.Queue = queue.Queue()
        self.received_at = 0.0  # see dispatch()
        self._outbox_address = f"inproc://outbox-{id(self)}"
        self._outbox_pull = self._context.socket(zmq.PULL)
        self._outbox_pull.bind(self._outbox_address)
        self._outbox_push = self._context.socket(zmq.PUSH)  # used by the main thread only
        self._outbox_push.connect(self._outbox_address)
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name="router-link", daemon=True)

    def start(self) -> None:
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)
        self._thread.start()

    def send(self, message: object) -> None:
        self._outbox_push.send(wire.encode(message))

    def receive(self, timeout_s: float) -> list[tuple[float, object]]:
        """Everything that has arrived, as (perf_counter when it arrived, message), waiting up to
        timeout_s for the first message."""
        try:
            first = self._inbox.get(timeout=timeout_s) if timeout_s > 0 else self._inbox.get_nowait()
        except queue.Empty:
            return []
        messages = [first]
        while True:
            try:
                messages.append(self._inbox.get_nowait())
            except queue.Empty:
                return messages

    def dispatch(self, handlers: dict[type, Callable[[object], None]], timeout_s: float) -> None:
        """Runs the handler of every message that has arrived, waiting up to timeout_s for the first.
        While a handler runs, received_at is when its message arrived (perf_counter): a worker busy
        in a forward pass leaves messages waiting here, and that wait is part of their queueing."""
        for self.received_at, message in self.receive(timeout_s):
            handler = handlers.get(type(message))
            if handler is None:
                log.warning("unexpected message", kind=type(message).__name__)
            else:
                handler(message)

    def close(self, linger_s: float = 1.0) -> None:
        """Flushes what was sent (up to linger_s), then stops the thread and the sockets."""
        self._closing.set()
        self._thread.join(timeout=linger_s + 1.0)
        self._outbox_push.close(linger=0)
        self._context.term()

    def _run(self) -> None:
        structlog.contextvars.bind_contextvars(worker_id=self._worker_id)  # one of two in services.colocated
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.IDENTITY, self._worker_id.encode())
        dealer.setsockopt(zmq.MAXMSGSIZE, wire.MAX_FRAME_BYTES)
        secure_client(dealer, self._endpoint, self._settings)
        dealer.connect(self._endpoint)
        poller = zmq.Poller()
        poller.register(dealer, zmq.POLLIN)
        poller.register(self._outbox_pull, zmq.POLLIN)
        dealer.send(wire.encode(self._registration()))
        next_beat = time.monotonic() + self._interval
        try:
            while not self._closing.is_set():
                ready = dict(poller.poll(timeout=max(0.0, next_beat - time.monotonic()) * 1000))
                if self._outbox_pull in ready:
                    while self._outbox_pull.poll(0):
                        dealer.send(self._outbox_pull.recv())
                if dealer in ready:
                    while dealer.poll(0):
                        self._on_frame(dealer, dealer.recv())
                if time.monotonic() >= next_beat:
                    dealer.send(wire.encode(self._heartbeat()))
                    next_beat = time.monotonic() + self._interval
            while self._outbox_pull.poll(0):  # flush final messages (Failed, ...) before leaving
                dealer.send(self._outbox_pull.recv())
            dealer.send(wire.encode(Deregister(self._worker_id)))
        finally:
            dealer.close(linger=1000)
            self._outbox_pull.close(linger=0)

    def _on_frame(self, dealer: zmq.Socket, frame: bytes) -> None:
        try:
            message = wire.decode(frame)
        except wire.WireError as exc:
            log.warning("dropped malformed frame from router", error=str(exc), size=len(frame))
            return
        if isinstance(message, Reregister):
            log.info("router asked to register again")
            dealer.send(wire.encode(self._registration()))
        elif isinstance(message, Registered):
            log.info("registered with router", router_started_at=message.router_started_at)
        else:
            self._inbox.put((time.perf_counter(), message))
