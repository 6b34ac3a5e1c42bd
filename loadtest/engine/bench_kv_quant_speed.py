"""GPU benchmark of the KV formats: the decode step and the handoff copy per kv.dtype (JSON on stdout).

    python3 -m loadtest.engine.bench_kv_quant_speed [--model random:llama-3.1-8b-512k]
        [--rows 32x8192,1x1024,1x524224] [--baseline FILE] [--handoff-tokens 32768] [--out FILE]

For each kv.dtype (bfloat16, float8_e4m3, int8) in one run: the decode step as the decode worker
runs it (one CUDA graph replay, p50 of 100, the page table as wide as the model's context) at each
row's batch and context, beside its floor (the weights plus the KV and scales it reads, at the copy
bandwidth measured in the same run) and its ratio to the bfloat16 step of the same row. float8_e4m3
also runs with the FP8-query attention (PagedLlama.fp8_query). With --baseline (a file of an
earlier shared/kernels/paged_attention_triton.py, loadtest/lib/baseline_attention.py) every row
also runs with that kernel in the step: the before and after of one run. Rows whose pool and
weights would not fit the GPU are left out and named. And the handoff's page copy
(shared/kv/pool.py copy_pages_from, both pools on the GPU) of --handoff-tokens tokens.
The issue's targets: at batch 32 x 8K a quantized step within 1.1x its floor (at most 0.7x the
bfloat16 step); one sequence at 512K within 1.25x; batch 1 at 1K within 1.15x.
"""

from __future__ import annotations

import argparse
import contextlib

import torch

from loadtest.lib import baseline_attention
from loadtest.lib.decode_batch import decode_batch, request_pages
from loadtest.lib.device_rates import copy_bandwidth_gbs, cuda_time_ms
from loadtest.lib.model_costs import weight_bytes_per_step
from loadtest.lib.percentiles import quantile
from loadtest.lib.report import emit
from services.decode.cuda_graphs import GraphedDecode
from shared.kv.pages import PageAllocator, pages_for
from shared.kv.pool import allocate_local_pool, layout_bytes, token_bytes
from shared.model import presets
from shared.model.llama import PagedLlama

PAGE_SIZE = 16
KV_DTYPES = ("bfloat16", "float8_e4m3", "int8")
# Memory the pool may take: the GPU's less the weights and this much for activations and graphs.
_HEADROOM_BYTES = 8 << 30


def variants(kv_dtype: str, baseline) -> dict[str, tuple[bool, contextlib.AbstractContextManager]]:
    """name -> (fp8_query, the kernel in place) of each way a row's step runs."""
    out = {"shipped": (False, contextlib.nullcontext())}
    if kv_dtype == "float8_e4m3":
        out["fp8_query"] = (True, contextlib.nullcontext())
    if baseline is not None:
        out["baseline"] = (False, baseline_attention.in_the_model(baseline))
    return out


def bench_row(model: PagedLlama, kv_dtype: str, batch: int, context: int, bandwidth_gbs: float,
              baseline) -> list[dict]:
    per_request = request_pages(context, PAGE_SIZE)
    layout = model.kv_layout(batch * per_request + 1, PAGE_SIZE, kv_dtype)
    pool, _buffer = allocate_local_pool(layout, "cuda")
    allocator = PageAllocator(layout.num_pages)
    scratch = allocator.allocate(1)[0]
    inputs = decode_batch(allocator, [context] * batch, PAGE_SIZE, "cuda").inputs
    kv_read = batch * context * token_bytes(layout)
    floor_ms = (weight_bytes_per_step(model) + kv_read) / (bandwidth_gbs * 1e9) * 1e3
    rows = []
    for name, (fp8_query, kernel) in variants(kv_dtype, baseline).items():
        model.fp8_query = fp8_query
        with kernel:
            graphs = GraphedDecode(model, pool, scratch, pages_for(model.max_context, PAGE_SIZE), [batch])
            times = cuda_time_ms(lambda: graphs.step(inputs), 100)
        del graphs
        rows.append({"kv_dtype": kv_dtype, "variant": name, "batch": batch, "context": context,
                     "graph_ms_p50": quantile(times, 0.5), "graph_ms_min": times[0], "kv_gb_read": kv_read / 1e9,
                     "floor_ms": floor_ms, "ratio_to_floor": quantile(times, 0.5) / floor_ms})
    model.fp8_query = False
    return rows


