"""One copy of the weights on a GPU shared by prefill and decode, through CUDA IPC.

When both workers sit on one GPU, the prefill publishes its weights once: a file in the runtime
folder (only the service user can enter it) lists, for every tensor, the CUDA IPC handle of its
storage with the tensor's offset, shape, stride and dtype. A decode configured with
`decode.weights_from = "<prefill worker id>"` maps them instead of loading its own copy
(16 GB for the 8B shape). The decode then depends on that prefill process: when the router
reports the prefill gone (PoolGone), the decode exits and its supervisor restarts it. Only a
decode on the prefill's own GPU may map them (read through peer access, every step's weights
would cross NVLink): the file names the GPU by UUID, and a decode on another GPU exits with a
configuration error.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import msgpack
import torch

from shared.control.dispatch import FatalError
from shared.kernels.device import device_uuid
from shared.model.llama import PagedLlama
from shared.model.weights import LlamaWeights
from shared.runtime.runtime_dir import write_private_file


class WeightsOnAnotherGpu(FatalError):
    exit_code = 2  # a configuration error, as a bad setting is: a restart does not mend it


def weights_file(runtime_dir: str, prefill_worker_id: str) -> Path:
    return Path(runtime_dir) / f"weights-{prefill_worker_id}.msgpack"


def publish_weights(model: PagedLlama, path: Path) -> None:
    entries = {}
    for name, tensor in model.weights.named().items():
        shared = tensor.untyped_storage()._share_cuda_()  # noqa: SLF001  the call torch.multiprocessing uses
        entries[name] = [list(shared), tensor.storage_offset(), list(tensor.shape), list(tensor.stride()),
                         str(tensor.dtype).removeprefix("torch.")]
    # Whole or not at all for a reader, and through no symlink planted in the runtime folder.
    owner = {"pid": os.getpid(), "device_uuid": device_uuid(model.device), "tensors": entries}
    write_private_file(path, msgpack.packb(owner, use_bin_type=True))


def map_weights(config, path: Path, device: torch.device | str, timeout_s: float) -> tuple[PagedLlama, int]:
    """The model over the publisher's weights, and the publisher's pid."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no weights published at {path} within {timeout_s} s")
        time.sleep(0.2)
    published = msgpack.unpackb(path.read_bytes(), raw=False)
    device = torch.device(device)
    if published["device_uuid"] != device_uuid(device):
        raise WeightsOnAnotherGpu(f"decode.weights_from shares weights on one GPU only: {path.name} is on GPU "
                                  f"{published['device_uuid']}, this decode on {device} ({device_uuid(device)})")
    tensors = {}
    for name, (shared, offset, shape, stride, dtype) in published["tensors"].items():
        # shared[0] is the publisher's device index, in its own numbering: the same GPU is ours.
        storage = torch.UntypedStorage._new_shared_cuda(device.index, *shared[1:])  # noqa: SLF001
        tensor = torch.empty(0, dtype=getattr(torch, dtype), device=device)
        tensors[name] = tensor.set_(storage, offset, shape, stride)
    weights = LlamaWeights.from_named(tensors, config.num_hidden_layers)
    return PagedLlama(config, weights, device), published["pid"]
