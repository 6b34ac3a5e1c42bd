"""A worker's connection to the router: the registration handshake, heartbeats and typed messages.

Registration is a handshake: start() sends Register and waits for Registered (the router's epoch)
or Refused (the reason; the worker exits EXIT_REFUSED, since a restart would be refused again).
Later, a router that does not know us (it restarted, or it dropped us as dead or stuck) answers
our heartbeat with Reregister: the router has then forgotten every request we hold, so we drop
them all (forget_all) before registering again, and nothing stays held for a router that is gone.

The worker's main thread owns the DEALER socket: it sends its results straight onto it and
reads its tasks from it between forward passes. No thread sits between the worker and the
socket, because every thread on the path costs a wake-up per message, and the KV handoff
crosses the link twice. Heartbeats must still go out while the main thread is inside a long
forward pass, so a heartbeat thread borrows the socket then: a lock hands the socket from one
thread to the other (a mutex is the full memory barrier ZeroMQ asks for when a socket changes
threads). While the main thread holds the socket, waiting for messages, it sends the heartbeats
itself. A heartbeat says how long ago the main loop last came round (made_progress), so the
router can tell a worker that is alive from one whose loop is stuck while this thread still beats.

The socket has no fixed ZeroMQ identity: the router learns each connection's routing id when it
registers, so no peer can take over another worker's id by connecting under its name.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Callable

import structlog
import zmq

from shared.config.schema import WorkerConfig
from shared.control import wire
from shared.control.curve import secure_client
from shared.control.dispatch import Dispatcher, FatalError
from shared.control.messages import EXIT_REFUSED, Deregister, Heartbeat, Refused, Register, Registered, Reregister

log = structlog.get_logger()

REGISTER_RESEND_S = 2.0  # a Register lost with a router that died before answering is sent again
STARTING_POLL_S = 0.1  # while registering, how often a stop signal is looked at
LATE_BEAT_WARNING_S = 1.0  # a heartbeat this late is logged


@dataclass(frozen=True)
class WorkerLoad:
    """What a worker's heartbeat reports of its own state."""
    free_pages: int
    running: int
    waiting: int
    holding: list[str]  # ids of the requests whose pages it holds


class RegistrationRefused(FatalError):
    exit_code = EXIT_REFUSED


class RegistrationTimeout(FatalError):
    pass


class RouterLink:
    def __init__(self, endpoint: str, registration: Register, load: Callable[[], WorkerLoad],
                 forget_all: Callable[[], None], settings: WorkerConfig):
        """forget_all: drops every request the worker holds, freeing its pages, without telling
        the router (which no longer knows them); called before registering again."""
        self._registration = registration
        self._worker_id = registration.worker_id
        self._load = load
        self._forget_all = forget_all
        self._settings = settings
        self._interval = settings.heartbeat_interval_s
        self._next_beat = 0.0
        self._registered_at = 0.0  # when Register last went out
        self._epoch = ""  # the router's, from Registered; empty until registered
        self._received: list[object] = []  # arrived during start(), not dispatched yet
        self._last_progress = time.monotonic()
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.DEALER)
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

    def start(self, stopping: Callable[[], bool]) -> bool:
        """Connects and registers: True once registered, False if stopping() came true first;
        raises RegistrationRefused or RegistrationTimeout."""
        self._socket.connect(self._endpoint)
        deadline = time.monotonic() + self._settings.register_timeout_s
        with self._lock:
            self._register()
        while not self._epoch:
            if stopping():
                return False
            if time.monotonic() >= deadline:
                raise RegistrationTimeout(f"no answer to Register from {self._endpoint} within "
                                          f"{self._settings.register_timeout_s} s")
            # What came right behind Registered (PoolAvailable, tasks) waits for the first dispatch.
            self._received += self.receive(min(STARTING_POLL_S, deadline - time.monotonic()))
        self._beater.start()
        return True

    def send(self, message: object) -> None:
        frame = wire.encode(message)
        with self._lock:
            self._socket.send(frame)

    @property
    def epoch(self) -> str:
        """The router's epoch this worker is registered with; empty while registering."""
        return self._epoch

    def made_progress(self) -> None:
        """The main loop came round (or finished a chunk of a long step)."""
        self._last_progress = time.monotonic()

    def receive(self, timeout_s: float) -> list[object]:
        """Every message that has arrived, waiting up to timeout_s for the first. Heartbeats due
        meanwhile go out from here; the router's handshake messages are handled here and not
        returned."""
        frames = []
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while True:
                self._beat_if_due()
                # Whole milliseconds, rounded up: zmq takes an int, and a wait cut to 0 ms spun the
                # loop through its last millisecond at every round (8 ms of CPU a second, idle).
                wait_ms = math.ceil(max(0.0, min(deadline, self._next_beat) - time.monotonic()) * 1000)
                if self._poller.poll(wait_ms):
                    try:
                        while True:
                            frames.append(self._socket.recv(zmq.NOBLOCK))
                    except zmq.Again:
                        break
                if time.monotonic() >= deadline:
                    break
        self.made_progress()  # waiting for messages is the loop coming round, however long
        return [m for m in map(self._decode, frames) if m is not None]

    def dispatch(self, dispatcher: Dispatcher, timeout_s: float) -> None:
        """Runs the handler of every message that has arrived, waiting up to timeout_s for the first."""
        messages, self._received = self._received + self.receive(0.0 if self._received else timeout_s), []
        for message in messages:
            dispatcher(message)

    def close(self, linger_s: float = 1.0) -> None:
        """Deregisters, flushes what was sent (up to linger_s) and closes the socket."""
        self._closing.set()
        if self._beater.ident is not None:  # started
            self._beater.join()
        if self._epoch:
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
        """Called with the lock held. Unregistered, it sends Register again instead."""
        now = time.monotonic()
        if not self._epoch:
            if now - self._registered_at >= REGISTER_RESEND_S:
                self._register()
        elif now >= self._next_beat:
            if now - self._next_beat >= LATE_BEAT_WARNING_S:
                # Neither thread could send (the process stopped, the GIL held through a compile or a
                # blocking call): the router may have dropped us meanwhile; the log says why.
                log.warning("heartbeat went out late", late_s=round(now - self._next_beat, 3))
            load = self._load()
            self._socket.send(wire.encode(Heartbeat(
                self._worker_id, self._epoch, load.free_pages, load.running, load.waiting,
                now - self._last_progress, load.holding)))
            self._next_beat = now + self._interval

    def _register(self) -> None:
        """Called with the lock held."""
        self._socket.send(wire.encode(self._registration))
        self._registered_at = time.monotonic()
        self._next_beat = self._registered_at + self._interval

    def _decode(self, frame: bytes) -> object | None:
        try:
            message = wire.decode(frame)
        except wire.WireError as exc:
            log.warning("dropped malformed frame from router", error=str(exc), size=len(frame))
            return None
        if isinstance(message, Registered):
            if not self._epoch:  # an answer to a resent Register repeats the first: nothing new
                self._epoch = message.router_epoch
                log.info("registered with router", router_epoch=message.router_epoch)
            return None
        if isinstance(message, Reregister):
            if not self._epoch:
                return None  # registering already: one of several answers to heartbeats sent before
            log.warning("the router does not know this worker (it restarted, or dropped it): dropping every "
                        "request held and registering again", router_epoch=self._epoch)
            self._forget_all()
            self._epoch = ""
            with self._lock:
                self._register()
            return None
        if isinstance(message, Refused):
            log.error("the router refused this worker", reason=message.reason)
            raise RegistrationRefused(f"refused by the router: {message.reason}")
        return message
