"""The router's view of its workers: who is alive, how much KV room each has promised away."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from shared.messages import Heartbeat, KvPoolHandle, Register, Role


@dataclass
class Worker:
    worker_id: str
    role: Role
    identity: bytes           # the ZeroMQ routing id of its DEALER socket
    pid: int
    total_pages: int
    pool: KvPoolHandle | None
    last_seen: float = field(default_factory=time.monotonic)
    reserved_pages: int = 0   # promised to requests in flight; never exceeds total_pages
    free_pages: int = 0       # as the worker last reported
    running: int = 0
    waiting: int = 0
    requests: set[str] = field(default_factory=set)

    @property
    def room(self) -> int:
        return self.total_pages - self.reserved_pages


class WorkerRegistry:
    def __init__(self) -> None:
        self.workers: dict[str, Worker] = {}

    def register(self, identity: bytes, message: Register) -> tuple[Worker, Worker | None]:
        """Returns the new record and the record it replaces (a restarted worker), if any."""
        old = self.workers.get(message.worker_id)
        if old is not None and old.pid == message.pid and old.identity == identity:
            old.last_seen = time.monotonic()
            return old, None
        worker = Worker(message.worker_id, message.role, identity, message.pid, message.total_pages,
                        message.pool, free_pages=message.total_pages)
        self.workers[message.worker_id] = worker
        return worker, old

    def heartbeat(self, message: Heartbeat) -> Worker | None:
        worker = self.workers.get(message.worker_id)
        if worker is not None:
            worker.last_seen = time.monotonic()
            worker.free_pages, worker.running, worker.waiting = message.free_pages, message.running, message.waiting
        return worker

    def remove(self, worker_id: str) -> Worker | None:
        return self.workers.pop(worker_id, None)

    def silent_since(self, timeout_s: float) -> list[Worker]:
        deadline = time.monotonic() - timeout_s
        return [w for w in self.workers.values() if w.last_seen < deadline]

    def of_role(self, role: Role) -> list[Worker]:
        return [w for w in self.workers.values() if w.role == role]

    def pick(self, role: Role, pages: int) -> Worker | None:
        """The worker of that role with the most unpromised room, if it can take `pages`."""
        best = max(self.of_role(role), key=lambda w: (w.room, -len(w.requests)), default=None)
        return best if best is not None and best.room >= pages else None

    def largest_pool(self, role: Role) -> int:
        return max((w.total_pages for w in self.of_role(role)), default=0)
