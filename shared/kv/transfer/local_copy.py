"""Transfers that are copies the decode makes itself, from a pool mapped into its address space.

The shm and cuda_ipc backends differ only in how they map a pool (map_pool); the rest is here.
Each pool is mapped once; per request the listed pages are copied for all layers at once, in one
batched copy (PagedKvPool.copy_pages_from) whose page ids are staged in one reused host buffer.
Between tensor-parallel ranks of different sizes, a request's copy from each prefill rank moves
only the KV heads this decode rank takes from it, and JointCopy makes them one transfer.

On a GPU the copy is queued on the decode's current stream (its high-priority stream in the
worker loop), so the request may join the next step at once: the device runs the step after the
copy, and the host prepares the step instead of waiting for the copy first. The prefill may reuse
its pages as soon as it hears KvPulled, so that waits for DONE, which a copy reaches only once the
device has finished it. On the CPU the copy is done when start() returns.
"""

from __future__ import annotations

import abc
from typing import Protocol

import numpy as np
import torch

from shared.control.messages import KvPoolHandle
from shared.kernels.device import Moment, date_moments
from shared.kv.pool import PagedKvPool
from shared.kv.transfer.base import Backend, HeadSlice, Source, Transfer, TransferError, TransferState
from shared.kv.transfer.staging import PageIdStaging


class Mapping(Protocol):
    """A peer's pool mapped into this process; close() unmaps it and never frees the memory."""
    pool: PagedKvPool | None

    def close(self) -> None: ...


class LocalCopy(Transfer):
    """A copy this decode launched on its own stream, or ran on the CPU."""

    stream_ordered = True

    def __init__(self, request_id: str, prefill_worker_id: str, copies: StreamCopies | None):
        super().__init__(request_id, prefill_worker_id)
        self.copies = copies
        self.done: torch.cuda.Event | None = None  # recorded behind a device copy, with timing

    def poll(self) -> TransferState:
        if self.state is TransferState.TRANSFERRING:
            self.copies.settle()
        return self.state

    def cancel(self, reason: str) -> None:
        # Whatever the decode queues later on its stream runs after the copy: the pages may be freed now.
        self.fail(reason)


class JointCopy(Transfer):
    """One request's copies from several mapped pools (a prefill's tensor-parallel ranks), all
    started on the decode's stream in turn: the last lands last, and then all have."""

    stream_ordered = True

    def __init__(self, copies: list[LocalCopy]):
        super().__init__(copies[0].request_id, copies[0].prefill_worker_id)
        self.copies = copies
        self.started_at = copies[0].started_at
        self.advance(TransferState.TRANSFERRING)
        self.poll()  # on the CPU they are done already

    def poll(self) -> TransferState:
        if self.state is TransferState.TRANSFERRING and self.copies[-1].poll() is TransferState.DONE:
            self.land(self.copies[-1].landed)
        return self.state

    def cancel(self, reason: str) -> None:
        self.fail(reason)  # as LocalCopy's: what the decode queues later runs after the copies


class StreamCopies:
    """The device copies in flight on the decode's stream, in launch order. They finish in that
    order, so one query of the last says whether all are done, and one timed probe dates them all."""

    def __init__(self, device: torch.device):
        self.device = device
        self.in_flight: list[LocalCopy] = []

    def launched(self, copy: LocalCopy) -> None:
        copy.done = torch.cuda.Event(enable_timing=True)
        copy.done.record(torch.cuda.current_stream(self.device))
        self.in_flight.append(copy)

    def settle(self) -> None:
        """Every copy is DONE (or stays cancelled) once the last has run; never waits for one."""
        if self.in_flight and self.in_flight[-1].done.query():
            self._date(self.in_flight)
            self.in_flight = []

    def _date(self, copies: list[LocalCopy]) -> None:
        """When each finished copy landed. The host sees a copy's end only when it asks, maybe a
        whole step later, so the device dates it (date_moments, against the last copy's event, which
        has run: a probe recorded now would wait for a step launched since), and the copy's event stays
        with its landing: a later moment of the same stream subtracts from it on the device's clock."""
        landings = [Moment(event=copy.done) for copy in copies]
        date_moments(landings, self.device, probe=copies[-1].done)
        for copy, landing in zip(copies, landings):
            if copy.state is TransferState.TRANSFERRING:
                copy.land(landing)


class LocalCopyBackend(Backend):
    head_slices = True

    def __init__(self, local: PagedKvPool, scratch_page: int):
        super().__init__(local, scratch_page)
        # A pull's destination pages are ours, so the pool's page count bounds every list.
        self.staging = PageIdStaging(2 * local.layout.num_pages + 2, local.kv.device)
        self.copies = StreamCopies(local.kv.device) if local.kv.is_cuda else None

    @staticmethod
    @abc.abstractmethod
    def map_pool(handle: KvPoolHandle, device: torch.device) -> Mapping:
        """The pool mapped into this process, for a decode on `device`."""

    def open(self, prefill_worker_id: str, handle: KvPoolHandle) -> MappedSource:
        return MappedSource(self, prefill_worker_id, handle, self.map_pool(handle, self.local.kv.device))


class MappedSource(Source):
    def __init__(self, backend: LocalCopyBackend, prefill_worker_id: str, handle: KvPoolHandle, mapped: Mapping):
        super().__init__(prefill_worker_id, handle)
        self.backend = backend
        self.mapped = mapped
        self._last: LocalCopy | None = None  # the latest copy that read the mapping
        # One page is copied into the scratch page now, so that the copy kernel is compiled for
        # this pool before a request needs it (a compile takes hundreds of ms). Only pools of our
        # head count move whole pages; some heads of a page move by torch indexing, not compiled.
        if handle.layout.num_kv_heads == backend.local.layout.num_kv_heads:
            src, dst = backend.staging.stage(np.zeros(1, dtype=np.int64), [backend.scratch_page],
                                             handle.layout.num_pages)
            backend.local.copy_pages_from(mapped.pool, src, dst)
            if backend.copies is not None:  # done: nothing reads the ids' slot or (after a close) the mapping
                torch.cuda.current_stream(backend.local.kv.device).synchronize()

    def start(self, request_id: str, src_pages: np.ndarray, dst_pages: list[int],
              heads: HeadSlice | None = None) -> LocalCopy:
        backend = self.backend
        copy = LocalCopy(request_id, self.prefill_worker_id, backend.copies)
        try:
            src, dst = backend.staging.stage(src_pages, dst_pages, self.handle.layout.num_pages)
        except ValueError as exc:
            raise TransferError(str(exc)) from None
        backend.local.copy_pages_from(self.mapped.pool, src, dst, heads)
        copy.advance(TransferState.TRANSFERRING)
        if backend.copies is None:
            copy.land()
        else:  # the ids are in host memory either way
            backend.copies.launched(copy)
            backend.staging.read_by(copy.done)
            self._last = copy
        return copy

    def close(self) -> None:
        if self._last is not None:  # a copy may still read the mapping
            self._last.done.synchronize()
        self.mapped.close()
