"""The paged KV pool: one flat buffer cut into per-layer K and V shards, and its page allocator.

Layout (KvLayout): shards K0 V0 K1 V1 ... of [pages, page_size, kv_heads, head_dim] each,
`shard_stride_bytes` apart, a multiple of 256 so every shard starts 256-byte aligned when the
buffer does. Because the stride is uniform, the whole pool is also one strided tensor
`kv[2 * layers, pages, page_size, kv_heads, head_dim]`: a handoff of any set of pages is one
gather over all layers at once, not one copy per page per layer.
"""

from __future__ import annotations

import torch

from shared import kv_copy_triton
from shared.messages import KvLayout

SHARD_ALIGN_BYTES = 256


class PoolExhausted(RuntimeError):
    pass


def make_layout(num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                dtype: torch.dtype) -> KvLayout:
    item = torch.empty((), dtype=dtype).element_size()
    shard_bytes = num_pages * page_size * num_kv_heads * head_dim * item
    stride = -(-shard_bytes // SHARD_ALIGN_BYTES) * SHARD_ALIGN_BYTES
    return KvLayout(num_layers, num_pages, page_size, num_kv_heads, head_dim, str(dtype).removeprefix("torch."), stride)


def layout_bytes(layout: KvLayout) -> int:
    return 2 * layout.num_layers * layout.shard_stride_bytes


def shard_regions(layout: KvLayout) -> list[tuple[int, int]]:
    """Every shard of the pool as (byte offset of its page 0 in the buffer, bytes per page). A
    transfer that moves raw bytes rather than typed pages (NIXL) moves page p of a request as one
    region per shard: offset + p * bytes per page."""
    item = torch.empty((), dtype=torch_dtype(layout)).element_size()
    page_bytes = layout.page_size * layout.num_kv_heads * layout.head_dim * item
    return [(shard * layout.shard_stride_bytes, page_bytes) for shard in range(2 * layout.num_layers)]


def torch_dtype(layout: KvLayout) -> torch.dtype:
    return getattr(torch, layout.dtype)


class PagedKvPool:
    """Typed views over a flat byte buffer; the buffer's owner (local, shm, CUDA IPC) keeps it alive."""

    def __init__(self, layout: KvLayout, storage: torch.Tensor):
        if storage.dtype != torch.uint8 or storage.dim() != 1 or storage.numel() < layout_bytes(layout):
            raise ValueError("storage must be a flat uint8 buffer of at least layout_bytes(layout)")
        if storage.data_ptr() % SHARD_ALIGN_BYTES:
            raise ValueError("pool storage must start 256-byte aligned")
        self.layout = layout
        dtype = torch_dtype(layout)
        item = torch.empty((), dtype=dtype).element_size()
        typed = storage[: layout_bytes(layout)].view(dtype)
        page = layout.page_size * layout.num_kv_heads * layout.head_dim
        self.kv = typed.as_strided(
            (2 * layout.num_layers, layout.num_pages, layout.page_size, layout.num_kv_heads, layout.head_dim),
            (layout.shard_stride_bytes // item, page, layout.num_kv_heads * layout.head_dim, layout.head_dim, 1),
        )
        self.kv_bits = kv_copy_triton.as_integers(self.kv)  # what the page copy moves

    def key(self, layer: int) -> torch.Tensor:
        return self.kv[2 * layer]

    def value(self, layer: int) -> torch.Tensor:
        return self.kv[2 * layer + 1]

    def shards(self) -> list[torch.Tensor]:
        return list(self.kv.unbind(0))

    def copy_pages_from(self, src: "PagedKvPool", src_pages: torch.Tensor, dst_pages: torch.Tensor) -> None:
        """All layers' K and V for the listed pages: one Triton launch on a GPU; on the CPU a
        gather and scatter of whole contiguous pages per shard, rather than one advanced index
        over the strided [shards, pages, ...] view, which copies element by element."""
        if self.kv.is_cuda:
            kv_copy_triton.copy_pages(src.kv_bits, self.kv_bits, src_pages, dst_pages)
        else:
            for to, source in zip(self.kv.flatten(2), src.kv.flatten(2)):
                to.index_copy_(0, dst_pages, source.index_select(0, src_pages))


def allocate_local_pool(layout: KvLayout, device: torch.device | str) -> tuple[PagedKvPool, torch.Tensor]:
    """A private pool; returns the pool and its backing buffer (keep both alive together)."""
    nbytes = layout_bytes(layout)
    raw = torch.zeros(nbytes + SHARD_ALIGN_BYTES, dtype=torch.uint8, device=device)
    offset = -raw.data_ptr() % SHARD_ALIGN_BYTES
    storage = raw[offset: offset + nbytes]
    return PagedKvPool(layout, storage), raw


class PageAllocator:
    """Free list of page ids; every page has exactly one owner or is free.

    Slices and set operations rather than a Python loop per page: a 32K-token request holds
    2,048 pages, and the decode allocates them on the handoff's critical path."""

    def __init__(self, num_pages: int):
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # taken from the end: low ids first
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, count: int) -> list[int]:
        if count > len(self._free):
            raise PoolExhausted(f"need {count} pages, {len(self._free)} free of {self.num_pages}")
        split = len(self._free) - count
        pages = self._free[split:][::-1]
        del self._free[split:]
        self._used.update(pages)
        return pages

    def free(self, pages: list[int]) -> None:
        freed = set(pages)
        if len(freed) != len(pages):
            raise ValueError(f"duplicate page ids in {pages}")
        if not freed <= self._used:
            raise ValueError(f"page {min(freed - self._used)} freed twice or out of range")
        self._used -= freed
        self._free.extend(pages)


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


def decode_pages_needed(num_prompt_tokens: int, max_tokens: int, page_size: int) -> int:
    """Pages a decode holds for a request: the router reserves exactly this before the prefill."""
    return pages_for(num_prompt_tokens + max_tokens, page_size)
