"""The router's view of its workers: who is alive, and how much KV room each has promised away."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from shared.control.messages import Heartbeat, KvCacheEvents, KvPoolHandle, ModelFingerprint, Register, Role


@dataclass(eq=False)
class WorkerRecord:
    """The router's record of one registered worker (the worker itself is another process)."""
    worker_id: str
    role: Role
    identity: bytes           # the ZeroMQ routing id of its connection, learnt at registration
    user_id: str | None       # the CURVE key it connected with (ZAP User-Id); None on ipc://
    incarnation: str          # random per process start
    pid: int
    total_pages: int
    max_batch_size: int       # a decode's: the most requests it runs at once (0 for a prefill)
    window: int               # a decode's model's sliding window on every layer (Register.window), else 0
    pool_handles: list[KvPoolHandle]  # a prefill's, as it registered them
    fingerprint: ModelFingerprint
    last_seen: float = field(default_factory=time.monotonic)
    stalled_s_when_seen: float = 0.0  # the registry's router_stalled_s at last_seen
    # Pages promised to each request in flight, by request id: the prompt's on a prefill until
    # the decode has pulled them, prompt + max_tokens on a decode until it ends the request. The
    # requests that fail if this worker dies are exactly these.
    reservations: dict[str, int] = field(default_factory=dict)
    # Prompt tokens placed on a prefill and not prefilled yet, by request id: its queue, in work.
    pending_tokens: dict[str, int] = field(default_factory=dict)
    draining: bool = False    # takes no new work (services/router/control/routing.py skips it)
    cached_keys: set[str] = field(default_factory=set)  # a prefill's prefix cache, as its KvCacheEvents say
    unreachable: dict[str, str] = field(default_factory=dict)  # a decode's prefills it cannot pull from, and why
    offered_nixl: set[str] = field(default_factory=set)  # a decode's prefills whose withheld NIXL handle it got
    unknown_holding: set[str] = field(default_factory=set)  # held, by its last heartbeat, unknown to the router
    free_pages: int = 0       # as the worker last reported
    running: int = 0
    waiting: int = 0
    stalled_s: float = 0.0    # its main loop's time since it last came round, as last reported

    @property
    def reserved_pages(self) -> int:
        """Derived from the reservations, never counted apart, so it cannot drift from them."""
        return sum(self.reservations.values())

    @property
    def room(self) -> int:
        return self.total_pages - self.reserved_pages

    @property
    def has_slot(self) -> bool:
        """Whether one more request may be placed here: a decode steps at most max_batch_size at once,
        and one placed beyond them would wait in its queue with the handoff's timeout running. A
        prefill queues its prompts, bounded by its pages alone."""
        return self.role != Role.DECODE or len(self.reservations) < self.max_batch_size

    @property
    def pending_prompt_tokens(self) -> int:
        return sum(self.pending_tokens.values())


class WorkerRegistry:
    def __init__(self) -> None:
        self.workers: dict[str, WorkerRecord] = {}
        # How long the router's own event loop has stood still, in all: heartbeats waited unread in
        # its socket meanwhile, so that time is no worker's silence.
        self.router_stalled_s = 0.0

    def register(self, identity: bytes, user_id: str | None,
                 message: Register) -> tuple[WorkerRecord, WorkerRecord | None]:
        """Returns the worker's record and the record it replaces, if any: a new process, or one
        that registers again because the router forgot it, and so holds nothing it was given. A
        Register repeated on the same connection by the same process (an answer was slow) keeps
        the record as it is."""
        old = self.workers.get(message.worker_id)
        if old is not None and old.incarnation == message.incarnation and old.identity == identity:
            return old, old
        worker = WorkerRecord(message.worker_id, message.role, identity, user_id, message.incarnation, message.pid,
                              message.total_pages, message.max_batch_size, message.window, message.pool_handles,
                              message.fingerprint, stalled_s_when_seen=self.router_stalled_s,
                              free_pages=message.total_pages)
        self.workers[message.worker_id] = worker
        if worker.role == Role.PREFILL:  # a new pool: every decode tries it afresh
            for decode in self.of_role(Role.DECODE):
                decode.unreachable.pop(worker.worker_id, None)
                decode.offered_nixl.discard(worker.worker_id)
        return worker, old

    @staticmethod
    def cache_changed(prefill: WorkerRecord, message: KvCacheEvents) -> None:
        """What the prefill's prefix cache holds now, by its own events."""
        if message.cleared:
            prefill.cached_keys.clear()
        prefill.cached_keys.difference_update(message.evicted)
        prefill.cached_keys.update(message.stored)

    def by_identity(self, identity: bytes) -> WorkerRecord | None:
        return next((w for w in self.workers.values() if w.identity == identity), None)

    def heartbeat(self, worker: WorkerRecord, message: Heartbeat) -> None:
        worker.last_seen, worker.stalled_s_when_seen = time.monotonic(), self.router_stalled_s
        worker.free_pages, worker.running, worker.waiting = message.free_pages, message.running, message.waiting
        worker.stalled_s = message.stalled_s

    def remove(self, worker: WorkerRecord) -> None:
        if self.workers.get(worker.worker_id) is worker:
            del self.workers[worker.worker_id]

    def silent_s(self, worker: WorkerRecord) -> float:
        """How long the router has listened for the worker since it last heard from it."""
        return time.monotonic() - worker.last_seen - (self.router_stalled_s - worker.stalled_s_when_seen)

    def silent_since(self, timeout_s: float) -> list[WorkerRecord]:
        return [w for w in self.workers.values() if self.silent_s(w) > timeout_s]

    def of_role(self, role: Role) -> list[WorkerRecord]:
        return [w for w in self.workers.values() if w.role == role]

    def serving(self, role: Role) -> list[WorkerRecord]:
        """The workers of that role that take new work."""
        return [w for w in self.of_role(role) if not w.draining]

    def paired(self) -> bool:
        """Whether some serving prefill and serving decode can hand KV over to each other."""
        return any(prefill.worker_id not in decode.unreachable
                   for prefill in self.serving(Role.PREFILL) for decode in self.serving(Role.DECODE))

    def decode_window(self) -> int:
        """The sliding window the decodes' requests attend to: theirs where they all say the same
        (they serve one model), else 0, which reserves for every position."""
        windows = {w.window for w in self.of_role(Role.DECODE)}
        return windows.pop() if len(windows) == 1 else 0

    def largest_pool(self, role: Role) -> int:
        return max((w.total_pages for w in self.of_role(role)), default=0)
