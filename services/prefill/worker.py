"""The prefill worker: runs prompts into its exported KV pool and samples each first token.

Lifecycle of a request here:
  PrefillTask arrives -> waits in FIFO order until its pages fit in the pool
  -> it holds the cached pages of its longest cached prefix and gets fresh pages for the rest
     (services/prefill/prefix_cache.py) -> the forward pass computes the rest into the fresh
     pages -> the first token is sampled -> the prompt's full pages join the cache
     Between two chunks of the forward pass the messages that arrived are handled, so an Abort,
     a router that forgot us, or a stop signal ends a long prompt at its next chunk, not minutes
     later (PromptAbandoned)
  -> KvReady (every page id of the prompt, cached ones too; the first token; the cached tokens)
     goes to the router -> the pages stay held until the router sends ReleaseKv (the decode has
     copied them) or Abort (the request is gone); then cached pages stay in the cache, the others
     are freed.
The pool is exported once at start (shared/kv/transfer), by the kinds kv.transfer calls for;
only page ids leave this process (a decode on another host reads the pages itself, by NIXL). The
cache's changes go to the router in batches (services/prefill/cache_events.py). With
prefill.prefix_cache off, no key is computed, so nothing is cached and every prompt runs whole.
"""

from __future__ import annotations

import array
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

import structlog
import torch

from services.prefill.cache_events import CacheEvents
from services.prefill.prefix_cache import Lease, PrefixCache
from services.prefill.rank_pools import export_rank_pool
from services.prefill.warmup import warmup_prompts
from shared.config.schema import Config
from shared.control import wire
from shared.control.dispatch import FatalError
from shared.control.messages import Abort, ErrorCode, Failed, KvLayout, KvReady, PrefillTask, ReleaseKv, Role
from shared.control.router_link import WorkerLoad
from shared.kernels.device import on_stream, worker_stream
from shared.kv.page_keys import PageKeys
from shared.kv.pages import pages_for
from shared.kv.pool import token_bytes
from shared.model.llama import PagedLlama
from shared.model.sampling import sample
from shared.model.weight_share import publish_weights, weights_file
from shared.runtime import metrics
from shared.worker.gpu_telemetry import serve_worker_metrics
from shared.worker.loop import WorkerLoop
from shared.worker.main import WorkerProcess

log = structlog.get_logger()

IDLE_WAIT_S = 0.1  # an idle loop's longest wait for a message (it also pings the watchdog)


PREFILL = "prefill"  # rank 0's command to its followers: [prompt, pages, start]


class PromptAbandoned(Exception):
    """The prompt being computed is no longer wanted; its pages are freed at once."""


def prefill_layout(config: Config, model: PagedLlama) -> KvLayout:
    """This rank's pool: its own KV heads (the model's shard), the same pages on every rank."""
    return model.kv_layout(config.kv.prefill_pages, config.kv.page_size, config.kv.dtype)


@dataclass(frozen=True)
class Queued:
    task: PrefillTask
    prompt: array.array  # the task's token ids, unpacked once
    keys: PageKeys | list[str]  # the prompt's page keys, each hashed when first read; none with the prefix cache off


