"""A node's GPU transfer: the prefill's pool in device memory, exported once as a CUDA IPC handle.

The pool is one cudaMalloc'd buffer whose IPC handle (about 100 bytes, with the GPU's UUID) is sent
once; a decode opens it once at registration (the first open also creates the CUDA context) and
keeps it. PyTorch's IPC reference counter keeps the block out of the exporter's cache while any
peer holds it; a peer that dies drops its mapping with its context.

The decode opens the handle on its own device, whichever GPU holds the pool: CUDA maps the memory
into that device's context and, for another GPU, enables peer access to it
(cudaIpcMemLazyEnablePeerAccess, which torch passes). The decode's copy kernel then reads the pool
over NVLink or PCIe, on the decode's own stream, by the same code as on one GPU. The exporter's
GPU is found by UUID, since device indices depend on each process's CUDA_VISIBLE_DEVICES.
"""

from __future__ import annotations

import gc

import msgpack
import torch

from shared.control.messages import KvLayout, KvPoolHandle
from shared.kernels.device import device_uuid
from shared.kv.pool import PagedKvPool, allocate_local_pool, layout_bytes
from shared.kv.transfer import local_exports
from shared.kv.transfer.base import TransferError
from shared.kv.transfer.local_copy import LocalCopyBackend, Mapping

BACKEND = "cuda_ipc"


class CudaIpcExport:
    """A pool in device memory, exported once as a CUDA IPC handle."""

    def __init__(self, layout: KvLayout, device: torch.device, first_kv_head: int = 0):
        self.pool, self._buffer = allocate_local_pool(layout, device)
        offset = self.pool.kv.data_ptr() - self._buffer.data_ptr()
        # The fields of UntypedStorage._share_cuda_, the call torch.multiprocessing uses, then
        # where the aligned pool starts inside the buffer and which GPU holds it.
        shared = self._buffer.untyped_storage()._share_cuda_()  # noqa: SLF001
        locator = msgpack.packb([*shared, offset, device_uuid(self._buffer.device)], use_bin_type=True)
        self.handle = KvPoolHandle(BACKEND, locator, layout, first_kv_head)

    def close(self) -> None:
        local_exports.remove(self)
        self.pool = None
        self._buffer = None


class CudaIpcMapping:
    """A peer's device pool, opened once through its CUDA IPC handle on this decode's device."""

    def __init__(self, handle: KvPoolHandle, device: torch.device):
        *shared, offset, exporter_uuid = msgpack.unpackb(handle.locator, raw=False)
        if len(shared) != 8:
            raise TransferError("malformed CUDA IPC handle")
        index = device.index if device.index is not None else torch.cuda.current_device()
        exporter = device_index_of(exporter_uuid)
        if exporter != index:
            require_peer_access(index, exporter)
        # shared[0] is the exporter's device index, in its own numbering: open on ours instead.
        storage = torch.UntypedStorage._new_shared_cuda(index, *shared[1:])  # noqa: SLF001
        buffer = torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", index))
        buffer.set_(storage, offset, (layout_bytes(handle.layout),), (1,))
        self.pool = PagedKvPool(handle.layout, buffer)

    def close(self) -> None:
        self.pool = None
        gc.collect()  # drops the storage, which closes the IPC mapping


def device_index_of(uuid: str) -> int:
    """This process's index of the GPU with that UUID."""
    for index in range(torch.cuda.device_count()):
        if device_uuid(torch.device("cuda", index)) == uuid:
            return index
    raise TransferError(f"the prefill's GPU {uuid} is not visible to this process (CUDA_VISIBLE_DEVICES): "
                        "a decode maps the pools of the GPUs it sees")


def require_peer_access(device: int, peer: int) -> None:
    if not torch.cuda.can_device_access_peer(device, peer):
        raise TransferError(f"cuda:{device} has no peer access to cuda:{peer}, which holds the prefill's pool: "
                            "place the decode on the prefill's GPU, or on one with NVLink or PCIe P2P to it")


class CudaIpcBackend(LocalCopyBackend):
    device_types = ("cuda",)

    @staticmethod
    def map_pool(handle: KvPoolHandle, device: torch.device) -> Mapping:
        return local_exports.mapping(handle) or CudaIpcMapping(handle, device)
