"""This process's own exports, so that a pool it exports itself maps without IPC.

services/colocated runs the prefill and the decode in one process. CUDA cannot open an IPC handle
in the process that exported it, and a second attachment of our own shared-memory segment would
unregister it from the resource tracker; so such a pool maps to the exporter's own. The mapping
holds the pool's tensors, so closing the export while it is still used frees nothing under it (on
the CPU the segment is unlinked, and unmapped when the process exits).
"""

from __future__ import annotations

from shared.control.messages import KvPoolHandle
from shared.kv.transfer.base import Export

# By locator, which is unique: a segment name with our pid, or an IPC handle.
_exported: dict[bytes, Export] = {}


def add(export: Export) -> None:
    _exported[export.handle.locator] = export


def remove(export: Export) -> None:
    _exported.pop(export.handle.locator, None)


class SameProcessMapping:
    """A pool this process exports itself, mapped without IPC: the exporter's own pool."""

    def __init__(self, exported: Export):
        self.pool = exported.pool

    def close(self) -> None:
        self.pool = None


def mapping(handle: KvPoolHandle) -> SameProcessMapping | None:
    """The exporter's own pool when this process exported the handle, else None."""
    exported = _exported.get(handle.locator)
    return SameProcessMapping(exported) if exported is not None and exported.handle == handle else None
