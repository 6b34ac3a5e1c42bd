"""Between hosts: the decode READs a request's pages out of the prefill's pool with NIXL, over UCX.

    prefill: NixlExport registers its pool's buffer (host or device memory) with its own agent
             once; the handle's locator carries the agent's metadata and the buffer's address,
             size, memory type and device, from which a peer builds its descriptors.
    decode:  NixlBackend registers the decode's pool once and prepares its descriptors;
             NixlSource, per prefill pool, loads the prefill's agent (add_remote_agent) and
             prepares the remote descriptors; NixlRead, per request, is one prepared READ of
             exactly the request's pages in every shard (shared/kv/pool.py shard_regions),
             the request id as its notification to the prefill. Between a prefill and a decode
             of different tensor-parallel sizes a decode rank reads some heads of each page
             from each prefill rank that holds them: one READ per prefill rank, of descriptors
             made for the request (a run of heads per token: nixl_agent.head_regions), all of
             them one transfer to the decode (AllOf).

Nothing here waits: a read is posted and then polled. A read cannot be called back: releasing an
unfinished one returned at once here, yet its bytes went on landing in the decode's pages (seen
over TCP with a stopped prefill). So cancel() only fails the request; the read keeps its handle
until settled(), when NIXL reports it over (done, or failed because the prefill is gone), and
the decode reuses its pages only then. For the same reason a prefill's agent is removed only
once no read from it is unsettled (removing it made NIXL lose track of a read whose bytes still
came); it is removed then, so a restarted prefill's new agent never meets a stale one.
"""

from __future__ import annotations

from collections import Counter

import msgpack
import numpy as np
import structlog
import torch

from shared.control.messages import KvLayout, KvPoolHandle
from shared.kv.pool import PagedKvPool, allocate_local_pool, layout_bytes, shard_regions
from shared.kv.transfer.base import Backend, HeadSlice, Source, Transfer, TransferError, TransferState
from shared.kv.transfer.nixl_agent import descriptor_ids, head_regions, memory_of, new_agent, page_regions
from shared.kv.transfer.nixl_network import LOOPBACK

log = structlog.get_logger()

BACKEND = "nixl"
LOCAL = "NIXL_INIT_AGENT"  # NIXL's name for this agent's own side of a transfer


class NixlExport:
    """A prefill's pool registered with a NIXL agent. pool: another export's pool to register as
    well (kv.transfer auto: shared memory for the host's decodes, NIXL for the others), which that
    export owns; None: a pool of its own. net_devices: where the agent listens (nixl_network.py)."""

    def __init__(self, layout: KvLayout, name_hint: str, device: torch.device, pool: PagedKvPool | None = None,
                 net_devices: str = LOOPBACK, first_kv_head: int = 0):
        self._buffer = None
        if pool is None:
            pool, self._buffer = allocate_local_pool(layout, device)
        self.pool = pool
        self.agent = new_agent(name_hint, net_devices)
        memory = memory_of(pool)
        address, size, kind, device_id = memory
        self._registered = self.agent.register_memory([(address, size, device_id, "")], kind)
        # The metadata names the registered memory, so it is taken after the registration.
        locator = msgpack.packb([self.agent.get_agent_metadata(), *memory], use_bin_type=True)
        self.handle = KvPoolHandle(BACKEND, locator, layout, first_kv_head)

    def read_notices(self) -> list[str]:
        """The request ids whose pages decodes have finished reading since the last call (each
        read's notification). Taking them keeps the agent's list of them from growing."""
        notices = self.agent.get_new_notifs()
        return [message.decode(errors="replace") for messages in notices.values() for message in messages]

    def close(self) -> None:
        if self.agent is None:
            return
        self.agent.deregister_memory(self._registered)
        self.agent = self.pool = self._buffer = None


class NixlBackend(Backend):
    """The decode's agent, its pool registered and its descriptors prepared once, and the
    prefills' agents it has loaded, each counted by the sources that use it."""

    device_types = ("cpu", "cuda")  # UCX moves host and device memory alike
    head_slices = True

    def __init__(self, local: PagedKvPool, scratch_page: int, net_devices: str = LOOPBACK):
        super().__init__(local, scratch_page)
        self.agent = new_agent("decode", net_devices)
        self.memory = memory = memory_of(local)
        address, size, self.kind, device_id = memory
        self._registered = self.agent.register_memory([(address, size, device_id, "")], self.kind)
        self.descriptors = self.agent.prep_xfer_dlist(LOCAL, page_regions(memory, local.layout), self.kind)
        self.num_shards = len(shard_regions(local.layout))
        self.remote_users: Counter[str] = Counter()

    def open(self, prefill_worker_id: str, handle: KvPoolHandle) -> NixlSource:
        return NixlSource(self, prefill_worker_id, handle)

    def load_remote(self, metadata: bytes) -> str:
        try:
            name = self.agent.add_remote_agent(metadata).decode()
        except Exception as exc:  # the bindings raise their own exception types
            raise TransferError(f"cannot load the prefill's NIXL agent: {exc}") from None
        self.remote_users[name] += 1
        return name

    def unload_remote(self, name: str) -> None:
        self.remote_users[name] -= 1
        if self.remote_users[name] == 0:
            del self.remote_users[name]
            self.agent.remove_remote_agent(name)
            log.info("removed a prefill's NIXL agent", agent=name)


