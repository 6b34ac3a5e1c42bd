"""Which prefill and which decode a request goes to: the lowest cost among the workers with room.

    prefill cost = prompt tokens placed on it and not prefilled yet (its queue, in work, not in
                   requests: one 8K-token prompt weighs as much as 64 prompts of 128 tokens)
    decode cost  = requests in flight on it + routing.decode_kv_weight x share of its pages promised
                   away (the batch it steps, and how close its pool is to full)

Workers that are draining, that lack room for the request, or that the request already failed on
are not candidates. Ties go to the worker with the most unpromised room.
"""

from __future__ import annotations

from services.router.request import InflightRequest
from services.router.workers import Worker
from shared.config import RoutingConfig


class RoutingPolicy:
    def __init__(self, config: RoutingConfig):
        self.config = config

    def prefill_cost(self, worker: Worker) -> float:
        return worker.pending_prompt_tokens

    def decode_cost(self, worker: Worker) -> float:
        promised = worker.reserved_pages / worker.total_pages if worker.total_pages else 1.0
        return len(worker.reservations) + self.config.decode_kv_weight * promised

    def pick_prefill(self, workers: list[Worker], request: InflightRequest, pages: int) -> Worker | None:
        return self._cheapest(workers, request, pages, self.prefill_cost)

    def pick_decode(self, workers: list[Worker], request: InflightRequest, pages: int) -> Worker | None:
        return self._cheapest(workers, request, pages, self.decode_cost)

    @staticmethod
    def _cheapest(workers: list[Worker], request: InflightRequest, pages: int, cost) -> Worker | None:
        candidates = [w for w in workers
                      if not w.draining and w.room >= pages and w.worker_id not in request.failed_on]
        return min(candidates, key=lambda w: (cost(w), -w.room), default=None)
