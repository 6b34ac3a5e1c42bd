"""The gRPC Generation service: validate, tokenize, submit to the token router, stream back."""

from __future__ import annotations

import asyncio
import time

import grpc
import structlog
from pdserve.v1 import generation_pb2, generation_pb2_grpc

from services.router.detokenizer import IncrementalText
from services.router.request import ErrorEvent, InflightRequest, RequestError
from services.router.token_router import TokenRouter
from services.router.validation import InvalidRequest, ModelLimits, build_job, check_request_shape, tokenize
from shared.messages import FinishReason
from shared.metrics import RequestTimer

log = structlog.get_logger()


class StreamStalled(Exception):
    """The client has not taken a chunk for router.stall_timeout_s."""


class GenerationService(generation_pb2_grpc.GenerationServicer):
    def __init__(self, router: TokenRouter, tokenizer, limits: ModelLimits, stall_timeout_s: float):
        self.router = router
        self.tokenizer = tokenizer
        self.limits = limits
        self.stall_timeout_s = stall_timeout_s

    async def Generate(self, request, context: grpc.aio.ServicerContext) -> None:
        timer = RequestTimer()
        with structlog.contextvars.bound_contextvars(label=request.request_id):
            try:
                check_request_shape(request, self.limits)
                # Tokenizing a long prompt takes milliseconds: keep it off the event loop.
                prompt_ids = await asyncio.to_thread(tokenize, request, self.tokenizer)
                job = build_job(request, prompt_ids, self.limits)
                tokenize_s = time.perf_counter() - timer.arrived
            except InvalidRequest as exc:
                log.info("invalid request", error=str(exc))
                timer.failed("INVALID_ARGUMENT")
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            except Exception as exc:  # the chat template or tokenizer refused the input
                log.info("input not tokenizable", error=str(exc))
                timer.failed("INVALID_ARGUMENT")
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"cannot tokenize the input: {exc}")
            inflight = InflightRequest(job, label=request.request_id)
            inflight.timings.tokenize_s = tokenize_s
            structlog.contextvars.bind_contextvars(request_id=inflight.request_id)
            try:
                await self.router.submit(inflight)
                async for response in self._responses(inflight, timer):
                    await self._write(context, response)
            except RequestError as exc:
                timer.failed(exc.code.value)
                await context.abort(grpc.StatusCode[exc.code.value], str(exc))
            except StreamStalled as exc:
                log.warning("cancelling a stream its client stopped reading", error=str(exc))
                timer.failed("CANCELLED")
                self.router.finish(inflight)
                # The status waits behind the unread chunks, so this returns once the client reads
                # again, goes away, or its deadline passes; nothing of the request is held meanwhile.
                await context.abort(grpc.StatusCode.CANCELLED, str(exc))
            except asyncio.CancelledError:  # the client went away, or its deadline passed
                timer.cancelled(context)
                raise
            finally:
                timer.failed("UNKNOWN")  # counts only if nothing above did: an unexpected error, gRPC's UNKNOWN
                self.router.finish(inflight)

    async def _write(self, context: grpc.aio.ServicerContext, response) -> None:
        """A write waits while the client's HTTP/2 window is full: a client that stops reading."""
        try:
            await asyncio.wait_for(context.write(response), self.stall_timeout_s)
        except TimeoutError:
            raise StreamStalled(f"the client read nothing for {self.stall_timeout_s} s "
                                "(router.stall_timeout_s)") from None

    async def _responses(self, inflight: InflightRequest, timer: RequestTimer):
        """One chunk per batch of events taken: one token each while the client keeps up, all that
        queued up when it reads slower than the decode writes."""
        text = IncrementalText(self.tokenizer, inflight.job.stop_strings)
        generated = 0
        while True:
            events = [await inflight.events.get()]
            while not inflight.events.empty():
                events.append(inflight.events.get_nowait())
            token_ids, pieces, finish = [], [], None
            for event in events:
                if isinstance(event, ErrorEvent):
                    log.warning("request failed", code=event.code.value, error=event.message)
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
                yield generation_pb2.GenerateResponse(request_id=inflight.label, token_ids=token_ids,
                                                      text="".join(pieces))
                continue
            usage = generation_pb2.Usage(prompt_tokens=len(inflight.job.prompt_token_ids), completion_tokens=generated)
            timer.succeeded(finish, generated)
            inflight.clock.fill(inflight.timings)
            yield generation_pb2.GenerateResponse(
                request_id=inflight.label, token_ids=token_ids, text="".join(pieces), finish_reason=finish.value,
                usage=usage, timings=generation_pb2.StageTimings(**inflight.timings.as_dict()))
            return

    async def ListWorkers(self, request, context):
        now = time.monotonic()
        return generation_pb2.ListWorkersResponse(workers=[
            generation_pb2.WorkerInfo(
                worker_id=w.worker_id, role=w.role.value, total_pages=w.total_pages, free_pages=w.free_pages,
                reserved_pages=w.reserved_pages, running_requests=w.running, waiting_requests=w.waiting,
                seconds_since_heartbeat=now - w.last_seen)
            for w in self.router.registry.workers.values()
        ])
