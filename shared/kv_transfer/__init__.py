"""KV transfer from a prefill's pool into a decode's (base.py: the interface and who calls what).

The prefill exports its pool with export_pool, by its device; a decode pulls each pool through
the backend that backend_for picks from the pool's handle and the decode's own device.

A new kind (a NIXL read, say) is a module with an export (handle.backend names the kind; the
locator carries what a peer needs, e.g. the agent's metadata), a Backend (per decode: register the
local pool once), its Source (per pool: load the remote's metadata, prepare descriptors) and its
Transfer (per request: post the read in start(), check its state in poll(), abort in cancel());
then an entry in BACKENDS, and a way for the prefill to choose it in export_pool. The decode's
puller already times out any transfer that is not stream-ordered (kv.transfer_timeout_s).
"""

from __future__ import annotations

import torch

from shared.kv_transfer import local_exports
from shared.kv_transfer.base import Backend, Export, Source, Transfer, TransferError, TransferState
from shared.kv_transfer.cuda_ipc import CudaIpcBackend, CudaIpcExport
from shared.kv_transfer.fake import FakeBackend
from shared.kv_transfer.shm import SharedMemoryExport, ShmBackend
from shared.messages import KvLayout, KvPoolHandle

__all__ = ["Backend", "Export", "Source", "Transfer", "TransferError", "TransferState", "backend_for", "export_pool"]

BACKENDS: dict[str, type[Backend]] = {"shm": ShmBackend, "cuda_ipc": CudaIpcBackend, "fake": FakeBackend}


def export_pool(layout: KvLayout, name_hint: str, device: torch.device | str) -> Export:
    """The prefill's pool, exported once: device memory by CUDA IPC on a GPU, shared memory on the CPU."""
    device = torch.device(device)
    exported = CudaIpcExport(layout, device) if device.type == "cuda" else SharedMemoryExport(layout, name_hint)
    local_exports.add(exported)
    return exported


def backend_for(handle: KvPoolHandle, device: torch.device | str) -> type[Backend]:
    """The backend a decode on `device` pulls this pool with."""
    device = torch.device(device)
    backend = BACKENDS.get(handle.backend)
    if backend is None or backend.device_type != device.type:
        raise TransferError(f"a decode on {device} cannot pull a {handle.backend!r} pool")
    return backend
