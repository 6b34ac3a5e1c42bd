"""Binding a service's addresses, and what a taken one means.

A port another process holds (most often another pdserve stack on the same host) is no crash: a
restart would find it taken again. So a service that cannot bind one stops with AddressTaken,
which names the setting and the address and exits EXIT_REFUSED, which neither the supervisor nor
systemd restarts; `python -m services.stack` checks every address of its stack before it starts
anything (bind_error).
"""

from __future__ import annotations

import os
import socket
from typing import Callable, TypeVar

import zmq

from shared.control.dispatch import FatalError
from shared.control.messages import EXIT_REFUSED

T = TypeVar("T")


class AddressTaken(FatalError):
    exit_code = EXIT_REFUSED

    def __init__(self, setting: str, address: str, error: object):
        super().__init__(f"{setting} {address} cannot be bound ({error}): another process holds it, maybe "
                         f"another pdserve stack on this host; stop it, or set {setting} to a free address")


def bind_or_refuse(setting: str, address: str, bind: Callable[[], T]) -> T:
    """bind(), the one call that binds `address`; AddressTaken when it cannot (gRPC says so with a
    RuntimeError, ZeroMQ with its own error, the rest with an OSError)."""
    try:
        return bind()
    except (OSError, RuntimeError, zmq.ZMQError) as exc:
        raise AddressTaken(setting, address, exc) from None


def host_and_port(address: str) -> tuple[str, int]:
    """"host:port", "[v6]:port" or ZeroMQ's "tcp://host:port" ("*" for every interface)."""
    host, _, port = address.removeprefix("tcp://").rpartition(":")
    host = host.strip("[]")
    return ("" if host == "*" else host), int(port)


def bind_error(address: str) -> str | None:
    """Why a TCP listener could not bind the address now, as the services bind theirs; None if it could."""
    host, port = host_and_port(address)
    try:
        socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET).close()
    except OSError as exc:
        return os.strerror(exc.errno) if exc.errno else str(exc)
    return None
