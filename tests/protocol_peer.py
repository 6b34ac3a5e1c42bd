"""A test's own peer on the router's ZeroMQ socket, speaking the real wire protocol (shared/control/wire.py).

It plays a worker where a real one never misbehaves on purpose: another protocol version, a
peer that forges messages about requests it was not given, a worker that holds a request the
router has forgotten.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import zmq
import zmq.auth

from shared.control import wire
from shared.control.messages import PROTOCOL_VERSION, Heartbeat, KvPoolHandle, ModelFingerprint, Register, Role
from shared.kv.pool import make_layout


class ProtocolPeer:
    def __init__(self, endpoint: str, worker_id: str, role: Role, fingerprint: ModelFingerprint,
                 total_pages: int = 64, page_size: int = 16, max_batch_size: int = 64,
                 incarnation: str = "peer-incarnation", curve: tuple[Path, Path] | None = None):
        """curve: on a tcp:// router, the peer's secret-key certificate and the router's public one."""
        self.worker_id = worker_id
        self.fingerprint = fingerprint
        self.role = role
        self.total_pages = total_pages
        self.page_size = page_size
        self.max_batch_size = max_batch_size if role == Role.DECODE else 0
        self.incarnation = incarnation
        self.epoch = ""
        self._context = zmq.Context()
        self.socket = self._context.socket(zmq.DEALER)
        if curve is not None:
            self.socket.curve_publickey, self.socket.curve_secretkey = zmq.auth.load_certificate(curve[0])
            self.socket.curve_serverkey = zmq.auth.load_certificate(curve[1])[0]
        self.socket.connect(endpoint)

    def close(self) -> None:
        self.socket.close(linger=0)
        self._context.term()

    def send(self, message: object) -> None:
        self.socket.send(wire.encode(message))

    def receive(self, kind: type, timeout_s: float = 10.0) -> object:
        """The next message of that kind, skipping others; TimeoutError if none comes."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if self.socket.poll(left * 1000):
                message = wire.decode(self.socket.recv())
                if isinstance(message, kind):
                    return message
        raise TimeoutError(f"{self.worker_id} received no {kind.__name__} within {timeout_s} s")

    def register(self, protocol_version: int = PROTOCOL_VERSION) -> None:
        handles = []
        if self.role == Role.PREFILL:  # a pool nobody can map: this peer never hands KV over for real
            layout = make_layout(1, self.total_pages, self.page_size, 1, 8, torch.float32)
            handles = [KvPoolHandle("shm", b"pdserve-kv-not-a-segment", layout, 0)]
        self.send(Register(self.worker_id, self.role, protocol_version, self.incarnation, 0, self.total_pages,
                           self.page_size, self.max_batch_size, 0, handles, self.fingerprint))

    def heartbeat(self, holding: list[str] = ()) -> None:
        self.send(Heartbeat(self.worker_id, self.epoch, self.total_pages, 0, 0, 0.0, list(holding)))
