"""Export a prefill's KV pool once and map it in a decode: POSIX shared memory or CUDA IPC.

`export_pool` picks the backend from the device, `map_pool` from the handle. The exporter owns
the memory and must outlive every mapping of it; a mapping never frees it.
- Shared memory (CPU): the exporter unlinks the segment on close; if it is killed,
  multiprocessing's resource tracker (a process of its own) unlinks it. An unlinked segment
  stays readable by a decode that still maps it, so a request being pulled is not torn away.
- CUDA IPC (GPU): the pool is one cudaMalloc'd buffer whose IPC handle (about 100 bytes) is sent
  once; a decode opens it once at registration (the first open also creates the CUDA context)
  and keeps it. PyTorch's IPC reference counter keeps the block out of the exporter's cache
  while any peer holds it; a peer that dies drops its mapping with its context.
- The same process (services/colocated runs the prefill and decode in one): `map_pool` hands back
  the exporter's own pool. CUDA cannot open an IPC handle in the process that exported it, and a
  second attachment of our own segment would unregister it from the resource tracker. Such a
  mapping holds the pool's tensors, so closing the export while it is still used frees nothing
  under it (on the CPU the segment is unlinked, and unmapped when the process exits).
"""

from __future__ import annotations

import gc
import os
from multiprocessing import resource_tracker, shared_memory

import msgpack
import torch

from shared.kv_pool import PagedKvPool, allocate_local_pool, layout_bytes
from shared.messages import KvLayout, KvPoolHandle


class SharedMemoryExport:
    """A pool in a POSIX shared-memory segment that peers may map; close() releases it for good."""

    def __init__(self, layout: KvLayout, name_hint: str):
        name = f"pdserve-kv-{name_hint}-{os.getpid()}"
        self._shm = shared_memory.SharedMemory(name=name, create=True, size=layout_bytes(layout))
        self.pool = PagedKvPool(layout, torch.frombuffer(self._shm.buf, dtype=torch.uint8))
        self.handle = KvPoolHandle("shm", self._shm.name.encode(), layout)

    def close(self) -> None:
        _exported_here.pop(self.handle.locator, None)
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
            raise ValueError("shared segment is smaller than its layout says")
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


class CudaIpcExport:
    """A pool in device memory, exported once as a CUDA IPC handle."""

    def __init__(self, layout: KvLayout, device: torch.device):
        self.pool, self._buffer = allocate_local_pool(layout, device)
        offset = self.pool.kv.data_ptr() - self._buffer.data_ptr()
        # The fields of UntypedStorage._share_cuda_, the call torch.multiprocessing uses, plus
        # where the aligned pool starts inside the buffer.
        shared = self._buffer.untyped_storage()._share_cuda_()
        self.handle = KvPoolHandle("cuda_ipc", msgpack.packb([*shared, offset], use_bin_type=True), layout)

    def close(self) -> None:
        _exported_here.pop(self.handle.locator, None)
        self.pool = None
        self._buffer = None


class CudaIpcMapping:
    """A peer's device pool, opened once through its CUDA IPC handle."""

    def __init__(self, handle: KvPoolHandle, device: torch.device):
        *shared, offset = msgpack.unpackb(handle.locator, raw=False)
        if len(shared) != 8:
            raise ValueError("malformed CUDA IPC handle")
        torch.cuda.set_device(device)
        storage = torch.UntypedStorage._new_shared_cuda(*shared)  # noqa: SLF001
        buffer = torch.empty(0, dtype=torch.uint8, device=device)
        buffer.set_(storage, offset, (layout_bytes(handle.layout),), (1,))
        self.pool = PagedKvPool(handle.layout, buffer)

    def close(self) -> None:
        self.pool = None
        gc.collect()  # drops the storage, which closes the IPC mapping


class SameProcessMapping:
    """A pool this process exports itself, mapped without IPC: the exporter's own pool."""

    def __init__(self, exported: SharedMemoryExport | CudaIpcExport):
        self.pool = exported.pool

    def close(self) -> None:
        self.pool = None


# This process's open exports by locator (unique: a segment name with our pid, or an IPC handle).
_exported_here: dict[bytes, SharedMemoryExport | CudaIpcExport] = {}


def export_pool(layout: KvLayout, name_hint: str, device: torch.device | str):
    device = torch.device(device)
    exported = CudaIpcExport(layout, device) if device.type == "cuda" else SharedMemoryExport(layout, name_hint)
    _exported_here[exported.handle.locator] = exported
    return exported


def map_pool(handle: KvPoolHandle, device: torch.device | str):
    device = torch.device(device)
    exported = _exported_here.get(handle.locator)
    if exported is not None and exported.handle == handle:
        return SameProcessMapping(exported)
    if handle.backend == "shm":
        return SharedMemoryMapping(handle)
    if handle.backend == "cuda_ipc" and device.type == "cuda":
        return CudaIpcMapping(handle, device)
    raise ValueError(f"a process on {device} cannot map a {handle.backend!r} pool")
