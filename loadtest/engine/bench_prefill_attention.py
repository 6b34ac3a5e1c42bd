"""The prefill's causal attention, one layer, each way the device has, side by side (JSON on stdout).

    python -m loadtest.engine.bench_prefill_attention [--cases 8192@0,32768@0,8192@57344,32768@122880,32768@491520]
        [--shape llama-3.1-8b|deepseek-v2-lite] [--repeats 5] [--ways NAME,...] [--out FILE]

--shape: the 8B's 32 query / 8 KV heads of 128, or DeepSeek-V2-Lite's prefill attention, 16 heads
with keys of 192 (128 from the latent, 64 RoPE) and values of 128 (shared/model/mla.py); for it
v_padded is also timed: the values zero-padded to the keys' width, so that kernels that want one
head dim take them, the output cut back.

A case T@B is T queries after B keys already in the pages: B = 0 a whole prompt (or its first
chunk), causal from the top left; B > 0 a later chunk, or a chunk after a cached prefix, causal
from the bottom right. The ways, each timed as the mean of --repeats calls after 3 warm-ups, beside
the bound: this attention's FLOPs at the bf16 matmul rate measured in the same run:
- today: shared/model/attention.py's masked_attention, the one SDPA call the prefill made until
  now, on whatever backend SDPA picks (sdpa_default names it for a whole prompt; with the
  bottom-right mask PyTorch goes to flash);
- flash, cudnn_whole: the same call held to SDPA's flash or cuDNN backend (cuDNN takes the
  bottom-right mask materialized, skipped above --max-mask-gib);
- cudnn_split, cudnn_split_stacked: shared/model/split_attention.py, cuDNN reading the grouped KV
  heads itself, or the query heads of each group stacked along the sequence;
- flashinfer: FlashInfer's Hopper (FA3) kernel, one call with the bottom-right causal mask
  (shared/kernels/flashinfer_prefill.py), where FlashInfer is installed and the GPU is a Hopper;
- flashinfer_fp8: the same kernel in FP8, q, k and v quantized per head in the call;
  flashinfer_fp8_kernel: the FP8 kernel alone, on inputs quantized before the timing (as a prefill
  that kept its K/V staged in FP8 would call it); flashinfer_fp8_fp16_out: with an fp16 output,
  and flashinfer_fp8_ungrouped: that with each KV head repeated for its query heads, the two
  things FlashInfer's own tests of the kernel do that flashinfer_fp8 does not (its bf16 output
  was wrong by as much as the output: docs/BENCHMARKS.md);
- triton_fp8: shared/kernels/fp8_prefill_attention_triton.py, both products on FP8 tensor cores, q,
  k and v quantized per head in the call (V transposed); triton_fp8_kernel_MxN_wWsS[rR]: the kernel
  alone on inputs quantized before, for each of its configs (M query rows by N keys a tile, W warps,
  S stages, at most R registers a thread);
- chosen: attention.prefill_attention, what the prefill runs now.
Each also reports its first call, synchronized (for a new shape it includes cuDNN's plan build), and
its largest difference from SDPA's math backend in float32 (beside the largest value, and the two
outputs' cosine) on the case cut to at most 1024 queries after 3072 keys.
TORCH_CUDNN_SDPA_AVOID_RECOMPILE, PyTorch's experimental setting for fewer plan builds, is in the
report as the environment gives it.

For a later chunk, what its layer's earlier K/V cost to read: the gather from scattered pages that
each chunk made until now (bf16 pages; int8 pages dequantized), against what the prefill does now,
writing the chunk's own K/V into the contiguous staging (shared/kv/prompt_kv.py); and that gather
summed over a 512K-token prompt in 32K chunks, 32 layers.
"""

from __future__ import annotations

