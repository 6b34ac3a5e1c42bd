"""GPU benchmark of the latent (MLA) decode attention kernel alone, per page format, split count and merge (JSON on stdout).

    python3 -m loadtest.engine.bench_latent_decode_attention [--shapes b1_1k,b64_1k,b1_32k,b1_512k] [--out FILE]

A step's attention at DeepSeek-V2-Lite's shape: one call per layer of 27 (16 heads, a latent of 512
and a RoPE key of 64), all in one CUDA graph, the median of 20 replays, beside its floor (the latent
and scales those calls read, at the copy bandwidth measured in the same run). The page table is as
wide as the decode worker's at the preset's context, so the split count is the one serving
chooses. For each shape and page format: the kernel as shipped; the same splits merged the other
way (by the last split program, or by a launch of their own); the split rule at 1032f1b (capped at
64, merged by the last program: `capped_64_merged_by_last`); for quantized pages, the products in
bf16 as at 1032f1b (`bf16_products`) rather than fp16; other split counts and tilings in place of
its own.
"""

from __future__ import annotations

import argparse

import torch

from loadtest.lib.device_rates import copy_bandwidth_gbs, graphed_time_ms
from loadtest.lib.report import emit, save
from shared.kernels import kv_quant
from shared.kernels.mla_decode_triton import (
    MlaTiling,
    auto_num_splits,
    default_tiling,
    mla_decode_attention,
)
from shared.kernels.split_merge_triton import MERGE_HERE_SPLITS
from shared.kv.pages import pages_for

PAGE_SIZE = 16
LAYERS, HEADS, RANK, ROPE = 27, 16, 512, 64
SCALE = (128 + ROPE) ** -0.5  # qk_nope_head_dim + qk_rope_head_dim
# name: (batch, context, the page table's width in tokens: the presets' contexts)
SHAPES = {"b1_1k": (1, 1024, 163840), "b64_1k": (64, 1024, 163840), "b1_32k": (1, 32768, 163840),
          "b1_512k": (1, 524224, 524288)}
KV_DTYPES = ("bfloat16", "int8", "float8_e4m3")
SPLITS = (64, 128, 264)
# 8 warps halve a thread's registers (116 against 212 on sm_90); 64 heads a block pad V2-Lite's 16 to
# the warpgroup MMA's 64 rows (HGMMA rather than HMMA, four times the products).
TILINGS = (MlaTiling(16, 64, 4, 2), MlaTiling(16, 32, 4, 3), MlaTiling(16, 32, 4, 5), MlaTiling(16, 32, 8, 2),
           MlaTiling(64, 32, 8, 2))


def filled_latents(kv_dtype: str, pages: int) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
    """Each layer's latent pages [pages, PAGE_SIZE, 1, RANK + ROPE] and scales (None in bf16), of
    finite values."""
    layers = []
    for _ in range(LAYERS):
        values = torch.randn((pages, PAGE_SIZE, 1, RANK + ROPE), dtype=torch.bfloat16, device="cuda")
        if kv_dtype == "bfloat16":
            layers.append((values, None))
        else:
            layers.append(kv_quant.quantize(values, kv_quant.storage_dtype(kv_dtype, torch.bfloat16)))
    return layers


def variants(batch: int, width: int, kv_dtype: str) -> dict:
    """name -> the options of the kernel's call, as shipped and with one choice changed."""
    tiling = default_tiling(HEADS, kv_dtype != "bfloat16")
    shipped_splits = auto_num_splits(batch, 1, width, 0, tiling, torch.device("cuda"))
    out = {"shipped": {}}
    if kv_dtype != "bfloat16":
        out["bf16_products"] = {"products": "native"}  # quantized values converted to bf16, as at 1032f1b
    if shipped_splits > 1:
        out["other_merge"] = {"num_splits": shipped_splits, "merge_here": shipped_splits > MERGE_HERE_SPLITS}
    if shipped_splits > 64:
        out["capped_64_merged_by_last"] = {"num_splits": 64, "merge_here": True}
    for splits in SPLITS:
        if splits != shipped_splits and splits <= width // 256:
            out[f"splits_{splits}"] = {"num_splits": splits}
    for other in TILINGS:
        out[f"tiling_h{other.block_h}_{other.block_n}x{other.num_warps}w{other.num_stages}s"] = {"tiling": other}
    return out


def bench_shape(shape: str, kv_dtype: str, bandwidth_gbs: float) -> list[dict]:
    batch, context, width = SHAPES[shape]
    per_request = pages_for(context, PAGE_SIZE)
    layers = filled_latents(kv_dtype, batch * per_request)
    table = torch.zeros((batch, pages_for(width, PAGE_SIZE)), dtype=torch.int32, device="cuda")
    table[:, :per_request] = torch.randperm(batch * per_request, device="cuda").view(batch, per_request)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q_latent = torch.randn((batch, HEADS, RANK), dtype=torch.bfloat16, device="cuda")
    q_rope = torch.randn((batch, HEADS, ROPE), dtype=torch.bfloat16, device="cuda")
    token_bytes = sum(c[0, 0].nbytes + (0 if s is None else s[0, 0].nbytes) for c, s in layers)
    floor_ms = batch * context * token_bytes / (bandwidth_gbs * 1e9) * 1e3
    rows = []
    for name, options in variants(batch, width, kv_dtype).items():
        def step():
            return [mla_decode_attention(q_latent, q_rope, cache, scales, table, seq_lens, SCALE, **options)
                    for cache, scales in layers]
        ms = graphed_time_ms(step)
        rows.append({"shape": shape, "batch": batch, "context": context, "kv_dtype": kv_dtype, "variant": name,
                     "options": {k: (vars(v) if isinstance(v, MlaTiling) else v) for k, v in options.items()},
                     "step_attention_ms": ms, "floor_ms": floor_ms, "ratio_to_floor": ms / floor_ms})
    shipped = rows[0]["step_attention_ms"]
    for row in rows:
        row["vs_shipped"] = row["step_attention_ms"] / shipped
    rows[0]["num_splits"] = auto_num_splits(batch, 1, width, 0, default_tiling(HEADS, kv_dtype != "bfloat16"),
                                          torch.device("cuda"))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(prog="python3 -m loadtest.engine.bench_latent_decode_attention")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--kv-dtypes", default=",".join(KV_DTYPES))
    parser.add_argument("--out")
    args = parser.parse_args()
    bandwidth = copy_bandwidth_gbs()
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "copy_bandwidth_gbs": bandwidth,
              "layers": LAYERS, "heads": HEADS, "rows": []}
    for shape in args.shapes.split(","):
        for kv_dtype in args.kv_dtypes.split(","):
            report["rows"] += bench_shape(shape, kv_dtype, bandwidth)
            save(report, args.out)
            torch.cuda.empty_cache()
    emit(report, args.out)


if __name__ == "__main__":
    main()
