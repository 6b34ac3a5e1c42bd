"""Which network a NIXL agent listens and moves pages on (kv.nixl_net_devices).

UCX opens a TCP listener on every network device it may use, every interface of the host unless
told otherwise, and NIXL's data plane has no authentication: a peer that reaches the listener with
a pool's agent metadata can read or write any page. So every agent gets a device list, in UCX's
own terms (UCX_NET_DEVICES), first found of:

    kv.nixl_net_devices           what the operator names ("eth1", "mlx5_0:1")
    UCX_NET_DEVICES               what the operator gave UCX itself
    "lo"                          on an ipc:// control plane: every worker is on this host
    the route to the router       on tcp://: the interface this host reaches router.zmq_address's
                                  host by, the network the stack already talks over

UCX reads its configuration from the environment when an agent's backend starts, so the list is
set there (the UCX backend's own `ucx_devices` parameter left the listeners on every interface,
tried with nixl 1.5.1).
"""

from __future__ import annotations

import fcntl
import ipaddress
import os
import socket
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlsplit

from shared.kv.transfer.base import TransferError

UCX_VARIABLE = "UCX_NET_DEVICES"
LOOPBACK = "lo"
SIOCGIFADDR = 0x8915  # Linux's ioctl for an interface's IPv4 address


def nixl_net_devices(configured: str, zmq_endpoint: str, environ: Mapping[str, str] = os.environ) -> str:
    if configured:
        return configured
    if environ.get(UCX_VARIABLE):
        return environ[UCX_VARIABLE]
    if not zmq_endpoint.startswith("tcp://"):
        return LOOPBACK
    return interface_toward(urlsplit(zmq_endpoint).hostname or "")


def use_net_devices(devices: str) -> None:
    """For the agents this process starts from now on."""
    os.environ[UCX_VARIABLE] = devices


def interface_toward(host: str) -> str:
    """The network interface whose address this host sends from to reach `host`."""
    try:
        family, _, _, _, address = socket.getaddrinfo(host, 9, type=socket.SOCK_DGRAM)[0]
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect(address)  # no packet goes out: a UDP connect only picks the route
            local = ipaddress.ip_address(probe.getsockname()[0].split("%")[0])
    except (OSError, UnicodeError) as exc:
        raise TransferError(f"cannot tell the network toward the router's host {host!r} for NIXL ({exc}): "
                            "set kv.nixl_net_devices") from None
    if local.is_loopback:
        return LOOPBACK
    name = next((name for _, name in socket.if_nameindex() if local in interface_addresses(name)), None)
    if name is None:
        raise TransferError(f"no network interface holds {local}, this host's address toward {host!r}: "
                            "set kv.nixl_net_devices")
    return name


def interface_addresses(name: str) -> set[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    """The interface's IPv4 address (its primary one) and IPv6 addresses."""
    found: set = set()
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            request = name.encode()[:15].ljust(256, b"\0")
            found.add(ipaddress.IPv4Address(fcntl.ioctl(probe.fileno(), SIOCGIFADDR, request)[20:24]))
        except OSError:  # no IPv4 address
            pass
    inet6 = Path("/proc/net/if_inet6")
    for line in inet6.read_text().splitlines() if inet6.exists() else []:
        fields = line.split()
        if fields[-1] == name:
            found.add(ipaddress.IPv6Address(bytes.fromhex(fields[0])))
    return found
