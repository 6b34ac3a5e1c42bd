"""Sweep of Triton GEMV configs for the decode step's weight shapes (JSON on stdout).

    python -m loadtest.engine.bench_gemv_configs [--rows 1,8] [--weights bf16|fp8] [--top 8] [--out FILE]

What chose shared/kernels/gemv_triton.CONFIGS: each config of a grid, one row (multiply-add) or a
batch (tensor cores, in the narrowest block of 16, 32 or 64 rows that holds it), reads each
Llama-3.1-8B weight shape, timed as the decode's LinearChooser times its candidates (back to back
in a CUDA graph, weights rotated past L2). In the same run: cuBLAS on the same shape in bf16 (the
baseline), and the floor, the weight's bytes over the device's copy bandwidth (bytes read +
written per second of a 4 GiB device-to-device copy). --weights fp8 sweeps float8_e4m3 weights
with their per-channel scales (model.quantization = "fp8"), x quantized per row before the timing,
as the decode's norms and SiLU hand it over (W8A8).
"""

from __future__ import annotations

import argparse
import functools
import itertools

import torch
import torch.nn.functional as F

from loadtest.lib.device_rates import copy_bandwidth_gbs
from loadtest.lib.report import emit
from shared.kernels import gemv_triton
from shared.kernels.triton_support import triton
from shared.model.linear_choice import time_per_call_ms
from shared.model.quantization import quantize_per_token, quantize_weight

SHAPES = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}


def grid(rows: int, fp8: bool) -> list:
    """Tensor-core configs (x padded to the narrowest block that holds the rows), and for one row the
    multiply-add configs too. FP8 weights: tensor-core blocks of 8-32 KB, and for one row the shipped
    multiply-add configs."""
    def configs(block_m, blocks, tuning):
        return [triton.Config({"BLOCK_M": block_m, "BLOCK_N": n, "BLOCK_K": k, "SPLIT_K": split},
                              num_warps=warps, num_stages=stages)
                for (n, k), (warps, stages, split) in itertools.product(blocks, list(tuning))]

    block_m = next(b for b in (gemv_triton.TENSOR_CORE_ROWS, 32, gemv_triton.MAX_ROWS) if rows <= b)
    if fp8:
        tensor_cores = configs(block_m, [(64, 128), (64, 256), (128, 128), (128, 256), (256, 128)],
                               itertools.product([4, 8], [3, 4], [1, 2, 4]))
        multiply_add = [c for c in gemv_triton.CONFIGS if c.kwargs["BLOCK_M"] == 1]
        return tensor_cores if rows > 1 else multiply_add + tensor_cores
    tensor_cores = configs(block_m, [(n, k) for n, k in itertools.product([32, 64, 128], [64, 128, 256])
                                                  if n * k <= 16384],
                           itertools.product([4, 8], [3, 4, 5], [1, 2, 4]))
    if rows > 1:
        return tensor_cores
    multiply_add = configs(1, [(n, k) for n, k in itertools.product([2, 4, 8, 16, 32], [256, 512, 1024, 2048])
                               if 2048 <= n * k <= 16384],
                           itertools.product([4, 8], [1, 3], [1, 2, 4]))
    return multiply_add + tensor_cores


def _key(config) -> tuple:
    return tuple(sorted(config.kwargs.items())), config.num_warps, config.num_stages


def sweep(rows: int, fp8: bool, top: int, bandwidth_gbs: float) -> list[dict]:
    results = []
    configs = grid(rows, fp8)
    for name, (n, k) in SHAPES.items():
        if fp8 and name == "lm_head":
            continue  # the lm_head stays bf16 (shared/model/quantization.py)
        weight = torch.randn(n, k, dtype=torch.bfloat16, device="cuda")
        x = torch.randn(rows, k, dtype=torch.bfloat16, device="cuda")
        times = time_per_call_ms({"cublas": functools.partial(F.linear, x)}, weight)
        scale, quantized_rows = None, {}
        if fp8:
            weight, scale = quantize_weight(weight)
            x_fp8, x_scale = quantize_per_token(x)
            x, quantized_rows = x_fp8, {"x_scale": x_scale, "out_dtype": torch.bfloat16}
        shared_memory = gemv_triton.shared_memory_per_program(torch.cuda.current_device())
        usable = [c for c in configs if k >= c.kwargs["SPLIT_K"] * c.kwargs["BLOCK_K"]
                  and gemv_triton.fits_shared_memory(c, shared_memory, weight.element_size(), x.element_size())]
        candidates = {i: functools.partial(gemv_triton.gemv, x, config=c, weight_scale=scale, **quantized_rows)
                      for i, c in enumerate(usable)}
        times |= time_per_call_ms(candidates, weight)
        ranked = sorted(range(len(usable)), key=times.__getitem__)[:top]
        shipped = {_key(c) for c in gemv_triton.CONFIGS}
        current = [i for i, c in enumerate(usable) if _key(c) in shipped]
        results.append({
            "rows": rows, "weight": name, "n": n, "k": k, "weight_dtype": str(weight.dtype),
            "floor_us": weight.numel() * weight.element_size() / (bandwidth_gbs * 1e9) * 1e6,
            "cublas_us": times["cublas"] * 1e3,
            "fastest": [{"us": times[i] * 1e3, "config": str(usable[i])} for i in ranked],
            "fastest_shipped": ({"us": times[min(current, key=times.__getitem__)] * 1e3,
                                 "config": str(usable[min(current, key=times.__getitem__)])} if current else None),
        })
        del weight
    return results


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m loadtest.engine.bench_gemv_configs")
    parser.add_argument("--rows", default="1,8", help="batch sizes to sweep")
    parser.add_argument("--weights", choices=("bf16", "fp8"), default="bf16")
    parser.add_argument("--top", type=int, default=8, help="fastest configs reported per shape")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    bandwidth = copy_bandwidth_gbs()
    report = {"device": torch.cuda.get_device_name(), "copy_bandwidth_gbs": bandwidth, "sweeps": []}
    for rows in (int(r) for r in args.rows.split(",")):
        report["sweeps"] += sweep(rows, args.weights == "fp8", args.top, bandwidth)
    emit(report, args.out)


if __name__ == "__main__":
    main()
