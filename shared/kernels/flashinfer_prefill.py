"""A prompt chunk's causal attention through FlashInfer's Hopper prefill kernel (its port of
FlashAttention-3), where FlashInfer is installed.

One call covers every case the prefill has: a whole prompt, and a chunk after earlier keys (earlier
chunks or a cached prefix), because FlashInfer aligns its causal mask at the bottom right, query i
of T seeing the keys up to S - T + i. It reads grouped KV heads itself, from the [S, KVH, D] layout
the prefill's staging keeps (shared/kv/prompt_kv.py), and needs no copy.

FlashInfer compiles its kernels when first asked for a shape (minutes), into ~/.cache/flashinfer or
under FLASHINFER_WORKSPACE_BASE; a kernel placed in its package's AOT folder loads at once. It is an
optional dependency (pyproject's `hopper` extra): without it the prefill keeps cuDNN
(shared/model/split_attention.py). Its FP8 kernel is measured beside it in
loadtest/engine/bench_prefill_attention.py, and not used: its results were wrong (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import functools
import importlib.util

import torch

HEAD_DIMS = (64, 128, 256)


@functools.cache
def installed() -> bool:
    return importlib.util.find_spec("flashinfer") is not None


@functools.cache
def runs_on(device: torch.device) -> bool:
    """FlashInfer is installed and the device is a Hopper GPU (sm_90)."""
    return device.type == "cuda" and installed() and torch.cuda.get_device_capability(device)[0] == 9


def accepts(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the Hopper kernel runs this case: bf16/fp16 on an sm_90 GPU, one head dim for q, k and v."""
    return (q.is_cuda and runs_on(q.device) and q.dtype in (torch.bfloat16, torch.float16)
            and k.dtype == v.dtype == q.dtype and q.shape[-1] == k.shape[-1] == v.shape[-1]
            and q.shape[-1] in HEAD_DIMS and q.shape[1] % k.shape[1] == 0)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [T, H, D], k/v [S, KVH, D] with S >= T, the last T keys the queries' own -> [T, H, D],
    causal from the bottom right."""
    import flashinfer

    return flashinfer.single_prefill_with_kv_cache(q, k, v, causal=True, sm_scale=scale, backend="fa3")
