"""The OpenAI-compatible HTTP API: /v1/models, /v1/completions and /v1/chat/completions, whole or
streamed as server-sent events, and /health for probes.

FastAPI on uvicorn, because: the request bodies are typed pydantic models (openai_protocol.py), and
a body that does not fit is refused in one place; it is ASGI, so uvicorn serves it as one more
coroutine in the router's own uvloop event loop, beside grpc.aio, with no thread and no lock between
the HTTP front and the token router; uvicorn does TLS; and it is what vLLM's and SGLang's OpenAI
servers are built on, so the official clients are well tried against it.

Before the app reads a body, http_gate.py checks the bearer token and takes a request slot, shared
with gRPC. Each request goes through frontend.py exactly as a gRPC call does: the same checks and
messages, the same admission, the same metrics. Errors are OpenAI's JSON error objects; `code` is the gRPC status
the same failure gets over gRPC (openai_errors.py has the table).
"""

from __future__ import annotations

import dataclasses
import json
import time

import structlog
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Send

from services.router.api import openai_errors as errors
from services.router.api.auth import BearerToken
from services.router.api.http_gate import HttpGate
from services.router.api.openai_protocol import Answer, ChatCompletionRequest, CompletionRequest, GenerateBody
from services.router.api.request_slots import RequestSlots
from services.router.control.request import RequestError
from services.router.frontend import Frontend, Generation, StreamStalled
from services.router.validation import InvalidRequest
from shared.runtime.metrics import RequestTimer

DONE = b"data: [DONE]\n\n"


def _event(body: dict) -> bytes:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n".encode()


def _body(data: bytes, more: bool = True) -> dict:
    return {"type": "http.response.body", "body": data, "more_body": more}


async def _send_whole(send: Send, response: Response) -> None:
    await send({"type": "http.response.start", "status": response.status_code, "headers": response.raw_headers})
    await send(_body(response.body, more=False))


class GenerationResponse(StreamingResponse):
    """One request from admission to its last byte, whole or as events, inside the task that
    Starlette's StreamingResponse cancels when the client disconnects (it listens for
    http.disconnect beside it, under the ASGI 2.3 that uvicorn speaks): wherever the request waits,
    in the admission queue or between two tokens, the cancellation reaches it and the router frees
    its pages. Errors before the first byte get their HTTP status; a stream that fails later ends
    with an error event, which the openai client raises as an APIError."""

    def __init__(self, frontend: Frontend, body: GenerateBody, label: str, token_salt: str):
        """token_salt: the cache salt of the caller's bearer token (auth.py)."""
        super().__init__(content=(), media_type="text/event-stream")
        self.frontend, self.body, self.label, self.token_salt = frontend, body, label, token_salt

    async def stream_response(self, send: Send) -> None:
        with structlog.contextvars.bound_contextvars(label=self.label):
            await self._respond(send)

    async def _respond(self, send: Send) -> None:
        try:
            request = dataclasses.replace(self.body.to_input(self.label), token_salt=self.token_salt)
            generation = await self.frontend.start(request, RequestTimer())
        except (InvalidRequest, RequestError) as exc:
            await _send_whole(send, errors.response(exc))
            return
        answer = Answer(self.body, generation.label, int(time.time()))
        try:
            async with generation:
                if self.body.stream:
                    await self._stream(generation, answer, send)
                else:
                    await self._whole(generation, answer, send)
        except StreamStalled:
            pass  # nothing more can reach a client that reads nothing: uvicorn closes the connection

    async def _whole(self, generation: Generation, answer: Answer, send: Send) -> None:
        try:
            response = JSONResponse(answer.whole([chunk async for chunk in generation]))
        except RequestError as exc:
            response = errors.response(exc)
        await generation.deliver(_send_whole(send, response))

    async def _stream(self, generation: Generation, answer: Answer, send: Send) -> None:
        await generation.deliver(send({"type": "http.response.start", "status": 200, "headers": self.raw_headers}))
        try:
            async for chunk in generation:
                await generation.deliver(send(_body(b"".join(map(_event, answer.events(chunk))))))
        except RequestError as exc:
            await generation.deliver(send(_body(_event(errors.body(exc)))))
        await generation.deliver(send(_body(DONE, more=False)))


def create_app(frontend: Frontend, model_name: str, token: BearerToken | None, max_body_bytes: int,
               slots: RequestSlots) -> FastAPI:
    """token: the bearer token /v1/ requires, if any; slots: shared with the gRPC front (http_gate.py)."""
    created = int(time.time())

    def check_model(body: GenerateBody) -> None:
        if body.model != model_name:
            raise errors.UnknownModel(body.model, model_name)

    def generation(body: GenerateBody, request: Request) -> GenerationResponse:
        token_salt = token.cache_salt(request.headers.get("authorization")) if token is not None else ""
        return GenerationResponse(frontend, body, request.headers.get("x-request-id", ""), token_salt)

    # Starlette refuses a body above the limit (413, by its Content-Length or as it counts the bytes),
    # as gRPC does one above router.max_request_bytes; the docs and OpenAPI schema: not part of the API.
    app = FastAPI(title="pdserve", max_body_size=max_body_bytes, docs_url=None, redoc_url=None, openapi_url=None)
    errors.install(app)
    app.add_middleware(HttpGate, token=token, slots=slots)

    @app.get("/health")
    async def health() -> Response:
        """Open, like gRPC's health service: 200 while a prefill and a decode are registered."""
        return Response(status_code=200 if frontend.router.serving() else 503)

    v1 = APIRouter(prefix="/v1")

    @v1.get("/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "pdserve", "max_model_len": frontend.limits.max_context}]}

    @v1.post("/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        check_model(body)
        return generation(body, request)

    @v1.post("/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        check_model(body)
        return generation(body, request)

    app.include_router(v1)
    return app