def parse_locator(handle: KvPoolHandle) -> tuple[bytes, tuple[int, int, str, int]]:
    """The agent's metadata and the pool's memory (address, size, memory type, device id)."""
    try:
        metadata, address, size, kind, device_id = msgpack.unpackb(handle.locator, raw=False, max_bin_len=1 << 20)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise TransferError(f"malformed NIXL pool handle: {exc}") from None
    if not (isinstance(metadata, bytes) and kind in ("DRAM", "VRAM")
            and all(type(v) is int and v >= 0 for v in (address, size, device_id))):
        raise TransferError("malformed NIXL pool handle")
    if size < layout_bytes(handle.layout):
        raise TransferError(f"the NIXL pool holds {size} bytes, less than its layout's {layout_bytes(handle.layout)}")
    return metadata, (address, size, kind, device_id)


class NixlSource(Source):
    def __init__(self, backend: NixlBackend, prefill_worker_id: str, handle: KvPoolHandle):
        super().__init__(prefill_worker_id, handle)
        metadata, memory = parse_locator(handle)
        self.memory = memory
        self.backend = backend
        agent = backend.agent
        self.remote = backend.load_remote(metadata)
        try:
            self.descriptors = agent.prep_xfer_dlist(self.remote, page_regions(memory, handle.layout), memory[2])
            # Connect now: over TCP the first read would otherwise spend a second or two connecting.
            agent.make_connection(self.remote)
        except Exception as exc:
            backend.unload_remote(self.remote)
            raise TransferError(f"cannot prepare reads from {prefill_worker_id}'s NIXL agent: {exc}") from None
        self.users = 1  # this source until closed, and each of its reads until settled

    def start(self, request_id: str, src_pages: np.ndarray, dst_pages: list[int],
              heads: HeadSlice | None = None) -> NixlRead:
        """heads (ours first, the decode's first, count): only those heads of each page."""
        backend, layout = self.backend, self.handle.layout
        dst = np.asarray(dst_pages, dtype=np.int64)
        if len(src_pages) != len(dst):
            raise TransferError(f"{len(src_pages)} source and {len(dst)} destination pages")
        if len(dst) and (src_pages.min() < 0 or src_pages.max() >= layout.num_pages):
            raise TransferError(f"source page ids outside [0, {layout.num_pages})")
        if len(dst) and (dst.min() < 0 or dst.max() >= backend.local.layout.num_pages):
            raise TransferError(f"destination page ids outside [0, {backend.local.layout.num_pages})")
        try:
            if heads is None:
                handle = backend.agent.make_prepped_xfer(
                    "READ", backend.descriptors, descriptor_ids(dst, backend.num_shards, backend.local.layout.num_pages),
                    self.descriptors, descriptor_ids(src_pages, backend.num_shards, layout.num_pages),
                    request_id.encode())
            else:
                handle = self._read_heads(request_id, src_pages, dst, heads)
        except Exception as exc:
            raise TransferError(f"cannot prepare the NIXL read: {exc}") from None
        read = NixlRead(request_id, self, handle)
        read.follow(backend.agent.transfer)
        return read

    def _read_heads(self, request_id: str, src_pages: np.ndarray, dst: np.ndarray, heads: HeadSlice):
        backend, (src_first, dst_first, count) = self.backend, heads
        agent = backend.agent
        local = agent.get_xfer_descs(head_regions(backend.memory, backend.local.layout, dst, dst_first, count),
                                     backend.kind)
        remote = agent.get_xfer_descs(head_regions(self.memory, self.handle.layout, src_pages, src_first, count),
                                      self.memory[2])
        return agent.initialize_xfer("READ", local, remote, self.remote, request_id.encode())

    def close(self) -> None:
        """Lets go of the pool now; its agent goes once the last read from it has settled."""
        self.release_user()

    def release_user(self) -> None:
        self.users -= 1
        if self.users == 0:
            self.descriptors.release()
            self.backend.unload_remote(self.remote)


class NixlRead(Transfer):
    def __init__(self, request_id: str, source: NixlSource, handle):
        super().__init__(request_id, source.prefill_worker_id)
        self.source = source
        self.handle = handle  # until settled
        source.users += 1

    def follow(self, status_of) -> None:
        """Moves on by what NIXL says of the read: posting it (agent.transfer) or checking it."""
        try:
            status = status_of(self.handle)
        except Exception as exc:  # a peer gone raises (nixlRemoteDisconnectError)
            status = f"{type(exc).__name__}: {exc}"
        if status == "PROC":
            if self.state is TransferState.PREPARING:
                self.advance(TransferState.TRANSFERRING)
        elif status == "DONE":
            self.land()
            self.settled()
        else:
            self.fail(f"NIXL read failed: {status}")
            self.settled()

    def poll(self) -> TransferState:
        if not self.state.finished:
            self.follow(self.source.backend.agent.check_xfer_state)
        return self.state

    def cancel(self, reason: str) -> None:
        """Fails the request; the read itself goes on until settled() (the module docstring)."""
        if not self.state.finished:
            self.fail(reason)

    def settled(self) -> bool:
        if self.handle is None:
            return True
        try:
            running = self.source.backend.agent.check_xfer_state(self.handle) == "PROC"
        except Exception:
            running = False  # an error: the peer is gone, and nothing more comes from it
        if running:
            return False
        self.handle.release()
        self.handle = None
        self.source.release_user()
        return True
