"""A prompt chunk's causal attention through FlashInfer's Hopper prefill kernel (its port of
FlashAttention-3), where FlashInfer is installed.

One call covers every case the prefill has: a whole prompt, and a chunk after earlier keys (earlier
chunks or a cached prefix), because FlashInfer aligns its causal mask at the bottom right, query i
of T seeing the keys up to S - T + i. It reads grouped KV heads itself, from the [S, KVH, D] layout
the prefill's staging keeps (shared/kv/prompt_kv.py), and needs no copy.

FlashInfer compiles a kernel with the machine's nvcc when first asked for its dtype and head dim
(minutes), into ~/.cache/flashinfer or under FLASHINFER_WORKSPACE_BASE; a kernel placed in its
package's AOT folder loads at once. One that does not build (no nvcc, say) is logged once and not
asked for again. FlashInfer is an optional dependency (pyproject's `hopper` extra): without it the
prefill keeps cuDNN (shared/model/split_attention.py). Its FP8 kernel is measured beside it in
loadtest/engine/bench_prefill_attention.py, and not used: its results were wrong (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import functools
import importlib.util

import structlog
import torch

HEAD_DIMS = (64, 128, 256)

log = structlog.get_logger()


@functools.cache
def installed() -> bool:
    return importlib.util.find_spec("flashinfer") is not None


@functools.cache
def runs_on(device: torch.device) -> bool:
    """FlashInfer is installed and the device is a Hopper GPU (sm_90)."""
    return device.type == "cuda" and installed() and torch.cuda.get_device_capability(device)[0] == 9


def accepts(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the Hopper kernel runs this case: bf16/fp16 on an sm_90 GPU, one head dim for q, k and
    v, and its kernel builds here."""
    return (q.is_cuda and runs_on(q.device) and q.dtype in (torch.bfloat16, torch.float16)
            and k.dtype == v.dtype == q.dtype and q.shape[-1] == k.shape[-1] == v.shape[-1]
            and q.shape[-1] in HEAD_DIMS and q.shape[1] % k.shape[1] == 0 and builds(q.dtype, q.shape[-1]))


@functools.cache
def builds(dtype: torch.dtype, head_dim: int) -> bool:
    """Whether the kernel for this dtype and head dim loads, built now if need be."""
    from flashinfer.prefill import get_single_prefill_module

    try:  # the module single_prefill_with_kv_cache asks for: no RoPE, window, soft cap or fp16 reduction
        get_single_prefill_module("fa3", dtype, dtype, dtype, head_dim, head_dim, 0, False, False, False)
    except Exception as exc:  # whatever stops the build (no nvcc, a compiler error) stops its use
        log.warning("FlashInfer's prefill kernel does not build here; the prefill attends without it",
                    dtype=str(dtype), head_dim=head_dim, error=str(exc).splitlines()[0] if str(exc) else repr(exc))
        return False
    return True


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [T, H, D], k/v [S, KVH, D] with S >= T, the last T keys the queries' own -> [T, H, D],
    causal from the bottom right."""
    import flashinfer

    return flashinfer.single_prefill_with_kv_cache(q, k, v, causal=True, sm_scale=scale, backend="fa3")
