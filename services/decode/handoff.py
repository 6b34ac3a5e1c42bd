"""Pulling a request's KV pages from a prefill's pool into the decode's own pool.

Each prefill pool is mapped once, when the router announces it (PoolAvailable), and kept
until the prefill goes away (PoolGone) or is replaced by a new incarnation. Per request the
listed pages are copied for all layers at once (PagedKvPool.copy_pages_from).

pull() only starts the copy. On a GPU the request may join the next decode step at once: the
step runs on the same stream, so the device runs it after the copy, and the host prepares the
step instead of waiting for the copy first. The prefill may reuse its pages as soon as it hears
KvPulled, so that waits for landed(), which reports a copy only once the device has finished
it. On the CPU the copy is done when pull() returns.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import structlog
import torch

from shared import wire
from shared.kv_pool import PagedKvPool, pages_for
from shared.kv_share import map_pool
from shared.messages import DecodeTask, KvPoolHandle

log = structlog.get_logger()


class HandoffError(RuntimeError):
    pass


@dataclass(frozen=True)
class Landed:
    """A pull whose pages are in the decode's pool: what KvPulled tells the router."""
    request_id: str
    prefill_worker_id: str
    pull_s: float     # pull() to the pages in the pool
    landed_at: float  # wall clock (time.time) when the pages were in the pool


@dataclass(frozen=True)
class _Copying:
    request_id: str
    prefill_worker_id: str
    started_at: float
    done: torch.cuda.Event  # recorded behind the copy, with timing


