"""The prefill worker: runs prompts into its exported KV pool and samples each first token.

Lifecycle of a request here:
  PrefillTask arrives -> waits in FIFO order until its pages fit in the pool
  -> the prompt's forward pass writes K/V into the pages -> the first token is sampled
  -> KvReady (page ids, first token) goes to the router -> the pages stay held until the
     router sends ReleaseKv (the decode has copied them) or Abort (the request is gone).
The pool is exported once at start (shared/kv_transfer); only page ids leave this process.
"""

from __future__ import annotations

import time
from collections import deque

import structlog

from shared import metrics, wire
from shared.device import worker_stream
from shared.kv_pool import PageAllocator, make_layout, pages_for
from shared.kv_transfer import export_pool
from shared.messages import Abort, ErrorCode, Failed, KvReady, PrefillTask, ReleaseKv, Role
from shared.model.weight_share import publish_weights, weights_file
from shared.router_link import WorkerLoad
from shared.sampling import sample
from shared.worker_loop import WorkerLoop
from shared.worker_main import Worker

log = structlog.get_logger()

IDLE_WAIT_S = 0.1  # an idle loop's longest wait for a message (it also pings the watchdog)


class PrefillWorker(WorkerLoop):
    role = Role.PREFILL

    def __init__(self, worker: Worker, colocated: bool = False):
        """colocated: a decode runs in this process on the same model (services/colocated), so no
        other process maps the weights, and the decode's metrics endpoint serves this process."""
        config, model = worker.config, worker.model
        self.model = model
        self.finish = worker.finish
        self.chunk_tokens = config.prefill.chunk_tokens
        layout = make_layout(model.num_layers, config.kv.prefill_pages, config.kv.page_size,
                             model.num_kv_heads, model.head_dim, model.embed.dtype)
        self.page_size = layout.page_size
        self.exported = export_pool(layout, config.prefill.worker_id, model.device)
        self.allocator = PageAllocator(layout.num_pages)
        self.waiting: deque[PrefillTask] = deque()
        self.held: dict[str, list[int]] = {}
        super().__init__(worker, config.prefill.worker_id, layout.num_pages, layout.page_size, self.exported.handle,
                         {PrefillTask: self._on_task, ReleaseKv: self._on_release, Abort: self._on_abort},
                         worker_stream(model.device, high_priority=False))
        self.weights_path = None
        if model.device.type == "cuda" and not colocated:  # a decode on this GPU may map them (decode.weights_from)
            self.weights_path = weights_file(config.router.runtime_dir, self.worker_id)
            publish_weights(model, self.weights_path)
        metrics.watch_pages(self.worker_id, Role.PREFILL, self.allocator.num_pages, lambda: self.load().free_pages)
        if not colocated:
            metrics.serve(config.prefill.metrics_address, metrics.WORKER, config.model.device)

    # ---- the skeleton's hooks ----

    def load(self) -> WorkerLoad:
        return WorkerLoad(self.allocator.num_free, len(self.held), len(self.waiting),
                          [*self.held, *(task.request_id for task in list(self.waiting))])

    def receive_timeout_s(self) -> float:
        return 0.0 if self._next_fits() else IDLE_WAIT_S

    def step(self) -> None:
        if self._next_fits():
            self._prefill(self.waiting.popleft())

    def forget_all(self) -> None:
        for pages in self.held.values():
            self.allocator.free(pages)
        self.held.clear()
        self.waiting.clear()

    def fail_all(self, reason: str) -> None:
        for task in self.waiting:
            self.link.send(Failed(task.request_id, ErrorCode.UNAVAILABLE, reason))
        self.waiting.clear()
        log.info("prefill pages still held at stop", held_pages=sum(map(len, self.held.values())))

    def close(self) -> None:
        self.exported.close()
        if self.weights_path is not None:
            self.weights_path.unlink(missing_ok=True)

    # ---- requests ----

    def _next_fits(self) -> bool:
        return bool(self.waiting) and pages_for(len(self.waiting[0].prompt_token_ids),
                                                self.page_size) <= self.allocator.num_free

    def _on_task(self, task: PrefillTask) -> None:
        needed = pages_for(len(task.prompt_token_ids), self.page_size)
        if not task.prompt_token_ids or needed > self.allocator.num_pages:
            self.link.send(Failed(task.request_id, ErrorCode.RESOURCE_EXHAUSTED,
                                  f"prompt needs {needed} KV pages; the prefill pool has {self.allocator.num_pages}"))
            return
        self.waiting.append(task)

    def _on_release(self, message: ReleaseKv) -> None:
        pages = self.held.pop(message.request_id, None)
        if pages is not None:
            self.allocator.free(pages)

    def _on_abort(self, message: Abort) -> None:
        self._on_release(ReleaseKv(message.request_id))
        self.waiting = deque(task for task in self.waiting if task.request_id != message.request_id)

    def _prefill(self, task: PrefillTask) -> None:
        queued_s = max(0.0, time.time() - task.sent_at)  # includes waiting in the socket behind earlier prompts
        started = time.perf_counter()
        prompt = task.prompt_token_ids
        pages = self.allocator.allocate(pages_for(len(prompt), self.page_size))
        try:
            logits = self.model.prefill(prompt, self.exported.pool, pages, self.chunk_tokens, self.link.made_progress)
            token = sample(logits[None], [task.sampling], [0])[0]  # syncs: the pages are written
        except Exception as exc:
            self.allocator.free(pages)
            log.exception("prefill failed", request_id=task.request_id)
            self.link.send(Failed(task.request_id, ErrorCode.INTERNAL, f"prefill failed: {exc}"))
            return
        self.held[task.request_id] = pages
        finish_reason = self.finish(token, 1, len(prompt) + 1, task.stop)
        compute_s = time.perf_counter() - started
        self.link.send(KvReady(task.request_id, self.worker_id, wire.pack_page_ids(pages), len(prompt), token,
                               finish_reason, queued_s, compute_s, time.time(), 0))
        log.debug("prefilled", request_id=task.request_id, prompt_tokens=len(prompt), compute_ms=compute_s * 1e3)
