"""What the NIXL backend needs of the NIXL package: an agent, a registered pool, its page regions.

NIXL ships one wheel per CUDA major version (nixl-cu12, nixl-cu13), each a module of its own
name; the `nixl` meta package, which would import whichever is there, pins versions the index
lacks. So the module is looked up by each name in turn.

An agent's UCX backend serves the reads of its peers only while something progresses its UCX
worker: over TCP a read is answered by the exporter's process, not by its NIC. NIXL's progress
thread does that, but its Python wrapper starts it with no delay, and the thread then polls
without sleeping: half a core of the 2-core CPU machine for an idle prefill. With a delay it
sleeps in poll() on the worker's event fd and wakes up for traffic, and at least every
PROGRESS_WAKEUP_US (NIXL's own workaround for wake-ups that UCX misses).
"""

from __future__ import annotations

import importlib
import secrets
from types import ModuleType

import numpy as np

from shared.kv.pool import PagedKvPool, layout_bytes, shard_regions
from shared.kv.transfer.base import TransferError
from shared.kv.transfer.nixl_network import use_net_devices

MODULES = ("nixl_cu13", "nixl_cu12", "nixl")
PROGRESS_WAKEUP_US = 1000


def nixl_module() -> ModuleType:
    for name in MODULES:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise TransferError("the NIXL package is not installed: pip install nixl-cu12 (CUDA 12 or CPU) or nixl-cu13")


def new_agent(name_hint: str, net_devices: str):
    """An agent named uniquely per process start: a restarted peer is another agent, never a stale
    one; it listens on net_devices alone (nixl_network.py)."""
    nixl = nixl_module()
    use_net_devices(net_devices)
    bindings = importlib.import_module(f"{nixl.__name__}._bindings")
    wrapper = importlib.import_module(f"{nixl.__name__}._api")
    base = bindings.nixlAgentConfig

    class SleepingProgress(base):
        """The wrapper's config, but with the progress thread's delay at PROGRESS_WAKEUP_US."""
        pthrDelay = property(base.pthrDelay.__get__, lambda config, _: base.pthrDelay.__set__(config, PROGRESS_WAKEUP_US))

    wrapper.nixlBind.nixlAgentConfig = SleepingProgress
    try:
        return nixl.nixl_agent(f"pdserve-{name_hint}-{secrets.token_hex(4)}",
                               nixl.nixl_agent_config(enable_prog_thread=True, backends=["UCX"]))
    except Exception as exc:  # the bindings raise their own exception types
        raise TransferError(f"cannot start a NIXL agent: {exc}") from None
    finally:
        wrapper.nixlBind.nixlAgentConfig = base


def memory_of(pool: PagedKvPool) -> tuple[int, int, str, int]:
    """The pool's bytes as NIXL registers them: (address, size, memory type, device id)."""
    device = pool.kv.device
    kind, device_id = ("VRAM", device.index or 0) if device.type == "cuda" else ("DRAM", 0)
    return pool.kv.data_ptr(), layout_bytes(pool.layout), kind, device_id


def page_regions(pool_memory: tuple[int, int, str, int], layout) -> np.ndarray:
    """Every (shard, page) of a pool as a NIXL descriptor row (address, bytes, device id), shard by
    shard, so a request's pages are descriptor shard * num_pages + page. The shards are whatever
    shard_regions lists (scale shards included), each page a region of its own."""
    address, _, _, device_id = pool_memory
    pages = np.arange(layout.num_pages, dtype=np.uint64)
    rows = []
    for offset, page_bytes in shard_regions(layout):
        shard = np.empty((layout.num_pages, 3), dtype=np.uint64)
        shard[:, 0] = address + offset + pages * page_bytes
        shard[:, 1] = page_bytes
        shard[:, 2] = device_id
        rows.append(shard)
    return np.concatenate(rows)


def head_regions(pool_memory: tuple[int, int, str, int], layout, pages: np.ndarray, first: int,
                 count: int) -> np.ndarray:
    """Heads first .. first + count - 1 of these pages, as NIXL descriptor rows: one per shard (scale
    shards included), page and token, in that order, each the token's run of those heads. A page
    holds its tokens' heads side by side ([page_size, kv_heads, ...]), so some heads of a page are
    page_size runs, not one region: two pools of other head counts pair row for row."""
    address, _, _, device_id = pool_memory
    tokens = np.arange(layout.page_size, dtype=np.uint64)
    pages = pages.astype(np.uint64)
    rows = []
    for offset, page_bytes in shard_regions(layout):
        token_bytes = page_bytes // layout.page_size
        head_bytes = token_bytes // layout.num_kv_heads
        starts = address + offset + pages[:, None] * page_bytes + tokens[None, :] * token_bytes + first * head_bytes
        shard = np.empty((starts.size, 3), dtype=np.uint64)
        shard[:, 0] = starts.ravel()
        shard[:, 1] = count * head_bytes
        shard[:, 2] = device_id
        rows.append(shard)
    return np.concatenate(rows)


def descriptor_ids(pages: np.ndarray, num_shards: int, num_pages: int) -> np.ndarray:
    """The descriptors of these pages in every shard, in page_regions' numbering."""
    shard_starts = np.arange(num_shards, dtype=np.int64)[:, None] * num_pages
    return (shard_starts + pages.astype(np.int64)[None, :]).ravel().astype(np.int32)
