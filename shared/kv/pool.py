"""The paged KV pool: one flat buffer cut into per-layer K and V shards, and its page allocator.

Layout (KvLayout): shards K0 V0 K1 V1 ... of [pages, page_size, kv_heads, head_dim] each,
`shard_stride_bytes` apart, a multiple of 256 so every shard starts 256-byte aligned when the
buffer does. Because the stride is uniform, the whole pool is also one strided tensor
`kv[2 * layers, pages, page_size, kv_heads, head_dim]`: a handoff of any set of pages is one
gather over all layers at once, not one copy per page per layer. An MLA model (DeepSeek) keeps one
shard per layer instead, L0 L1 ..., of [pages, page_size, 1, kv_lora_rank + qk_rope_head_dim]:
each token's compressed latent then its RoPE key (shared/model/mla.py); whatever moves pages by
shard moves these alike.

Quantized pages (int8, float8_e4m3fn: shared/kernels/kv_quant.py) have their float32 scales, one per token
and KV head, in scale shards after the page shards, in the same order (K0 V0 K1 V1 ...), each
[pages, page_size, kv_heads] and 256-byte aligned likewise: `scales[2 * layers, pages, page_size,
kv_heads]` (one per token and layer for a latent). A page id names a page's values and its scales alike, so whatever moves or caches
pages by id (the handoff, the prefix cache) carries both.
"""

from __future__ import annotations

import numpy
import torch

from shared.control.messages import KvLayout
from shared.kernels import kv_copy_triton, kv_quant

SHARD_ALIGN_BYTES = 256


def make_layout(num_layers: int, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                dtype: torch.dtype, shards_per_layer: int = 2) -> KvLayout:
    item = torch.empty((), dtype=dtype).element_size()
    stride = _aligned(num_pages * page_size * num_kv_heads * head_dim * item)
    return KvLayout(num_layers, num_pages, page_size, num_kv_heads, head_dim, str(dtype).removeprefix("torch."), stride,
                    shards_per_layer)


def num_shards(layout: KvLayout) -> int:
    """Page shards of the pool (as many scale shards follow where it is quantized)."""
    return layout.shards_per_layer * layout.num_layers


