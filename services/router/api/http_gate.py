"""What an OpenAI API request passes before a byte of its body is read: the bearer token, then a
request slot (request_slots.py), which it holds until its last byte is sent.

An ASGI middleware in front of the whole app, because FastAPI reads and parses a body before it runs
a route's dependencies: a client without the token could make the router parse 4 MiB of JSON
(router.max_request_bytes) and learn from the 400 that it was read. Only /v1/ is gated: /health
stays open to probes, and never waits for a slot.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from services.router.api import openai_errors as errors
from services.router.api.auth import BearerToken
from services.router.api.request_slots import RequestSlots

GATED_PREFIX = "/v1/"


class HttpGate:
    def __init__(self, app: ASGIApp, token: BearerToken | None, slots: RequestSlots):
        self.app, self.token, self.slots = app, token, slots

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(GATED_PREFIX):
            await self.app(scope, receive, send)
        elif self.token is not None and not self.token.admits(_header(scope, b"authorization")):
            await errors.unauthenticated()(scope, receive, send)
        elif not self.slots.take():
            await errors.busy(self.slots.refusal())(scope, receive, send)
        else:
            try:
                await self.app(scope, receive, send)
            finally:
                self.slots.give_back()


def _header(scope: Scope, name: bytes) -> bytes | None:
    return next((value for key, value in scope["headers"] if key == name), None)
