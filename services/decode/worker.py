"""The decode worker: pulls each request's KV from a prefill and decodes with continuous batching.

Lifecycle of a request here:
  DecodeTask arrives -> pages for prompt + max_tokens are allocated in the decode's own pool
  (they were reserved by the router before the prefill started, so they are free; a migrated
  request's prompt ends with the DecodeTask.generated tokens it already streamed, which count
  against max_tokens); for a model whose every layer has a sliding window, only the pages the
  window spans, reused as a ring over the positions (shared/kv/pages.py)
  -> the transfer of the prompt's pages from the prefill's pool starts (services/decode/kv_pull.py)
  -> a copy on the decode's own stream lets the request join the running batch at the next step
  boundary (on a GPU that step waits for the copy on the stream, not on the host); any other
  transfer keeps it aside until DONE, and one that fails frees its pages and sends Failed
  -> once the pages have landed, KvPulled is sent (the prefill may now free its pages), ahead of
  the step's tokens -> each step emits one token per running request (TokenBatch; for a request's
  first step, with how long its pages waited for it, dated on the device) -> it leaves
  the batch on EOS, max_tokens, the model's context, or an Abort from the router, and its pages
  are freed once no step in flight writes them.

A step is launched, then read back (services/decode/in_flight.py). With decode.overlap_steps the
next step is launched before the last one is read, its tokens taken from the last one's on the
device: a request about to end by length is left out of it; one that ends on EOS, or is aborted,
meanwhile runs in it for nothing, its token unread.
"""

from __future__ import annotations

import time
from collections import deque

import structlog

from services.decode.in_flight import LaunchedStep, TokenReadback
from services.decode.kv_pull import HandoffError
from services.decode.rank_engine import MAP_POOL, PULL, UNMAP_POOL, build_rank_engine, lead_step
from services.decode.step_inputs import DecodingRequest, StepInputBuilder
from shared.control import wire
from shared.control.dispatch import FatalError
from shared.control.messages import (
    Abort,
    DecodeTask,
    ErrorCode,
    Failed,
    Joined,
    KvPulled,
    PoolAvailable,
    PoolGone,
    PoolUnreachable,
    Role,
    TokenBatch,
    TokenOut,
)
from shared.control.router_link import WorkerLoad
from shared.kernels.device import date_moments, mark
from shared.kv.pages import PageAllocator, PoolExhausted, decode_pages_needed
from shared.kv.pool import token_bytes
from shared.kv.transfer import TransferState
from shared.model.loader import attention_span
from shared.model.sampling import sample_on_device
from shared.runtime import metrics
from shared.worker.gpu_telemetry import serve_worker_metrics
from shared.worker.loop import WorkerLoop
from shared.worker.main import WorkerProcess

log = structlog.get_logger()


IDLE_WAIT_S = 0.1  # an idle loop's longest wait for a message (it also pings the watchdog)


def receive_timeout_s(busy: bool, idle_for_s: float, idle_spin_s: float) -> float:
    """How long the loop may wait for messages: not at all while it has work, nor while it
    spins after its last work (decode.idle_spin_s)."""
    return 0.0 if busy or idle_for_s < idle_spin_s else IDLE_WAIT_S


class WeightsOwnerGone(FatalError):
    """Exits the decode (its supervisor restarts it once the prefill is back)."""


