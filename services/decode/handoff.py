"""Pulling a request's KV pages from a prefill's pool into the decode's own pool.

Each prefill pool is mapped once, when the router announces it (PoolAvailable), and kept
until the prefill goes away (PoolGone) or is replaced by a new incarnation. Per request the
listed pages are copied for all layers at once (PagedKvPool.copy_pages_from).
"""

from __future__ import annotations

import time

import structlog
import torch

from shared.kv_pool import PagedKvPool, pages_for
from shared.kv_share import map_pool
from shared.messages import DecodeTask, KvPoolHandle

log = structlog.get_logger()


class HandoffError(RuntimeError):
    pass


class KvPuller:
    def __init__(self, local: PagedKvPool):
        self.local = local
        self.mapped: dict[str, tuple[KvPoolHandle, object]] = {}

    def map_pool(self, prefill_worker_id: str, handle: KvPoolHandle) -> None:
        current = self.mapped.get(prefill_worker_id)
        if current is not None and current[0] == handle:
            return
        self.unmap_pool(prefill_worker_id)
        layout, local = handle.layout, self.local.layout
        if (layout.num_layers, layout.page_size, layout.num_kv_heads, layout.head_dim, layout.dtype) != (
                local.num_layers, local.page_size, local.num_kv_heads, local.head_dim, local.dtype):
            raise HandoffError(f"pool of {prefill_worker_id} has layout {layout}, ours is {local}")
        self.mapped[prefill_worker_id] = (handle, map_pool(handle, self.local.kv.device))
        log.info("mapped prefill pool", prefill=prefill_worker_id, pages=layout.num_pages)

    def unmap_pool(self, prefill_worker_id: str) -> None:
        entry = self.mapped.pop(prefill_worker_id, None)
        if entry is not None:
            entry[1].close()

    def pull(self, task: DecodeTask, local_pages: list[int]) -> float:
        """Copies the task's prompt pages into local_pages; returns the seconds it took."""
        entry = self.mapped.get(task.prefill_worker_id)
        if entry is None:
            raise HandoffError(f"no mapped pool for prefill {task.prefill_worker_id}")
        count = pages_for(task.num_tokens, self.local.layout.page_size)
        if len(task.src_page_ids) < count or any(not 0 <= p < entry[0].layout.num_pages for p in task.src_page_ids):
            raise HandoffError("page ids do not fit the prefill pool")
        started = time.perf_counter()
        device = self.local.kv.device
        self.local.copy_pages_from(entry[1].pool, torch.tensor(task.src_page_ids[:count], device=device),
                                   torch.tensor(local_pages[:count], device=device))
        if device.type == "cuda":  # the prefill may reuse its pages as soon as we acknowledge
            torch.cuda.current_stream(device).synchronize()
        return time.perf_counter() - started

    def close(self) -> None:
        for prefill_worker_id in list(self.mapped):
            self.unmap_pool(prefill_worker_id)
