"""The token router: each request's journey over the worker socket, from admission to its last token.

    submit():   Admission places the request on a prefill and a decode  -> PrefillTask
    KvReady:    the first token goes to the front; DecodeTask to the decode (or, when the first
                token ended it, ReleaseKv to the prefill)
    KvPulled:   ReleaseKv to the prefill (only now may it free the prompt's pages)
    TokenBatch: tokens go to the front; the last one gives the decode's reservation back
    finish():   the front is done (the end, or client gone, stop string): Abort to a worker
                that still holds the request, ReleaseKv to a prefill whose KV was not pulled yet

Nothing is trusted blindly: each message about a request must come from the worker the router
gave it to. Who may join and when a worker is dropped is membership's job (membership.py); frames
in and out are the worker socket's (worker_socket.py). A worker that membership drops fails its
requests with UNAVAILABLE; so does a request that overstays any stage's timeout. Except that a
request whose prefill fails before its first token moves once to another prefill, and one whose
decode fails moves to another decode and goes on streaming (migration.py).

One request's trouble stays its own: an exception while handling one request (a message about it,
its timeout, its worker's loss, one token of a batch) fails that request alone with INTERNAL and
releases what it held, and the handler goes on with the others. The socket's and the timeouts'
loops outlive a failed iteration (shared/runtime/tasks.py, LoopGuard).
"""

from __future__ import annotations

import asyncio
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import structlog

from services.router.control.admission import Admission
from services.router.control.membership import Membership, Peer
from services.router.control.migration import Migration
from services.router.control.registration import RegistrationPolicy
from services.router.control.request import ErrorEvent, InflightRequest, Stage, TokenEvent, internal_error
from services.router.control.routing import RoutingPolicy
from services.router.control.worker_records import WorkerRecord, WorkerRegistry
from services.router.control.worker_socket import WorkerSocket
from shared.config.schema import Config
from shared.control import wire
from shared.control.dispatch import Dispatcher
from shared.control.messages import (
    Abort,
    DecodeTask,
    ErrorCode,
    Failed,
    KvPulled,
    KvReady,
    PrefillTask,
    ReleaseKv,
    Role,
    TokenBatch,
    TokenOut,
)
from shared.runtime import metrics
from shared.runtime.tasks import LoopGuard, OnFailure, spawn

log = structlog.get_logger()


@dataclass
class Handoff:
    """A prefill's KV that the decode has not pulled yet: ReleaseKv is owed to the prefill."""
    prefill_id: str
    decode_id: str
    since: float  # time.monotonic() of KvReady


