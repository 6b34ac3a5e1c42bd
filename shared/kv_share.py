"""Export a prefill's KV pool once and map it in a decode: POSIX shared memory on the CPU.

The exporter owns the memory and must outlive every mapping of it: it unlinks the segment on
close, and if it is killed, multiprocessing's resource tracker (a process of its own) unlinks
it. A mapping never unlinks. CUDA IPC (issue: GPU path) plugs in behind the same two calls.
"""

from __future__ import annotations

import gc
import os
from multiprocessing import resource_tracker, shared_memory

import torch

from shared.kv_pool import PagedKvPool, layout_bytes
from shared.messages import KvLayout, KvPoolHandle


class ExportedPool:
    """A pool in shared memory that peers may map; close() releases it for good."""

    def __init__(self, layout: KvLayout, name_hint: str):
        name = f"pdserve-kv-{name_hint}-{os.getpid()}"
        self._shm = shared_memory.SharedMemory(name=name, create=True, size=layout_bytes(layout))
        self.pool = PagedKvPool(layout, torch.frombuffer(self._shm.buf, dtype=torch.uint8))
        self.handle = KvPoolHandle("shm", self._shm.name.encode(), layout)

    def close(self) -> None:
        _release(self, unlink=True)


class MappedPool:
    """A peer's exported pool, mapped into this process (read by the decode's handoff)."""

    def __init__(self, handle: KvPoolHandle):
        if handle.backend != "shm":
            raise ValueError(f"this process cannot map a {handle.backend!r} pool")
        self._shm = shared_memory.SharedMemory(name=handle.locator.decode(), create=False)
        # Python 3.11's SharedMemory registers attachments too, and its tracker would unlink
        # the exporter's segment when this process exits.
        resource_tracker.unregister(self._shm._name, "shared_memory")  # noqa: SLF001
        if self._shm.size < layout_bytes(handle.layout):
            self._shm.close()
            raise ValueError("shared segment is smaller than its layout says")
        self.pool = PagedKvPool(handle.layout, torch.frombuffer(self._shm.buf, dtype=torch.uint8))

    def close(self) -> None:
        _release(self, unlink=False)


def _release(owner: ExportedPool | MappedPool, unlink: bool) -> None:
    shm = owner.__dict__.pop("_shm", None)
    if shm is None:
        return
    owner.pool = None  # tensors pin the buffer; drop them before closing it
    gc.collect()
    try:
        shm.close()
    except BufferError:
        pass  # a caller still holds a view; the mapping goes when the process exits
    if unlink:
        shm.unlink()
