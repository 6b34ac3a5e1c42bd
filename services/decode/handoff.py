"""Pulling a request's KV pages from a prefill's pool into the decode's own pool.

Each prefill pool is opened once, when the router announces it (PoolAvailable), through the
backend its handle and this decode's device call for (shared/kv_transfer), and kept until the
prefill goes away (PoolGone) or is replaced by a new incarnation. Per request exactly the
prompt's pages move, in one transfer; landed() and failed() report each finished transfer once.
A transfer that is not stream-ordered and has not finished within the timeout is cancelled and
reported failed; a stream-ordered one ends with the decode's own stream, which the router's
progress timeout watches.
"""

from __future__ import annotations

import time

import numpy as np
import structlog

from shared import wire
from shared.config import KvConfig
from shared.kv_pool import PagedKvPool, pages_for
from shared.kv_transfer import Backend, Source, Transfer, TransferError, TransferState, backend_for
from shared.messages import DecodeTask, KvPoolHandle

log = structlog.get_logger()


class HandoffError(RuntimeError):
    pass


class KvPuller:
    def __init__(self, local: PagedKvPool, scratch_page: int,
                 transfer_timeout_s: float = KvConfig.transfer_timeout_s):
        """scratch_page: a page of local that the backends may overwrite (to warm up the transfer
        from a newly opened pool before a request needs it)."""
        self.local = local
        self.scratch_page = scratch_page
        self.transfer_timeout_s = transfer_timeout_s
        self.backends: dict[type[Backend], Backend] = {}
        self.sources: dict[str, Source] = {}
        self.unmappable: dict[str, str] = {}  # prefill id -> why its pool could not be opened
        self.in_flight: list[Transfer] = []   # in start order
        self._landed: list[Transfer] = []
        self._failed: list[Transfer] = []

    @property
    def copying(self) -> bool:
        """Some transfer has not been reported by landed() or failed() yet."""
        return bool(self.in_flight or self._landed or self._failed)

    def map_pool(self, prefill_worker_id: str, handle: KvPoolHandle) -> None:
        current = self.sources.get(prefill_worker_id)
        if current is not None and current.handle == handle:
            return
        self.unmap_pool(prefill_worker_id)
        layout, local = handle.layout, self.local.layout
        try:
            if (layout.num_layers, layout.page_size, layout.num_kv_heads, layout.head_dim, layout.dtype) != (
                    local.num_layers, local.page_size, local.num_kv_heads, local.head_dim, local.dtype):
                raise TransferError(f"its layout is {layout}, ours is {local}")
            self.sources[prefill_worker_id] = self._backend(handle).open(prefill_worker_id, handle)
        except (TransferError, OSError, ValueError) as exc:
            self.unmappable[prefill_worker_id] = str(exc)
            raise HandoffError(f"cannot open the pool of {prefill_worker_id}: {exc}") from None
        log.info("mapped prefill pool", prefill=prefill_worker_id, backend=handle.backend, pages=layout.num_pages)

    def _backend(self, handle: KvPoolHandle) -> Backend:
        kind = backend_for(handle, self.local.kv.device)
        if kind not in self.backends:
            self.backends[kind] = kind(self.local, self.scratch_page)
        return self.backends[kind]

    def unmap_pool(self, prefill_worker_id: str) -> None:
        self.unmappable.pop(prefill_worker_id, None)
        source = self.sources.pop(prefill_worker_id, None)
        if source is not None:
            source.close()

    def pull(self, task: DecodeTask, local_pages: list[int]) -> Transfer:
        """Starts moving the task's prompt pages into local_pages; landed() says when they are there."""
        source = self.sources.get(task.prefill_worker_id)
        if source is None:
            why = self.unmappable.get(task.prefill_worker_id, "not announced")
            raise HandoffError(f"no mapped pool for prefill {task.prefill_worker_id} ({why})")
        count = pages_for(task.num_tokens, self.local.layout.page_size)
        try:
            src_ids = np.frombuffer(wire.unpack_page_ids(task.src_page_ids), dtype=np.intc)
            if len(src_ids) < count:
                raise ValueError(f"{len(src_ids)} page ids for a prompt of {count} pages")
            transfer = source.start(task.request_id, src_ids[:count], local_pages[:count])
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

    def cancel(self, request_id: str) -> None:
        """Ends the request's transfer, if unfinished, without reporting it: the request is gone."""
        for transfer in [t for t in self.in_flight if t.request_id == request_id]:
            transfer.cancel("the request ended")
            self.in_flight.remove(transfer)

    def _poll(self) -> None:
        still = []
        for transfer in self.in_flight:
            state = transfer.poll()
            if not state.finished and not transfer.stream_ordered and (
                    time.time() - transfer.started_at > self.transfer_timeout_s):
                transfer.cancel(f"not done within {self.transfer_timeout_s:g} s ({state.name.lower()})")
            if transfer.state is TransferState.DONE:
                self._landed.append(transfer)
            elif transfer.state is TransferState.FAILED:
                self._failed.append(transfer)
            else:
                still.append(transfer)
        self.in_flight = still

    def close(self) -> None:
        for prefill_worker_id in list(self.sources):
            self.unmap_pool(prefill_worker_id)
