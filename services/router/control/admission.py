"""Admission: requests wait here, FIFO, until one prefill and one decode have room, then are placed.

Room is KV pages on both, and on the decode a batch slot too: a decode registers its
decode.max_batch_size, and a request placed beyond it would wait there for a slot with the
handoff's timeout running (routing.py's candidates).

Placing reserves the prompt's pages on the prefill and prompt + max_tokens pages on the decode
(fewer for a model whose every layer has a sliding window: shared/kv/pages.py) as the prefill
starts, so a finished prefill never waits for decode room. Reservations live on the workers'
records (WorkerRecord.reservations) and go back when the workers are done with them:
the prefill's when the decode has pulled the pages, the decode's when it ends the request, both
when the request fails; admit_waiting() then places whoever waits. A request moved off a failed
decode (migration.py) is placed again by the prefix it has, ahead of the line (readmit()).
The waiting line is bounded in length (router.max_waiting_requests) and in time (router.admission_timeout_s): past either, the
request is refused with RESOURCE_EXHAUSTED.

A request is reserved for only once its PrefillTask went out: a task that cannot be sent (a bug
that let an unencodable value through) holds nothing, and its error goes to that request's own
caller, even when a handler of another request's message placed it from the waiting line.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Callable

from services.router.control.request import InflightRequest, RequestError
from services.router.control.routing import RoutingPolicy
from services.router.control.worker_records import WorkerRecord, WorkerRegistry
from shared.config.schema import RouterConfig
from shared.control.messages import ErrorCode, Role
from shared.kv.pages import decode_pages_needed, pages_for
from shared.runtime import metrics


class Admission:
    def __init__(self, registry: WorkerRegistry, policy: RoutingPolicy, config: RouterConfig, page_size: int,
                 on_placed: Callable[[InflightRequest], None]):
        """on_placed: sends a request that has its workers its PrefillTask, and raises if it cannot;
        the request's reservations follow once it has returned."""
        self.registry = registry
        self.policy = policy
        self.config = config
        self.page_size = page_size
        self.on_placed = on_placed
        self.waiting: deque[tuple[InflightRequest, asyncio.Future]] = deque()

    def pages_needed(self, request: InflightRequest) -> dict[Role, int]:
        """By the prefix a prefill computes: the prompt, and after a migration the tokens already streamed."""
        prefix_tokens = request.prefix_len()
        return {Role.PREFILL: pages_for(prefix_tokens, self.page_size),
                Role.DECODE: decode_pages_needed(prefix_tokens, request.tokens_left(), self.page_size,
                                                 self.registry.decode_window())}

    async def admit(self, request: InflightRequest) -> None:
        """Returns once the request is placed; raises RequestError when it cannot be."""
        if not self.registry.paired():
            raise RequestError(ErrorCode.UNAVAILABLE, "no prefill and decode workers are serving "
                                                      "(or none of the decodes can pull from a prefill)")
        for role, pages in self.pages_needed(request).items():
            largest = self.registry.largest_pool(role)
            if pages > largest:
                raise RequestError(ErrorCode.RESOURCE_EXHAUSTED,
                                   f"request needs {pages} KV pages, more than any {role} pool holds ({largest})")
        if not self.waiting and self._place(request):
            return
        if len(self.waiting) >= self.config.max_waiting_requests:
            raise RequestError(ErrorCode.RESOURCE_EXHAUSTED,
                               f"{len(self.waiting)} requests already wait for KV room; try again later")
        placed = asyncio.get_running_loop().create_future()
        entry = (request, placed)
        self.waiting.append(entry)
        try:
            async with asyncio.timeout(self.config.admission_timeout_s):  # a cancel is never swallowed (frontend.py)
                await placed
        except TimeoutError:
            raise RequestError(ErrorCode.RESOURCE_EXHAUSTED, "no KV room became free within "
                               f"{self.config.admission_timeout_s} s") from None
        finally:
            if entry in self.waiting:
                self.waiting.remove(entry)

    def admit_waiting(self) -> None:
        """Places waiting requests, in order, while the first of them fits; one that fails to start
        hears why from its future, and the next is placed."""
        while self.waiting:
            request, placed = self.waiting[0]
            if not placed.done():  # else its caller gave up
                try:
                    if not self._place(request):
                        return
                    placed.set_result(None)
                except Exception as exc:
                    placed.set_exception(exc)
            self.waiting.popleft()

    def readmit(self, request: InflightRequest) -> None:
        """Places a request moved off its decode (migration.py) now if it fits, else first in line:
        it came before everyone waiting. No caller awaits it: its stage deadline bounds the wait."""
        if not self._place(request):
            self.waiting.appendleft((request, asyncio.get_running_loop().create_future()))

    def withdraw(self, request: InflightRequest) -> None:
        """Takes a readmitted request out of the line: it ended while it waited."""
        self.waiting = deque(entry for entry in self.waiting if entry[0] is not request)

    @staticmethod
    def release(worker: WorkerRecord | None, request: InflightRequest) -> bool:
        """Gives the request's reservation on that worker back; False if it held none there."""
        if worker is None:
            return False
        worker.pending_tokens.pop(request.request_id, None)
        return worker.reservations.pop(request.request_id, None) is not None

    def replace_prefill(self, request: InflightRequest) -> bool:
        """Moves a request that failed on its prefill, before its first token, to another one
        with room now, and starts it there (on_placed); False if there is none. Its old reservation
        is released either way; its new one is made once the task went out."""
        request.failed_on.add(request.prefill.worker_id)
        self.release(request.prefill, request)
        pages = self.pages_needed(request)[Role.PREFILL]
        prefills = self.policy.reachable(self.registry.serving(Role.PREFILL), [request.decode])
        prefill = self.policy.pick_prefill(prefills, request, pages)
        if prefill is None:
            return False
        request.prefill = prefill
        self.on_placed(request)
        self._reserve_prefill(request, prefill, pages)
        return True

    def _place(self, request: InflightRequest) -> bool:
        """Starts the request on the pair with room (False if none has); raises what on_placed raised."""
        needed = self.pages_needed(request)
        pair = self.policy.pick_pair(self.registry.serving(Role.PREFILL), self.registry.serving(Role.DECODE), request,
                                     needed[Role.PREFILL], needed[Role.DECODE])
        if pair is None:
            return False
        prefill, decode = pair
        request.prefill, request.decode = prefill, decode
        if not request.timings.migrations:  # the first placement's wait: a moved request's is not queueing
            request.timings.router_queue_s = time.perf_counter() - request.submitted_at
        self.on_placed(request)
        self._reserve_prefill(request, prefill, needed[Role.PREFILL])
        decode.reservations[request.request_id] = needed[Role.DECODE]
        metrics.count_routed(decode.worker_id, Role.DECODE, request.prefix_len())
        return True

    def _reserve_prefill(self, request: InflightRequest, prefill: WorkerRecord, pages: int) -> None:
        prefill.reservations[request.request_id] = pages
        prefill.pending_tokens[request.request_id] = self.policy.tokens_to_compute(prefill, request)
        metrics.count_routed(prefill.worker_id, Role.PREFILL, prefill.pending_tokens[request.request_id])