class TokenRouter:
    def __init__(self, config: Config, checkpoint: tuple[str, str, str], on_workers_changed: Callable[[bool], None],
                 on_failure: OnFailure):
        """checkpoint: the (config, weights, tokenizer) hashes of the router's own copy of the model
        (shared/model/fingerprint.py); every worker's must equal them. on_failure: called when a
        background loop dies (shared/runtime/tasks.py), to stop the router."""
        self.config = config
        self.checkpoint = checkpoint
        self.settings = config.router
        self.registry = WorkerRegistry()
        self.admission = Admission(self.registry, RoutingPolicy(config.routing, config.kv.page_size), config.router,
                                   config.kv.page_size, self._start_prefill)
        self.requests: dict[str, InflightRequest] = {}  # by the router's own request ids
        self.migration = Migration(self.registry, self.admission, config.router)
        self.handoffs: dict[str, Handoff] = {}
        metrics.watch_load(lambda: len(self.requests), lambda: len(self.admission.waiting))
        self._on_workers_changed = on_workers_changed
        self._on_failure = on_failure
        self.socket = WorkerSocket(config.router)
        self.membership = Membership(self.registry, self.socket, config.router, self._on_worker_lost,
                                     self._workers_changed, self._awaiting_release)
        self._tasks: list[asyncio.Task] = []
        self.dispatch = Dispatcher({
            **self.membership.handlers, KvReady: self._on_kv_ready, KvPulled: self._on_kv_pulled,
            TokenBatch: self._on_token_batch, Failed: self._on_failed,
        })

    async def start(self) -> None:
        security = self.socket.bind()
        self.membership.registration = RegistrationPolicy(self.config.kv.page_size, self.checkpoint, security)
        self._tasks = [spawn(self.socket.receive_loop(self._on_message), "worker socket", self._on_failure),
                       spawn(self._timeouts_loop(), "timeouts", self._on_failure)]
        log.info("token router started", epoch=self.membership.epoch)

    async def stop(self) -> None:
        for request in list(self.requests.values()):
            self._fail(request, ErrorCode.UNAVAILABLE, "router is shutting down")
        self.membership.release_all()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self.socket.close()

    def serving(self) -> bool:
        return self.membership.serving()

    def drain(self, worker_id: str) -> bool:
        """Asks a worker to drain (it answers Draining); False if no such worker is registered."""
        return self.membership.drain(worker_id)

    # ---- requests: called by the fronts ----

    async def submit(self, request: InflightRequest) -> None:
        """Places the request and starts its prefill; raises RequestError when it cannot."""
        await self.admission.admit(request)
        self.membership.drop_unreachable()  # the PrefillTask's send may have found its worker gone

    def finish(self, request: InflightRequest) -> None:
        """The front is done with the request (ended, failed or cancelled): release what is left."""
        if self.requests.pop(request.request_id, None) is None:
            return
        early = not request.ended()
        if early:
            self._abort_on_workers(request)
            self._end(request)
        log.info("request finished", request_id=request.request_id, label=request.label, aborted=early,
                 prefill=request.prefill.worker_id if request.prefill else None,
                 decode=request.decode.worker_id if request.decode else None,
                 prompt_tokens=len(request.job.prompt_token_ids),
                 total_s=round(time.perf_counter() - request.submitted_at, 6),
                 **{k: round(v, 6) for k, v in request.timings.as_dict().items()})
        self.membership.drop_unreachable()

    # ---- a request's stages ----

    def _start_prefill(self, request: InflightRequest) -> None:
        """Sends the PrefillTask to request.prefill, then records the request; raises when the task
        cannot be sent (admission reserves for the request only once this has returned)."""
        request.enter(Stage.PREFILL, self.settings.prefill_timeout_s)
        job = request.job
        prompt = wire.pack_token_ids(request.prefix_token_ids())
        self.socket.send(request.prefill, PrefillTask(request.request_id, prompt, job.cache_salt, job.sampling, job.stop,
                                                      len(request.output_token_ids)))
        self.requests[request.request_id] = request

    def _end(self, request: InflightRequest, event: object | None = None) -> None:
        """The request is over inside pdserve: its reservations go back at once, whether or not the
        front has taken its last events (a client that stops reading holds no KV room). So do the
        prefill's pages of a handoff not pulled yet (a cancel mid-pull): a read still under way
        only fills pages that the decode, told Abort, frees once that read settles."""
        if request.stage == Stage.ADMITTING:  # a moved request, first in line
            self.admission.withdraw(request)
        request.stage = Stage.DONE
        for worker in (request.prefill, request.decode):
            Admission.release(worker, request)
        self._release_handoff(request.request_id)
        if event is not None:
            request.emit(event)
        self.admission.admit_waiting()

    def _fail(self, request: InflightRequest, code: ErrorCode, message: str,
              failed: WorkerRecord | None = None) -> None:
        """Ends the request with that error, unless `failed` is its decode and the error UNAVAILABLE:
        then it moves to another decode (migration.py); or `failed` is the prefill it has not had
        its next token from yet: then it gets another prefill, once."""
        if request.ended():
            return
        self._abort_on_workers(request)
        if failed is not None and failed is request.decode and code == ErrorCode.UNAVAILABLE:
            refusal = self._migrate(request, failed, message)
            if refusal is None:
                return
            message = f"{message}; not moved to another decode: {refusal}"
        before_first_token = request.stage == Stage.PREFILL and failed is request.prefill
        if before_first_token and code != ErrorCode.RESOURCE_EXHAUSTED and self._retry_prefill(request):
            log.warning("request moved to another prefill", request_id=request.request_id, reason=message,
                        prefill=request.prefill.worker_id)
            return
        self._end(request, ErrorEvent(code, message))

    def _retry_prefill(self, request: InflightRequest) -> bool:
        """Before its first token a request has lost nothing the client saw: it gets one more
        prefill, a new one, if one has room now."""
        if request.prefill_retried or not self.admission.replace_prefill(request):
            return False
        request.prefill_retried = True
        metrics.REQUEST_RETRIES.inc()
        return True

    @contextmanager
    def _alone(self, request: InflightRequest) -> Iterator[None]:
        """Around the handling of one request: what it raises fails that request alone (INTERNAL,
        its reservations released), and the caller goes on with the others."""
        try:
            yield
        except Exception as exc:
            error = internal_error(exc)
            if not request.ended():
                self._abort_on_workers(request)
                self._end(request, ErrorEvent(error.code, str(error)))

    def _migrate(self, request: InflightRequest, decode: WorkerRecord, reason: str) -> str | None:
        """Moves the request off its failed decode; returns why it cannot, or None once it moved."""
        refusal = self.migration.refusal(request, decode)
        if refusal is not None:
            return refusal
        self._release_handoff(request.request_id)  # ReleaseKv for the old id before a task under the new
        old_id = self.migration.move(request, decode)
        del self.requests[old_id]
        self.requests[request.request_id] = request
        log.warning("request moved to another decode", request_id=old_id, new_request_id=request.request_id,
                    label=request.label, reason=reason, decode=decode.worker_id, streamed=len(request.output_token_ids),
                    migrations=request.timings.migrations)
        return None

    def _abort_on_workers(self, request: InflightRequest) -> None:
        holder = request.holder()
        if holder is not None and self.registry.workers.get(holder.worker_id) is holder:
            self.socket.send(holder, Abort(request.request_id))

    # ---- what arrives, and what time ends ----

    def _on_message(self, message: object, identity: bytes, user_id: str | None) -> None:
        self.dispatch(message, self.membership.peer(identity, user_id))
        self.membership.drop_unreachable()

    async def _timeouts_loop(self) -> None:
        """What time alone ends: a silent worker, a stage past its deadline, a handoff never pulled.
        A wake-up later than the period is the event loop standing still (the process stopped or
        starved, a long callback): heartbeats waited unread meanwhile, so the delay is told to
        membership first, which does not count it as the workers' silence."""
        period = min(0.25, self.settings.heartbeat_timeout_s / 4)
        guard = LoopGuard("timeouts")
        woke = time.monotonic()
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            late_s, woke = now - woke - period, now
            with guard.iteration():
                self.membership.router_stalled(late_s)
                self.membership.drop_silent()
                self._expire_stages(time.monotonic())
                self.membership.drop_unreachable()

    def _expire_stages(self, now: float) -> None:
        for request in list(self.requests.values()):
            if not request.ended() and now > request.deadline:
                with self._alone(request):
                    self._fail(request, ErrorCode.UNAVAILABLE,
                               f"the request's {request.stage.value} stage timed out", request.holder())
        for request_id, handoff in list(self.handoffs.items()):
            if now - handoff.since > self.settings.handoff_timeout_s:
                log.warning("handoff not pulled in time: releasing the prefill's pages", request_id=request_id)
                self._release_handoff(request_id)

    # ---- membership's callbacks ----

    def _workers_changed(self, serving: bool) -> None:
        self._on_workers_changed(serving)
        self.admission.admit_waiting()

    def _awaiting_release(self, prefill_id: str) -> set[str]:
        return {request_id for request_id, h in self.handoffs.items() if h.prefill_id == prefill_id}

    def _on_worker_lost(self, worker: WorkerRecord, reason: str) -> None:
        for request_id in list(worker.reservations):
            request = self.requests.get(request_id)
            if request is not None:
                with self._alone(request):
                    self._fail(request, ErrorCode.UNAVAILABLE, reason, worker)  # aborts it on its other worker
        for request_id, handoff in list(self.handoffs.items()):
            if handoff.decode_id == worker.worker_id:
                self._release_handoff(request_id)
            elif handoff.prefill_id == worker.worker_id:
                del self.handoffs[request_id]

    # ---- handlers of the request's messages: each takes the sending Peer and the message ----

    def _on_kv_ready(self, peer: Peer, message: KvReady) -> None:
        prefill = peer.worker
        if prefill is None or prefill.role != Role.PREFILL or prefill.worker_id != message.prefill_worker_id:
            log.warning("dropped KvReady from a peer that is not that prefill", request_id=message.request_id)
            return
        request = self.requests.get(message.request_id)
        if request is None or request.stage != Stage.PREFILL or request.prefill is not prefill:
            self.socket.send(prefill, ReleaseKv(message.request_id))  # the request ended meanwhile
            return
        with self._alone(request):
            self._hand_over(request, prefill, message)

    def _hand_over(self, request: InflightRequest, prefill: WorkerRecord, message: KvReady) -> None:
        """The first token to the front, and the KV to the decode (or, when it ended there, back)."""
        prefill.pending_tokens.pop(request.request_id, None)
        generated = len(request.output_token_ids)  # before this token: non-zero once the request moved
        if not generated:
            self._first_token_timings(request, message)
        if message.finish_reason is not None:
            self.socket.send(prefill, ReleaseKv(request.request_id))
            self._end(request, TokenEvent(message.first_token_id, message.finish_reason))
            return
        request.emit(TokenEvent(message.first_token_id, None))
        request.enter(Stage.DECODE, self.settings.handoff_timeout_s)
        job = request.job
        self.socket.send(request.decode, DecodeTask(request.request_id, prefill.worker_id, message.page_ids,
                                                    message.num_tokens, message.first_token_id, job.sampling, job.stop,
                                                    generated))
        # Only a task that went out owes the prefill a ReleaseKv; pages of one that did not are
        # held by a request the router no longer knows, which the prefill's heartbeats get aborted.
        self.handoffs[request.request_id] = Handoff(prefill.worker_id, request.decode.worker_id, time.monotonic())

    @staticmethod
    def _first_token_timings(request: InflightRequest, message: KvReady) -> None:
        timings = request.timings
        timings.first_token(time.perf_counter() - request.submitted_at, message.compute_s)
        timings.cached_prompt_tokens = message.cached_tokens
        metrics.observe(metrics.REQUEST_QUEUE_TIME, timings.router_queue_s + timings.prefill_queue_s)

    def _on_kv_pulled(self, peer: Peer, message: KvPulled) -> None:
        handoff = self.handoffs.get(message.request_id)
        if handoff is None or peer.worker is None or peer.worker.worker_id != handoff.decode_id:
            return  # already released, or not that handoff's decode speaking
        self._release_handoff(message.request_id)
        request = self.requests.get(message.request_id)
        if request is not None and request.decode is peer.worker:
            metrics.observe(metrics.KV_PULL, message.pull_s)
            if Admission.release(request.prefill, request):
                self.admission.admit_waiting()

    def _release_handoff(self, request_id: str) -> None:
        handoff = self.handoffs.pop(request_id, None)
        prefill = self.registry.workers.get(handoff.prefill_id) if handoff is not None else None
        if prefill is not None:
            self.socket.send(prefill, ReleaseKv(request_id))

    def _on_token_batch(self, peer: Peer, message: TokenBatch) -> None:
        """Token by token: one whose handling raises fails its own request, never the batch."""
        decode = peer.worker
        if decode is None or decode.role != Role.DECODE:
            return
        joined = {j.request_id: j.queued_s for j in message.joined}  # requests in their first step
        for token in message.tokens:
            request = self.requests.get(token.request_id)
            if request is None or request.decode is not decode or request.stage != Stage.DECODE:
                if token.finish_reason is None:
                    self.socket.send(decode, Abort(token.request_id))  # decoding what nobody waits for
                continue
            with self._alone(request):
                self._on_token(request, token, joined.get(token.request_id), message.step_s)

    def _on_token(self, request: InflightRequest, token: TokenOut, queued_s: float | None, step_s: float) -> None:
        """queued_s: set in the request's first step on its decode, which dates the stages up to its
        second token (after a migration that token came from an earlier decode: nothing to date)."""
        if queued_s is not None and len(request.output_token_ids) == 1:
            self._second_token(request, queued_s, step_s)
        event = TokenEvent(token.token_id, token.finish_reason)
        if token.finish_reason is not None:
            self._end(request, event)
        else:
            request.deadline = time.monotonic() + self.settings.decode_token_timeout_s
            request.emit(event)

    @staticmethod
    def _second_token(request: InflightRequest, queued_s: float, step_s: float) -> None:
        timings = request.timings
        timings.second_token(time.perf_counter() - request.submitted_at, queued_s, step_s)
        metrics.observe(metrics.KV_HANDOFF, timings.kv_handoff_s + timings.decode_queue_s)

    def _on_failed(self, peer: Peer, message: Failed) -> None:
        sender = peer.worker
        if sender is None:
            return
        handoff = self.handoffs.get(message.request_id)
        if handoff is not None and handoff.decode_id == sender.worker_id:
            self._release_handoff(message.request_id)  # a decode that failed will never pull it
        request = self.requests.get(message.request_id)
        if request is not None and request.holder() is sender:
            with self._alone(request):
                self._fail(request, message.code, message.message, sender)
