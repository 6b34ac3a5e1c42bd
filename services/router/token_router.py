"""The token router: one ZeroMQ ROUTER socket to every worker, request placement and routing.

A request's journey through the router (InflightRequest.stage):
  ADMITTING  submit() waits, FIFO, until one prefill and one decode have room; it reserves the
             prompt's pages on the prefill and prompt + max_tokens pages on the decode, so a
             finished prefill never waits for decode room; then sends PrefillTask.
  PREFILL    KvReady: the first token goes to the caller; DecodeTask goes to the decode (or the
             request is already done and the prefill is told ReleaseKv).
  DECODE     KvPulled: ReleaseKv to the prefill. TokenBatch entries go to the caller.
  DONE       the workers ended it (EOS, length), or finish() ended it early (client gone, stop
             string, error) and sent Abort to the worker that still holds it.
Every prefill KV that has not been released is tracked in `handoffs` until ReleaseKv is sent,
even after its request is gone, so no prefill page outlives its purpose. A worker silent past
the heartbeat timeout is dropped and its requests fail with UNAVAILABLE.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable

import structlog
import zmq
import zmq.asyncio

from services.router.validation import Job
from services.router.workers import Worker, WorkerRegistry
from shared import metrics, wire
from shared.config import Config
from shared.kv_pool import decode_pages_needed, pages_for
from shared.messages import (Abort, DecodeTask, Deregister, ErrorCode, Failed, FinishReason, Heartbeat, KvPulled,
                             KvReady, PoolAvailable, PoolGone, PrefillTask, Register, Registered, ReleaseKv,
                             Reregister, Role, TokenBatch)
from shared.zmq_security import secure_server

log = structlog.get_logger()


class RequestError(Exception):
    def __init__(self, code: ErrorCode, message: str):
        super().__init__(message)
        self.code = code


class Stage(Enum):
    ADMITTING = "admitting"
    PREFILL = "prefill"
    DECODE = "decode"
    DONE = "done"


@dataclass(frozen=True)
class TokenEvent:
    token_id: int
    finish_reason: FinishReason | None


@dataclass(frozen=True)
class ErrorEvent:
    code: ErrorCode
    message: str


@dataclass(eq=False)
class InflightRequest:
    request_id: str
    job: Job
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    stage: Stage = Stage.ADMITTING
    prefill: Worker | None = None
    decode: Worker | None = None
    prefill_pages: int = 0
    decode_pages: int = 0
    # Seconds per stage, for the summary line and the benchmarks' TTFT breakdown.
    timings: dict[str, float] = field(default_factory=dict)
    submitted_at: float = field(default_factory=time.perf_counter)
    # Wall clocks (time.time) of the handoff, stamped by the processes where each happened.
    kv_ready_at: float = 0.0            # the prefill's KV complete
    pulled_at: float = 0.0              # the pages in the decode's pool
    first_step_started_at: float = 0.0  # the decode's first step for this request began
    first_step_received_at: float = 0.0  # that step's tokens reached the router

    def stage_timings(self) -> dict[str, float]:
        """The StageTimings of the API (proto/pdserve/v1/generation.proto), in seconds."""
        t = self.timings
        stages = {"tokenize_s": t.get("tokenize_s", 0.0), "router_queue_s": t.get("admission_s", 0.0),
                  "prefill_queue_s": t.get("prefill_queue_s", 0.0),
                  "prefill_compute_s": t.get("prefill_compute_s", 0.0),
                  "first_token_s": t.get("tokenize_s", 0.0) + t.get("ttft_s", 0.0)}
        if self.pulled_at and self.first_step_started_at:
            stages.update(kv_handoff_s=self.pulled_at - self.kv_ready_at,
                          decode_queue_s=self.first_step_started_at - self.pulled_at,
                          first_decode_step_s=self.first_step_received_at - self.first_step_started_at)
        return stages


class TokenRouter:
    def __init__(self, config: Config, on_workers_changed: Callable[[bool], None]):
        self.config = config
        self.page_size = config.kv.page_size
        self.registry = WorkerRegistry()
        self.requests: dict[str, InflightRequest] = {}
        self.handoffs: dict[str, tuple[str, str]] = {}  # request id -> (prefill id, decode id)
        self.admission: deque[tuple[InflightRequest, asyncio.Future]] = deque()
        metrics.watch_load(lambda: len(self.requests), lambda: len(self.admission))
        self.started_at = time.time()
        self._on_workers_changed = on_workers_changed
        self._context = zmq.asyncio.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted worker takes over its id
        self._socket.setsockopt(zmq.MAXMSGSIZE, wire.MAX_FRAME_BYTES)
        self._authenticator = None  # CURVE's ZAP handler, on tcp:// only
        self._tasks: list[asyncio.Task] = []
        self.handlers = {
            Register: self._on_register, Heartbeat: self._on_heartbeat, KvReady: self._on_kv_ready,
            KvPulled: self._on_kv_pulled, TokenBatch: self._on_token_batch, Failed: self._on_failed,
            Deregister: self._on_deregister,
        }

    async def start(self) -> None:
        self._authenticator = secure_server(self._socket, self.config.router)
        self._socket.bind(self.config.router.zmq_endpoint())
        self._tasks = [asyncio.create_task(self._receive_loop()), asyncio.create_task(self._liveness_loop())]

    async def stop(self) -> None:
        for request in list(self.requests.values()):
            self._fail(request, ErrorCode.UNAVAILABLE, "router is shutting down")
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._socket.close(linger=500)
        if self._authenticator is not None:
            self._authenticator.stop()
        self._context.term()

    def serving(self) -> bool:
        return bool(self.registry.of_role(Role.PREFILL)) and bool(self.registry.of_role(Role.DECODE))

    # ---- requests: called by the gRPC servicer ----

    async def submit(self, request: InflightRequest) -> None:
        """Places the request on a prefill and a decode, waiting in FIFO order for room."""
        job = request.job
        request.prefill_pages = pages_for(len(job.prompt_token_ids), self.page_size)
        request.decode_pages = decode_pages_needed(len(job.prompt_token_ids), job.stop.max_tokens, self.page_size)
        if not self.serving():
            raise RequestError(ErrorCode.UNAVAILABLE, "no prefill and decode workers are registered yet")
        for role, pages in ((Role.PREFILL, request.prefill_pages), (Role.DECODE, request.decode_pages)):
            if pages > self.registry.largest_pool(role):
                raise RequestError(ErrorCode.RESOURCE_EXHAUSTED, f"request needs {pages} KV pages, more than any "
                                   f"{role} pool holds ({self.registry.largest_pool(role)})")
        if not self.admission and self._place(request):
            return
        if len(self.admission) >= self.config.router.max_waiting_requests:
            raise RequestError(ErrorCode.RESOURCE_EXHAUSTED,
                               f"{len(self.admission)} requests already wait for KV room; try again later")
        admitted = asyncio.get_running_loop().create_future()
        entry = (request, admitted)
        self.admission.append(entry)
        try:
            await asyncio.wait_for(admitted, self.config.router.admission_timeout_s)
        except TimeoutError:
            raise RequestError(ErrorCode.RESOURCE_EXHAUSTED, "no KV room became free within "
                               f"{self.config.router.admission_timeout_s} s") from None
        finally:
            if entry in self.admission:
                self.admission.remove(entry)

    def finish(self, request: InflightRequest) -> None:
        """The caller is done with the request (ended, failed or cancelled): release everything."""
        if self.requests.pop(request.request_id, None) is None:
            return
        if request.stage == Stage.PREFILL and request.prefill is not None:
            self._send(request.prefill, Abort(request.request_id))
        elif request.stage == Stage.DECODE and request.decode is not None:
            self._send(request.decode, Abort(request.request_id))
        for worker, pages in ((request.prefill, request.prefill_pages), (request.decode, request.decode_pages)):
            if worker is not None:
                worker.reserved_pages -= pages
                worker.requests.discard(request.request_id)
        request.prefill_pages = request.decode_pages = 0
        early = request.stage != Stage.DONE
        request.stage = Stage.DONE
        request.timings["total_s"] = time.perf_counter() - request.submitted_at
        log.info("request finished", request_id=request.request_id, aborted=early,
                 prompt_tokens=len(request.job.prompt_token_ids),
                 **{k: round(v, 6) for k, v in request.timings.items()})
        self._admit_waiting()

    # ---- placement ----

    def _place(self, request: InflightRequest) -> bool:
        prefill = self.registry.pick(Role.PREFILL, request.prefill_pages)
        decode = self.registry.pick(Role.DECODE, request.decode_pages)
        if prefill is None or decode is None:
            return False
        request.prefill, request.decode = prefill, decode
        prefill.reserved_pages += request.prefill_pages
        decode.reserved_pages += request.decode_pages
        prefill.requests.add(request.request_id)
        decode.requests.add(request.request_id)
        request.stage = Stage.PREFILL
        request.timings["admission_s"] = time.perf_counter() - request.submitted_at
        self.requests[request.request_id] = request
        job = request.job
        self._send(prefill, PrefillTask(request.request_id, job.prompt_token_ids, job.sampling, job.stop, time.time()))
        return True

    def _admit_waiting(self) -> None:
        while self.admission:
            request, admitted = self.admission[0]
            if admitted.done():
                self.admission.popleft()
            elif self._place(request):
                self.admission.popleft()
                admitted.set_result(None)
            else:
                return

    # ---- the socket ----

    def _send(self, worker: Worker, message: object) -> None:
        self._socket.send_multipart([worker.identity, wire.encode(message)])

    async def _receive_loop(self) -> None:
        while True:
            frames = await self._socket.recv_multipart()
            if len(frames) != 2:
                log.warning("dropped frame with unexpected envelope", parts=len(frames))
                continue
            identity, payload = frames
            try:
                message = wire.decode(payload)
            except wire.WireError as exc:
                log.warning("dropped malformed frame", error=str(exc), size=len(payload), peer=identity[:64])
                continue
            handler = self.handlers.get(type(message))
            if handler is None:
                log.warning("dropped unexpected message", kind=type(message).__name__, peer=identity[:64])
                continue
            try:
                handler(identity, message)
            except Exception:
                log.exception("handler failed", kind=type(message).__name__)

    async def _liveness_loop(self) -> None:
        timeout = self.config.router.heartbeat_timeout_s
        while True:
            await asyncio.sleep(timeout / 4)
            for worker in self.registry.silent_since(timeout):
                self._drop_worker(worker, f"worker {worker.worker_id} missed heartbeats for {timeout} s")

    # ---- handlers ----

    def _known(self, identity: bytes, worker_id: str) -> Worker | None:
        worker = self.registry.workers.get(worker_id)
        return worker if worker is not None and worker.identity == identity else None

    def _on_register(self, identity: bytes, message: Register) -> None:
        if message.page_size != self.page_size:
            log.error("refused worker with another page size", worker=message.worker_id, page_size=message.page_size)
            return
        if (message.role == Role.PREFILL) != (message.pool is not None):
            log.error("refused registration: only a prefill exports a pool", worker=message.worker_id)
            return
        worker, replaced = self.registry.register(identity, message)
        if replaced is not None:
            self._drop_worker(replaced, f"worker {replaced.worker_id} restarted", remove=False)
        metrics.watch_pages(worker.worker_id, worker.role, worker.total_pages, lambda: worker.free_pages,
                            lambda: worker.reserved_pages)
        self._send(worker, Registered(self.started_at))
        if worker.role == Role.PREFILL:
            for decode in self.registry.of_role(Role.DECODE):
                self._send(decode, PoolAvailable(worker.worker_id, message.pool))
        else:
            for prefill in self.registry.of_role(Role.PREFILL):
                self._send(worker, PoolAvailable(prefill.worker_id, prefill.pool))
        log.info("worker registered", worker=worker.worker_id, role=worker.role, pid=worker.pid,
                 pages=worker.total_pages)
        self._on_workers_changed(self.serving())
        self._admit_waiting()

    def _on_deregister(self, identity: bytes, message: Deregister) -> None:
        worker = self._known(identity, message.worker_id)
        if worker is not None:
            self._drop_worker(worker, f"worker {worker.worker_id} stopped")

    def _on_heartbeat(self, identity: bytes, message: Heartbeat) -> None:
        if self._known(identity, message.worker_id) is None:
            self._socket.send_multipart([identity, wire.encode(Reregister())])
            return
        self.registry.heartbeat(message)

    def _on_kv_ready(self, identity: bytes, message: KvReady) -> None:
        request = self.requests.get(message.request_id)
        prefill = self._known(identity, message.prefill_worker_id)
        if request is None or request.stage != Stage.PREFILL or prefill is not request.prefill:
            if prefill is not None:  # the request ended meanwhile: its KV is no longer wanted
                self._send(prefill, ReleaseKv(message.request_id))
            return
        request.timings.update(prefill_queue_s=message.queued_s, prefill_compute_s=message.compute_s,
                               ttft_s=time.perf_counter() - request.submitted_at)
        metrics.observe(metrics.REQUEST_QUEUE_TIME, request.timings.get("admission_s", 0.0) + message.queued_s)
        request.kv_ready_at = message.ready_at
        request.events.put_nowait(TokenEvent(message.first_token_id, message.finish_reason))
        if message.finish_reason is not None:
            request.stage = Stage.DONE
            self._send(prefill, ReleaseKv(request.request_id))
            return
        request.stage = Stage.DECODE
        self.handoffs[request.request_id] = (prefill.worker_id, request.decode.worker_id)
        job = request.job
        self._send(request.decode, DecodeTask(request.request_id, prefill.worker_id, message.page_ids,
                                              message.num_tokens, message.first_token_id, job.sampling, job.stop))

    def _on_kv_pulled(self, identity: bytes, message: KvPulled) -> None:
        self._release_handoff(message.request_id)
        request = self.requests.get(message.request_id)
        if request is not None and request.prefill is not None:
            request.timings["kv_pull_s"] = message.pull_s
            request.pulled_at = message.pulled_at
            metrics.observe(metrics.KV_PULL, message.pull_s)
            request.prefill.reserved_pages -= request.prefill_pages
            request.prefill.requests.discard(request.request_id)
            request.prefill_pages = 0
            self._admit_waiting()

    def _release_handoff(self, request_id: str) -> None:
        entry = self.handoffs.pop(request_id, None)
        if entry is not None and entry[0] in self.registry.workers:
            self._send(self.registry.workers[entry[0]], ReleaseKv(request_id))

    def _on_token_batch(self, identity: bytes, message: TokenBatch) -> None:
        for token in message.tokens:
            request = self.requests.get(token.request_id)
            if request is None or request.stage != Stage.DECODE:
                continue
            if not request.first_step_started_at:  # its first decode step
                request.first_step_started_at, request.first_step_received_at = message.step_started_at, time.time()
                request.timings["handoff_s"] = message.step_started_at - request.kv_ready_at
                metrics.observe(metrics.KV_HANDOFF, request.timings["handoff_s"])
            if token.finish_reason is not None:
                request.stage = Stage.DONE
            request.events.put_nowait(TokenEvent(token.token_id, token.finish_reason))

    def _on_failed(self, identity: bytes, message: Failed) -> None:
        self._release_handoff(message.request_id)  # a decode that failed will never pull it
        request = self.requests.get(message.request_id)
        if request is not None and request.stage != Stage.DONE:
            self._fail(request, message.code, message.message)

    def _fail(self, request: InflightRequest, code: ErrorCode, message: str) -> None:
        request.events.put_nowait(ErrorEvent(code, message))

    def _drop_worker(self, worker: Worker, reason: str, remove: bool = True) -> None:
        log.warning("dropping worker", worker=worker.worker_id, reason=reason, requests=len(worker.requests))
        if remove:
            self.registry.remove(worker.worker_id)
        metrics.forget_pages(worker.worker_id, worker.role)  # a replacement registers its own right after
        for request_id in list(worker.requests):
            request = self.requests.get(request_id)
            if request is not None:
                self._fail(request, ErrorCode.UNAVAILABLE, reason)
        worker.requests.clear()
        for request_id, (prefill_id, decode_id) in list(self.handoffs.items()):
            if worker.worker_id == decode_id:
                self._release_handoff(request_id)
            elif worker.worker_id == prefill_id:
                del self.handoffs[request_id]
        if worker.role == Role.PREFILL:
            for decode in self.registry.of_role(Role.DECODE):
                self._send(decode, PoolGone(worker.worker_id))
        self._on_workers_changed(self.serving())
