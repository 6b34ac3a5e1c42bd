"""The router's HTTP connections (services/router/api/http_connections.py), in-process: the router's
own HttpServer on a real socket, with a small ASGI app whose requests a test can hold in flight,
and clients on raw sockets. The bounds on the real stack: tests/test_caps.py."""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from starlette.applications import Starlette
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from services.router.api.http_server import HttpServer
from shared.config.schema import RouterConfig
from tests.connections import closed_by_peer
from tests.stack import free_port

WAIT_S = 30.0  # for what the server does within its configured timeouts, on a loaded machine


class App:
    """/health answers at once; /hold answers once the test releases it; /flood streams until its client leaves."""

    def __init__(self):
        self.release = threading.Event()
        self.holding = 0
        self.flood_ended = threading.Event()
        self.app = Starlette(routes=[Route("/health", self.health), Route("/hold", self.hold),
                                     Route("/flood", self.flood)])

    async def health(self, request) -> Response:
        return Response("ok")

    async def hold(self, request) -> Response:
        self.holding += 1
        await asyncio.to_thread(self.release.wait, WAIT_S)
        return Response("held")

    async def flood(self, request) -> StreamingResponse:
        async def chunks():
            try:
                while True:
                    yield b"x" * 65536
                    await asyncio.sleep(0)  # as a real stream waits for its next token
            finally:
                self.flood_ended.set()
        return StreamingResponse(chunks())


@pytest.fixture
def serve() -> Iterator[Callable[..., tuple[HttpServer, App]]]:
    """Starts an HttpServer with the given router settings on an event loop of its own."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    servers: list[HttpServer] = []

    def start(**settings) -> tuple[HttpServer, App]:
        app = App()
        server = HttpServer(app.app, RouterConfig(http_address=f"127.0.0.1:{free_port()}", grace_period_s=1.0,
                                                  **settings))

        async def started() -> None:
            server.start(on_failure=lambda exc: None)

        asyncio.run_coroutine_threadsafe(started(), loop).result(WAIT_S)
        servers.append(server)
        return server, app

    yield start
    for server in servers:
        asyncio.run_coroutine_threadsafe(server.stop(), loop).result(WAIT_S)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(WAIT_S)


def _connect(server: HttpServer, receive_buffer: int | None = None) -> socket.socket:
    host, _, port = server.address.rpartition(":")
    sock = socket.socket()
    if receive_buffer is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, receive_buffer)
    sock.connect((host, int(port)))
    sock.settimeout(WAIT_S)
    return sock


def _get(server: HttpServer, path: str) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection(server.address, timeout=WAIT_S)
    try:
        connection.request("GET", path)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def test_a_connection_that_sends_nothing_or_half_a_head_is_closed(serve):
    """uvicorn alone starts no timer before a first answer, and stops its timer at any byte."""
    server, _ = serve(connection_idle_timeout_s=0.5)
    silent, slow = _connect(server), _connect(server)
    slow.sendall(b"GET /health HTTP/1.1\r\nHo")  # a head sent slowly, slowloris style
    kept_alive = _connect(server)
    kept_alive.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    assert kept_alive.recv(65536).startswith(b"HTTP/1.1 200")
    assert [closed_by_peer(s, WAIT_S) for s in (silent, slow, kept_alive)] == [True, True, True]
    assert _get(server, "/health")[0] == 200


def test_idle_connections_beyond_the_bound_make_room_oldest_first(serve):
    server, _ = serve(http_max_connections=3, connection_idle_timeout_s=WAIT_S * 4)
    idle = [_connect(server) for _ in range(10)]
    assert _get(server, "/health") == (200, b"ok")  # it took the place of the eighth idle connection
    assert [closed_by_peer(s, WAIT_S) for s in idle[:8]] == [True] * 8
    for sock in idle[8:]:
        assert not closed_by_peer(sock, 0.5)


def test_with_every_connection_busy_a_new_one_gets_503_as_an_openai_error(serve):
    server, app = serve(http_max_connections=2)
    held = [_connect(server) for _ in range(2)]
    for sock in held:
        sock.sendall(b"GET /hold HTTP/1.1\r\nHost: x\r\n\r\n")
    deadline = time.monotonic() + WAIT_S
    while app.holding < 2:  # both requests in flight: neither connection is idle
        assert time.monotonic() < deadline, "the held requests never arrived"
        time.sleep(0.05)
    status, body = _get(server, "/health")
    assert status == 503, body
    error = json.loads(body)["error"]
    assert (error["type"], error["code"]) == ("service_unavailable", "UNAVAILABLE")
    assert "router.http_max_connections" in error["message"]
    app.release.set()
    for sock in held:
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")
    assert _get(server, "/health") == (200, b"ok")


def test_a_client_that_stops_reading_is_disconnected_after_the_stall_timeout(serve):
    server, app = serve(stall_timeout_s=0.5)
    reader = _connect(server, receive_buffer=4096)
    reader.sendall(b"GET /flood HTTP/1.1\r\nHost: x\r\n\r\n")
    assert app.flood_ended.wait(WAIT_S), "the stream went on for a client that reads nothing"
    assert closed_by_peer(reader, WAIT_S)
    deadline = time.monotonic() + WAIT_S
    while len(server.connections):
        assert time.monotonic() < deadline, "the stalled connection is still counted"
        time.sleep(0.05)
