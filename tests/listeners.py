"""Where a process listens for TCP, read from /proc: what the NIXL tests check their agents' sockets with."""

from __future__ import annotations

import ipaddress
import os
from pathlib import Path


def _socket_address(hex_address: str) -> tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]:
    """/proc/net/tcp's local address and port: IPv4 as a little-endian word, IPv6 as four of them."""
    host, _, port = hex_address.partition(":")
    raw = bytes.fromhex(host)
    if len(raw) == 4:
        return ipaddress.IPv4Address(raw[::-1]), int(port, 16)
    address = ipaddress.IPv6Address(b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4)))
    return address.ipv4_mapped or address, int(port, 16)


def listening_sockets(pid: int) -> list[tuple]:
    """Where the process listens for TCP: its sockets' inodes, looked up in its network namespace's tables."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except FileNotFoundError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    return [_socket_address(fields[1]) for table in ("tcp", "tcp6")
            for fields in map(str.split, Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:])
            if fields[3] == "0A" and fields[9] in inodes]  # 0A: LISTEN