import argparse
import functools
import os
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from loadtest.lib.device_rates import GIB, cuda_time_ms, matmul_tflops
from loadtest.lib.report import emit
from shared.kernels import flashinfer_prefill, fp8_prefill_attention_triton
from shared.kernels.fp8_prefill_attention_triton import quantize_per_head
from shared.kv.pool import allocate_local_pool, make_layout
from shared.kv.prompt_kv import PromptKv
from shared.model import attention, split_attention


@dataclass(frozen=True)
class Shape:
    heads: int
    kv_heads: int
    head_dim: int  # queries' and keys'
    v_dim: int
    layers: int

    @property
    def scale(self) -> float:
        return self.head_dim ** -0.5


SHAPES = {"llama-3.1-8b": Shape(32, 8, 128, 128, 32), "deepseek-v2-lite": Shape(16, 16, 192, 128, 27)}
CHECK_QUERIES, CHECK_BEFORE = 1024, 3072
PAGE_SIZE = 16
DEVICE = "cuda"
LONG_PROMPT, LONG_CHUNK = 524288, 32768


def attention_flops(shape: Shape, queries: int, before: int) -> float:
    """QK^T and PV over the keys each query sees: `before` earlier ones and the causal part of its own chunk."""
    seen = queries * before + queries * (queries + 1) / 2
    return 2 * shape.heads * (shape.head_dim + shape.v_dim) * seen


def inputs(shape: Shape, queries: int, before: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [T, H, D], k [B + T, KVH, D], v [B + T, KVH, Dv] as the prefill hands them over, bf16."""
    generator = torch.Generator(device=DEVICE).manual_seed(seed)
    q, k, v = (torch.randn(rows, heads, dim, device=DEVICE, dtype=torch.bfloat16, generator=generator)
               for rows, heads, dim in ((queries, shape.heads, shape.head_dim),
                                        (before + queries, shape.kv_heads, shape.head_dim),
                                        (before + queries, shape.kv_heads, shape.v_dim)))
    return q, k, v


def held_to(backend: SDPBackend):
    def call(q, k, v, scale):
        with sdpa_kernel(backend):
            return attention.masked_attention(q, k, v, scale)
    return call


def split(modes: tuple[str, str]):
    def call(q, k, v, scale):
        forced = modes if k.shape[0] > q.shape[0] else (None, modes[1])
        return split_attention.split_attention(q, k, v, scale, forced)
    return call


def fp8_kernel(q8, k8, v8, scales, scale: float, out_dtype: torch.dtype) -> torch.Tensor:
    import flashinfer

    q_scale, k_scale, v_scale = scales
    return flashinfer.single_prefill_with_kv_cache(q8, k8, v8, causal=True, sm_scale=scale, backend="fa3",
                                                   scale_q=q_scale, scale_k=k_scale, scale_v=v_scale,
                                                   o_dtype=out_dtype)


def fp8_attention(q, k, v, scale):
    """FlashInfer's FP8 kernel, q, k and v quantized in the call."""
    (q8, q_scale), (k8, k_scale), (v8, v_scale) = (quantize_per_head(x) for x in (q, k, v))
    return fp8_kernel(q8, k8, v8, (q_scale, k_scale, v_scale), scale, q.dtype)


def fp8_attention_fp16_out(q, k, v, scale):
    """flashinfer_fp8 with the kernel's output in fp16, then in q's dtype."""
    (q8, q_scale), (k8, k_scale), (v8, v_scale) = (quantize_per_head(x) for x in (q, k, v))
    return fp8_kernel(q8, k8, v8, (q_scale, k_scale, v_scale), scale, torch.float16).to(q.dtype)


def fp8_attention_ungrouped(q, k, v, scale):
    """fp8_attention_fp16_out over as many KV heads as query heads, each KV head repeated for its group."""
    group = q.shape[1] // k.shape[1]
    return fp8_attention_fp16_out(q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), scale)


