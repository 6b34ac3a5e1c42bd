"""An exception nobody expected reaches a client as "internal error" and an id, never as its text:
gRPC INTERNAL through the server's interceptor (services/router/api/internal_errors.py), HTTP 500
through the OpenAI app's handler (openai_errors.py); the log line with that id has the exception."""

from __future__ import annotations

import asyncio
import json
import re

import grpc
import pytest
from structlog.testing import capture_logs

from services.router.api import openai_errors
from services.router.api.internal_errors import HideInternalErrors
from services.router.control.request import RequestError, internal_error, unexpected_as_internal
from shared.control.messages import ErrorCode

SECRET = "the router's insides: /etc/pdserve, 0xdeadbeef"
ERROR_ID = re.compile(r"^internal error \(error id ([0-9a-f]{16})\)$")


def _logged_with(logs: list[dict], message: str) -> dict:
    error_id = ERROR_ID.match(message).group(1)
    [entry] = [e for e in logs if e.get("error_id") == error_id]
    return entry


def test_an_internal_error_names_an_id_that_the_log_carries_with_the_exception():
    with capture_logs() as logs:
        error = internal_error(RuntimeError(SECRET))
    assert error.code == ErrorCode.INTERNAL and SECRET not in str(error)
    entry = _logged_with(logs, str(error))
    assert entry["log_level"] == "error" and str(entry["exc_info"]) == SECRET


def test_only_unexpected_exceptions_become_internal_errors():
    refusal = RequestError(ErrorCode.RESOURCE_EXHAUSTED, "no room")
    with pytest.raises(RequestError) as kept, unexpected_as_internal():
        raise refusal
    assert kept.value is refusal
    with pytest.raises(RequestError) as hidden, unexpected_as_internal():
        raise KeyError(SECRET)
    assert hidden.value.code == ErrorCode.INTERNAL and SECRET not in str(hidden.value)


async def _raise(request, context):
    raise RuntimeError(SECRET)


async def _write_then_raise(request, context):
    await context.write(b"first")
    raise RuntimeError(SECRET)


async def _abort(request, context):
    await context.abort(grpc.StatusCode.NOT_FOUND, "no worker 'x' is registered")


async def _call(method: str, streaming: bool) -> grpc.aio.AioRpcError:
    """One call to a real grpc.aio server on a free port, with the router's interceptor."""
    handlers = {"Unary": grpc.unary_unary_rpc_method_handler(_raise),
                "Stream": grpc.unary_stream_rpc_method_handler(_write_then_raise),
                "Abort": grpc.unary_unary_rpc_method_handler(_abort)}
    server = grpc.aio.server(interceptors=[HideInternalErrors()])
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("test.Boom", handlers)])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            try:
                if streaming:
                    async for _ in channel.unary_stream(f"/test.Boom/{method}")(b""):
                        pass
                else:
                    await channel.unary_unary(f"/test.Boom/{method}")(b"")
            except grpc.aio.AioRpcError as error:
                return error
            raise AssertionError("the call succeeded")
    finally:
        await server.stop(None)


@pytest.mark.parametrize(("method", "streaming"), [("Unary", False), ("Stream", True)])
def test_grpc_answers_an_unexpected_exception_internal_without_its_text(method, streaming):
    with capture_logs() as logs:
        error = asyncio.run(_call(method, streaming))
    assert error.code() == grpc.StatusCode.INTERNAL, error  # not UNKNOWN "Unexpected <class ...>: ..."
    assert SECRET not in error.details()
    assert str(_logged_with(logs, error.details())["exc_info"]) == SECRET


def test_a_status_a_handler_sets_on_purpose_passes_through():
    error = asyncio.run(_call("Abort", streaming=False))
    assert (error.code(), error.details()) == (grpc.StatusCode.NOT_FOUND, "no worker 'x' is registered")


def test_http_answers_an_unexpected_exception_500_without_its_text():
    from fastapi import FastAPI

    app = FastAPI()
    openai_errors.install(app)
    with capture_logs() as logs:
        response = asyncio.run(app.exception_handlers[Exception](None, RuntimeError(SECRET)))
    body = json.loads(response.body)["error"]
    assert response.status_code == 500 and (body["type"], body["code"]) == ("server_error", "INTERNAL")
    assert SECRET not in body["message"]
    assert str(_logged_with(logs, body["message"])["exc_info"]) == SECRET
