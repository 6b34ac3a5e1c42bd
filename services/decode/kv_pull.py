"""Pulling a request's KV pages from a prefill's pool into the decode's own pool.

Each prefill pool is opened once, when the router announces it (PoolAvailable), by the first kind
of its handles that kv.transfer allows and that opens here (shared/kv/transfer/choice.py), through
the backend that kind and this decode's device call for, and kept until the prefill goes away
(PoolGone) or is replaced by a new incarnation. A prefill and a decode of tensor parallelism pair
rank by rank: this decode rank opens the pool of each prefill rank that holds some of its KV
heads (PrefillPool), and takes those heads from it, never through another rank. Per request
exactly the prompt's pages move, in one transfer; landed() and failed() report each finished
transfer once. A transfer that is not stream-ordered and has not finished within the timeout is
cancelled and reported failed; a stream-ordered one ends with the decode's own stream, which the
router's progress timeout watches.

The pages of a request dropped before its pages landed (aborted, failed) go back to the pool
through drop(): at once, or, while a cancelled remote read may still write into them, once it
has settled (shared/kv/transfer/base.py).
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np
import structlog

from shared.config.schema import KvConfig
from shared.control import wire
from shared.control.messages import DecodeTask, KvLayout, KvPoolHandle
from shared.kv.pages import pages_for, pulled_indices, ring_row
from shared.kv.pool import PagedKvPool
from shared.kv.transfer import Backend, Source, Transfer, TransferError, TransferState, backend_for, usable_handles
from shared.kv.transfer.base import AllOf, HeadSlice, whole_pages_only
from shared.kv.transfer.choice import heads_from
from shared.kv.transfer.local_copy import JointCopy
from shared.kv.transfer.nixl import NixlBackend
from shared.kv.transfer.nixl_network import LOOPBACK

log = structlog.get_logger()


class HandoffError(RuntimeError):
    pass


class PrefillPool:
    """A prefill's pool as this decode rank pulls from it: a Source per prefill rank that holds
    some of our KV heads, and which of them each fills (None: whole pages, the same heads)."""

    def __init__(self, pieces: list[tuple[Source, HeadSlice | None]]):
        self.pieces = pieces
        self.sources = list(dict.fromkeys(source for source, _ in pieces))

    def start(self, request_id: str, src_pages: np.ndarray, dst_pages: list[int]) -> Transfer:
        copies: list[Transfer] = []
        try:
            for source, heads in self.pieces:
                copies.append(source.start(request_id, src_pages, dst_pages, heads))
        except TransferError as exc:
            if not copies:
                raise
            started = AllOf(copies)  # failed, yet what it started must settle before its pages go back
            started.cancel(str(exc))
            return started
        # Several pieces come only from a backend with head_slices (KvPuller._open): copies on the
        # decode's stream, which land in order, or reads that land each on their own (NIXL).
        if len(copies) == 1:
            return copies[0]
        return JointCopy(copies) if copies[0].stream_ordered else AllOf(copies)

    def close(self) -> None:
        for source in self.sources:
            source.close()


class KvPuller:
    def __init__(self, local: PagedKvPool, scratch_page: int, free_pages: Callable[[list[int]], None],
                 transfer_timeout_s: float = KvConfig.transfer_timeout_s, transfer: str = KvConfig.transfer,
                 nixl_net_devices: str = LOOPBACK, kv_heads: range | None = None):
        """scratch_page: a page of local that the backends may overwrite (to warm up the transfer
        from a newly opened pool before a request needs it); free_pages: gives pages back to the
        decode's allocator; transfer: kv.transfer, the kinds this decode pulls with;
        nixl_net_devices: where its NIXL agent, if it needs one, listens (shared/kv/transfer/nixl_network.py);
        kv_heads: the model's KV heads this decode rank holds, in its pool's order (None: all of
        them, a decode without tensor parallelism)."""
        self.kv_heads = kv_heads if kv_heads is not None else range(local.layout.num_kv_heads)
        if len(self.kv_heads) != local.layout.num_kv_heads:
            raise ValueError(f"{len(self.kv_heads)} KV heads for a pool of {local.layout.num_kv_heads}")
        self.local = local
        self.scratch_page = scratch_page
        self.free_pages = free_pages
        self.transfer_timeout_s = transfer_timeout_s
        self.transfer = transfer
        self.nixl_net_devices = nixl_net_devices
        self.backends: dict[type[Backend], Backend] = {}
        self.pools: dict[str, PrefillPool] = {}
        self.offered: dict[str, list[KvPoolHandle]] = {}  # prefill id -> the handles its pool came with
        self.unmappable: dict[str, str] = {}  # prefill id -> why its pool could not be opened
        self.in_flight: list[Transfer] = []   # in start order
        self._landed: list[Transfer] = []
        self._failed: list[Transfer] = []
        self._unsettled: dict[str, Transfer] = {}  # failed, still writing: by request id, until dropped
        self.settling: list[tuple[Transfer, list[int]]] = []  # dropped, still writing: their pages wait

    @property
    def copying(self) -> bool:
        """Some transfer has not been reported by landed() or failed() yet."""
        return bool(self.in_flight or self._landed or self._failed)

    def map_pool(self, prefill_worker_id: str, handles: list[KvPoolHandle]) -> None:
        if self.offered.get(prefill_worker_id) == handles and prefill_worker_id in self.pools:
            return
        self.unmap_pool(prefill_worker_id)
        self.offered[prefill_worker_id] = handles
        usable = usable_handles(handles, self.transfer)
        failures = [] if usable else [f"kv.transfer is {self.transfer}, the pool is offered by "
                                      f"{', '.join(h.backend for h in handles) or 'nothing'}"]
        for kind in dict.fromkeys(handle.backend for handle in usable):
            try:
                pool = self._open(prefill_worker_id, [h for h in usable if h.backend == kind])
            except (RuntimeError, OSError, ValueError) as exc:  # TransferError is a RuntimeError
                failures.append(f"{kind}: {exc}")
                continue
            self.pools[prefill_worker_id] = pool
            log.info("mapped prefill pool", prefill=prefill_worker_id, backend=kind, ranks=len(pool.sources),
                     pages=pool.sources[0].handle.layout.num_pages, passed_over=failures)
            return
        self.unmappable[prefill_worker_id] = "; ".join(failures)
        raise HandoffError(f"cannot open the pool of {prefill_worker_id}: {self.unmappable[prefill_worker_id]}")

    def _open(self, prefill_worker_id: str, handles: list[KvPoolHandle]) -> PrefillPool:
        """A pool from the handles of one kind that hold our heads; TransferError if one is
        missing, a handle does not open, or the backend cannot move the heads as they lie."""
        plan = heads_from(handles, self.kv_heads)
        for handle, _ in plan:
            self._check_layout(handle.layout)
        kind = backend_for(plan[0][0], self.local.kv.device)
        if not kind.head_slices and any(heads is not None for _, heads in plan):
            raise whole_pages_only(plan[0][0].backend)
        backend = self._backend(kind)
        sources: dict[KvPoolHandle, Source] = {}
        try:
            for handle in dict.fromkeys(handle for handle, _ in plan):
                sources[handle] = backend.open(prefill_worker_id, handle)
        except BaseException:
            for source in sources.values():
                source.close()
            raise
        return PrefillPool([(sources[handle], heads) for handle, heads in plan])

    def _check_layout(self, layout: KvLayout) -> None:
        """Ours but for the head count, which tensor parallelism divides."""
        local = self.local.layout
        if (layout.num_layers, layout.page_size, layout.head_dim, layout.dtype, layout.shards_per_layer) != (
                local.num_layers, local.page_size, local.head_dim, local.dtype, local.shards_per_layer):
            raise TransferError(f"its layout is {layout}, ours is {local}")

    def _backend(self, kind: type[Backend]) -> Backend:
        if kind not in self.backends:
            network = (self.nixl_net_devices,) if kind is NixlBackend else ()
            self.backends[kind] = kind(self.local, self.scratch_page, *network)
        return self.backends[kind]

    def unmap_pool(self, prefill_worker_id: str) -> None:
        self.unmappable.pop(prefill_worker_id, None)
        self.offered.pop(prefill_worker_id, None)
        pool = self.pools.pop(prefill_worker_id, None)
        if pool is not None:
            pool.close()

    def pull(self, task: DecodeTask, local_pages: list[int]) -> Transfer:
        """Starts moving the task's prompt pages into local_pages, the request's pages as the decode
        holds them: one a prompt page, or, fewer under a sliding window, a ring (shared/kv/pages.py)
        that takes only the last of them. landed() says when they are there."""
        pool = self.pools.get(task.prefill_worker_id)
        if pool is None:
            why = self.unmappable.get(task.prefill_worker_id, "not announced")
            raise HandoffError(f"no mapped pool for prefill {task.prefill_worker_id} ({why})")
        count = pages_for(task.num_tokens, self.local.layout.page_size)
        try:
            src_ids = np.frombuffer(wire.unpack_page_ids(task.src_page_ids), dtype=np.intc)
            if len(src_ids) < count:
                raise ValueError(f"{len(src_ids)} page ids for a prompt of {count} pages")
            pulled = pulled_indices(count, len(local_pages))
            row = ring_row(local_pages, count)
            transfer = pool.start(task.request_id, src_ids[pulled.start:pulled.stop], row[pulled.start:pulled.stop])
        except (TransferError, ValueError) as exc:  # WireError is a ValueError
            raise HandoffError(f"page ids do not fit the prefill pool: {exc}") from None
        self.in_flight.append(transfer)
        return transfer

    def landed(self) -> list[Transfer]:
        """Every transfer whose pages are in the pool, each reported once; never waits for one."""
        self._poll()
        landed, self._landed = self._landed, []
        return landed

    def failed(self) -> list[Transfer]:
        """Every transfer that failed (its error says why), each reported once."""
        self._poll()
        failed, self._failed = self._failed, []
        return failed

    def drop(self, request_id: str, pages: list[int]) -> None:
        """The request is gone before its pages landed (aborted, or its transfer failed): its
        transfer, if unfinished, ends unreported, and its pages go back to the allocator as soon
        as nothing writes into them."""
        transfer = self._unsettled.pop(request_id, None)
        for unfinished in [t for t in self.in_flight if t.request_id == request_id]:
            unfinished.cancel("the request ended")
            self.in_flight.remove(unfinished)
            transfer = unfinished
        if transfer is None or transfer.settled():
            self.free_pages(pages)
        else:
            self.settling.append((transfer, pages))

    def _poll(self) -> None:
        waiting = []
        for transfer, pages in self.settling:
            if transfer.settled():
                self.free_pages(pages)
            else:
                waiting.append((transfer, pages))
        self.settling = waiting
        still = []
        for transfer in self.in_flight:
            state = transfer.poll()
            if not state.finished and not transfer.stream_ordered and (
                    time.perf_counter() - transfer.started_at > self.transfer_timeout_s):
                transfer.cancel(f"not done within {self.transfer_timeout_s:g} s ({state.name.lower()})")
            if transfer.state is TransferState.DONE:
                self._landed.append(transfer)
            elif transfer.state is TransferState.FAILED:
                self._failed.append(transfer)
                if not transfer.settled():
                    self._unsettled[transfer.request_id] = transfer
            else:
                still.append(transfer)
        self.in_flight = still

    def close(self) -> None:
        for prefill_worker_id in list(self.pools):
            self.unmap_pool(prefill_worker_id)