@functools.lru_cache(maxsize=1)
def quantized(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """The last case's inputs in FP8 with their per-head scales (tensors hash by identity)."""
    return tuple(quantize_per_head(x) for x in (q, k, v))


def fp8_kernel_alone(q, k, v, scale):
    (q8, q_scale), (k8, k_scale), (v8, v_scale) = quantized(q, k, v)
    return fp8_kernel(q8, k8, v8, (q_scale, k_scale, v_scale), scale, q.dtype)


def triton_fp8(config):
    """shared/kernels/fp8_prefill_attention_triton.py, q, k and v quantized in the call."""
    def call(q, k, v, scale):
        return fp8_prefill_attention_triton.attention(*fp8_prefill_attention_triton.quantize_for_attention(q, k, v),
                                                      scale, q.dtype, config)
    return call


@functools.lru_cache(maxsize=1)
def triton_quantized(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """The last case's inputs as the Triton FP8 kernel takes them (tensors hash by identity)."""
    return fp8_prefill_attention_triton.quantize_for_attention(q, k, v)


def triton_fp8_kernel(config):
    """The Triton FP8 kernel alone, on inputs quantized before the timing."""
    def call(q, k, v, scale):
        return fp8_prefill_attention_triton.attention(*triton_quantized(q, k, v), scale, q.dtype, config)
    return call


def v_padded(q, k, v, scale):
    padded = F.pad(v, (0, k.shape[-1] - v.shape[-1]))
    return attention.prefill_attention(q, k, padded, scale)[..., : v.shape[-1]]


WAYS = {
    "today": lambda q, k, v, scale: attention.masked_attention(q, k, v, scale),
    "flash": held_to(SDPBackend.FLASH_ATTENTION),
    "cudnn_whole": held_to(SDPBackend.CUDNN_ATTENTION),
    "cudnn_split": split((split_attention.GQA_NATIVE, split_attention.GQA_NATIVE)),
    "cudnn_split_stacked": split((split_attention.GQA_STACKED, split_attention.GQA_STACKED)),
    "chosen": lambda q, k, v, scale: attention.prefill_attention(q, k, v, scale),
}
FLASHINFER_WAYS = {
    "flashinfer": flashinfer_prefill.attention,
    "flashinfer_fp8": fp8_attention,
    "flashinfer_fp8_kernel": fp8_kernel_alone,
    "flashinfer_fp8_fp16_out": fp8_attention_fp16_out,
    "flashinfer_fp8_ungrouped": fp8_attention_ungrouped,
}


def triton_fp8_name(config: fp8_prefill_attention_triton.Config) -> str:
    """triton_fp8_kernel_MxN_wWsS, and rR where registers are capped at R."""
    cap = f"r{config.max_registers}" if config.max_registers else ""
    return f"triton_fp8_kernel_{config.block_m}x{config.block_n}_w{config.warps}s{config.stages}{cap}"


# Each config of the Triton FP8 kernel alone; the first also with the quantization in the call.
TRITON_FP8_WAYS = {"triton_fp8": triton_fp8(fp8_prefill_attention_triton.CONFIGS[0])} | {
    triton_fp8_name(config): triton_fp8_kernel(config) for config in fp8_prefill_attention_triton.CONFIGS}


def ways(shape: Shape) -> dict:
    if shape.kv_heads == shape.heads:  # no groups to stack
        named = {name: fn for name, fn in WAYS.items() if name != "cudnn_split_stacked"}
    else:
        named = dict(WAYS)
    q, k, v = (torch.empty(1, heads, dim, device=DEVICE, dtype=torch.bfloat16)
               for heads, dim in ((shape.heads, shape.head_dim), (shape.kv_heads, shape.head_dim),
                                  (shape.kv_heads, shape.v_dim)))
    if flashinfer_prefill.accepts(q, k, v):
        named |= FLASHINFER_WAYS
    if fp8_prefill_attention_triton.runs_on(q.device) and shape.v_dim == shape.head_dim:
        named |= TRITON_FP8_WAYS
    return named | ({"v_padded": v_padded} if shape.v_dim != shape.head_dim else {})


def run_way(shape: Shape, name: str, fn, queries: int, before: int, repeats: int, rate_tflops: float,
            max_mask_gib: float) -> dict:
    mask_gib = 3 * queries * (before + queries) / GIB  # bool, then bf16
    if name == "cudnn_whole" and before and mask_gib > max_mask_gib:
        return {"skipped": f"the materialized mask would take {mask_gib:.1f} GiB"}
    q, k, v = inputs(shape, queries, before)
    try:
        first_ms = first_call_ms(lambda: fn(q, k, v, shape.scale))
        times = cuda_time_ms(lambda: fn(q, k, v, shape.scale), repeats)
    except RuntimeError as exc:
        return {"refused": str(exc).splitlines()[0]}
    mean_ms = sum(times) / len(times)
    flops = attention_flops(shape, queries, before)
    bound_ms = flops / (rate_tflops * 1e12) * 1e3
    return {"ms": round(mean_ms, 3), "tflops": round(flops / mean_ms / 1e9, 1),
            "fraction_of_matmul_rate": round(bound_ms / mean_ms, 3), "bound_ms": round(bound_ms, 3),
            "first_call_ms": round(first_ms, 1), **against_math(shape, fn, queries, before)}


def first_call_ms(fn) -> float:
    torch.cuda.synchronize()
    started = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - started) * 1e3


def against_math(shape: Shape, fn, queries: int, before: int) -> dict:
    """The way's output against the math backend's: the largest difference, beside the largest value,
    and the cosine of the two outputs, the measure FP8 attention is usually reported by."""
    q, k, v = inputs(shape, min(queries, CHECK_QUERIES), min(before, CHECK_BEFORE), seed=1)
    out, reference = fn(q, k, v, shape.scale).float(), math_backend(q, k, v, shape.scale)
    return {"max_abs_diff_vs_math": (out - reference).abs().max().item(),
            "math_max_abs": reference.abs().max().item(),
            "cosine_vs_math": F.cosine_similarity(out.flatten(), reference.flatten(), dim=0).item()}


def math_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    length, context = q.shape[0], k.shape[0]
    seen = torch.arange(context, device=DEVICE)[None, :] <= torch.arange(length, device=DEVICE)[:, None] + (
        context - length)
    with sdpa_kernel(SDPBackend.MATH):
        out = F.scaled_dot_product_attention(*(x.float().transpose(0, 1)[None] for x in (q, k, v)), attn_mask=seen,
                                             scale=scale, enable_gqa=True)
    return out[0].transpose(0, 1)


def sdpa_default(shape: Shape, queries: int) -> str:
    """The backend SDPA itself picks for a whole causal prompt of this length."""
    q, k, v = (x.transpose(0, 1)[None] for x in inputs(shape, queries, 0))
    try:
        return SDPBackend(torch._fused_sdp_choice(q, k, v, is_causal=True, enable_gqa=True)).name
    except (RuntimeError, TypeError, ValueError) as exc:
        return f"unknown: {exc}"


def reading_earlier_kv(shape: Shape, queries: int, before: int, pools: dict, repeats: int) -> dict:
    """One layer's cost, in ms: today's gather of the context from the pages, against the staging write."""
    staged = PromptKv(before + queries, shape.kv_heads, shape.head_dim, torch.bfloat16, torch.device(DEVICE))
    _, own_k, own_v = inputs(shape, queries, 0)
    pages = pools["page_order"][: -(-(before + queries) // PAGE_SIZE)]
    mean = lambda fn: sum(cuda_time_ms(fn, repeats)) / repeats
    return {
        "gather_bf16_ms": mean(lambda: staged.load_prefix(pools["bfloat16"], 0, pages, before + queries)),
        "gather_int8_ms": mean(lambda: (staged.load_prefix(pools["int8"], 0, pages, before),
                                        staged.write(before, own_k, own_v))),
        "staging_write_ms": mean(lambda: staged.write(before, own_k, own_v)),
    }


def one_layer_pools(shape: Shape, tokens: int) -> dict:
    """A bf16 and an int8 pool of one layer holding `tokens`, and a random order of their pages."""
    pages = -(-tokens // PAGE_SIZE)
    pools = {"page_order": torch.randperm(pages, device=DEVICE)}
    for dtype, storage in (("bfloat16", torch.bfloat16), ("int8", torch.int8)):
        pools[dtype] = allocate_local_pool(make_layout(1, pages, PAGE_SIZE, shape.kv_heads, shape.head_dim,
                                                      storage), DEVICE)[0]
    return pools


def long_prompt_gather_s(shape: Shape, per_token_ms: float) -> float:
    """The gather summed over a LONG_PROMPT in LONG_CHUNK chunks, every layer: chunk c read c chunks."""
    chunks = LONG_PROMPT // LONG_CHUNK
    return per_token_ms * LONG_CHUNK * chunks * (chunks + 1) / 2 * shape.layers / 1e3


def run(args) -> dict:
    rate = matmul_tflops()
    shape = SHAPES[args.shape]
    cases = [tuple(int(n) for n in case.split("@")) for case in args.cases.split(",")]
    # MLA's pages hold latents, not these keys and values: the gather comparison is the 8B's alone.
    later = [(t, b) for t, b in cases if b] if shape.v_dim == shape.head_dim else []
    pools = one_layer_pools(shape, max(t + b for t, b in later)) if later else None
    report_cases = []
    for queries, before in cases:
        case = {"queries": queries, "keys_before": before}
        if not before:
            case["sdpa_default"] = sdpa_default(shape, queries)
        for name, fn in ways(shape).items():
            if args.ways and name not in args.ways.split(","):
                continue
            case[name] = run_way(shape, name, fn, queries, before, args.repeats, rate, args.max_mask_gib)
            torch.cuda.empty_cache()
        if (queries, before) in later:
            case["reading_earlier_kv_per_layer"] = reading_earlier_kv(shape, queries, before, pools, args.repeats)
        report_cases.append(case)
    report = {"benchmark": "prefill attention, one layer", "device": torch.cuda.get_device_name(),
              "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
              "flashinfer": flashinfer_version(),
              "avoid_recompile": os.environ.get("TORCH_CUDNN_SDPA_AVOID_RECOMPILE"),
              "shape": {"name": args.shape, "heads": shape.heads, "kv_heads": shape.kv_heads,
                        "head_dim": shape.head_dim, "v_dim": shape.v_dim, "dtype": "bfloat16"},
              "matmul_tflops": round(rate, 1), "cases": report_cases}
    if later:
        queries, before = max(later, key=sum)
        reading = next(c for c in report_cases if (c["queries"], c["keys_before"]) == (queries, before))
        per_token = {kind: reading["reading_earlier_kv_per_layer"][f"gather_{kind}_ms"] / (queries + before)
                     for kind in ("bf16", "int8")}
        report[f"gather_over_a_{LONG_PROMPT}_token_prompt_in_{LONG_CHUNK}_chunks_s"] = {
            kind: round(long_prompt_gather_s(shape, ms), 2) for kind, ms in per_token.items()}
    return report


def flashinfer_version() -> str | None:
    if not flashinfer_prefill.installed():
        return None
    import flashinfer

    return flashinfer.__version__


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="8192@0,32768@0,8192@57344,32768@122880,32768@491520",
                        help="QUERIES@KEYS_BEFORE, comma-separated")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.1-8b")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--ways", help="only these ways, comma-separated (default: every way this device runs)")
    parser.add_argument("--max-mask-gib", type=float, default=4.0,
                        help="cudnn_whole's materialized bottom-right mask above this is skipped")
    parser.add_argument("--out")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    emit(run(args), args.out)


if __name__ == "__main__":
    main()
