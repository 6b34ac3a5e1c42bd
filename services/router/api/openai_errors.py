"""The OpenAI API's errors: OpenAI's JSON error object with the HTTP status of each failure.

    {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}

`message` says what gRPC says of the same failure, word for word; `code` is that gRPC status. One
answer is not this object: a body whose Content-Length is above the limit gets Starlette's plain
413 before it is read.

| failure                                                       | HTTP | type                  | code               |
|---------------------------------------------------------------|------|-----------------------|--------------------|
| bad input: validation.py's checks, a body the models refuse    | 400  | invalid_request_error | INVALID_ARGUMENT   |
| no bearer token, or a wrong one (when one is configured)       | 401  | authentication_error  | UNAUTHENTICATED    |
| a model this router does not serve, a path it does not have    | 404  | invalid_request_error | NOT_FOUND          |
| a body above router.max_request_bytes, counted as it comes     | 413  | invalid_request_error | RESOURCE_EXHAUSTED |
| admission refused: the queue full, no KV room in time, too big | 429  | rate_limit_error      | RESOURCE_EXHAUSTED |
| router.max_concurrent_rpcs requests in flight already          | 429  | rate_limit_error      | RESOURCE_EXHAUSTED |
| no worker serves, a worker failed, a stage timed out           | 503  | service_unavailable   | UNAVAILABLE        |
| router.http_max_connections open, each with a request in flight | 503 | service_unavailable   | UNAVAILABLE        |
| anything else, as "internal error (error id …)"               | 500  | server_error          | INTERNAL           |
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from services.router.control.request import RequestError, internal_error
from services.router.validation import InvalidRequest
from shared.control.messages import ErrorCode

# 429 for a full admission queue: the client should come back later, and clients back off on it.
_BY_ERROR_CODE = {ErrorCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
                  ErrorCode.UNAVAILABLE: (503, "service_unavailable"), ErrorCode.INTERNAL: (500, "server_error")}
_BY_STATUS = {400: "INVALID_ARGUMENT", 401: "UNAUTHENTICATED", 404: "NOT_FOUND", 405: "UNIMPLEMENTED",
              413: "RESOURCE_EXHAUSTED", 429: "RESOURCE_EXHAUSTED", 503: "UNAVAILABLE"}


class UnknownModel(Exception):
    def __init__(self, asked: str, served: str):
        super().__init__(f"the model {asked!r} is not served here; this router serves {served!r} "
                         "(router.served_model_name, listed by GET /v1/models)")


def error_object(status: int, message: str, kind: str, param: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": _BY_STATUS.get(status, "INTERNAL")}}


def _json(status: int, message: str, kind: str, param: str | None = None, headers=None) -> JSONResponse:
    return JSONResponse(error_object(status, message, kind, param), status_code=status, headers=headers)


def unauthenticated() -> JSONResponse:
    return _json(401, "missing or wrong bearer token (header 'Authorization: Bearer <token>')",
                 "authentication_error", headers={"WWW-Authenticate": "Bearer"})


def busy(message: str) -> JSONResponse:
    """Every request slot taken (request_slots.py): the client should come back shortly."""
    return _json(429, message, "rate_limit_error", headers={"Retry-After": "1"})


def overloaded(message: str) -> JSONResponse:
    """Every connection the router keeps open has a request in flight (http_connections.py)."""
    return _json(503, message, "service_unavailable", headers={"Retry-After": "1", "Connection": "close"})


def _status(exc: InvalidRequest | RequestError) -> tuple[int, str]:
    return (400, "invalid_request_error") if isinstance(exc, InvalidRequest) else _BY_ERROR_CODE[exc.code]


def body(exc: InvalidRequest | RequestError) -> dict:
    """The error object of a request that failed in frontend.py; also a failed stream's last event."""
    status, kind = _status(exc)
    return error_object(status, str(exc), kind)


def response(exc: InvalidRequest | RequestError) -> JSONResponse:
    return JSONResponse(body(exc), status_code=_status(exc)[0])


def install(app: FastAPI) -> None:
    """Every error the app can raise becomes an OpenAI error object."""

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        """A body that is not JSON or does not fit the request models: each problem with where it is."""
        problems, params = [], []
        for error in exc.errors():
            if error["type"] == "json_invalid":
                problems.append(f"the body is not JSON: {error['ctx']['error']} (at character {error['loc'][-1]})")
                continue
            where = ".".join(str(part) for part in error["loc"] if part != "body")
            params.append(where)
            # A refusal of ours names its field already (openai_protocol.py); pydantic's messages do not.
            problems.append(error["msg"] if error["type"] == "unsupported" or not where else f"{where}: {error['msg']}")
        return _json(400, "; ".join(problems), "invalid_request_error", params[0] if params else None)

    @app.exception_handler(UnknownModel)
    async def unknown_model(request: Request, exc: UnknownModel) -> JSONResponse:
        return _json(404, str(exc), "invalid_request_error", "model")

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> JSONResponse:
        """Starlette's own: a path or method it does not have, a body over the limit it counted."""
        return _json(exc.status_code, str(exc.detail), "invalid_request_error", headers=exc.headers)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        """Its text goes to the log, under the id the client is given (control/request.py, internal_error)."""
        return _json(500, str(internal_error(exc)), "server_error")
