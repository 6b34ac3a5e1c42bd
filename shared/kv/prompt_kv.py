"""One layer's K and V for every position of the prompt being prefilled, contiguous.

The prefill runs a prompt layer by layer, each layer over the prompt's chunks in order
(shared/model/llama.py, PagedLlama.prefill), so a chunk's attention reads what its layer's earlier
chunks wrote here, in place, as one contiguous tensor: no chunk gathers the growing context from the
scattered pages again (what that gather cost at 512K: docs/BENCHMARKS.md, "Prefill attention"). A
cached prefix is read from the pages once per layer, dequantized where they are quantized; the
prompt's own K/V stay here as computed, so a prompt in chunks attends to the same K/V as whole.
One buffer serves each layer in turn: two [tokens, kv_heads, head_dim] tensors in the model's
dtype, 2 GiB for 512K tokens of Llama-3.1-8B's shape, however many layers.
"""

from __future__ import annotations

import torch

from shared.kv.pool import PagedKvPool


class PromptKv:
    def __init__(self, tokens: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 v_dim: int | None = None):
        """v_dim: the values' head dim where it is not the keys' (MLA's keys and values, expanded from
        the latent: shared/model/mla.py)."""
        self.k = torch.empty((tokens, kv_heads, head_dim), dtype=dtype, device=device)
        self.v = torch.empty((tokens, kv_heads, v_dim or head_dim), dtype=dtype, device=device)

    def load_prefix(self, pool: PagedKvPool, layer: int, pages: torch.Tensor, count: int) -> None:
        """The first `count` tokens' K and V of `layer`, from the pages that hold them (in order)."""
        for shard, staged in ((2 * layer, self.k), (2 * layer + 1, self.v)):
            staged[:count] = pool.read_tokens(shard, pages, count, staged.dtype)

    def write(self, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """A chunk's K and V [T, kv_heads, head_dim], as computed, at positions start onwards."""
        self.k[start: start + len(k)] = k
        self.v[start: start + len(v)] = v
