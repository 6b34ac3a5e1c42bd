"""Quantized KV pages: int8 or FP8 (e4m3) values with one float32 scale per token and KV head.

A (token, KV head) row x of head_dim values is stored as x / s, rounded to the format, with
s = max|x| / QMAX and QMAX the format's largest value (127 for int8, 448 for e4m3); s is kept
beside the page, in a scale shard of the pool (shared/kv/pool.py). Per row rather than per
tensor: a scale that follows each row's own largest value needs no calibration, and an outlier
token or head costs precision only to itself. The scale costs 4 bytes against head_dim bytes of
values, 3% at head_dim 128.

kv.dtype names the cache's format: "bfloat16" keeps K and V unquantized in the model's own dtype
(model.dtype: bfloat16 on a GPU, float32 on the CPU), exactly as computed.

The functions here are the CPU path and the reference of the GPU kernels: the RoPE/KV write
(shared/kernels/fused_triton.py) quantizes the same way, and the decode attention
(shared/kernels/paged_attention_triton.py) dequantizes in registers.
"""

from __future__ import annotations

import torch

# Config name -> what the pages hold; None: the model's dtype, unquantized.
KV_DTYPES: dict[str, torch.dtype | None] = {"bfloat16": None, "float8_e4m3": torch.float8_e4m3fn, "int8": torch.int8}
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0}
SCALE_DTYPE = torch.float32


def storage_dtype(kv_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The dtype of a pool's pages for kv.dtype, on a model computing in model_dtype."""
    return KV_DTYPES[kv_dtype] or model_dtype


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in QMAX


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (values [..., D] in dtype, scales [...] float32), one scale per row of D."""
    y, scales = scaled_rows(x, dtype)
    return y.to(dtype), scales


def scaled_rows(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """What quantize casts to dtype, in float32 (int8's already rounded), and the scales."""
    qmax = QMAX[dtype]
    x = x.float()
    amax = x.abs().amax(-1)
    # A row of zeros stays zeros whatever it is multiplied by, and its scale is 0.
    inverse = qmax / torch.where(amax > 0, amax, 1.0)
    y = (x * inverse[..., None]).clamp(-qmax, qmax)
    if dtype == torch.int8:
        y = torch.floor(y + 0.5)  # as the Triton write rounds: half up, not PyTorch's half to even
    return y, amax / qmax


def dequantize(values: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """values [..., D] with their scales [...] -> [..., D] in dtype."""
    return (values.float() * scales[..., None]).to(dtype)
