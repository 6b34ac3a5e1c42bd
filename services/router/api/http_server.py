"""uvicorn serving the OpenAI API (openai_api.py) as one more task on the router's event loop.

uvicorn.Server.serve() is a coroutine, so it runs on the uvloop loop that grpc.aio and the token
router already use. Three things differ from uvicorn run on its own: it leaves SIGINT and SIGTERM to
the router, which stops the fronts before the token router; the socket is bound here, before
serving starts, so a port already taken stops the router at start, as a taken gRPC port does; and
each connection is uvicorn's h11 protocol with the bounds of http_connections.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket

import structlog
import uvicorn

from services.router.api.http_connections import Connections, protocol_factory
from shared.config.schema import RouterConfig
from shared.runtime.tasks import OnFailure, spawn

log = structlog.get_logger()


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        """uvicorn would replace the router's signal handlers with its own: keep the router's."""
        yield


def _bind(address: str) -> socket.socket:
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    return socket.create_server((host, int(port)), family=socket.AF_INET6 if ":" in host else socket.AF_INET)


class HttpServer:
    def __init__(self, app, router: RouterConfig):
        self.address = router.http_address
        self.connections = Connections(router.http_max_connections, router.stall_timeout_s)
        self.server = _Server(uvicorn.Config(
            app, ssl_certfile=router.tls_cert_file or None, ssl_keyfile=router.tls_key_file or None,
            # One summary line per request comes from the token router; uvicorn's own loggers stay
            # unconfigured, so only its warnings and errors reach stderr.
            log_config=None, access_log=False, lifespan="off",
            # No WebSocket: an upgraded connection would leave the protocol that counts it.
            http=protocol_factory(self.connections), ws="none",
            timeout_keep_alive=router.connection_idle_timeout_s,
            # In-flight requests get the grace period, as gRPC streams do; then they are cancelled.
            timeout_graceful_shutdown=router.grace_period_s))
        self.task: asyncio.Task | None = None

    def start(self, on_failure: OnFailure) -> None:
        """on_failure: called if uvicorn dies with an exception (shared/runtime/tasks.py)."""
        listener = _bind(self.address)
        self.task = spawn(self.server.serve(sockets=[listener]), "http", on_failure)
        log.info("http serving", address=self.address, tls=self.server.config.ssl_certfile is not None)

    async def stop(self) -> None:
        """Stops taking connections, lets requests in flight finish within the grace period, cancels the rest."""
        self.server.should_exit = True
        await asyncio.wait([self.task])  # an exception of its went to on_failure already
