"""Who may call the router, over gRPC or HTTP: TLS for the channel, a bearer token for each call.

Both are optional (router.tls_cert_file/tls_key_file, router.auth_token_file/auth_token). With a
token, every call must carry `authorization: Bearer <token>` or ends before it reaches a handler:
UNAUTHENTICATED for Generation, ListWorkers and reflection alike, 401 for the OpenAI API
(services/router/api/openai_api.py). Only health checks stay open, for load balancers and probes that
hold no token.
"""

from __future__ import annotations

import hmac
from pathlib import Path

import grpc
from grpc_health.v1 import health

from shared.config import RouterConfig

OPEN_PREFIX = f"/{health.SERVICE_NAME}/"


def tls_credentials(router: RouterConfig) -> grpc.ServerCredentials | None:
    if not router.tls_cert_file:
        return None
    return grpc.ssl_server_credentials([(Path(router.tls_key_file).read_bytes(),
                                         Path(router.tls_cert_file).read_bytes())])


async def _unauthenticated(request: bytes, context: grpc.aio.ServicerContext) -> None:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token (metadata "
                        "'authorization: Bearer <token>')")


class BearerToken:
    """The one check of an `authorization` value, gRPC metadata or HTTP header alike."""

    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()

    def admits(self, authorization: str | bytes | None) -> bool:
        if authorization is None:
            return False
        given = authorization.encode() if isinstance(authorization, str) else authorization
        return hmac.compare_digest(given, self._expected)  # in constant time: no guessing it byte by byte


def bearer_token(router: RouterConfig) -> BearerToken | None:
    token = router.bearer_token()
    return BearerToken(token) if token else None


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, token: BearerToken):
        self._token = token
        self._deny = grpc.unary_unary_rpc_method_handler(_unauthenticated)

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        metadata = details.invocation_metadata or ()
        if details.method.startswith(OPEN_PREFIX) or self._token.admits(
                next((v for k, v in metadata if k == "authorization"), None)):
            return await continuation(details)
        return self._deny


def interceptors(router: RouterConfig) -> list[grpc.aio.ServerInterceptor]:
    token = bearer_token(router)
    return [BearerTokenInterceptor(token)] if token else []