class PageIdStaging:
    """The two page-id lists of a pull in one reused buffer of pinned host memory, which the copy
    kernel reads in place: a GPU reads pinned memory over PCIe, and a pull's ids are a few KiB.

    Numpy fills a view of the buffer in one call; nothing is uploaded and no event recorded,
    because when a request reaches a decode that sat idle, each torch call costs tens of µs on
    the H200 host, and an upload took several. Pulls take consecutive slices. A slice is rewritten
    only after the copy that reads it: a full buffer makes the host wait for the last copy (they
    run in stream order, so then all are done). Every list starts 16-byte aligned: Triton compiles
    a kernel per alignment of its pointers, and a compile on a request's path stalls it.
    """

    def __init__(self, capacity: int, device: torch.device):
        self.host = torch.empty(capacity, dtype=torch.int64, pin_memory=device.type == "cuda")
        self.ids = self.host.numpy()
        self.used = 0
        self._last_reader: torch.cuda.Event | None = None  # recorded after the latest copy that read ids

    def stage(self, src: np.ndarray, dst: list[int], src_limit: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Both id lists as index tensors for the copy; ValueError unless every src id is in
        [0, src_limit)."""
        n = len(src)
        slot = n + n % 2  # two int64 ids are 16 bytes
        if len(dst) != n or 2 * slot > len(self.ids):
            raise ValueError(f"{n} source and {len(dst)} destination pages do not fit a buffer of {len(self.ids)}")
        if self.used + 2 * slot > len(self.ids):
            if self._last_reader is not None:
                self._last_reader.synchronize()
            self.used = 0
        src_at, dst_at = self.used, self.used + slot
        self.used += 2 * slot
        self.ids[src_at: src_at + n], self.ids[dst_at: dst_at + n] = src, dst
        if n and (self.ids[src_at: src_at + n].min() < 0 or self.ids[src_at: src_at + n].max() >= src_limit):
            raise ValueError(f"source page ids outside [0, {src_limit})")
        return self.host[src_at: src_at + n], self.host[dst_at: dst_at + n]

    def read_by(self, copy_done: torch.cuda.Event) -> None:
        """The staged lists are read by the copy that this event follows on the device."""
        self._last_reader = copy_done


class KvPuller:
    def __init__(self, local: PagedKvPool, scratch_page: int):
        """scratch_page: a page of local that the puller may overwrite. Each newly mapped pool is
        copied into it once, so that the copy kernel is compiled for that pool before a request
        needs it (a compile takes hundreds of ms)."""
        self.local = local
        self.scratch_page = scratch_page
        self.mapped: dict[str, tuple[KvPoolHandle, object]] = {}
        # A pull's destination pages are ours, so the pool's page count bounds every list.
        self.staging = PageIdStaging(2 * local.layout.num_pages + 2, local.kv.device)
        self._copying: list[_Copying] = []
        self._landed: list[Landed] = []

    @property
    def copying(self) -> bool:
        """Some copy has not been reported by landed() yet."""
        return bool(self._copying)

    def map_pool(self, prefill_worker_id: str, handle: KvPoolHandle) -> None:
        current = self.mapped.get(prefill_worker_id)
        if current is not None and current[0] == handle:
            return
        self.unmap_pool(prefill_worker_id)
        layout, local = handle.layout, self.local.layout
        if (layout.num_layers, layout.page_size, layout.num_kv_heads, layout.head_dim, layout.dtype) != (
                local.num_layers, local.page_size, local.num_kv_heads, local.head_dim, local.dtype):
            raise HandoffError(f"pool of {prefill_worker_id} has layout {layout}, ours is {local}")
        mapped = map_pool(handle, self.local.kv.device)
        self.mapped[prefill_worker_id] = (handle, mapped)
        src, dst = self.staging.stage(np.zeros(1, dtype=np.int64), [self.scratch_page], layout.num_pages)
        self.local.copy_pages_from(mapped.pool, src, dst)
        if self.local.kv.is_cuda:  # done: nothing reads the ids' slot or (after an unmap) the mapping
            torch.cuda.current_stream().synchronize()
        log.info("mapped prefill pool", prefill=prefill_worker_id, pages=layout.num_pages)

    def unmap_pool(self, prefill_worker_id: str) -> None:
        entry = self.mapped.pop(prefill_worker_id, None)
        if entry is not None:
            if self._copying:  # a copy may still read the mapping
                self._copying[-1].done.synchronize()
            entry[1].close()

    def pull(self, task: DecodeTask, local_pages: list[int]) -> None:
        """Starts copying the task's prompt pages into local_pages; landed() says when they are there."""
        entry = self.mapped.get(task.prefill_worker_id)
        if entry is None:
            raise HandoffError(f"no mapped pool for prefill {task.prefill_worker_id}")
        count = pages_for(task.num_tokens, self.local.layout.page_size)
        started_at = time.time()
        try:
            src_ids = np.frombuffer(wire.unpack_page_ids(task.src_page_ids), dtype=np.intc)
            if len(src_ids) < count:
                raise ValueError(f"{len(src_ids)} page ids for a prompt of {count} pages")
            src, dst = self.staging.stage(src_ids[:count], local_pages[:count], entry[0].layout.num_pages)
        except ValueError as exc:  # WireError is one
            raise HandoffError(f"page ids do not fit the prefill pool: {exc}") from None
        self.local.copy_pages_from(entry[1].pool, src, dst)
        if self.local.kv.is_cuda:  # the ids are in host memory either way
            done = torch.cuda.Event(enable_timing=True)
            done.record()
            self.staging.read_by(done)
            self._copying.append(_Copying(task.request_id, task.prefill_worker_id, started_at, done))
        else:
            landed_at = time.time()
            self._landed.append(Landed(task.request_id, task.prefill_worker_id, landed_at - started_at, landed_at))

    def landed(self) -> list[Landed]:
        """Every pull whose pages are in the pool, each reported once; never waits for a copy.
        Dates are tightest when the stream has nothing else queued (after a step's tokens)."""
        if self._copying and self._copying[-1].done.query():  # stream order: the last done, all done
            self._landed += _dated(self._copying)
            self._copying = []
        landed, self._landed = self._landed, []
        return landed

    def close(self) -> None:
        for prefill_worker_id in list(self.mapped):
            self.unmap_pool(prefill_worker_id)


def _dated(copies: list[_Copying]) -> list[Landed]:
    """When each finished copy landed. The host sees a copy's end only when it asks, maybe a
    whole step later, so it asks the device: a timed probe runs after the copies; the clock is
    read once the probe has run, and each copy's device time before the probe is subtracted.
    That is never earlier than the copy's true end, and later only by the probe's wake-up."""
    probe = torch.cuda.Event(enable_timing=True)
    probe.record()
    probe.synchronize()
    now = time.time()
    out = []
    for copy in copies:
        landed_at = now - copy.done.elapsed_time(probe) / 1e3
        out.append(Landed(copy.request_id, copy.prefill_worker_id, landed_at - copy.started_at, landed_at))
    return out
