"""Which workers belong to the stack: register, heartbeat, drain, drop, and who is alive.

The router is one incarnation among many: its epoch, sent in Registered, comes back in every
heartbeat, and a worker that hears Reregister drops all it held before registering again. A
worker's CURVE key decides which worker ids and roles it may register as (registration.py). A
worker id belongs to one live process: another process registering under it (a second stack on
the same runtime folder, a worker started twice by hand) is refused while the holder still beats
and its connection is there, and never evicts it; a restarted worker, whose old process is gone
with its connection, takes its id back at once. A worker is dropped when it deregisters, registers
again, goes silent past router.heartbeat_timeout_s (time the router's own loop stood still, its
socket unread, does not count: WorkerRegistry.router_stalled_s), reports its main loop stuck past
router.progress_timeout_s, or a send finds its connection gone.
Heartbeats list what each worker holds, and the router aborts what it no longer knows. Every
decode hears of every prefill's pool (PoolAvailable), but of a NIXL handle only once it has shown
that it runs on another host (first_offer).

The request's stages (token_router.py) hear of membership only through the callbacks they pass in,
so this module never imports them:
    on_worker_lost(worker, reason)  the worker is gone (already out of the registry): fail the
                                    requests it held, settle its handoffs
    on_workers_changed(serving)     a worker joined, left, drains or cannot pull from a prefill:
                                    serving is whether some prefill and decode still pair
    awaiting_release(worker_id)     the request ids whose pages that prefill keeps until the
                                    ReleaseKv the stages still owe it
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Callable

import structlog

from services.router.control.registration import RegistrationPolicy
from services.router.control.worker_records import WorkerRecord, WorkerRegistry
from services.router.control.worker_socket import WorkerSocket
from shared.config.schema import RouterConfig
from shared.control.messages import (
    Abort,
    Deregister,
    Drain,
    Drained,
    Draining,
    Heartbeat,
    KvCacheEvents,
    KvPoolHandle,
    PoolAvailable,
    PoolGone,
    PoolUnreachable,
    Refused,
    Register,
    Registered,
    Reregister,
    Role,
)
from shared.runtime import metrics

log = structlog.get_logger()

STALL_WARNING_S = 1.0  # a stall of the router's loop this long is logged: it delays every request
NIXL = "nixl"  # KvPoolHandle.backend of a pool offered over NIXL (shared/kv/transfer/nixl.py)


def first_offer(handles: list[KvPoolHandle]) -> list[KvPoolHandle]:
    """A prefill's handles as a decode first gets them. One that offers its host's kind and NIXL
    (kv.transfer auto on a tcp:// stack) is offered without NIXL, whose data plane has no
    authentication: only a decode that cannot open the host's kind, so runs on another host, gets
    the NIXL handle, when it says so (PoolUnreachable)."""
    return [handle for handle in handles if handle.backend != NIXL] or handles


def nixl_withheld(handles: list[KvPoolHandle]) -> list[KvPoolHandle]:
    """The NIXL handles first_offer held back."""
    return [handle for handle in handles if handle.backend == NIXL] if first_offer(handles) != handles else []


@dataclass(frozen=True)
class Peer:
    """Who sent a frame: its connection, the CURVE key it proved (None on ipc://), and the worker
    registered on that connection with that key, if any."""
    identity: bytes
    user_id: str | None
    worker: WorkerRecord | None


class Membership:
    def __init__(self, registry: WorkerRegistry, socket: WorkerSocket, settings: RouterConfig,
                 on_worker_lost: Callable[[WorkerRecord, str], None], on_workers_changed: Callable[[bool], None],
                 awaiting_release: Callable[[str], set[str]]):
        self.registry = registry
        self.socket = socket
        self.settings = settings
        self.epoch = secrets.token_hex(8)
        self.registration: RegistrationPolicy | None = None  # made in the token router's start(), with CURVE
        self._on_worker_lost = on_worker_lost
        self._on_workers_changed = on_workers_changed
        self._awaiting_release = awaiting_release
        self.handlers = {
            Register: self._on_register, Heartbeat: self._on_heartbeat, Deregister: self._on_deregister,
            Draining: self._on_draining, KvCacheEvents: self._on_kv_cache_events,
            PoolUnreachable: self._on_pool_unreachable,
        }

    def peer(self, identity: bytes, user_id: str | None) -> Peer:
        worker = self.registry.by_identity(identity)
        if worker is not None and worker.user_id != user_id:
            worker = None  # a connection that no longer speaks with the key it registered with
        return Peer(identity, user_id, worker)

    def serving(self) -> bool:
        return self.registry.paired()

    def drain(self, worker_id: str) -> bool:
        """Asks a worker to drain (it answers Draining); False if no such worker is registered."""
        worker = self.registry.workers.get(worker_id)
        if worker is None:
            return False
        self.socket.send(worker, Drain())
        self.drop_unreachable()
        return True

    def release_all(self) -> None:
        """The router stops: a worker draining alongside may go now."""
        for worker in self.registry.workers.values():
            self.socket.send(worker, Drained())

    def router_stalled(self, seconds: float) -> None:
        """The router's event loop ran this much later than it meant to: that time is no worker's silence."""
        if seconds <= 0:
            return
        if seconds >= STALL_WARNING_S:
            log.warning("router event loop stood still", seconds=round(seconds, 3))
        self.registry.router_stalled_s += seconds

    def drop_silent(self) -> None:
        timeout = self.settings.heartbeat_timeout_s
        for worker in self.registry.silent_since(timeout):
            self.drop(worker, f"worker {worker.worker_id} missed heartbeats for {timeout} s")

    def drop_unreachable(self) -> None:
        """Drops the workers whose connection a send found gone; called once the sending is done."""
        unreachable = self.socket.unreachable
        while unreachable:
            worker = unreachable.pop()
            if self.registry.workers.get(worker.worker_id) is worker:
                self.drop(worker, f"worker {worker.worker_id} is unreachable")

    def drop(self, worker: WorkerRecord, reason: str) -> None:
        log.warning("dropping worker", worker=worker.worker_id, reason=reason, requests=len(worker.reservations))
        self.registry.remove(worker)  # a no-op for a record a new registration already replaced
        metrics.forget_pages(worker.worker_id, worker.role)  # a replacement registers its own right after
        self._on_worker_lost(worker, reason)
        worker.reservations.clear()
        if worker.role == Role.PREFILL:
            for decode in self.registry.of_role(Role.DECODE):
                self.socket.send(decode, PoolGone(worker.worker_id))
        self._on_workers_changed(self.serving())

    # ---- handlers: each takes the sending Peer and the message ----

    def _on_register(self, peer: Peer, message: Register) -> None:
        reason = self.registration.refusal(message, peer.user_id, self.registry) or self._held_by_another(message, peer)
        if reason:
            log.error("refused worker", worker=message.worker_id, role=message.role, reason=reason)
            self.socket.reply(peer.identity, Refused(reason))
            return
        worker, replaced = self.registry.register(peer.identity, peer.user_id, message)
        self.socket.send(worker, Registered(self.epoch))  # before any task that the drops below may place on it
        if replaced is worker:
            return
        if peer.worker is not None and peer.worker is not replaced:  # this connection re-registers as another id
            self.drop(peer.worker, f"worker {peer.worker.worker_id} registered again as {message.worker_id}")
        if replaced is not None:
            self.drop(replaced, f"worker {replaced.worker_id} registered again")
        metrics.watch_routed(worker)
        if worker.role == Role.PREFILL:
            for decode in self.registry.of_role(Role.DECODE):
                self.socket.send(decode, PoolAvailable(worker.worker_id, first_offer(message.pool_handles)))
        else:
            for prefill in self.registry.of_role(Role.PREFILL):
                self.socket.send(worker, PoolAvailable(prefill.worker_id, first_offer(prefill.pool_handles)))
        log.info("worker registered", worker=worker.worker_id, role=worker.role, pid=worker.pid,
                 incarnation=worker.incarnation, pages=worker.total_pages)
        self._on_workers_changed(self.serving())

    def _held_by_another(self, message: Register, peer: Peer) -> str:
        """Why the id is not this process's to take: another incarnation holds it that was heard from
        within router.heartbeat_timeout_s and whose connection is still there (Registered, which a
        registered worker ignores, does not bounce). "" if the id is free or its holder is gone."""
        holder = self.registry.workers.get(message.worker_id)
        if holder is None or holder.incarnation == message.incarnation or holder.identity == peer.identity:
            return ""
        silent_s = self.registry.silent_s(holder)
        if silent_s > self.settings.heartbeat_timeout_s or not self.socket.reaches(holder, Registered(self.epoch)):
            return ""
        return (f"worker id {message.worker_id!r} is held by a live worker (pid {holder.pid}, heard from "
                f"{silent_s:.1f} s ago), maybe of another stack on this runtime folder: give this one another id, "
                "or another router")

    def _on_draining(self, peer: Peer, message: Draining) -> None:
        worker = peer.worker
        if worker is not None and worker.worker_id == message.worker_id and not worker.draining:
            log.info("worker draining", worker=worker.worker_id, requests=len(worker.reservations))
            worker.draining = True
            self._on_workers_changed(self.serving())

    def _on_kv_cache_events(self, peer: Peer, message: KvCacheEvents) -> None:
        prefill = peer.worker
        if prefill is not None and prefill.role == Role.PREFILL and prefill.worker_id == message.worker_id:
            self.registry.cache_changed(prefill, message)

    def _on_pool_unreachable(self, peer: Peer, message: PoolUnreachable) -> None:
        decode = peer.worker
        if decode is None or decode.role != Role.DECODE:
            return
        prefill = self.registry.workers.get(message.prefill_worker_id)
        withheld = nixl_withheld(prefill.pool_handles) if prefill is not None else []
        if withheld and prefill.worker_id not in decode.offered_nixl:
            log.info("offering NIXL: the decode cannot open the prefill's pool on its host", decode=decode.worker_id,
                     prefill=prefill.worker_id, reason=message.reason)
            decode.offered_nixl.add(prefill.worker_id)
            self.socket.send(decode, PoolAvailable(prefill.worker_id, withheld))
            return
        log.warning("pair avoided: the decode cannot pull from the prefill's pool", decode=decode.worker_id,
                    prefill=message.prefill_worker_id, reason=message.reason)
        decode.unreachable[message.prefill_worker_id] = message.reason
        self._on_workers_changed(self.serving())

    def _on_deregister(self, peer: Peer, message: Deregister) -> None:
        if peer.worker is not None and peer.worker.worker_id == message.worker_id:
            self.drop(peer.worker, f"worker {message.worker_id} stopped")

    def _on_heartbeat(self, peer: Peer, message: Heartbeat) -> None:
        worker = peer.worker
        if worker is None or worker.worker_id != message.worker_id:
            self.socket.reply(peer.identity, Reregister())
            return
        if message.router_epoch != self.epoch:
            return  # sent before its Registered from this router arrived
        self.registry.heartbeat(worker, message)
        if message.stalled_s > self.settings.progress_timeout_s:
            self.drop(worker, f"worker {worker.worker_id}'s main loop made no progress for "
                              f"{message.stalled_s:.1f} s (router.progress_timeout_s)")
            return
        owed = self._awaiting_release(worker.worker_id)
        if worker.draining and not worker.reservations and not owed:
            self.socket.send(worker, Drained())
        # A request the router just let go of may be listed once more, by a heartbeat sent before
        # the worker read the ReleaseKv or Abort: only one listed twice in a row is held astray.
        unknown = {r for r in message.holding if r not in worker.reservations and r not in owed}
        for request_id in unknown & worker.unknown_holding:
            log.warning("worker holds a request the router does not know: aborting it", worker=worker.worker_id,
                        request_id=request_id)
            self.socket.send(worker, Abort(request_id))
        worker.unknown_holding = unknown
