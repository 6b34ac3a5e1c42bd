"""Which transfer a prefill offers and a decode uses (kv.transfer), and how "the same host" is known.

A prefill offers its one pool by one or more handles, best first (Register.pool_handles):
    shm, cuda_ipc   that kind alone (shm for a pool in host memory, cuda_ipc for one on a GPU);
    nixl            NIXL alone, for decodes on this host too;
    auto            the host's own kind, and NIXL too when the control plane is tcp://: only then
                    may a decode be on another host, since an ipc:// socket reaches this host alone.
                    The router passes the NIXL handle on only to a decode that cannot open the
                    host's kind (services/router/control/membership.py, first_offer).
A decode takes the first handle that its own kv.transfer allows (auto: any) and that opens here.
That attempt is what tells whether the pair shares a host, not names or addresses: a shared-memory
segment opens only where the prefill's /dev/shm is (its name carries a random token, so another
host cannot hold one of that name), a CUDA IPC handle only where the prefill's GPU is seen (by
UUID). Containers of one host with private /dev/shm count as other hosts, as their memory does.
"""

from __future__ import annotations

from shared.control.messages import KvPoolHandle

TRANSFERS = ("auto", "shm", "cuda_ipc", "nixl")
HOST_KIND = {"cpu": "shm", "cuda": "cuda_ipc"}  # by the type of the pool's device


def offered_kinds(transfer: str, device_type: str, cross_host: bool) -> list[str]:
    """The kinds a prefill exports its pool by, best first. cross_host: decodes may be on other hosts."""
    if transfer != "auto":
        return [transfer]
    return [HOST_KIND[device_type], "nixl"] if cross_host else [HOST_KIND[device_type]]


def usable_handles(handles: list[KvPoolHandle], transfer: str) -> list[KvPoolHandle]:
    """The handles a decode may try, in the prefill's order."""
    return [handle for handle in handles if transfer in ("auto", handle.backend)]
