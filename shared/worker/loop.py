"""The loop every worker runs, prefill and decode alike; each supplies its handlers and its step.

    link.start()            register with the router (a handshake: Registered or Refused; a stop
                            signal meanwhile ends it)
    loop until stopped:     ping the watchdog, tell the link the loop came round, run the
                            handlers of what arrived (waiting receive_timeout_s() at most), step(),
                            tick the other ranks if they have heard nothing for long
    draining (SIGTERM, or the router's Drain): send Draining, go on until the router answers
                            Drained (nothing of ours is in flight any more) or worker.drain_timeout_s
    on the way out:         fail what it still holds (Failed, so callers hear it at once),
                            deregister, close(), stop the other ranks

Only rank 0 of a tensor-parallel worker runs it (serve(), a worker process's main); its other
ranks follow rank 0's commands (shared/worker/ranks.py).

A worker subclass provides: `role`, its handlers, load() (what its heartbeat reports),
receive_timeout_s(), step(), forget_all() (drop every request without a word: the router has
forgotten them), fail_all(reason) and close().
"""

from __future__ import annotations

import abc
import os
import secrets
import time
from typing import Callable

import structlog
import torch

from shared.control.dispatch import Dispatcher
from shared.control.messages import PROTOCOL_VERSION, Drain, Drained, Draining, KvPoolHandle, Register, Role
from shared.control.router_link import RouterLink, WorkerLoad
from shared.kernels.device import on_stream
from shared.runtime import metrics
from shared.worker.main import WorkerProcess, start_worker

log = structlog.get_logger()


class WorkerLoop(abc.ABC):
    role: Role

    def __init__(self, worker: WorkerProcess, worker_id: str, total_pages: int, page_size: int,
                 pool_handles: list[KvPoolHandle], handlers: dict[type, Callable[[object], None]],
                 stream: torch.cuda.Stream | None, max_batch_size: int = 0, window: int = 0):
        """max_batch_size and window: a decode's, which the router learns in Register; 0 for a prefill."""
        self.worker_id = worker_id
        self.stop = worker.stop
        self.drain_timeout_s = worker.config.worker.drain_timeout_s
        self.drain_deadline: float | None = None  # set once draining
        self.draining_told = ""  # the router epoch that heard our Draining: a new router must hear it too
        self.drained_by = ""  # the router epoch that said Drained: nothing of ours is in flight there
        self.notify = worker.notify
        self.stream = stream
        self.ranks = worker.ranks  # this is rank 0: the others follow its commands
        registration = Register(worker_id, self.role, PROTOCOL_VERSION, secrets.token_hex(8), os.getpid(),
                                total_pages, page_size, max_batch_size, window, pool_handles, worker.fingerprint)
        self.link = RouterLink(worker.config.router.zmq_endpoint(), registration, self.load, self.forget_all,
                               worker.config.worker)
        self.dispatch = Dispatcher({**handlers, Drain: self._on_drain, Drained: self._on_drained})

    def run(self) -> None:
        try:
            if self.link.start(lambda: self.stop.now.is_set() or self.stop.drain.is_set()):
                self.notify.ready()
                log.info(f"{self.role} worker serving")
                with on_stream(self.stream):
                    while not self._done():
                        self.notify.watchdog()
                        self.link.made_progress()
                        self.link.dispatch(self.dispatch, self.receive_timeout_s())
                        self.step()
                        self.ranks.keep_alive()
        finally:
            self.notify.stopping()
            self.fail_all(f"{self.role} worker is shutting down")
            self.link.close()
            self.close()
            self.ranks.close()
            log.info(f"{self.role} worker stopped")

    def _done(self) -> bool:
        if self.stop.now.is_set():
            return True
        if not self.stop.drain.is_set():
            return False
        if self.drain_deadline is None:
            log.info(f"{self.role} worker draining", timeout_s=self.drain_timeout_s)
            self.drain_deadline = time.monotonic() + self.drain_timeout_s
        if self.link.epoch and self.link.epoch != self.draining_told:
            self.link.send(Draining(self.worker_id))
            self.draining_told = self.link.epoch
        return self.drained_by == self.link.epoch or time.monotonic() > self.drain_deadline

    def _on_drain(self, message: Drain) -> None:
        self.stop.drain.set()

    def _on_drained(self, message: Drained) -> None:
        # Kept even when not draining yet: a stopping router sends Drained to every worker at its
        # SIGTERM, which may reach us before our own SIGTERM's drain has come round this loop.
        # It holds for that router's epoch only; a new router must say it again.
        self.drained_by = self.link.epoch

    @abc.abstractmethod
    def load(self) -> WorkerLoad: ...

    @abc.abstractmethod
    def receive_timeout_s(self) -> float:
        """How long the loop may wait for messages before its next step."""

    @abc.abstractmethod
    def step(self) -> None:
        """The worker's compute between two rounds of messages; may do nothing."""

    @abc.abstractmethod
    def forget_all(self) -> None:
        """Drops every request and frees their pages, telling no one: the router forgot them."""

    @abc.abstractmethod
    def fail_all(self, reason: str) -> None:
        """Sends Failed for every request held and frees their pages."""

    @abc.abstractmethod
    def close(self) -> None:
        """Releases what the worker owns (its exported pool, its mappings), after deregistering."""


def serve(role: Role, worker_loop: Callable[[WorkerProcess], WorkerLoop],
          follow: Callable[[WorkerProcess], None]) -> None:
    """A worker process's main: rank 0 (every worker without tensor parallelism) runs the worker's
    loop; the other ranks follow it (shared/worker/ranks.py)."""
    worker = start_worker(role)
    if not worker.ranks.leads:
        follow(worker)
        return
    loop = worker_loop(worker)
    metrics.watch_workers([loop.load])
    loop.run()
