"""The token router: one ZeroMQ ROUTER socket to every worker, and each request's journey over it.

    submit():   Admission places the request on a prefill and a decode  -> PrefillTask
    KvReady:    the first token goes to the front; DecodeTask to the decode (or, when the first
                token ended it, ReleaseKv to the prefill)
    KvPulled:   ReleaseKv to the prefill (only now may it free the prompt's pages)
    TokenBatch: tokens go to the front; the last one gives the decode's reservation back
    finish():   the front is done (the end, or client gone, stop string): Abort to a worker
                that still holds the request

The router is one incarnation among many: its epoch, sent in Registered, comes back in every
heartbeat, and a worker that hears Reregister drops all it held before registering again.
Nothing is trusted blindly: each message about a request must come from the worker the router
gave it to, a worker's CURVE key decides which worker ids and roles it may register as, and a
send to a worker that is gone (ROUTER_MANDATORY) drops it at once. A worker silent past
router.heartbeat_timeout_s, or whose main loop has not come round for router.progress_timeout_s,
is dropped and its requests fail with UNAVAILABLE; so does a request that overstays any stage's
timeout. Heartbeats list what each worker holds, and the router aborts what it no longer knows.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass
from typing import Callable

import structlog
import zmq
import zmq.asyncio

from services.router.control.admission import Admission
from services.router.control.registration import RegistrationPolicy, version_refusal
from services.router.control.request import ErrorEvent, InflightRequest, Stage, TokenEvent
from services.router.control.routing import RoutingPolicy
from services.router.control.worker_records import Worker, WorkerRegistry
from shared.config import Config
from shared.control import wire
from shared.control.curve import secure_server
from shared.control.dispatch import Dispatcher
from shared.control.messages import (
    PROTOCOL_VERSION,
    Abort,
    DecodeTask,
    Deregister,
    Drain,
    Drained,
    Draining,
    ErrorCode,
    Failed,
    Heartbeat,
    KvCacheEvents,
    KvPulled,
    KvReady,
    PoolAvailable,
    PoolGone,
    PoolUnreachable,
    PrefillTask,
    Refused,
    Register,
    Registered,
    ReleaseKv,
    Reregister,
    Role,
    TokenBatch,
)
from shared.runtime import metrics

log = structlog.get_logger()

@dataclass(frozen=True)
class Peer:
    """Who sent a frame: its connection, the CURVE key it proved (None on ipc://), and the worker
    registered on that connection with that key, if any."""
    identity: bytes
    user_id: str | None
    worker: Worker | None


@dataclass
class Handoff:
    """A prefill's KV that the decode has not pulled yet: ReleaseKv is owed to the prefill."""
    prefill_id: str
    decode_id: str
    since: float  # time.monotonic() of KvReady


class TokenRouter:
    def __init__(self, config: Config, checkpoint: tuple[str, str, str], on_workers_changed: Callable[[bool], None]):
        """checkpoint: the (config, weights, tokenizer) hashes of the router's own copy of the model
        (shared/model/fingerprint.py); every worker's must equal them."""
        self.config = config
        self.checkpoint = checkpoint
        self.settings = config.router
        self.epoch = secrets.token_hex(8)
        self.registry = WorkerRegistry()
        self.admission = Admission(self.registry, RoutingPolicy(config.routing, config.kv.page_size), config.router,
                                   config.kv.page_size, self._start_prefill)
        self.requests: dict[str, InflightRequest] = {}  # by the router's own request ids
        self.handoffs: dict[str, Handoff] = {}
        metrics.watch_load(lambda: len(self.requests), lambda: len(self.admission.waiting))
        self._on_workers_changed = on_workers_changed
        self._unreachable: set[Worker] = set()
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
        self._security = None
        self.registration: RegistrationPolicy | None = None  # made in start(), with the CURVE server
        self._tasks: list[asyncio.Task] = []
        self.dispatch = Dispatcher({
            Register: self._on_register, Heartbeat: self._on_heartbeat, KvReady: self._on_kv_ready,
            KvPulled: self._on_kv_pulled, TokenBatch: self._on_token_batch, Failed: self._on_failed,
            Deregister: self._on_deregister, Draining: self._on_draining, KvCacheEvents: self._on_kv_cache_events,
            PoolUnreachable: self._on_pool_unreachable,
        })

    async def start(self) -> None:
        self._security = secure_server(self._socket, self.settings)
        self.registration = RegistrationPolicy(self.config.kv.page_size, self.checkpoint, self._security)
        self._socket.bind(self.settings.zmq_endpoint())
        self._tasks = [asyncio.create_task(self._receive_loop()), asyncio.create_task(self._liveness_loop())]
        log.info("token router started", epoch=self.epoch)

    async def stop(self) -> None:
        for request in list(self.requests.values()):
            self._fail(request, ErrorCode.UNAVAILABLE, "router is shutting down")
        for worker in self.registry.workers.values():  # a worker draining alongside may go now
            self._send(worker, Drained())
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._socket.close(linger=500)
        if self._security is not None:
            self._security.stop()
        self._context.term()

    def serving(self) -> bool:
        return self.registry.paired()

    def drain(self, worker_id: str) -> bool:
        """Asks a worker to drain (it answers Draining); False if no such worker is registered."""
        worker = self.registry.workers.get(worker_id)
        if worker is None:
            return False
        self._send(worker, Drain())
        self._drop_unreachable()
        return True

    # ---- requests: called by the fronts ----

    async def submit(self, request: InflightRequest) -> None:
        """Places the request and starts its prefill; raises RequestError when it cannot."""
        await self.admission.admit(request)
        self._drop_unreachable()  # the PrefillTask's send may have found its worker gone

    def finish(self, request: InflightRequest) -> None:
        """The front is done with the request (ended, failed or cancelled): release what is left."""
        if self.requests.pop(request.request_id, None) is None:
            return
        early = not request.ended()
        if early:
            self._abort_on_workers(request)
            self._end(request)
        request.clock.fill(request.timings)
        log.info("request finished", request_id=request.request_id, label=request.label, aborted=early,
                 prefill=request.prefill.worker_id if request.prefill else None,
                 decode=request.decode.worker_id if request.decode else None,
                 prompt_tokens=len(request.job.prompt_token_ids),
                 total_s=round(time.perf_counter() - request.submitted_at, 6),
                 **{k: round(v, 6) for k, v in request.timings.as_dict().items()})
        self._drop_unreachable()

    # ---- a request's stages ----

    def _start_prefill(self, request: InflightRequest) -> None:
        self.requests[request.request_id] = request
        self._send_prefill_task(request)

    def _send_prefill_task(self, request: InflightRequest) -> None:
        request.enter(Stage.PREFILL, self.settings.prefill_timeout_s)
        job = request.job
        self._send(request.prefill, PrefillTask(request.request_id, job.prompt_token_ids, job.sampling, job.stop,
                                                time.time()))

    def _end(self, request: InflightRequest, event: object | None = None) -> None:
        """The request is over inside pdserve: its reservations go back at once, whether or not the
        front has taken its last events (a client that stops reading holds no KV room)."""
        request.stage = Stage.DONE
        for worker in (request.prefill, request.decode):
            Admission.release(worker, request)
        if event is not None:
            request.events.put_nowait(event)
        self.admission.admit_waiting()

    def _fail(self, request: InflightRequest, code: ErrorCode, message: str, failed: Worker | None = None) -> None:
        """Ends the request with that error, unless `failed` is the prefill it has not had its first
        token from yet: then it gets another prefill, once."""
        if request.ended():
            return
        self._abort_on_workers(request)
        before_first_token = request.stage == Stage.PREFILL and failed is request.prefill
        if before_first_token and code != ErrorCode.RESOURCE_EXHAUSTED and self._retry_prefill(request):
            log.warning("request moved to another prefill", request_id=request.request_id, reason=message,
                        prefill=request.prefill.worker_id)
            return
        self._end(request, ErrorEvent(code, message))

    def _retry_prefill(self, request: InflightRequest) -> bool:
        """Before its first token a request has lost nothing the client saw: it gets one more
        prefill, a new one, if one has room now."""
        if request.failed_on or not self.admission.replace_prefill(request):
            return False
        metrics.REQUEST_RETRIES.inc()
        self._send_prefill_task(request)
        return True

    def _abort_on_workers(self, request: InflightRequest) -> None:
        holder = request.holder()
        if holder is not None and self.registry.workers.get(holder.worker_id) is holder:
            self._send(holder, Abort(request.request_id))

    # ---- the socket ----

    def _send(self, worker: Worker, message: object) -> None:
        try:
            self._sender.send_multipart([worker.identity, wire.encode(message)], flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # EHOSTUNREACH: the connection is gone (ROUTER_MANDATORY)
            log.warning("worker unreachable", worker=worker.worker_id, kind=type(message).__name__, error=str(exc))
            self._unreachable.add(worker)

    def _reply(self, peer: Peer, message: object) -> None:
        """To a connection that is no registered worker; if it is gone, nothing is lost."""
        try:
            self._sender.send_multipart([peer.identity, wire.encode(message)], flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def _drop_unreachable(self) -> None:
        while self._unreachable:
            worker = self._unreachable.pop()
            if self.registry.workers.get(worker.worker_id) is worker:
                self._drop_worker(worker, f"worker {worker.worker_id} is unreachable")

    async def _receive_loop(self) -> None:
        while True:
            frames = await self._socket.recv_multipart(copy=False)
            if len(frames) != 2:
                log.warning("dropped frame with unexpected envelope", parts=len(frames))
                continue
            identity, payload = frames[0].bytes, frames[1].bytes
            try:
                message = wire.decode(payload)
            except wire.WireError as exc:
                log.warning("dropped malformed frame", error=str(exc), size=len(payload), peer=identity[:64])
                version = wire.claimed_protocol_version(payload)
                if version is not None and version != PROTOCOL_VERSION:
                    self._reply(Peer(identity, None, None), Refused(version_refusal(version)))
                continue
            user_id = self._user_id(frames[1])
            worker = self.registry.by_identity(identity)
            if worker is not None and worker.user_id != user_id:
                worker = None  # a connection that no longer speaks with the key it registered with
            self.dispatch(message, Peer(identity, user_id, worker))
            self._drop_unreachable()

    def _user_id(self, frame: zmq.Frame) -> str | None:
        """The CURVE key the frame came with (the ZAP User-Id); None on ipc://, which has no keys."""
        if self._security is None:
            return None
        return frame.get("User-Id")

    async def _liveness_loop(self) -> None:
        period = min(0.25, self.settings.heartbeat_timeout_s / 4)
        while True:
            await asyncio.sleep(period)
            timeout = self.settings.heartbeat_timeout_s
            for worker in self.registry.silent_since(timeout):
                self._drop_worker(worker, f"worker {worker.worker_id} missed heartbeats for {timeout} s")
            self._expire_stages(time.monotonic())
            self._drop_unreachable()

    def _expire_stages(self, now: float) -> None:
        for request in list(self.requests.values()):
            if not request.ended() and now > request.deadline:
                self._fail(request, ErrorCode.UNAVAILABLE, f"the request's {request.stage.value} stage timed out",
                           request.holder())
        for request_id, handoff in list(self.handoffs.items()):
            if now - handoff.since > self.settings.handoff_timeout_s:
                log.warning("handoff not pulled in time: releasing the prefill's pages", request_id=request_id)
                self._release_handoff(request_id)

    # ---- handlers: each takes the sending Peer and the message ----

    def _on_register(self, peer: Peer, message: Register) -> None:
        reason = self.registration.refusal(message, peer.user_id, self.registry)
        if reason:
            log.error("refused worker", worker=message.worker_id, role=message.role, reason=reason)
            self._reply(peer, Refused(reason))
            return
        worker, replaced = self.registry.register(peer.identity, peer.user_id, message)
        self._send(worker, Registered(self.epoch))  # before any task that the drops below may place on it
        if replaced is worker:
            return
        if peer.worker is not None and peer.worker is not replaced:  # this connection re-registers as another id
            self._drop_worker(peer.worker, f"worker {peer.worker.worker_id} registered again as {message.worker_id}")
        if replaced is not None:
            self._drop_worker(replaced, f"worker {replaced.worker_id} registered again", remove=False)
        metrics.watch_routed(worker)
        if worker.role == Role.PREFILL:
            for decode in self.registry.of_role(Role.DECODE):
                self._send(decode, PoolAvailable(worker.worker_id, message.pool_handles))
        else:
            for prefill in self.registry.of_role(Role.PREFILL):
                self._send(worker, PoolAvailable(prefill.worker_id, prefill.pool_handles))
        log.info("worker registered", worker=worker.worker_id, role=worker.role, pid=worker.pid,
                 incarnation=worker.incarnation, pages=worker.total_pages)
        self._on_workers_changed(self.serving())
        self.admission.admit_waiting()

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
        log.warning("pair avoided: the decode cannot pull from the prefill's pool", decode=decode.worker_id,
                    prefill=message.prefill_worker_id, reason=message.reason)
        decode.unreachable[message.prefill_worker_id] = message.reason
        self._on_workers_changed(self.serving())

    def _on_deregister(self, peer: Peer, message: Deregister) -> None:
        if peer.worker is not None and peer.worker.worker_id == message.worker_id:
            self._drop_worker(peer.worker, f"worker {message.worker_id} stopped")

    def _on_heartbeat(self, peer: Peer, message: Heartbeat) -> None:
        worker = peer.worker
        if worker is None or worker.worker_id != message.worker_id:
            self._reply(peer, Reregister())
            return
        if message.router_epoch != self.epoch:
            return  # sent before its Registered from this router arrived
        self.registry.heartbeat(worker, message)
        if message.stalled_s > self.settings.progress_timeout_s:
            self._drop_worker(worker, f"worker {worker.worker_id}'s main loop made no progress for "
                                      f"{message.stalled_s:.1f} s (router.progress_timeout_s)")
            return
        owed = {request_id for request_id, h in self.handoffs.items() if h.prefill_id == worker.worker_id}
        if worker.draining and not worker.reservations and not owed:
            self._send(worker, Drained())
        # A request the router just let go of may be listed once more, by a heartbeat sent before
        # the worker read the ReleaseKv or Abort: only one listed twice in a row is held astray.
        unknown = {r for r in message.holding if r not in worker.reservations and r not in owed}
        for request_id in unknown & worker.unknown_holding:
            log.warning("worker holds a request the router does not know: aborting it", worker=worker.worker_id,
                        request_id=request_id)
            self._send(worker, Abort(request_id))
        worker.unknown_holding = unknown

    def _on_kv_ready(self, peer: Peer, message: KvReady) -> None:
        prefill = peer.worker
        if prefill is None or prefill.role != Role.PREFILL or prefill.worker_id != message.prefill_worker_id:
            log.warning("dropped KvReady from a peer that is not that prefill", request_id=message.request_id)
            return
        request = self.requests.get(message.request_id)
        if request is None or request.stage != Stage.PREFILL or request.prefill is not prefill:
            self._send(prefill, ReleaseKv(message.request_id))  # the request ended meanwhile
            return
        prefill.pending_tokens.pop(request.request_id, None)
        timings = request.timings
        timings.prefill_queue_s, timings.prefill_compute_s = message.queued_s, message.compute_s
        timings.cached_prompt_tokens = message.cached_tokens
        timings.first_token_s = timings.tokenize_s + time.perf_counter() - request.submitted_at
        metrics.observe(metrics.REQUEST_QUEUE_TIME, timings.router_queue_s + message.queued_s)
        request.clock.kv_ready_at = message.ready_at
        if message.finish_reason is not None:
            self._send(prefill, ReleaseKv(request.request_id))
            self._end(request, TokenEvent(message.first_token_id, message.finish_reason))
            return
        request.events.put_nowait(TokenEvent(message.first_token_id, None))
        request.enter(Stage.DECODE, self.settings.handoff_timeout_s)
        self.handoffs[request.request_id] = Handoff(prefill.worker_id, request.decode.worker_id, time.monotonic())
        job = request.job
        self._send(request.decode, DecodeTask(request.request_id, prefill.worker_id, message.page_ids,
                                              message.num_tokens, message.first_token_id, job.sampling, job.stop))

    def _on_kv_pulled(self, peer: Peer, message: KvPulled) -> None:
        handoff = self.handoffs.get(message.request_id)
        if handoff is None or peer.worker is None or peer.worker.worker_id != handoff.decode_id:
            return  # already released, or not that handoff's decode speaking
        self._release_handoff(message.request_id)
        request = self.requests.get(message.request_id)
        if request is not None and request.decode is peer.worker:
            request.clock.pulled_at = message.pulled_at
            metrics.observe(metrics.KV_PULL, message.pull_s)
            if Admission.release(request.prefill, request):
                self.admission.admit_waiting()

    def _release_handoff(self, request_id: str) -> None:
        handoff = self.handoffs.pop(request_id, None)
        prefill = self.registry.workers.get(handoff.prefill_id) if handoff is not None else None
        if prefill is not None:
            self._send(prefill, ReleaseKv(request_id))

    def _on_token_batch(self, peer: Peer, message: TokenBatch) -> None:
        decode = peer.worker
        if decode is None or decode.role != Role.DECODE:
            return
        now = time.monotonic()
        for token in message.tokens:
            request = self.requests.get(token.request_id)
            if request is None or request.decode is not decode or request.stage != Stage.DECODE:
                if token.finish_reason is None:
                    self._send(decode, Abort(token.request_id))  # decoding what nobody waits for
                continue
            clock = request.clock
            if not clock.first_step_started_at:  # its first decode step
                clock.first_step_started_at, clock.first_step_received_at = message.step_started_at, time.time()
                metrics.observe(metrics.KV_HANDOFF, message.step_started_at - clock.kv_ready_at)
            event = TokenEvent(token.token_id, token.finish_reason)
            if token.finish_reason is not None:
                self._end(request, event)
            else:
                request.deadline = now + self.settings.decode_token_timeout_s
                request.events.put_nowait(event)

    def _on_failed(self, peer: Peer, message: Failed) -> None:
        sender = peer.worker
        if sender is None:
            return
        handoff = self.handoffs.get(message.request_id)
        if handoff is not None and handoff.decode_id == sender.worker_id:
            self._release_handoff(message.request_id)  # a decode that failed will never pull it
        request = self.requests.get(message.request_id)
        if request is not None and request.holder() is sender:
            self._fail(request, message.code, message.message, sender)

    def _drop_worker(self, worker: Worker, reason: str, remove: bool = True) -> None:
        log.warning("dropping worker", worker=worker.worker_id, reason=reason, requests=len(worker.reservations))
        if remove:
            self.registry.remove(worker)
        metrics.forget_pages(worker.worker_id, worker.role)  # a replacement registers its own right after
        for request_id in list(worker.reservations):
            request = self.requests.get(request_id)
            if request is not None:
                self._fail(request, ErrorCode.UNAVAILABLE, reason, worker)  # aborts it on its other worker
        worker.reservations.clear()
        for request_id, handoff in list(self.handoffs.items()):
            if handoff.decode_id == worker.worker_id:
                self._release_handoff(request_id)
            elif handoff.prefill_id == worker.worker_id:
                del self.handoffs[request_id]
        if worker.role == Role.PREFILL:
            for decode in self.registry.of_role(Role.DECODE):
                self._send(decode, PoolGone(worker.worker_id))
        self._on_workers_changed(self.serving())
        self.admission.admit_waiting()

