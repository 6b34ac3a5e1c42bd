"""KV transfer: how a request's KV pages get from a prefill's pool into a decode's, behind one interface.

Who calls what, in which process:

    prefill process                         decode process (services/decode/kv_pull.py, KvPuller)
    ---------------                         -----------------------------------------------------
    export_pool(layout, worker id, device)  a Backend per kind of pool, made when the first such
      -> an Export: .pool, which the          pool is announced: what all its pools share (a
         prefill writes; .handle, sent        staging buffer, a registered local pool)
         once in Register; close() at exit  once per prefill pool (PoolAvailable), for each
      (one per tensor-parallel rank)          prefill rank holding some of the decode rank's KV
                                              heads: backend.open() -> a Source: the pool mapped
                                              or registered, ready
                                            per request (DecodeTask): source.start(ids) -> Transfer
                                              from each Source, joined into one
                                            every loop round, per transfer in flight: poll(); one
                                              that is not stream-ordered and outlives the timeout
                                              is cancel()ed
                                            at PoolGone, or a new incarnation: source.close()
                                            pages of a cancelled or failed transfer: reused once
                                              transfer.settled()

A transfer's states only move forward:

    PREPARING ---> TRANSFERRING ---> DONE      the pages are in the decode's pool: now KvPulled goes,
        |               |                      and the prefill may reuse its pages
        +---------------+----------> FAILED    the decode frees the request's pages and sends Failed

PREPARING: accepted, being set up (page ids staged, a remote transfer being posted).
TRANSFERRING: bytes are moving, or queued to move on the decode's device.
A FAILED transfer's pages go back to the decode's pool once it has settled(): a remote read that
was cancelled may still be writing into them.

A stream-ordered transfer (a copy the decode launched itself on its own stream) lets the request
join the next decode step at once, since the device runs the step after the copy; it cannot fail
once started. Any other transfer (a NIXL read, the fake) keeps its request out of the batch until
DONE, and may fail or time out on its way.
"""

from __future__ import annotations

import abc
import time
from enum import IntEnum
from typing import Protocol

import numpy as np

from shared.control.messages import KvPoolHandle
from shared.kernels.device import Moment
from shared.kv.pool import PagedKvPool


class TransferError(RuntimeError):
    """A pool that cannot be mapped here, or page ids that do not fit it: nothing was started."""


# Some KV heads of every page, in each pool's own head indices: (the source's first, the
# decode's first, count). Tensor-parallel ranks of a prefill and a decode of other sizes hold
# different heads, so a decode rank takes its heads from the prefill ranks that hold them.
HeadSlice = tuple[int, int, int]


def whole_pages_only(kind: str) -> TransferError:
    """A backend that moves whole pages only (KvPoolHandle.backend `kind`) cannot move some heads of them."""
    return TransferError(f"{kind.upper()} moves whole pages: a prefill and a decode of different tensor_parallel sizes "
                         "cannot pair over it")


class TransferState(IntEnum):
    """In the order a transfer goes through them (FAILED may follow either of the first two)."""
    PREPARING = 0
    TRANSFERRING = 1
    DONE = 2
    FAILED = 3

    @property
    def finished(self) -> bool:
        return self >= TransferState.DONE


