"""Which prefill and which decode a request goes to: the lowest cost among the workers with room.

    prefill cost = prompt tokens queued on it (placed, not prefilled yet: work, not requests; one
                   8K-token prompt weighs as much as 64 prompts of 128 tokens)
                   + routing.prefix_weight x the prompt tokens it would compute there: all of them,
                   less the full pages its prefix cache holds (the keys it reports in KvCacheEvents)
    decode cost  = requests in flight on it + routing.decode_kv_weight x share of its pages promised
                   away (the batch it steps, and how close its pool is to full)

When the prefills' queues differ by more than routing.balance_tokens, the cache is left out of
the prefill cost and the least loaded takes the prompt, so a hot prefix cannot pile every request
onto one prefill. Workers that are draining, that lack room for the request (pages, and on a
decode a batch slot: decode.max_batch_size), or that the request already failed on are not
candidates, nor is a pair whose decode cannot pull from the prefill's pool (PoolUnreachable).
Ties go to the worker with the most unpromised room.
"""

from __future__ import annotations

from services.router.control.request import InflightRequest
from services.router.control.worker_records import WorkerRecord
from shared.config.schema import RoutingConfig


class RoutingPolicy:
    def __init__(self, config: RoutingConfig, page_size: int):
        self.config = config
        self.page_size = page_size

    def tokens_to_compute(self, worker: WorkerRecord, request: InflightRequest) -> int:
        """The prompt tokens this prefill would compute, its cached prefix left out."""
        prompt_tokens = request.prefix_len()
        if not self.config.prefix_aware:
            return prompt_tokens
        cached = 0
        for key in request.page_keys(self.page_size):
            if key not in worker.cached_keys:
                break
            cached += self.page_size
        return prompt_tokens - min(cached, (prompt_tokens - 1) // self.page_size * self.page_size)

    def decode_cost(self, worker: WorkerRecord) -> float:
        promised = worker.reserved_pages / worker.total_pages if worker.total_pages else 1.0
        return len(worker.reservations) + self.config.decode_kv_weight * promised

    def pick_prefill(self, workers: list[WorkerRecord], request: InflightRequest, pages: int) -> WorkerRecord | None:
        candidates = self._candidates(workers, request, pages)
        queues = [w.pending_prompt_tokens for w in candidates]
        if candidates and max(queues) - min(queues) > self.config.balance_tokens:
            return min(candidates, key=lambda w: (w.pending_prompt_tokens, -w.room))
        weight = self.config.prefix_weight
        return min(candidates, default=None, key=lambda w: (
            w.pending_prompt_tokens + weight * self.tokens_to_compute(w, request), -w.room))

    def pick_pair(self, prefills: list[WorkerRecord], decodes: list[WorkerRecord], request: InflightRequest,
                  prefill_pages: int, decode_pages: int) -> tuple[WorkerRecord, WorkerRecord] | None:
        """The prefill by its cost among those some decode with room can pull from, then the
        cheapest decode that can pull from it."""
        decodes = self._candidates(decodes, request, decode_pages)
        prefill = self.pick_prefill(self.reachable(prefills, decodes), request, prefill_pages)
        decode = min((d for d in decodes if prefill is not None and prefill.worker_id not in d.unreachable),
                     key=lambda w: (self.decode_cost(w), -w.room), default=None)
        return (prefill, decode) if decode is not None else None

    @staticmethod
    def reachable(prefills: list[WorkerRecord], decodes: list[WorkerRecord]) -> list[WorkerRecord]:
        """The prefills at least one of these decodes can pull from."""
        return [p for p in prefills if any(p.worker_id not in d.unreachable for d in decodes)]

    @staticmethod
    def _candidates(workers: list[WorkerRecord], request: InflightRequest, pages: int) -> list[WorkerRecord]:
        return [w for w in workers if not w.draining and w.room >= pages and w.has_slot
                and w.worker_id not in request.failed_on]
