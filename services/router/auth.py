"""Who may call the router over gRPC: TLS for the channel, a bearer token for each call.

Both are optional (router.tls_cert_file/tls_key_file, router.auth_token_file/auth_token). With a
token, every call must carry `authorization: Bearer <token>` or ends UNAUTHENTICATED before it
reaches a servicer: Generation, ListWorkers and reflection alike. Only the health service stays
open, for load balancers and probes that hold no token.
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


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, token: str):
        self._expected = f"Bearer {token}".encode()
        self._deny = grpc.unary_unary_rpc_method_handler(_unauthenticated)

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        if details.method.startswith(OPEN_PREFIX) or self._authorized(details.invocation_metadata):
            return await continuation(details)
        return self._deny

    def _authorized(self, metadata) -> bool:
        value = next((v for k, v in metadata or () if k == "authorization"), None)
        if value is None:
            return False
        return hmac.compare_digest(value.encode() if isinstance(value, str) else value, self._expected)


def interceptors(router: RouterConfig) -> list[grpc.aio.ServerInterceptor]:
    token = router.bearer_token()
    return [BearerTokenInterceptor(token)] if token else []
