"""The gRPC Generation service: GenerateRequest in, GenerateResponse chunks out; frontend.py does the rest."""

from __future__ import annotations

import grpc
import structlog

from pdserve.v1 import generation_pb2, generation_pb2_grpc
from services.router.api.admin import list_workers
from services.router.control.request import RequestError
from services.router.frontend import Chunk, Frontend, StreamStalled
from services.router.validation import ChatMessage, GenerateInput, InvalidRequest
from shared.runtime.metrics import RequestTimer


def generate_input(request: generation_pb2.GenerateRequest) -> GenerateInput:
    def given(name: str):
        return getattr(request, name) if request.HasField(name) else None

    return GenerateInput(
        request_id=request.request_id, prompt=given("prompt"),
        messages=tuple(ChatMessage(m.role, m.content) for m in request.messages),
        prompt_token_ids=tuple(request.prompt_token_ids), max_tokens=given("max_tokens"),
        temperature=given("temperature"), top_p=given("top_p"), top_k=given("top_k"), seed=given("seed"),
        stop=tuple(request.stop), ignore_eos=request.ignore_eos)


def _response(label: str, chunk: Chunk) -> generation_pb2.GenerateResponse:
    response = generation_pb2.GenerateResponse(request_id=label, token_ids=chunk.token_ids, text=chunk.text)
    if chunk.finish_reason is not None:
        response.finish_reason = chunk.finish_reason.value
        response.usage.CopyFrom(generation_pb2.Usage(prompt_tokens=chunk.usage.prompt_tokens,
                                                     completion_tokens=chunk.usage.completion_tokens,
                                                     cached_prompt_tokens=chunk.usage.cached_prompt_tokens,
                                                     migrations=chunk.usage.migrations))
        response.timings.CopyFrom(generation_pb2.StageTimings(**chunk.timings.as_dict()))
    return response


class GenerationService(generation_pb2_grpc.GenerationServicer):
    def __init__(self, frontend: Frontend):
        self.frontend = frontend

    async def Generate(self, request, context: grpc.aio.ServicerContext) -> None:
        timer = RequestTimer(context.time_remaining)
        with structlog.contextvars.bound_contextvars(label=request.request_id):
            try:
                generation = await self.frontend.start(generate_input(request), timer)
                async with generation:
                    async for chunk in generation:
                        await generation.deliver(context.write(_response(generation.label, chunk)))
            except InvalidRequest as exc:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            except RequestError as exc:
                await context.abort(grpc.StatusCode[exc.code.value], str(exc))
            except StreamStalled as exc:
                # The status waits behind the unread chunks, so this returns once the client reads
                # again, goes away, or its deadline passes; nothing of the request is held meanwhile.
                await context.abort(grpc.StatusCode.CANCELLED, str(exc))

    async def ListWorkers(self, request, context):
        return list_workers(self.frontend.router.registry)
