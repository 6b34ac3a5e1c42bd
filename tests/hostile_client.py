"""A client that misbehaves on purpose, for the chaos test: values out of range over both fronts, a
chat of more messages than the router templates, connections that never send a byte, and streams
whose reader never reads. Each act ends with what it was owed (a refusal of ours, the connection
closed, the stream cancelled) or, while a service restarts, with the router's absence; never with
an internal error or a hang.
"""

from __future__ import annotations

import http.client
import json
import random
import socket
import time

import grpc

from pdserve.v1 import generation_pb2, generation_pb2_grpc
from shared.config.schema import Config
from tests.connections import closed_by_peer

TIMEOUT_S = 30.0
IDLE_CONNECTIONS = 20
UNREAD_LABEL = "x" * 256  # in every chunk: an unread stream fills its 1 KiB window within a few tokens
# What each act may end with: the refusal it is owed, or the router's absence while it restarts.
ABSENT = {"UNAVAILABLE", "unreachable", "503"}
OWED = {"grpc_out_of_range": {"INVALID_ARGUMENT"}, "http_out_of_range": {"400"}, "http_many_messages": {"400"},
        "idle_connections": {"closed by the router"}, "unread_stream": {"CANCELLED"}}


class HostileClient:
    def __init__(self, config: Config, grpc_address: str, http_address: str):
        self.config = config
        self.grpc_address = grpc_address
        self.http_host, _, port = http_address.rpartition(":")
        self.http_port = int(port)
        self.acts = {"grpc_out_of_range": self._grpc_out_of_range, "http_out_of_range": self._http_out_of_range,
                     "http_many_messages": self._http_many_messages, "idle_connections": self._idle_connections,
                     "unread_stream": self._unread_stream}

    def run(self, seed: int, until: float, outcomes: list) -> None:
        """Acts at random until the deadline; appends (act, outcome) for each. An act that has not yet
        got what it is owed (it met a restart) is drawn before the others, so that each gets it."""
        rng = random.Random(seed)
        while time.monotonic() < until:
            unpaid = [act for act in sorted(self.acts) if not any(a == act and self.owed(a, o) for a, o in outcomes)]
            act = rng.choice(unpaid or sorted(self.acts))
            outcomes.append((act, self.acts[act]()))
            time.sleep(rng.uniform(0.5, 1.5))

    @staticmethod
    def owed(act: str, outcome: str) -> bool:
        return outcome in OWED[act]

    @staticmethod
    def allowed(act: str, outcome: str) -> bool:
        return outcome in OWED[act] or outcome in ABSENT

    def _grpc_out_of_range(self) -> str:
        request = generation_pb2.GenerateRequest(prompt="Hello", max_tokens=2, top_k=(1 << 31) - 1)
        with grpc.insecure_channel(self.grpc_address) as channel:
            try:
                list(generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=TIMEOUT_S))
            except grpc.RpcError as error:
                return error.code().name
        return "served"

    def _http_out_of_range(self) -> str:
        return self._post({"model": "embedded", "prompt": "Hello", "max_tokens": 2, "top_k": 1 << 64,
                           "seed": 1 << 64})

    def _http_many_messages(self) -> str:
        messages = [{"role": "user", "content": ""}] * (self.config.router.max_chat_messages + 1)
        return self._post({"model": "embedded", "messages": messages, "max_tokens": 2})

    def _post(self, body: dict) -> str:
        connection = http.client.HTTPConnection(self.http_host, self.http_port, timeout=TIMEOUT_S)
        try:
            connection.request("POST", "/v1/chat/completions" if "messages" in body else "/v1/completions",
                               json.dumps(body), {"Content-Type": "application/json"})
            return str(connection.getresponse().status)
        except OSError:
            return "unreachable"
        finally:
            connection.close()

    def _idle_connections(self) -> str:
        """Connections to both fronts that send nothing: the router closes each within its idle timeout."""
        try:
            idle = [socket.create_connection(address, timeout=TIMEOUT_S) for address in
                    [(self.http_host, self.http_port)] * IDLE_CONNECTIONS +
                    [tuple(self.grpc_address.rsplit(":", 1))] * 4]
        except OSError:
            return "unreachable"
        try:
            wait_s = self.config.router.connection_idle_timeout_s + TIMEOUT_S
            return "closed by the router" if all(closed_by_peer(sock, wait_s) for sock in idle) else "left open"
        finally:
            for sock in idle:
                sock.close()

    def _unread_stream(self) -> str:
        """A stream whose client reads a chunk, then nothing for longer than router.stall_timeout_s,
        again and again: a window of 1 KiB, never grown. The router cancels it once a write has
        waited that long, and the client reads the status after the chunks its window held. Tokens
        may stop coming for a while (on a loaded machine, or while the request moves from a killed
        decode), and a stream with nothing to send does not stall: so the client pauses after every
        chunk, not only after its first (a CI run read on after one pause that met such a gap, and
        its 400 tokens ran past the deadline)."""
        options = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]
        request = generation_pb2.GenerateRequest(prompt="Tell me a long story.", max_tokens=400, ignore_eos=True,
                                                 temperature=0, request_id=UNREAD_LABEL)
        with grpc.insecure_channel(self.grpc_address, options=options) as channel:
            call = generation_pb2_grpc.GenerationStub(channel).Generate(request, timeout=TIMEOUT_S * 3)
            try:
                for _ in call:
                    time.sleep(self.config.router.stall_timeout_s + 2)
            except grpc.RpcError as error:
                return error.code().name
        return "served"
