"""Whether a server closed a raw TCP connection: what the idle- and stalled-connection tests ask."""

from __future__ import annotations

import socket


def closed_by_peer(sock: socket.socket, within_s: float) -> bool:
    """Reads whatever the server sends (gRPC's preface, an HTTP answer) until it closes the
    connection; False if it is still open after within_s."""
    sock.settimeout(within_s)
    try:
        while sock.recv(65536):
            pass
        return True
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False