class DecodeWorker(WorkerLoop):
    role = Role.DECODE

    def __init__(self, worker: WorkerProcess):
        config, model = worker.config, worker.model
        self.model = model
        self.finish = worker.finish
        self.max_batch_size = config.decode.max_batch_size
        self.idle_spin_s = config.decode.idle_spin_s
        self.weights_from = config.decode.weights_from
        self.allocator = PageAllocator(config.kv.decode_pages)
        # Past a sliding window that every layer has, a request's pages are a ring (shared/kv/pages.py).
        self.window = attention_span(model.windows)
        self.engine = build_rank_engine(config, model, worker.ranks, self.allocator.free)
        self.pool, self.puller = self.engine.pool, self.engine.puller
        self.inputs = StepInputBuilder(self.max_batch_size, self.engine.max_pages, self.pool.layout.page_size,
                                       model.device)
        self.readback = TokenReadback(self.max_batch_size, model.device)
        overlap = config.decode.overlap_steps
        self.overlap = overlap == "on" or (overlap == "auto" and model.device.type == "cuda")
        self.in_flight: LaunchedStep | None = None  # with overlap, the step launched and not yet read back
        self.running: list[DecodingRequest] = []
        self.waiting: deque[DecodingRequest] = deque()  # pulled, waiting for a batch slot
        self.pulling: dict[str, DecodingRequest] = {}   # kept out of the batch until their transfer is DONE
        self.last_busy = float("-inf")
        stream = self.engine.stream
        super().__init__(worker, config.decode.worker_id, self.allocator.num_pages, self.pool.layout.page_size, [],
                         {DecodeTask: self._on_task, Abort: self._on_abort, PoolAvailable: self._on_pool_available,
                          PoolGone: self._on_pool_gone}, stream, self.max_batch_size, self.window)
        metrics.watch_pages(self.worker_id, Role.DECODE, self.allocator.num_pages, lambda: self.load().free_pages)
        metrics.report_kv_bytes_per_token(self.worker_id, Role.DECODE, token_bytes(self.pool.layout) * self.ranks.size)
        serve_worker_metrics(config.decode.metrics_address, config.model.device)
        log.info("decode worker ready", pool_pages=self.allocator.num_pages, max_batch=self.max_batch_size,
                 stream_priority=stream.priority if stream is not None else None, overlap_steps=self.overlap)

    # ---- the skeleton's hooks ----

    def load(self) -> WorkerLoad:
        held = [*self.running, *list(self.waiting), *list(self.pulling.values())]
        return WorkerLoad(self.allocator.num_free, len(self.running), len(held) - len(self.running),
                          [request.request_id for request in held])

    def receive_timeout_s(self) -> float:
        now = time.monotonic()
        busy = bool(self.running or self.puller.copying or self.in_flight)
        if busy:
            self.last_busy = now
        return receive_timeout_s(busy, now - self.last_busy, self.idle_spin_s)

    def step(self) -> None:
        self._acknowledge_pulls()
        while self.waiting and len(self.running) < self.max_batch_size:
            self.running.append(self.waiting.popleft())
        if not self.overlap:
            if self.running:
                self._read_back(self._launch(self.running, None))
            return
        previous = self.in_flight
        batch = [r for r in self.running if not (previous is not None
                                                 and self.finish.ends_by_length(r.num_generated, r.kv_len + 1, r.stop)
                                                 and previous.includes(r))]
        self.in_flight = self._launch(batch, previous) if batch else None
        if previous is not None:
            self._read_back(previous)

    def forget_all(self) -> None:
        self._acknowledge_pulls()  # copies in flight still land; the prefill's pages are its own concern
        self._drop_all()

    def fail_all(self, reason: str) -> None:
        for request in self._drop_all():
            self.link.send(Failed(request.request_id, ErrorCode.UNAVAILABLE, reason))

    def _drop_all(self) -> list[DecodingRequest]:
        """Every request held, out of the batch, its pages freed (once its unfinished transfer,
        ended now, has settled, and the step in flight has run)."""
        if self.in_flight is not None:  # its tokens go unread
            self.in_flight.read()
            for pages in self.in_flight.free_after:
                self.allocator.free(pages)
            self.in_flight = None
        for request in self.pulling.values():
            self.puller.drop(request.request_id, request.pages)
        for request in [*self.running, *self.waiting]:
            self.allocator.free(request.pages)
        dropped = [*self.running, *self.waiting, *self.pulling.values()]
        self.running, self.waiting, self.pulling = [], deque(), {}
        return dropped

    def close(self) -> None:
        self.puller.close()

    # ---- requests ----

    def _on_pool_available(self, message: PoolAvailable) -> None:
        self.ranks.lead(MAP_POOL, wire.encode(message))
        error = ""
        try:
            self.puller.map_pool(message.prefill_worker_id, message.pool_handles)
        except HandoffError as exc:
            error = str(exc)
        if not self.ranks.all_agree(not error):
            error = error or "another rank of this decode cannot open the pools that hold its KV heads"
            self._unmap(message.prefill_worker_id)
            log.error("cannot map prefill pool", prefill=message.prefill_worker_id, error=error)
            self.link.send(PoolUnreachable(message.prefill_worker_id, error))

    def _unmap(self, prefill_worker_id: str) -> None:
        self.ranks.lead(UNMAP_POOL, prefill_worker_id)
        self.puller.unmap_pool(prefill_worker_id)

    def _on_pool_gone(self, message: PoolGone) -> None:
        self._unmap(message.prefill_worker_id)
        if message.prefill_worker_id == self.weights_from:
            raise WeightsOwnerGone(f"prefill {self.weights_from}, whose weights this decode maps, is gone")

    def _on_task(self, task: DecodeTask) -> None:
        try:
            pages = self.allocator.allocate(decode_pages_needed(
                task.num_tokens, task.stop.max_tokens - task.generated, self.pool.layout.page_size, self.window))
        except PoolExhausted as exc:
            self.link.send(Failed(task.request_id, ErrorCode.RESOURCE_EXHAUSTED, f"decode KV pool: {exc}"))
            return
        self.ranks.lead(PULL, wire.encode(task), pages)
        transfer, error = None, ""
        try:
            transfer = self.puller.pull(task, pages)
        except HandoffError as exc:
            error = str(exc)
        if not self.ranks.all_agree(not error):
            if transfer is not None:
                self.puller.drop(task.request_id, pages)
            else:
                self.allocator.free(pages)
            error = error or "another rank of this decode could not pull its KV heads"
            self.link.send(Failed(task.request_id, ErrorCode.UNAVAILABLE, f"KV handoff failed: {error}"))
            return
        request = DecodingRequest(task.request_id, pages, task.num_tokens, task.first_token_id, task.generated + 1,
                                  task.sampling, task.stop, transfer)
        if transfer.stream_ordered or transfer.state is TransferState.DONE:
            self.waiting.append(request)
        else:
            self.pulling[task.request_id] = request

    def _acknowledge_pulls(self) -> None:
        """KvPulled for each transfer that has landed: only then may the prefill reuse its pages. A
        request kept aside for it may step now; one whose transfer failed is dropped."""
        for pulled in self.puller.landed():
            self.link.send(KvPulled(pulled.request_id, pulled.prefill_worker_id, pulled.pull_s))
            log.debug("KV pulled", request_id=pulled.request_id, prefill=pulled.prefill_worker_id,
                      pull_ms=round(pulled.pull_s * 1e3, 3))
            if pulled.request_id in self.pulling:
                self.waiting.append(self.pulling.pop(pulled.request_id))
        for failed in self.puller.failed():
            request = self.pulling.pop(failed.request_id, None)
            if request is not None:  # only a transfer the decode does not order on its stream fails
                self.puller.drop(request.request_id, request.pages)
                self.link.send(Failed(request.request_id, ErrorCode.UNAVAILABLE, f"KV transfer failed: {failed.error}"))

    def _on_abort(self, message: Abort) -> None:
        if message.request_id in self.pulling:
            self.puller.drop(message.request_id, self.pulling.pop(message.request_id).pages)
        for group in (self.running, self.waiting):
            for request in [r for r in group if r.request_id == message.request_id]:
                group.remove(request)
                self._leave(request)

    def _leave(self, request: DecodingRequest) -> None:
        """Out of the batch: its pages go back once no step in flight writes them."""
        request.finished = True
        if self.in_flight is not None and self.in_flight.includes(request):
            self.in_flight.free_after.append(request.pages)
        else:
            self.allocator.free(request.pages)

    # ---- steps ----

    def _launch(self, batch: list[DecodingRequest], previous: LaunchedStep | None) -> LaunchedStep:
        """One step of the batch, queued on the device with its sampling and its tokens' copy back;
        previous: the step before, not read back yet, whose tokens its requests feed in."""
        joining = [(r, r.handoff) for r in batch if r.handoff is not None]
        started = mark(self.model.device) if joining else None
        for request, _ in joining:
            request.handoff = None
        inputs = self.inputs.build(batch, previous.previous_tokens() if previous is not None else None)
        lead_step(self.ranks, inputs)
        logits = self.engine.step(inputs)
        tokens = sample_on_device(logits, [r.sampling for r in batch], [r.num_generated for r in batch])
        host_tokens, done = self.readback.start(tokens)
        for request in batch:
            request.kv_len += 1
            request.num_generated += 1
        return LaunchedStep(list(batch), [(r.num_generated, r.kv_len) for r in batch], tokens, host_tokens, done,
                            joining, started)

    def _read_back(self, step: LaunchedStep) -> None:
        """The step's tokens to the router (KvPulled first for the pages that landed before it), the
        requests they end out of the batch."""
        tokens = step.read()
        self._acknowledge_pulls()  # the step has run, and so have the copies before it
        joined = self._joined(step) if step.joining else []
        out = []
        for request, token, (generated, kv_len) in zip(step.requests, tokens, step.counts):
            if request.finished:  # it left while the step was in flight: its token is nobody's
                continue
            request.last_token = token
            reason = self.finish(token, generated, kv_len + 1, request.stop)
            out.append(TokenOut(request.request_id, token, reason))
            if reason is not None:
                self._leave(request)
        self.running = [r for r in self.running if not r.finished]
        for pages in step.free_after:
            self.allocator.free(pages)
        if out or joined:
            self.link.send(TokenBatch(out, time.perf_counter() - step.started.at if step.joining else 0.0, joined))

    def _joined(self, step: LaunchedStep) -> list[Joined]:
        """How long the pages of each request in its first step waited for the step: on a GPU the
        step's start is dated on the device, as the copies are, and from a copy of its own stream by
        the device's clock alone (it may have been launched before the copy ended, and it waited for
        the copy there). Called once the step and its copies have run."""
        date_moments([step.started], self.model.device, probe=step.done)
        return [Joined(request.request_id, handoff.landed.seconds_until(step.started))
                for request, handoff in step.joining if handoff.landed is not None and not request.finished]
