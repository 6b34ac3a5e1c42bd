"""GPU benchmark of the decode attention kernel alone, per KV format, mode, tiling and split count (JSON on stdout).

    python3 -m loadtest.engine.bench_decode_attention [--baseline FILE] [--shapes b32_8k,b1_1k,b1_512k]
        [--tilings 128x4w2s,128x4w5s] [--out FILE]

A step's attention: one call per layer of a 32-layer pool of the 8B shape (8 kv heads of 128, 32
query heads), all 32 in one CUDA graph, the median of 20 replays, beside its floor (the K, V and
scales those calls read, at the copy bandwidth measured in the same run). The page table is as wide
as the decode worker's (the model's context), so the split count is the one serving chooses. For
each shape and kv.dtype: the kernel as shipped; each tiling of TILINGS (or of --tilings, named
BLOCK_NxWARPSwSTAGESs, "_on_load" for convert_on_load) and each split count of
SPLITS in place of its own; the splits merged by their last program and by a launch of their
own; the FP8-query mode on float8_e4m3 pages; and, with --baseline (a file
of an earlier shared/kernels/paged_attention_triton.py, loadtest/lib/baseline_attention.py), the
earlier kernel on the same pages: the before and after of one run.
"""

from __future__ import annotations

import argparse
import re

import torch

from loadtest.lib import baseline_attention
from loadtest.lib.device_rates import copy_bandwidth_gbs, graphed_time_ms
from loadtest.lib.report import emit
from shared.kernels import kv_quant
from shared.kernels.decode_tiling import Tiling, default_tiling
from shared.kernels.paged_attention_triton import compute_mode, paged_decode_attention
from shared.kv.pages import pages_for
from shared.kv.pool import allocate_local_pool, make_layout, token_bytes

PAGE_SIZE = 16
LAYERS, KV_HEADS, HEADS, HEAD_DIM = 32, 8, 32, 128
# name: (batch, context, the page table's width in tokens: the 8B presets' contexts)
SHAPES = {"b32_8k": (32, 8192, 131072), "b16_8k": (16, 8192, 131072), "b8_8k": (8, 8192, 131072),
          "b64_1k": (64, 1024, 131072), "b1_1k": (1, 1024, 131072), "b1_512k": (1, 524224, 524288)}
KV_DTYPES = ("bfloat16", "int8", "float8_e4m3")
TILINGS = (Tiling(64, 4, 2), Tiling(64, 4, 3), Tiling(128, 4, 2), Tiling(128, 4, 3), Tiling(128, 8, 2),
           Tiling(32, 4, 3), Tiling(64, 4, 2, True), Tiling(128, 4, 2, True))
FP8_QUERY_TILINGS = (Tiling(64, 4, 2), Tiling(128, 8, 2))
SPLITS = {"b32_8k": (2,), "b16_8k": (), "b8_8k": (), "b64_1k": (), "b1_1k": (4, 16), "b1_512k": (16, 49, 66, 132)}


def filled_pool(kv_dtype: str, pages: int):
    """A 32-layer pool with finite values: normal bf16, int8 in [-127, 127], e4m3 bytes of finite
    positive values, scales in [1e-3, 1e-2]."""
    layout = make_layout(LAYERS, pages, PAGE_SIZE, KV_HEADS, HEAD_DIM, kv_quant.storage_dtype(kv_dtype, torch.bfloat16))
    pool, buffer = allocate_local_pool(layout, "cuda")
    for shard in pool.shards():
        if shard.dtype == torch.int8:
            shard.random_(-127, 128)
        elif shard.dtype == torch.float8_e4m3fn:
            shard.view(torch.uint8).random_(0, 0x78)
        else:
            shard.normal_()
    if pool.scales is not None:
        pool.scales.uniform_(1e-3, 1e-2)
    return pool, buffer


def step_attention(pool, q: torch.Tensor, table: torch.Tensor, seq_lens: torch.Tensor, kernel) -> list:
    return [kernel(q, pool.key(i), pool.value(i), table, seq_lens, HEAD_DIM ** -0.5, pool.key_scale(i),
                   pool.value_scale(i)) for i in range(LAYERS)]


