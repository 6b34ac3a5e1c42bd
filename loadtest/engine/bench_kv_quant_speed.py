"""GPU benchmark of the KV formats: the decode step and the handoff copy per kv.dtype (JSON on stdout).

    python -m loadtest.engine.bench_kv_quant_speed [--model random:llama-3.1-8b] [--batch 32] [--context 8192]

For each kv.dtype (bfloat16, float8_e4m3, int8) in one run: the decode step as the decode worker
runs it (one CUDA graph replay, p50 of 100) at --batch requests of --context tokens each, where
reading the KV dominates, beside its floor (the weights plus the KV and scales it reads, at the
copy bandwidth measured in the same run) and its ratio to the bfloat16 step; and the handoff's
page copy (shared/kv/pool.py copy_pages_from, both pools on the GPU) of --handoff-tokens tokens:
bytes moved, time, and both as fractions of bfloat16's. The issue's targets: a quantized step at
most 0.65 times the bfloat16 step; handoff bytes and time halved.
"""

from __future__ import annotations

import argparse

import torch

from loadtest.lib.decode_batch import decode_batch, request_pages
from loadtest.lib.device_rates import copy_bandwidth_gbs, cuda_time_ms
from loadtest.lib.model_costs import weight_bytes_per_step
from loadtest.lib.percentiles import quantile
from loadtest.lib.report import emit
from services.decode.cuda_graphs import GraphedDecode
from shared.kv.pages import PageAllocator, pages_for
from shared.kv.pool import allocate_local_pool, token_bytes
from shared.model import presets
from shared.model.llama import PagedLlama

PAGE_SIZE = 16
KV_DTYPES = ("bfloat16", "float8_e4m3", "int8")


def bench_decode(model: PagedLlama, kv_dtype: str, batch: int, context: int, bandwidth_gbs: float) -> dict:
    per_request = request_pages(context, PAGE_SIZE)
    layout = model.kv_layout(batch * per_request + 1, PAGE_SIZE, kv_dtype)
    pool, _buffer = allocate_local_pool(layout, "cuda")
    allocator = PageAllocator(layout.num_pages)
    graphs = GraphedDecode(model, pool, allocator.allocate(1)[0], per_request, [batch])
    inputs = decode_batch(allocator, [context] * batch, PAGE_SIZE, "cuda").inputs
    times = cuda_time_ms(lambda: graphs.step(inputs), 100)
    kv_read = batch * context * token_bytes(layout)
    floor_ms = (weight_bytes_per_step(model) + kv_read) / (bandwidth_gbs * 1e9) * 1e3
    return {"kv_dtype": kv_dtype, "batch": batch, "context": context, "graph_ms_p50": quantile(times, 0.5),
            "graph_ms_min": times[0], "kv_gb_read": kv_read / 1e9, "floor_ms": floor_ms,
            "ratio_to_floor": quantile(times, 0.5) / floor_ms}


def bench_handoff(model: PagedLlama, kv_dtype: str, tokens: int) -> dict:
    count = pages_for(tokens, PAGE_SIZE)
    layout = model.kv_layout(count, PAGE_SIZE, kv_dtype)
    src, _src_buffer = allocate_local_pool(layout, "cuda")
    dst, _dst_buffer = allocate_local_pool(layout, "cuda")
    src_ids, dst_ids = torch.randperm(count, device="cuda"), torch.randperm(count, device="cuda")
    times = cuda_time_ms(lambda: dst.copy_pages_from(src, src_ids, dst_ids), 20)
    return {"kv_dtype": kv_dtype, "tokens": tokens, "bytes": count * PAGE_SIZE * token_bytes(layout),
            "copy_ms_p50": quantile(times, 0.5)}


def relative_to_bfloat16(rows: list[dict], key: str, name: str) -> None:
    base = next(row[key] for row in rows if row["kv_dtype"] == "bfloat16")
    for row in rows:
        row[name] = row[key] / base


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m loadtest.engine.bench_kv_quant_speed")
    parser.add_argument("--model", default="random:llama-3.1-8b")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=8192)
    parser.add_argument("--handoff-tokens", type=int, default=32768)
    parser.add_argument("--out")
    args = parser.parse_args()
    bandwidth = copy_bandwidth_gbs()
    model = PagedLlama.from_hf(presets.random_hf_model(args.model, torch.bfloat16, "cuda"), "cuda")
    torch.cuda.empty_cache()
    decode, handoff = [], []
    for kv_dtype in KV_DTYPES:
        decode.append(bench_decode(model, kv_dtype, args.batch, args.context, bandwidth))
        torch.cuda.empty_cache()  # the pool and its graphs are gone with the call
        handoff.append(bench_handoff(model, kv_dtype, args.handoff_tokens))
        torch.cuda.empty_cache()
    relative_to_bfloat16(decode, "graph_ms_p50", "step_vs_bfloat16")
    relative_to_bfloat16(handoff, "bytes", "bytes_vs_bfloat16")
    relative_to_bfloat16(handoff, "copy_ms_p50", "time_vs_bfloat16")
    emit({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "model": args.model,
          "copy_bandwidth_gbs": bandwidth, "decode": decode, "handoff_copy": handoff}, args.out)


if __name__ == "__main__":
    main()
