"""The CPU's transfer: the prefill's pool in a POSIX shared-memory segment that decodes map.

The exporter owns the segment and must outlive every mapping of it; a mapping never frees it. The
exporter unlinks the segment on close; if it is killed, multiprocessing's resource tracker (a
process of its own) unlinks it. An unlinked segment stays readable by a decode that still maps
it, so a request being pulled is not torn away.
"""

from __future__ import annotations

import gc
import os
import secrets
from multiprocessing import resource_tracker, shared_memory

import torch

from shared.control.messages import KvLayout, KvPoolHandle
from shared.kv.pool import PagedKvPool, layout_bytes
from shared.kv.transfer import local_exports
from shared.kv.transfer.base import TransferError
from shared.kv.transfer.local_copy import LocalCopyBackend, Mapping

BACKEND = "shm"


class SharedMemoryExport:
    """A pool in a POSIX shared-memory segment that peers may map; close() releases it for good."""

    def __init__(self, layout: KvLayout, name_hint: str, first_kv_head: int = 0):
        # The random token: a decode on another host never finds a segment of this name, so one
        # that opens is this one (shared/kv/transfer/choice.py). The pid last, for leak checks.
        name = f"pdserve-kv-{name_hint}-{secrets.token_hex(4)}-{os.getpid()}"
        self._shm = shared_memory.SharedMemory(name=name, create=True, size=layout_bytes(layout))
        self.pool = PagedKvPool(layout, torch.frombuffer(self._shm.buf, dtype=torch.uint8))
        self.handle = KvPoolHandle(BACKEND, self._shm.name.encode(), layout, first_kv_head)

    def close(self) -> None:
        local_exports.remove(self)
        _release_shm(self, unlink=True)


class SharedMemoryMapping:
    """A peer's shared-memory pool, mapped into this process."""

    def __init__(self, handle: KvPoolHandle):
        self._shm = shared_memory.SharedMemory(name=handle.locator.decode(), create=False)
        # Python 3.11's SharedMemory registers attachments too, and its tracker would unlink
        # the exporter's segment when this process exits.
        resource_tracker.unregister(self._shm._name, "shared_memory")  # noqa: SLF001
        if self._shm.size < layout_bytes(handle.layout):
            self._shm.close()
            raise TransferError("shared segment is smaller than its layout says")
        self.pool = PagedKvPool(handle.layout, torch.frombuffer(self._shm.buf, dtype=torch.uint8))

    def close(self) -> None:
        _release_shm(self, unlink=False)


def _release_shm(owner: SharedMemoryExport | SharedMemoryMapping, unlink: bool) -> None:
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


class ShmBackend(LocalCopyBackend):
    device_types = ("cpu",)

    @staticmethod
    def map_pool(handle: KvPoolHandle, device: torch.device) -> Mapping:
        return local_exports.mapping(handle) or SharedMemoryMapping(handle)