def tiling_name(tiling: Tiling) -> str:
    name = f"{tiling.block_n}x{tiling.num_warps}w{tiling.num_stages}s"
    return f"{name}_on_load" if tiling.convert_on_load else name


def parse_tiling(name: str) -> Tiling:
    """A tiling from its tiling_name."""
    match = re.fullmatch(r"(\d+)x(\d+)w(\d+)s(_on_load)?", name)
    if match is None:
        raise argparse.ArgumentTypeError(f"tiling {name!r}: BLOCK_NxWARPSwSTAGESs[_on_load] expected")
    return Tiling(int(match[1]), int(match[2]), int(match[3]), match[4] is not None)


def variants(shape: str, kv_dtype: str, baseline, tilings: tuple[Tiling, ...]) -> dict:
    """name -> the kernel's call, as shipped and with one choice changed."""
    out = {"shipped": paged_decode_attention}
    for tiling in tilings:
        out[f"tiling_{tiling_name(tiling)}"] = _with(tiling=tiling)
    for splits in SPLITS[shape]:
        out[f"splits_{splits}"] = _with(num_splits=splits)
    for merge_here in (True, False):
        out[f"merged_{'by_the_last_split' if merge_here else 'by_a_launch'}"] = _with(merge_here=merge_here)
    if kv_dtype == "float8_e4m3":
        for tiling in FP8_QUERY_TILINGS:
            out[f"fp8_query_{tiling.block_n}x{tiling.num_warps}w"] = _with(fp8_query=True, tiling=tiling)
    if baseline is not None:
        out["baseline"] = lambda *args: baseline_attention.call(baseline, *args)
    return out


def _with(**options):
    return lambda *args: paged_decode_attention(*args, **options)


def bench_shape(shape: str, kv_dtype: str, bandwidth_gbs: float, baseline, tilings: tuple[Tiling, ...]) -> list[dict]:
    batch, context, width = SHAPES[shape]
    per_request = pages_for(context, PAGE_SIZE)
    pool, _buffer = filled_pool(kv_dtype, batch * per_request)
    table = torch.zeros((batch, pages_for(width, PAGE_SIZE)), dtype=torch.int32, device="cuda")
    table[:, :per_request] = torch.randperm(batch * per_request, device="cuda").view(batch, per_request)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn((batch, HEADS, HEAD_DIM), dtype=torch.bfloat16, device="cuda")
    floor_ms = batch * context * token_bytes(pool.layout) / (bandwidth_gbs * 1e9) * 1e3
    rows = []
    for name, kernel in variants(shape, kv_dtype, baseline, tilings).items():
        ms = graphed_time_ms(lambda: step_attention(pool, q, table, seq_lens, kernel))
        rows.append({"shape": shape, "batch": batch, "context": context, "kv_dtype": kv_dtype, "variant": name,
                     "step_attention_ms": ms, "floor_ms": floor_ms, "ratio_to_floor": ms / floor_ms})
    shipped = rows[0]["step_attention_ms"]
    for row in rows:
        row["vs_shipped"] = row["step_attention_ms"] / shipped
    mode = compute_mode(q, pool.key(0), False)
    rows[0].update(mode=mode, tiling=vars(default_tiling(mode, batch, table.shape[1] * PAGE_SIZE)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(prog="python3 -m loadtest.engine.bench_decode_attention")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--kv-dtypes", default=",".join(KV_DTYPES))
    parser.add_argument("--baseline", help="a file of an earlier shared/kernels/paged_attention_triton.py")
    parser.add_argument("--tilings", type=lambda text: tuple(parse_tiling(name) for name in text.split(",")),
                        default=TILINGS, help="the tilings beside the shipped one, comma-separated")
    parser.add_argument("--out")
    args = parser.parse_args()
    bandwidth = copy_bandwidth_gbs()
    baseline = baseline_attention.load(args.baseline) if args.baseline else None
    rows = []
    for shape in args.shapes.split(","):
        for kv_dtype in args.kv_dtypes.split(","):
            rows += bench_shape(shape, kv_dtype, bandwidth, baseline, args.tilings)
            torch.cuda.empty_cache()
    emit({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_bandwidth_gbs": bandwidth,
          "layers": LAYERS, "baseline": args.baseline, "rows": rows}, args.out)


if __name__ == "__main__":
    main()