class Transfer(abc.ABC):
    """One request's pages on their way; the decode polls it until it is finished."""

    stream_ordered = False  # see the module docstring

    def __init__(self, request_id: str, prefill_worker_id: str):
        self.request_id = request_id
        self.prefill_worker_id = prefill_worker_id  # whom KvPulled or Failed concerns
        self.started_at = time.perf_counter()
        self.state = TransferState.PREPARING
        self.error = ""                  # why it FAILED
        self.landed: Moment | None = None  # when DONE: the pages were in the pool

    @property
    def pull_s(self) -> float:
        """From the start of the transfer to the pages in the pool (DONE only)."""
        return self.landed.at - self.started_at

    @abc.abstractmethod
    def poll(self) -> TransferState:
        """The state now; never waits for the transfer."""

    @abc.abstractmethod
    def cancel(self, reason: str) -> None:
        """Ends an unfinished transfer as FAILED; its pages may be reused once settled()."""

    def settled(self) -> bool:
        """Whether nothing writes into the destination pages any more, once finished. At once for
        a copy the decode orders itself (what it queues later runs after the copy); a remote read
        that cannot be called back (NIXL) settles only when its bytes have stopped coming."""
        return True

    def advance(self, state: TransferState) -> None:
        if state < self.state or self.state.finished:
            raise RuntimeError(f"transfer of {self.request_id}: {self.state.name} cannot become {state.name}")
        self.state = state

    def land(self, landed: Moment | None = None) -> None:
        """None: the pages are in the pool now, by the host's clock."""
        self.advance(TransferState.DONE)
        self.landed = landed or Moment(time.perf_counter())

    def fail(self, reason: str) -> None:
        self.advance(TransferState.FAILED)
        self.error = reason


class AllOf(Transfer):
    """One request's transfers from several prefill ranks that each land on their own (NIXL reads):
    DONE once all are, FAILED as soon as one is (the others cancelled), settled once all are."""

    def __init__(self, parts: list[Transfer]):
        super().__init__(parts[0].request_id, parts[0].prefill_worker_id)
        self.parts = parts
        self.started_at = parts[0].started_at

    def poll(self) -> TransferState:
        if self.state.finished:
            return self.state
        states = [part.poll() for part in self.parts]
        failed = next((part for part in self.parts if part.state is TransferState.FAILED), None)
        if failed is not None:
            self.cancel(failed.error)
        elif all(state is TransferState.DONE for state in states):
            self.land(max((part.landed for part in self.parts), key=lambda moment: moment.at))
        elif self.state is TransferState.PREPARING and TransferState.TRANSFERRING in states:
            self.advance(TransferState.TRANSFERRING)
        return self.state

    def cancel(self, reason: str) -> None:
        for part in self.parts:
            part.cancel(reason)
        if not self.state.finished:
            self.fail(reason)

    def settled(self) -> bool:
        return all([part.settled() for part in self.parts])  # a list: each settles what it can


class Source(abc.ABC):
    """One prefill's pool as a decode pulls from it, prepared once (mapped, registered)."""

    def __init__(self, prefill_worker_id: str, handle: KvPoolHandle):
        self.prefill_worker_id = prefill_worker_id
        self.handle = handle

    @abc.abstractmethod
    def start(self, request_id: str, src_pages: np.ndarray, dst_pages: list[int],
              heads: HeadSlice | None = None) -> Transfer:
        """Starts moving pool pages src_pages[i] into the decode's dst_pages[i]: whole pages, or
        only `heads` of them where the backend has head_slices. TransferError when a source page
        is outside the pool, or heads are asked of a backend without head_slices; then nothing
        was started."""

    @abc.abstractmethod
    def close(self) -> None:
        """Lets go of the pool: a copy from a mapping returns once none reads it any more; a
        remote read keeps what it needs (the peer's agent) until it settles."""


class Backend(abc.ABC):
    """A decode's side of one kind of transfer: what every pool of that kind shares."""

    device_types: tuple[str, ...]  # the types of device ("cpu", "cuda") a decode may be on to use it
    head_slices = False  # whether its sources move some KV heads of each page (Source.start's heads)

    def __init__(self, local: PagedKvPool, scratch_page: int):
        """local: the decode's pool; scratch_page: a page of it the backend may overwrite (to
        compile or warm up the transfer of a newly opened pool before a request needs it)."""
        self.local = local
        self.scratch_page = scratch_page

    @abc.abstractmethod
    def open(self, prefill_worker_id: str, handle: KvPoolHandle) -> Source:
        """Prepares a prefill's pool for transfers; TransferError when it cannot be reached."""


class Export(Protocol):
    """A prefill's pool, exported once; close() releases it for good (mappings never free it)."""
    pool: PagedKvPool | None
    handle: KvPoolHandle

    def close(self) -> None: ...
