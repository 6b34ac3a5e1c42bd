"""What every front does with a request, whatever its protocol: check and tokenize the input, hand it
to the token router, turn its tokens into chunks of text, and let it go.

    generation = await frontend.start(request, timer)  # InvalidRequest or RequestError; else admitted
    async with generation:                              # router.finish() on the way out, however it ends
        async for chunk in generation:                  # RequestError when a worker fails it
            await generation.deliver(write(chunk))      # StreamStalled when the client stops reading

The fronts (generation.py for gRPC, openai_api.py for HTTP) only translate: their request into a
GenerateInput, a Chunk into their response, an error into their status. The outcome is counted
here, once per request (shared/runtime/metrics.py RequestTimer), so a dashboard sees both fronts alike.
An exception nobody expected while a request is placed reaches them as RequestError INTERNAL:
"internal error" and an id, its text only in the log (control/request.py, internal_error).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass

import structlog

from services.router.control.request import (
    ErrorEvent,
    InflightRequest,
    RequestError,
    StageTimings,
    unexpected_as_internal,
)
from services.router.control.token_router import TokenRouter
from services.router.detokenizer import IncrementalText
from services.router.prompt_tokenizer import PromptTokenizer
from services.router.validation import GenerateInput, InvalidRequest, build_job, check_request_shape
from shared.control.messages import FinishReason
from shared.runtime.metrics import RequestTimer

log = structlog.get_logger()


class StreamStalled(Exception):
    """The client has not taken a chunk for router.stall_timeout_s."""


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int = 0  # of prompt_tokens, those whose KV the prefill took from its prefix cache
    migrations: int = 0  # times the request moved to another decode (services/router/control/migration.py)


@dataclass(frozen=True)
class Chunk:
    """What one write to the client carries; the last chunk also says how and why the request ended."""
    token_ids: list[int]
    text: str  # never part of a multi-byte character, never part of a stop string
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    timings: StageTimings | None = None


class Frontend:
    def __init__(self, router: TokenRouter, prompts: PromptTokenizer, stall_timeout_s: float):
        self.router = router
        self.prompts = prompts
        self.tokenizer = prompts.tokenizer  # also the detokenizer's
        self.limits = prompts.limits
        self.stall_timeout_s = stall_timeout_s

    async def start(self, request: GenerateInput, timer: RequestTimer) -> Generation:
        """The request checked, tokenized and admitted; if it cannot be, its failure is counted, the
        router holds nothing of it, and the error (InvalidRequest, RequestError) is raised."""
        inflight = InflightRequest(await self._job(request, timer), label=request.request_id)
        inflight.timings.tokenize_s = time.perf_counter() - timer.arrived
        structlog.contextvars.bind_contextvars(request_id=inflight.request_id)
        generation = Generation(self, inflight, timer)
        try:
            with unexpected_as_internal():
                await self.router.submit(inflight)
        except BaseException as exc:  # refused by admission, the client left while it waited, or a bug
            generation.close(exc)
            raise
        return generation

    async def _job(self, request: GenerateInput, timer: RequestTimer):
        try:
            check_request_shape(request, self.limits)  # before any tokenizing: bad input costs nothing
            prompt_ids = await self.prompts.token_ids(request)
            return build_job(request, prompt_ids, self.limits)
        except InvalidRequest as exc:
            log.info("invalid request", error=str(exc))
            timer.failed("INVALID_ARGUMENT")
            raise
        except RequestError as exc:  # no turn to tokenize in time
            log.warning("request refused", code=exc.code.value, error=str(exc))
            timer.failed(exc.code.value)
            raise
        except asyncio.CancelledError:
            timer.cancelled()
            raise
        except Exception as exc:  # the chat template or tokenizer refused the input
            log.info("input not tokenizable", error=str(exc))
            timer.failed("INVALID_ARGUMENT")
            raise InvalidRequest(f"cannot tokenize the input: {exc}") from exc


class Generation:
    """One admitted request, streamed by one front; `async with` it, so the router lets it go."""

    def __init__(self, frontend: Frontend, inflight: InflightRequest, timer: RequestTimer):
        self.frontend = frontend
        self.inflight = inflight
        self.timer = timer

    @property
    def label(self) -> str:
        """The client's request_id, or the router's own id when it gave none."""
        return self.inflight.label

    async def __aenter__(self) -> Generation:
        return self

    async def __aexit__(self, kind, error, traceback) -> None:
        self.close(error)

    def close(self, error: BaseException | None) -> None:
        """Lets the request go, and counts what ended it unless a step before did (a worker's error, a
        stalled stream, the success): a front that leaves early without an error, or is cancelled, lost
        its client; any other exception is unexpected, gRPC's UNKNOWN."""
        self.frontend.router.finish(self.inflight)
        if error is None or isinstance(error, asyncio.CancelledError):
            self.timer.cancelled()
        else:
            if isinstance(error, RequestError):
                self.timer.failed(error.code.value)
            self.timer.failed("UNKNOWN")

    async def deliver(self, write: Awaitable) -> None:
        """A write waits while the client's window or socket buffer is full: a client that stops reading.
        asyncio.timeout, not wait_for: Python 3.11's wait_for returns the write's result when the
        client's cancel lands as the write completes, and the handler then waited for tokens of a
        request nobody reads (a CI run's decode never heard Abort)."""
        try:
            async with asyncio.timeout(self.frontend.stall_timeout_s):
                await write
        except TimeoutError:
            log.warning("cancelling a stream its client stopped reading")
            self.timer.failed("CANCELLED")
            raise StreamStalled(f"the client read nothing for {self.frontend.stall_timeout_s} s "
                                "(router.stall_timeout_s)") from None

    async def __aiter__(self) -> AsyncIterator[Chunk]:
        """One chunk per batch of events taken: one token each while the client keeps up, all that
        queued up when it reads slower than the decode writes."""
        inflight, timer = self.inflight, self.timer
        text = IncrementalText(self.frontend.tokenizer, inflight.job.stop_strings)
        generated = 0
        while True:
            events = [await inflight.events.get()]
            while not inflight.events.empty():
                events.append(inflight.events.get_nowait())
            token_ids, pieces, finish = [], [], None
            for event in events:
                if isinstance(event, ErrorEvent):
                    log.warning("request failed", code=event.code.value, error=event.message)
                    timer.failed(event.code.value)
                    raise RequestError(event.code, event.message)
                generated += 1
                piece, stopped = text.push(event.token_id)
                token_ids.append(event.token_id)
                pieces.append(piece)
                finish = FinishReason.STOP if stopped else event.finish_reason
                if finish is not None:
                    if not stopped:
                        pieces.append(text.flush())
                    break
            timer.chunk()
            if finish is None:
                yield Chunk(token_ids, "".join(pieces))
                continue
            timer.succeeded(finish, generated)
            timings = inflight.timings
            usage = Usage(len(inflight.job.prompt_token_ids), generated, timings.cached_prompt_tokens,
                          timings.migrations)
            yield Chunk(token_ids, "".join(pieces), finish, usage, timings)
            return

