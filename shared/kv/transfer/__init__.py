"""KV transfer from a prefill's pool into a decode's (base.py: the interface and who calls what).

The prefill exports its pool once with export_pool, by the kinds kv.transfer and its device call
for (choice.py); a decode pulls each pool through the backend that backend_for picks from the
first usable handle and the decode's own device. The kinds: shm (host memory of one host),
cuda_ipc (GPU memory of one host), nixl (either, between hosts), fake (tests).

A new kind is a module with an export (handle.backend names the kind; the locator carries what a
peer needs), a Backend (per decode: register the local pool once), its Source (per pool) and its
Transfer (per request: start, poll, cancel, settled); then an entry in BACKENDS and in choice.py.
"""

from __future__ import annotations

import torch

from shared.control.messages import KvLayout, KvPoolHandle
from shared.kv.transfer import local_exports
from shared.kv.transfer.base import Backend, Export, Source, Transfer, TransferError, TransferState
from shared.kv.transfer.choice import handles_of_ranks, offered_kinds, usable_handles
from shared.kv.transfer.cuda_ipc import CudaIpcBackend, CudaIpcExport
from shared.kv.transfer.fake import FakeBackend
from shared.kv.transfer.nixl import NixlBackend, NixlExport
from shared.kv.transfer.nixl_network import LOOPBACK
from shared.kv.transfer.shm import SharedMemoryExport, ShmBackend

__all__ = ["Backend", "Export", "ExportedPool", "Source", "Transfer", "TransferError", "TransferState",
           "backend_for", "export_pool", "handles_of_ranks", "usable_handles"]

BACKENDS: dict[str, type[Backend]] = {"shm": ShmBackend, "cuda_ipc": CudaIpcBackend, "nixl": NixlBackend,
                                      "fake": FakeBackend}


class ExportedPool:
    """A prefill's one pool (a tensor-parallel rank's), exported by one or more kinds: .pool, which
    the prefill writes, and .handles, best first, sent once in Register (with the other ranks':
    choice.py)."""

    def __init__(self, exports: list[Export]):
        self.exports = exports
        self.pool = exports[0].pool if exports else None
        self.handles = [export.handle for export in exports]

    def read_notices(self) -> list[str]:
        """Request ids whose pages a decode has read by NIXL since the last call."""
        return [notice for export in self.exports if isinstance(export, NixlExport) for notice in export.read_notices()]

    def close(self) -> None:
        for export in reversed(self.exports):  # NIXL lets go of a pool that another export owns first
            export.close()


def export_pool(layout: KvLayout, name_hint: str, device: torch.device | str, transfer: str = "auto",
                cross_host: bool = False, nixl_net_devices: str = LOOPBACK, first_kv_head: int = 0) -> ExportedPool:
    """The prefill's pool, exported once by the kinds kv.transfer calls for (choice.py); cross_host:
    decodes may be on other hosts (the control plane is tcp://); nixl_net_devices: where a NIXL
    agent listens (nixl_network.py); first_kv_head: the first of the model's KV heads that this
    tensor-parallel rank's pool holds (KvPoolHandle)."""
    device = torch.device(device)
    exports: list[Export] = []
    try:
        for kind in offered_kinds(transfer, device.type, cross_host):
            exports.append(_export(kind, layout, name_hint, device, exports[0].pool if exports else None,
                                   nixl_net_devices, first_kv_head))
    except BaseException:
        ExportedPool(exports).close()
        raise
    return ExportedPool(exports)


def _export(kind: str, layout: KvLayout, name_hint: str, device: torch.device, pool, nixl_net_devices: str,
            first_kv_head: int) -> Export:
    """pool: the pool another kind already exports, which NIXL registers too."""
    if kind == "nixl":
        return NixlExport(layout, name_hint, device, pool, nixl_net_devices, first_kv_head)
    if kind == "cuda_ipc":
        exported = CudaIpcExport(layout, device, first_kv_head)
    else:
        exported = SharedMemoryExport(layout, name_hint, first_kv_head)
    local_exports.add(exported)
    return exported


def backend_for(handle: KvPoolHandle, device: torch.device | str) -> type[Backend]:
    """The backend a decode on `device` pulls this pool with."""
    device = torch.device(device)
    backend = BACKENDS.get(handle.backend)
    if backend is None or device.type not in backend.device_types:
        raise TransferError(f"a decode on {device} cannot pull a {handle.backend!r} pool")
    return backend
