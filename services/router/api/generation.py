"""The gRPC Generation service: GenerateRequest in, GenerateResponse chunks out; frontend.py does the rest."""

from __future__ import annotations

import grpc
import structlog

from pdserve.v1 import generation_pb2, generation_pb2_grpc
from services.router.api.admin import list_workers
from services.router.api.auth import BearerToken, authorization
from services.router.api.request_slots import RequestSlots
from services.router.control.request import RequestError
from services.router.frontend import Chunk, Frontend, StreamStalled
from services.router.validation import ChatMessage, GenerateInput, InvalidRequest
from shared.runtime.metrics import RequestTimer


def generate_input(request: generation_pb2.GenerateRequest, token_salt: str = "") -> GenerateInput:
    """token_salt: the cache salt of the bearer token the call came with (auth.py)."""
    def given(name: str):
        return getattr(request, name) if request.HasField(name) else None

    return GenerateInput(
        request_id=request.request_id, prompt=given("prompt"),
        messages=tuple(ChatMessage(m.role, m.content) for m in request.messages),
        prompt_token_ids=tuple(request.prompt_token_ids), max_tokens=given("max_tokens"),
        temperature=given("temperature"), top_p=given("top_p"), top_k=given("top_k"), seed=given("seed"),
        stop=tuple(request.stop), ignore_eos=request.ignore_eos, cache_salt=given("cache_salt"),
        token_salt=token_salt)


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
    def __init__(self, frontend: Frontend, slots: RequestSlots, token: BearerToken | None = None):
        """token: the bearer tokens, whose cache salts the calls take (the interceptor admitted them)."""
        self.frontend = frontend
        self.slots = slots
        self.token = token

    async def Generate(self, request, context: grpc.aio.ServicerContext) -> None:
        """The slot goes back before an error status is sent: a status waits behind the chunks a
        stalled client has not read, and a slot held meanwhile would refuse other calls."""
        if not self.slots.take():
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, self.slots.refusal())
        try:
            with structlog.contextvars.bound_contextvars(label=request.request_id):
                status = await self._stream(request, context)
        finally:
            self.slots.give_back()
        if status is not None:
            await context.abort(*status)

    async def _stream(self, request, context: grpc.aio.ServicerContext) -> tuple[grpc.StatusCode, str] | None:
        """Streams the request's chunks; returns the status it failed with, None if it did not."""
        timer = RequestTimer(context.time_remaining)
        token_salt = self.token.cache_salt(authorization(context.invocation_metadata())) if self.token else ""
        try:
            generation = await self.frontend.start(generate_input(request, token_salt), timer)
            async with generation:
                async for chunk in generation:
                    await generation.deliver(context.write(_response(generation.label, chunk)))
        except InvalidRequest as exc:
            return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
        except RequestError as exc:
            return grpc.StatusCode[exc.code.value], str(exc)
        except StreamStalled as exc:
            # Nothing of the request is held any more; the status reaches the client once it reads
            # again, goes away, or its deadline passes.
            return grpc.StatusCode.CANCELLED, str(exc)
        return None

    async def ListWorkers(self, request, context):
        return list_workers(self.frontend.router.registry)
