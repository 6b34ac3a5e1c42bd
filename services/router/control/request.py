"""The router's record of one request in flight, and what it tells the front that streams it.

A request is keyed inside pdserve by `request_id`, which the router makes (random, so unique
per router incarnation: a frame about an old router's request can never match a new one). The
client's own request_id is only its `label`: it shows in logs and responses, and two calls may
carry the same label at once without ever seeing each other's tokens.

Stages (InflightRequest.stage):
  ADMITTING  waiting, FIFO, until one prefill and one decode have room (services/router/control/admission.py)
  PREFILL    PrefillTask sent; KvReady brings the first token and the prompt's page ids
  DECODE     DecodeTask sent; TokenBatch entries bring the rest
  DONE       ended by the workers (EOS, length, failure) or by the front (client gone, stop string)
Every stage has a deadline (router.*_timeout_s): a request past it fails with UNAVAILABLE.
An exception nobody expected fails the request it concerns with INTERNAL (internal_error).

A request whose decode fails goes back to ADMITTING under a new request_id (migration.py), its
prompt followed by the tokens it already streamed (output_token_ids): each placement has its own
id on the wire, so no late frame about an earlier one can pass for the current one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum

import structlog

from services.router.control.worker_records import WorkerRecord
from services.router.validation import Job
from shared.control.messages import ErrorCode, FinishReason
from shared.kv.page_keys import PageKeys


log = structlog.get_logger()


class RequestError(Exception):
    def __init__(self, code: ErrorCode, message: str):
        super().__init__(message)
        self.code = code


def internal_error(exc: BaseException) -> RequestError:
    """An unexpected exception as its client hears of it: "internal error" and an id. Its text
    stays in the log line, which carries the same id and the traceback."""
    error_id = secrets.token_hex(8)
    log.error("internal error", error_id=error_id, exc_info=exc)
    return RequestError(ErrorCode.INTERNAL, f"internal error (error id {error_id})")


@contextmanager
def unexpected_as_internal() -> Iterator[None]:
    """Lets RequestError through and turns any other Exception into internal_error's."""
    try:
        yield
    except RequestError:
        raise
    except Exception as exc:
        raise internal_error(exc) from exc


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


@dataclass
class StageTimings:
    """Where a request's time went, in seconds, with the field names of the API's StageTimings
    (proto/pdserve/v1/generation.proto says what each covers).

    Only readings of one clock are ever subtracted: the router's own (time.perf_counter) for the
    time up to each token's arrival, and the workers' durations, each measured on its own clock
    (the prefill's compute; the decode's wait and first step, on a GPU dated on the device). A
    stage that spans processes is what the router's clock leaves once those are taken out, hops
    included. So no stage is negative, the stages hold across hosts whose clocks disagree, and
    they sum: the first four to first_token_s, which with the last three makes the time to the
    second token (the decode's first) at the router."""
    tokenize_s: float = 0.0
    router_queue_s: float = 0.0
    prefill_queue_s: float = 0.0
    prefill_compute_s: float = 0.0
    first_token_s: float = 0.0
    kv_handoff_s: float = 0.0
    decode_queue_s: float = 0.0
    first_decode_step_s: float = 0.0
    cached_prompt_tokens: int = 0  # not a time: the prompt tokens the prefill took from its cache
    migrations: int = 0  # not a time: how many times the request moved to another decode (migration.py)

    def first_token(self, since_submitted_s: float, compute_s: float) -> None:
        """The prefill's first token is at the router, since_submitted_s after the front handed the
        request over; compute_s is the prefill's own measure. Its queue keeps both hops. A duration
        of another host's clock may run a few parts per million long: hence the floor at 0."""
        self.first_token_s = self.tokenize_s + since_submitted_s
        self.prefill_compute_s = compute_s
        self.prefill_queue_s = max(0.0, since_submitted_s - self.router_queue_s - compute_s)

    def second_token(self, since_submitted_s: float, queued_s: float, step_s: float) -> None:
        """The decode's first step's token is at the router; queued_s and step_s are the decode's
        own measures (its pages waiting for the step, the step until its tokens went out). The
        handoff keeps the DecodeTask's way to the decode, the pull, and the tokens' way back."""
        self.decode_queue_s, self.first_decode_step_s = queued_s, step_s
        between = self.tokenize_s + since_submitted_s - self.first_token_s
        self.kv_handoff_s = max(0.0, between - queued_s - step_s)

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


def new_request_id() -> str:
    return secrets.token_hex(16)


@dataclass(eq=False)
class InflightRequest:
    job: Job
    label: str = ""  # the client's request_id; the router's own id when it gave none
    request_id: str = field(default_factory=new_request_id)
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    stage: Stage = Stage.ADMITTING
    prefill: WorkerRecord | None = None  # once placed
    decode: WorkerRecord | None = None
    timings: StageTimings = field(default_factory=StageTimings)
    submitted_at: float = field(default_factory=time.perf_counter)  # tokenized, handed to the router
    deadline: float = float("inf")  # time.monotonic() by which the current stage must move on
    # Workers it must not be placed on again: a prefill it failed on before a token, a decode it
    # moved off that is still registered (a timeout, a Failed).
    failed_on: set[str] = field(default_factory=set)
    prefill_retried: bool = False  # it had its one move to another prefill (token_router.py)
    output_token_ids: list[int] = field(default_factory=list)  # handed to the front, in order
    _page_keys: PageKeys | None = None

    def __post_init__(self) -> None:
        self.label = self.label or self.request_id

    def enter(self, stage: Stage, timeout_s: float) -> None:
        self.stage = stage
        self.deadline = time.monotonic() + timeout_s

    def page_keys(self, page_size: int) -> PageKeys:
        """The prefix's full pages' keys (shared/kv/page_keys.py), each hashed once per placement, when
        routing first asks."""
        if self._page_keys is None:
            self._page_keys = PageKeys(self.prefix_token_ids(), page_size, self.job.cache_salt)
        return self._page_keys

    def prefix_token_ids(self) -> list[int]:
        """What a prefill computes: the prompt, then the tokens already streamed (after a migration)."""
        if not self.output_token_ids:
            return self.job.prompt_token_ids
        return self.job.prompt_token_ids + self.output_token_ids

    def prefix_len(self) -> int:
        return len(self.job.prompt_token_ids) + len(self.output_token_ids)

    def tokens_left(self) -> int:
        """max_tokens less the tokens already streamed: what a decode placed now may still produce."""
        return self.job.stop.max_tokens - len(self.output_token_ids)

    def emit(self, event: TokenEvent | ErrorEvent) -> None:
        """Hands an event to the front; a token is also kept, for the prefix should the request move."""
        if isinstance(event, TokenEvent):
            self.output_token_ids.append(event.token_id)
        self.events.put_nowait(event)

    def rekey(self) -> str:
        """A new request_id for the next placement, the page keys of its longer prefix to be
        hashed afresh; returns the old id."""
        old, self.request_id, self._page_keys = self.request_id, new_request_id(), None
        return old

    def holder(self) -> WorkerRecord | None:
        """The worker that has the request in its current stage."""
        return {Stage.PREFILL: self.prefill, Stage.DECODE: self.decode}.get(self.stage)

    def ended(self) -> bool:
        return self.stage == Stage.DONE
