"""The gRPC Generation service: validate, tokenize, submit to the token router, stream back."""

from __future__ import annotations

import asyncio
import time
import uuid

import grpc
import structlog
from pdserve.v1 import generation_pb2, generation_pb2_grpc

from services.router.detokenizer import IncrementalText
from services.router.token_router import ErrorEvent, InflightRequest, RequestError, TokenRouter
from services.router.validation import InvalidRequest, ModelLimits, build_job, check_request_shape, tokenize
from shared.messages import FinishReason
from shared.metrics import RequestTimer

log = structlog.get_logger()


class GenerationService(generation_pb2_grpc.GenerationServicer):
    def __init__(self, router: TokenRouter, tokenizer, limits: ModelLimits):
        self.router = router
        self.tokenizer = tokenizer
        self.limits = limits

    async def Generate(self, request, context: grpc.aio.ServicerContext):
        timer = RequestTimer()
        request_id = request.request_id or uuid.uuid4().hex
        with structlog.contextvars.bound_contextvars(request_id=request_id):
            try:
                check_request_shape(request)
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
            inflight = InflightRequest(request_id, job)
            inflight.timings["tokenize_s"] = tokenize_s
            try:
                await self.router.submit(inflight)
                async for response in self._stream(inflight, context, timer):
                    yield response
            except RequestError as exc:
                timer.failed(exc.code.value)
                await context.abort(grpc.StatusCode[exc.code.value], str(exc))
            except (asyncio.CancelledError, GeneratorExit):  # the client went away, or its deadline passed
                timer.cancelled(context)
                raise
            finally:
                timer.failed("UNKNOWN")  # counts only if nothing above did: an unexpected error, gRPC's UNKNOWN
                self.router.finish(inflight)

    async def _stream(self, inflight: InflightRequest, context, timer: RequestTimer):
        text = IncrementalText(self.tokenizer, inflight.job.stop_strings)
        generated = 0
        while True:
            event = await inflight.events.get()
            if isinstance(event, ErrorEvent):
                log.warning("request failed", code=event.code.value, error=event.message)
                timer.failed(event.code.value)
                await context.abort(grpc.StatusCode[event.code.value], event.message)
            generated += 1
            piece, stopped = text.push(event.token_id)
            finish = FinishReason.STOP if stopped else event.finish_reason
            timer.chunk()
            if finish is None:
                yield generation_pb2.GenerateResponse(request_id=inflight.request_id, token_ids=[event.token_id],
                                                      text=piece)
                continue
            usage = generation_pb2.Usage(prompt_tokens=len(inflight.job.prompt_token_ids), completion_tokens=generated)
            timer.succeeded(finish, generated)
            yield generation_pb2.GenerateResponse(
                request_id=inflight.request_id, token_ids=[event.token_id],
                text=piece if stopped else piece + text.flush(), finish_reason=finish.value, usage=usage,
                timings=generation_pb2.StageTimings(**inflight.stage_timings()))
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
