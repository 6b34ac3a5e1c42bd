"""A backend for tests: pages move within this process, one state per poll, or fail on cue.

A FakeExport is a pool of this process under a name, with a Script that says how each transfer
from it goes: how many polls it spends in each state, and a state at which it fails or stalls (a
stalled transfer waits for the decode's timeout, as a lost remote read would). Its transfers are
not stream-ordered, like a NIXL read: a request waits for DONE before it may step. Nothing here
crosses a process: the tests drive a decode's KvPuller and both pools in one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from shared.control.messages import KvLayout, KvPoolHandle
from shared.kv.pool import PagedKvPool, allocate_local_pool
from shared.kv.transfer.base import Backend, HeadSlice, Source, Transfer, TransferError, TransferState, whole_pages_only

BACKEND = "fake"


@dataclass(frozen=True)
class Script:
    polls_per_state: int = 1
    fail_at: TransferState | None = None   # PREPARING or TRANSFERRING: fails instead of moving on
    stall_at: TransferState | None = None  # never moves on from this state (until cancelled)
    lingers_polls: int = 0  # after a cancel, settled() says False this many times (as a NIXL read)


_exports: dict[bytes, FakeExport] = {}


class FakeExport:
    def __init__(self, layout: KvLayout, name: str, script: Script = Script(), first_kv_head: int = 0):
        self.pool, self._buffer = allocate_local_pool(layout, "cpu")
        self.handle = KvPoolHandle(BACKEND, name.encode(), layout, first_kv_head)
        self.script = script
        _exports[self.handle.locator] = self

    def close(self) -> None:
        _exports.pop(self.handle.locator, None)
        self.pool = None


class FakeTransfer(Transfer):
    def __init__(self, request_id: str, source: FakeSource, src: torch.Tensor, dst: torch.Tensor):
        super().__init__(request_id, source.prefill_worker_id)
        self.source, self.src, self.dst = source, src, dst
        self.polls = 0  # in the current state
        self.lingering = 0  # settled() calls still to answer False

    def poll(self) -> TransferState:
        script = self.source.script
        if self.state.finished or self.state == script.stall_at:
            return self.state
        self.polls += 1
        if self.polls < script.polls_per_state:
            return self.state
        self.polls = 0
        if self.state == script.fail_at:
            self.fail(f"scripted failure while {self.state.name.lower()}")
        elif self.state is TransferState.PREPARING:
            self.advance(TransferState.TRANSFERRING)
        else:
            self.source.local.copy_pages_from(self.source.pool, self.src, self.dst)
            self.land()
        return self.state

    def cancel(self, reason: str) -> None:
        self.fail(reason)  # nothing moves between polls, so nothing more is written...
        self.lingering = self.source.script.lingers_polls  # ...unless the script plays a NIXL read

    def settled(self) -> bool:
        if self.lingering:
            self.lingering -= 1
            return False
        return True


class FakeSource(Source):
    def __init__(self, prefill_worker_id: str, export: FakeExport, local: PagedKvPool):
        super().__init__(prefill_worker_id, export.handle)
        self.pool, self.script, self.local = export.pool, export.script, local
        self.transfers: list[FakeTransfer] = []

    def start(self, request_id: str, src_pages: np.ndarray, dst_pages: list[int],
              heads: HeadSlice | None = None) -> FakeTransfer:
        if heads is not None:
            raise whole_pages_only(BACKEND)
        if len(src_pages) != len(dst_pages):
            raise TransferError(f"{len(src_pages)} source and {len(dst_pages)} destination pages")
        if len(src_pages) and (src_pages.min() < 0 or src_pages.max() >= self.handle.layout.num_pages):
            raise TransferError(f"source page ids outside [0, {self.handle.layout.num_pages})")
        transfer = FakeTransfer(request_id, self, torch.from_numpy(src_pages.astype(np.int64)),
                                torch.tensor(dst_pages, dtype=torch.int64))
        self.transfers.append(transfer)
        return transfer

    def close(self) -> None:
        """Runs every unfinished transfer to its end first (a stalled one is cancelled)."""
        for transfer in self.transfers:
            while not transfer.poll().finished:
                if transfer.state == self.script.stall_at:
                    transfer.cancel("the pool was closed")
        self.transfers, self.pool = [], None


class FakeBackend(Backend):
    device_types = ("cpu",)

    def open(self, prefill_worker_id: str, handle: KvPoolHandle) -> FakeSource:
        export = _exports.get(handle.locator)
        if export is None:
            raise TransferError(f"no fake pool named {handle.locator.decode()!r} in this process")
        return FakeSource(prefill_worker_id, export, self.local)
