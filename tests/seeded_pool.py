"""A KV pool's pages (and scales, where quantized) filled from a seed: the same in a process that
exports the pool and in the test that checks what a read of it brought."""

from __future__ import annotations

import torch

from shared.kv.pool import PagedKvPool


def fill_seeded(pool: PagedKvPool, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(pool.kv.shape, generator=generator).mul(50).clamp(-127, 127)
    pool.kv.copy_(values.to(pool.kv.dtype))
    if pool.scales is not None:
        pool.scales.copy_(torch.rand(pool.scales.shape, generator=generator))