class PrefillWorker(WorkerLoop):
    role = Role.PREFILL

    def __init__(self, worker: WorkerProcess, colocated: bool = False):
        """colocated: a decode runs in this process on the same model (services/colocated), so no
        other process maps the weights, and the decode's metrics endpoint serves this process."""
        config, model = worker.config, worker.model
        self.model = model
        self.finish = worker.finish
        self.chunk_tokens = config.prefill.chunk_tokens
        self.ranks = worker.ranks
        layout = prefill_layout(config, model)
        self.page_size = layout.page_size
        self.exported, handles = export_rank_pool(config, model, self.ranks, layout, colocated)
        self.cache = PrefixCache(layout.num_pages, layout.page_size)
        self.use_cache = config.prefill.prefix_cache
        self.waiting: deque[Queued] = deque()
        self.held: dict[str, Lease] = {}
        self.running: str | None = None  # the request whose prompt is being computed
        self.abandoned = ""  # why the running prompt is no longer wanted
        super().__init__(worker, config.prefill.worker_id, layout.num_pages, layout.page_size, handles,
                         {PrefillTask: self._on_task, ReleaseKv: self._on_release, Abort: self._on_abort},
                         worker_stream(model.device, high_priority=False))
        self.events = CacheEvents(self.worker_id, self.cache, self.link) if self.use_cache else None
        if model.device.type == "cuda":
            self._compile_prefill_kernels()
        self.weights_path = None
        # A decode on this GPU may map them (decode.weights_from); one rank's shard is no model to map.
        if model.device.type == "cuda" and not colocated and self.ranks.size == 1:
            self.weights_path = weights_file(config.router.runtime_dir, self.worker_id)
            publish_weights(model, self.weights_path)
        metrics.watch_pages(self.worker_id, Role.PREFILL, self.cache.num_pages, lambda: self.load().free_pages)
        metrics.report_kv_bytes_per_token(self.worker_id, Role.PREFILL, token_bytes(layout) * self.ranks.size)
        if self.use_cache:
            metrics.watch_prefix_cache(lambda: self.cache.num_cached)
        if not colocated:
            serve_worker_metrics(config.prefill.metrics_address, config.model.device)

    def _compile_prefill_kernels(self) -> None:
        """Runs services/prefill/warmup.py's prompts before registering, so that no request pays for
        compiling a kernel, which would silence the heartbeat thread."""
        with on_stream(self.stream):
            for warmup in warmup_prompts(self.model, self.page_size, self.cache.num_pages, self.chunk_tokens,
                                         self.use_cache):
                self._run_prompt(warmup.prompt, warmup.pages, warmup.start, lambda: None)
        torch.cuda.synchronize(self.model.device)

    def _run_prompt(self, prompt: Sequence[int], pages: list[int], start: int, between_chunks) -> torch.Tensor:
        """The prompt's forward pass on every rank (services/prefill/follower.py runs the others'),
        between_chunks deciding for all of them whether it goes on; the last position's logits."""
        if self.ranks.size > 1:  # the followers' copy of the prompt: one rank packs nothing
            self.ranks.lead(PREFILL, wire.pack_token_ids(prompt), pages, start)

        def after_chunk() -> None:
            try:
                between_chunks()
            except PromptAbandoned:
                self.ranks.decide(False)
                raise
            self.ranks.decide(True)

        return self.model.prefill(prompt, self.exported.pool, pages, self.chunk_tokens, after_chunk, start)

    # ---- the skeleton's hooks ----

    def load(self) -> WorkerLoad:
        # Cached pages no request holds count as free: an allocation evicts them when it needs room,
        # so the router's reservations (each request's prompt pages) stay within what we report.
        return WorkerLoad(self.cache.num_available, len(self.held), len(self.waiting),
                          [*self.held, *(queued.task.request_id for queued in list(self.waiting))])

    def receive_timeout_s(self) -> float:
        if self._next_fits():
            return 0.0
        return min(IDLE_WAIT_S, self.events.due_in_s()) if self.events else IDLE_WAIT_S

    def step(self) -> None:
        if self._next_fits():
            self._prefill(self.waiting.popleft())
        if self.events:
            self.events.flush()
        for request_id in self.exported.read_notices():  # a NIXL read's notification; ReleaseKv frees the pages
            log.debug("KV read by a decode", request_id=request_id)

    def forget_all(self) -> None:
        """The cache itself stays: its pages hold what their keys say whoever routes to us; the
        router that registers us next hears every key again (cleared=True)."""
        for lease in self.held.values():
            self.cache.release(lease)
        self.held.clear()
        self.waiting.clear()
        if self.running is not None:
            self.abandoned = "the router forgot it"
        if self.events:
            self.events.resync()

    def fail_all(self, reason: str) -> None:
        for queued in self.waiting:
            self.link.send(Failed(queued.task.request_id, ErrorCode.UNAVAILABLE, reason))
        self.waiting.clear()
        log.info("prefill pages still held at stop", held_pages=sum(len(lease.pages) for lease in self.held.values()))

    def close(self) -> None:
        self.exported.close()
        if self.weights_path is not None:
            self.weights_path.unlink(missing_ok=True)

    # ---- requests ----

    def _next_fits(self) -> bool:
        if not self.waiting:
            return False
        head = self.waiting[0]
        return self.cache.fits(head.keys, len(head.prompt))

    def _between_chunks(self) -> None:
        """The liveness of a long prompt (receiving is the loop coming round) and its cancellation.
        A task arriving meanwhile only queues; a ReleaseKv frees another request's pages."""
        self.link.dispatch(self.dispatch, 0.0)
        if self.stop.now.is_set():
            self.abandoned = "the worker is stopping now"
        if self.abandoned:
            raise PromptAbandoned(self.abandoned)

    def _on_task(self, task: PrefillTask) -> None:
        prompt = wire.unpack_token_ids(task.prompt_token_ids)
        needed = pages_for(len(prompt), self.page_size)
        if not prompt or needed > self.cache.num_pages:
            self.link.send(Failed(task.request_id, ErrorCode.RESOURCE_EXHAUSTED,
                                  f"prompt needs {needed} KV pages; the prefill pool has {self.cache.num_pages}"))
            return
        keys = PageKeys(prompt, self.page_size, task.cache_salt) if self.use_cache else []
        self.waiting.append(Queued(task, prompt, keys))

    def _on_release(self, message: ReleaseKv) -> None:
        lease = self.held.pop(message.request_id, None)
        if lease is not None:
            self.cache.release(lease)

    def _on_abort(self, message: Abort) -> None:
        if message.request_id == self.running:
            self.abandoned = "aborted"
        self._on_release(ReleaseKv(message.request_id))
        self.waiting = deque(queued for queued in self.waiting if queued.task.request_id != message.request_id)

    def _prefill(self, queued: Queued) -> None:
        task, prompt = queued.task, queued.prompt
        started = time.perf_counter()
        lease = self.cache.acquire(queued.keys, len(prompt))
        cached_tokens = lease.cached_pages * self.page_size
        if self.use_cache:
            metrics.count_prefix_cache(len(prompt), cached_tokens)
        self.running, self.abandoned = task.request_id, ""
        try:
            logits = self._run_prompt(prompt, lease.pages, cached_tokens, self._between_chunks)
            if self.use_cache:  # while the GPU computes: the sample below waits for it, store() reads every key
                queued.keys.hash_all()
            token = sample(logits[None], [task.sampling], [task.generated])[0]  # syncs: the pages are written
        except PromptAbandoned:
            self.cache.release(lease)
            log.info("prompt abandoned mid-way", request_id=task.request_id, reason=self.abandoned)
            if self.stop.now.is_set():
                self.link.send(Failed(task.request_id, ErrorCode.UNAVAILABLE, "prefill worker is shutting down"))
            return
        except FatalError as exc:  # a rank broke off: the worker exits, failing what it holds
            self.cache.release(lease)
            self.link.send(Failed(task.request_id, ErrorCode.UNAVAILABLE, f"prefill worker failed: {exc}"))
            raise
        except Exception as exc:
            self.cache.release(lease)
            log.exception("prefill failed", request_id=task.request_id)
            self.link.send(Failed(task.request_id, ErrorCode.INTERNAL, f"prefill failed: {exc}"))
            return
        finally:
            self.running = None
        self.cache.store(queued.keys, lease)
        self.held[task.request_id] = lease
        finish_reason = self.finish(token, task.generated + 1, len(prompt) + 1, task.stop)
        compute_s = time.perf_counter() - started
        self.link.send(KvReady(task.request_id, self.worker_id, wire.pack_page_ids(lease.pages), len(prompt), token,
                               finish_reason, compute_s, cached_tokens))
        log.debug("prefilled", request_id=task.request_id, prompt_tokens=len(prompt), cached_tokens=cached_tokens,
                  compute_ms=compute_s * 1e3)
