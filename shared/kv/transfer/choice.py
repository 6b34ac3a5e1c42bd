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

A prefill of tensor-parallel ranks has a pool per rank, each holding some of the model's KV heads
(KvPoolHandle.first_kv_head): its handles are, for each kind best first, every rank's handle of
that kind in rank order (handles_of_ranks). A decode rank takes the first kind whose handles hold
all of its own heads, each head from the first handle that holds it (a head replicated on several
ranks comes from the lowest), and opens those handles (heads_from); a kind that misses a head, or
one of whose handles does not open, falls through to the next as a single handle does.
"""

from __future__ import annotations

from shared.control.messages import KvPoolHandle
from shared.kv.transfer.base import HeadSlice, TransferError

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


def handles_of_ranks(handles_by_rank: list[list[KvPoolHandle]]) -> list[KvPoolHandle]:
    """A prefill's handles for Register, from each rank's (best first): by kind, then by rank."""
    kinds = dict.fromkeys(handle.backend for handles in handles_by_rank for handle in handles)
    return [handle for kind in kinds for handles in handles_by_rank for handle in handles if handle.backend == kind]


def heads_from(handles: list[KvPoolHandle], needed: range) -> list[tuple[KvPoolHandle, HeadSlice | None]]:
    """Where a decode rank's KV heads (needed, its local heads in order) come from, in runs of
    consecutive heads from one handle: (handle, heads), heads None for its whole pages (the
    handle holds exactly our heads). TransferError naming a head that no handle holds."""
    runs: list[tuple[KvPoolHandle, list[int]]] = []
    for ours, head in enumerate(needed):
        holder = next((h for h in handles if head in held_heads(h)), None)
        if holder is None:
            held = ", ".join(f"{r.start}-{r.stop - 1}" for r in map(held_heads, handles))
            raise TransferError(f"no handle holds KV head {head} (they hold heads {held})")
        if runs and runs[-1][0] is holder:
            runs[-1][1][2] += 1
        else:
            runs.append((holder, [head - holder.first_kv_head, ours, 1]))
    whole = len(runs) == 1 and held_heads(runs[0][0]) == needed
    return [(handle, None if whole else tuple(heads)) for handle, heads in runs]


def held_heads(handle: KvPoolHandle) -> range:
    return range(handle.first_kv_head, handle.first_kv_head + handle.layout.num_kv_heads)
