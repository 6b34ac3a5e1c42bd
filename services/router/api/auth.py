"""Who may call the router, over gRPC or HTTP: TLS for the channel, a bearer token for each call.

Both are optional (router.tls_cert_file/tls_key_file, router.auth_token_file/auth_token). With
tokens, every call must carry `authorization: Bearer <one of them>` or ends before it reaches a
handler: UNAUTHENTICATED for Generation, ListWorkers and reflection alike, 401 for the OpenAI API
(services/router/api/openai_api.py). A token may come with a cache salt for its calls' prefix-cache
keys. Only health checks stay open, for load balancers and probes that hold no token.

Admin calls (Drain stops a worker) take the admin token (router.admin_token_file) and no other:
without one configured they are refused, PERMISSION_DENIED, whatever the call carries.
"""

from __future__ import annotations

import hmac
from pathlib import Path

import grpc
from grpc_health.v1 import health

from pdserve.v1 import generation_pb2
from shared.config.schema import RouterConfig

OPEN_PREFIX = f"/{health.SERVICE_NAME}/"
ADMIN_PREFIX = f"/{generation_pb2.DESCRIPTOR.services_by_name['Admin'].full_name}/"


def tls_credentials(router: RouterConfig) -> grpc.ServerCredentials | None:
    if not router.tls_cert_file:
        return None
    return grpc.ssl_server_credentials([(Path(router.tls_key_file).read_bytes(),
                                         Path(router.tls_cert_file).read_bytes())])


def _refusal(code: grpc.StatusCode, message: str) -> grpc.RpcMethodHandler:
    async def refuse(request: bytes, context: grpc.aio.ServicerContext) -> None:
        await context.abort(code, message)
    return grpc.unary_unary_rpc_method_handler(refuse)


class BearerToken:
    """The one check of an `authorization` value, gRPC metadata or HTTP header alike, against the
    tokens configured, each with the cache salt of its calls ("" for none)."""

    def __init__(self, tokens: dict[str, str]):
        self._salts = {f"Bearer {token}".encode(): salt for token, salt in tokens.items()}

    def match(self, authorization: str | bytes | None) -> str | None:
        """The cache salt of the token the value carries, or None when it carries none of them."""
        if authorization is None:
            return None
        given = authorization.encode() if isinstance(authorization, str) else authorization
        found = None
        for expected, salt in self._salts.items():  # each in constant time: no guessing one byte by byte
            if hmac.compare_digest(given, expected):
                found = salt
        return found

    def admits(self, authorization: str | bytes | None) -> bool:
        return self.match(authorization) is not None

    def cache_salt(self, authorization: str | bytes | None) -> str:
        return self.match(authorization) or ""


def bearer_token(router: RouterConfig) -> BearerToken | None:
    tokens = router.bearer_tokens()
    return BearerToken(tokens) if tokens else None


def admin_token(router: RouterConfig) -> BearerToken | None:
    return BearerToken({router.admin_token(): ""}) if router.admin_token_file else None


def authorization(metadata) -> str | bytes | None:
    """The `authorization` value of a call's metadata."""
    return next((value for key, value in metadata or () if key == "authorization"), None)


class AccessInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, token: BearerToken | None, admin: BearerToken | None):
        self._token, self._admin = token, admin
        self._unauthenticated = _refusal(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token "
                                         "(metadata 'authorization: Bearer <token>')")
        self._not_admin = _refusal(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong admin token: Admin calls "
                                   "take router.admin_token_file's token, not the generation token "
                                   "(pdserve --admin-token-file FILE)")
        self._admin_off = _refusal(grpc.StatusCode.PERMISSION_DENIED, "Admin calls are off: set "
                                   "router.admin_token_file to a file holding a token of their own, and send it "
                                   "(pdserve --admin-token-file FILE drain ...)")

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        refusal = self._refusal(details.method, authorization(details.invocation_metadata))
        return refusal if refusal is not None else await continuation(details)

    def _refusal(self, method: str, given: str | bytes | None) -> grpc.RpcMethodHandler | None:
        if method.startswith(OPEN_PREFIX):
            return None
        if method.startswith(ADMIN_PREFIX):
            if self._admin is None:
                return self._admin_off
            return None if self._admin.admits(given) else self._not_admin
        return None if self._token is None or self._token.admits(given) else self._unauthenticated


def interceptors(router: RouterConfig) -> list[grpc.aio.ServerInterceptor]:
    return [AccessInterceptor(bearer_token(router), admin_token(router))]