def _aligned(nbytes: int) -> int:
    return -(-nbytes // SHARD_ALIGN_BYTES) * SHARD_ALIGN_BYTES


def _scale_page_bytes(layout: KvLayout) -> int:
    """0 where the pages are not quantized: such a pool has no scale shards."""
    if not kv_quant.is_quantized(torch_dtype(layout)):
        return 0
    return layout.page_size * layout.num_kv_heads * kv_quant.SCALE_DTYPE.itemsize


def scale_stride_bytes(layout: KvLayout) -> int:
    """Bytes from one scale shard to the next; 0 without scales. Derived from the layout's other
    fields, so two pools whose pages match match in their scales too."""
    return _aligned(layout.num_pages * _scale_page_bytes(layout))


def layout_bytes(layout: KvLayout) -> int:
    return num_shards(layout) * (layout.shard_stride_bytes + scale_stride_bytes(layout))


def shard_regions(layout: KvLayout) -> list[tuple[int, int]]:
    """Every shard of the pool, scale shards included, as (byte offset of its page 0 in the buffer,
    bytes per page). A transfer that moves raw bytes rather than typed pages (NIXL) moves page p of
    a request as one region per shard: offset + p * bytes per page."""
    item = torch.empty((), dtype=torch_dtype(layout)).element_size()
    page_bytes = layout.page_size * layout.num_kv_heads * layout.head_dim * item
    shards = num_shards(layout)
    regions = [(shard * layout.shard_stride_bytes, page_bytes) for shard in range(shards)]
    scale_bytes, scale_stride = _scale_page_bytes(layout), scale_stride_bytes(layout)
    if scale_bytes:
        scales_at = shards * layout.shard_stride_bytes
        regions += [(scales_at + shard * scale_stride, scale_bytes) for shard in range(shards)]
    return regions


def token_bytes(layout: KvLayout) -> int:
    """What one token's K and V (or latent) take in the pool, scales included, over all layers: what a handoff
    moves and a decode step reads per token."""
    return sum(page_bytes for _, page_bytes in shard_regions(layout)) // layout.page_size


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
            (num_shards(layout), layout.num_pages, layout.page_size, layout.num_kv_heads, layout.head_dim),
            (layout.shard_stride_bytes // item, page, layout.num_kv_heads * layout.head_dim, layout.head_dim, 1),
        )
        self.kv_bits = kv_copy_triton.as_integers(self.kv)  # what the page copy moves
        self.scales: torch.Tensor | None = None
        self.scale_bits: torch.Tensor | None = None
        if kv_quant.is_quantized(dtype):
            self.scales = self._scale_view(layout, storage)
            self.scale_bits = kv_copy_triton.as_integers(self.scales)

    @staticmethod
    def _scale_view(layout: KvLayout, storage: torch.Tensor) -> torch.Tensor:
        scales_at = num_shards(layout) * layout.shard_stride_bytes
        typed = storage[scales_at: layout_bytes(layout)].view(kv_quant.SCALE_DTYPE)
        row = layout.page_size * layout.num_kv_heads
        return typed.as_strided(
            (num_shards(layout), layout.num_pages, layout.page_size, layout.num_kv_heads),
            (scale_stride_bytes(layout) // kv_quant.SCALE_DTYPE.itemsize, row, layout.num_kv_heads, 1),
        )

    def key(self, layer: int) -> torch.Tensor:
        return self.kv[2 * layer]

    def value(self, layer: int) -> torch.Tensor:
        return self.kv[2 * layer + 1]

    def key_scale(self, layer: int) -> torch.Tensor | None:
        """[pages, page_size, kv_heads] float32, or None where the pages are not quantized."""
        return None if self.scales is None else self.scales[2 * layer]

    def value_scale(self, layer: int) -> torch.Tensor | None:
        return None if self.scales is None else self.scales[2 * layer + 1]

    def latent(self, layer: int) -> torch.Tensor:
        """An MLA pool's shard of `layer`: [pages, page_size, 1, kv_lora_rank + qk_rope_head_dim]."""
        return self.kv[layer]

    def latent_scale(self, layer: int) -> torch.Tensor | None:
        return None if self.scales is None else self.scales[layer]

    def read_tokens(self, shard: int, pages: torch.Tensor, count: int, dtype: torch.dtype) -> torch.Tensor:
        """The first `count` tokens of the pages (in order) in one shard, dequantized where the pool
        is quantized, in dtype: a cached prefix as the prefill reads it back."""
        values = self.kv[shard][pages].flatten(0, 1)[:count]
        if self.scales is None:
            return values.to(dtype)
        return kv_quant.dequantize(values, self.scales[shard][pages].flatten(0, 1)[:count], dtype)

    def write_latent(self, layer: int, pages: torch.Tensor, offsets: torch.Tensor, latent: torch.Tensor) -> None:
        """Tokens' latents [N, 1, kv_lora_rank + qk_rope_head_dim] into their slots, quantized where the pool is."""
        if self.scales is None:
            self.kv[layer][pages, offsets] = latent
            return
        values, scales = kv_quant.quantize(latent, self.kv.dtype)
        self.kv[layer][pages, offsets] = values
        self.scales[layer][pages, offsets] = scales

    def write(self, layer: int, pages: torch.Tensor, offsets: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Tokens' K and V [N, kv_heads, head_dim] into slot offsets[n] of page pages[n], quantized
        where the pool is (the GPU's decode and prefill quantize in their fused RoPE write instead)."""
        if self.scales is None:
            self.key(layer)[pages, offsets] = k
            self.value(layer)[pages, offsets] = v
            return
        for shard, x in ((2 * layer, k), (2 * layer + 1, v)):
            values, scales = kv_quant.quantize(x, self.kv.dtype)
            self.kv[shard][pages, offsets] = values
            self.scales[shard][pages, offsets] = scales

    def shards(self) -> list[torch.Tensor]:
        return list(self.kv.unbind(0))

    def copy_pages_from(self, src: "PagedKvPool", src_pages: torch.Tensor, dst_pages: torch.Tensor,
                        heads: tuple[int, int, int] | None = None) -> None:
        """All layers' K and V for the listed pages, with their scales where quantized: one Triton
        launch for the values and one for the scales on a GPU; on the CPU a gather and scatter of
        whole contiguous pages per shard, rather than one advanced index over the strided
        [shards, pages, ...] view, which copies element by element (of bits: PyTorch's CPU
        index_copy_ has no float8). heads: (src's first, ours first, count): only those KV heads
        of each page, as between tensor-parallel ranks of different sizes (_copy_heads)."""
        for dst_bits, src_bits in ((self.kv_bits, src.kv_bits), (self.scale_bits, src.scale_bits)):
            if dst_bits is None:
                continue
            if heads is not None:
                _copy_heads(src_bits, dst_bits, src_pages, dst_pages, heads)
            elif self.kv.is_cuda:
                kv_copy_triton.copy_pages(src_bits, dst_bits, src_pages, dst_pages)
            else:
                for to, source in zip(dst_bits.flatten(2), src_bits.flatten(2)):
                    to.index_copy_(0, dst_pages, source.index_select(0, src_pages))


def _copy_heads(src_bits: torch.Tensor, dst_bits: torch.Tensor, src_pages: torch.Tensor, dst_pages: torch.Tensor,
                heads: tuple[int, int, int]) -> None:
    """Some heads of the listed pages, between [shards, pages, page_size, kv_heads(, head_dim)]
    views, by torch indexing (a head's slice of a page is not contiguous, which the Triton copy
    needs). On a GPU the page ids go up without waiting, as the Triton copy reads them: pinned
    host memory that the caller rewrites only after the copy. On the CPU, one gather of whole
    pages and one scatter into the heads' slice per shard."""
    src_first, dst_first, count = heads
    dst_heads = dst_bits.narrow(3, dst_first, count)
    if dst_bits.is_cuda:
        src_ids, dst_ids = (pages.to(dst_bits.device, non_blocking=True) for pages in (src_pages, dst_pages))
        dst_heads[:, dst_ids] = src_bits.narrow(3, src_first, count)[:, src_ids]
        return
    for to, source in zip(dst_heads, src_bits):
        to.index_copy_(0, dst_pages, source.index_select(0, src_pages).narrow(2, src_first, count))


def allocate_local_pool(layout: KvLayout, device: torch.device | str) -> tuple[PagedKvPool, torch.Tensor]:
    """A private pool; returns the pool and its backing buffer (keep both alive together)."""
    nbytes = layout_bytes(layout)
    raw = _zeroed_bytes(nbytes + SHARD_ALIGN_BYTES, torch.device(device))
    offset = -raw.data_ptr() % SHARD_ALIGN_BYTES
    storage = raw[offset: offset + nbytes]
    return PagedKvPool(layout, storage), raw


def _zeroed_bytes(nbytes: int, device: torch.device) -> torch.Tensor:
    """On the CPU through calloc (numpy's zeros), whose large blocks are pages the OS zeroes as they
    are first touched: a pool costs memory as it fills, not all at start (torch.zeros writes every
    byte: 1.4 GB resident for the embedded model's default decode pool before any request)."""
    if device.type == "cpu":
        return torch.from_numpy(numpy.zeros(nbytes, dtype=numpy.uint8))
    return torch.zeros(nbytes, dtype=torch.uint8, device=device)