def fits(model: PagedLlama, kv_dtype: str, batch: int, context: int) -> bool:
    layout = model.kv_layout(batch * request_pages(context, PAGE_SIZE) + 1, PAGE_SIZE, kv_dtype)
    free, _total = torch.cuda.mem_get_info()
    return layout_bytes(layout) + _HEADROOM_BYTES < free


def bench_handoff(model: PagedLlama, kv_dtype: str, tokens: int) -> dict:
    count = pages_for(tokens, PAGE_SIZE)
    layout = model.kv_layout(count, PAGE_SIZE, kv_dtype)
    src, _src_buffer = allocate_local_pool(layout, "cuda")
    dst, _dst_buffer = allocate_local_pool(layout, "cuda")
    src_ids, dst_ids = torch.randperm(count, device="cuda"), torch.randperm(count, device="cuda")
    times = cuda_time_ms(lambda: dst.copy_pages_from(src, src_ids, dst_ids), 20)
    return {"kv_dtype": kv_dtype, "tokens": tokens, "bytes": count * PAGE_SIZE * token_bytes(layout),
            "copy_ms_p50": quantile(times, 0.5)}


def relative_to_bfloat16(rows: list[dict], key: str, name: str, same: tuple[str, ...] = ()) -> None:
    """row[name] = row[key] over the key of the shipped bfloat16 row that matches it in `same`."""
    for row in rows:
        base = [r[key] for r in rows if r["kv_dtype"] == "bfloat16" and r.get("variant", "shipped") == "shipped"
                and all(r[field] == row[field] for field in same)]
        if base:
            row[name] = row[key] / base[0]


def relative_to_baseline(rows: list[dict]) -> None:
    for row in rows:
        base = [r["graph_ms_p50"] for r in rows if r["variant"] == "baseline"
                and (r["kv_dtype"], r["batch"], r["context"]) == (row["kv_dtype"], row["batch"], row["context"])]
        if base:
            row["step_vs_baseline"] = row["graph_ms_p50"] / base[0]


def parse_rows(text: str) -> list[tuple[int, int]]:
    return [tuple(int(part) for part in row.split("x")) for row in text.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(prog="python3 -m loadtest.engine.bench_kv_quant_speed")
    parser.add_argument("--model", default="random:llama-3.1-8b-512k", help="its context bounds the rows'")
    parser.add_argument("--rows", default="32x8192,1x1024,1x524224", help="batch x context, comma-separated")
    parser.add_argument("--kv-dtypes", default=",".join(KV_DTYPES))
    parser.add_argument("--baseline", help="a file of an earlier shared/kernels/paged_attention_triton.py")
    parser.add_argument("--handoff-tokens", type=int, default=32768, help="0 leaves the handoff copy out")
    parser.add_argument("--out")
    args = parser.parse_args()
    bandwidth = copy_bandwidth_gbs()
    model = PagedLlama.from_hf(presets.random_hf_model(args.model, torch.bfloat16, "cuda"), "cuda")
    baseline = baseline_attention.load(args.baseline) if args.baseline else None
    torch.cuda.empty_cache()
    decode, handoff, left_out = [], [], []
    for kv_dtype in args.kv_dtypes.split(","):
        for batch, context in parse_rows(args.rows):
            if fits(model, kv_dtype, batch, context):
                decode += bench_row(model, kv_dtype, batch, context, bandwidth, baseline)
            else:
                left_out.append(f"{kv_dtype} {batch}x{context}: the pool does not fit beside the weights")
            torch.cuda.empty_cache()  # the pool and its graphs are gone with the call
        if args.handoff_tokens:
            handoff.append(bench_handoff(model, kv_dtype, args.handoff_tokens))
            torch.cuda.empty_cache()
    relative_to_bfloat16(decode, "graph_ms_p50", "step_vs_bfloat16", ("batch", "context"))
    relative_to_baseline(decode)
    relative_to_bfloat16(handoff, "bytes", "bytes_vs_bfloat16")
    relative_to_bfloat16(handoff, "copy_ms_p50", "time_vs_bfloat16")
    emit({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "model": args.model,
          "copy_bandwidth_gbs": bandwidth, "baseline": args.baseline, "decode": decode, "left_out": left_out,
          "handoff_copy": handoff}, args.out)


if __name__ == "__main__":
    main()
