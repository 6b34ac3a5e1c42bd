"""FP8 weights against bf16 on one GPU, in one run (JSON on stdout).

    python -m loadtest.engine.bench_fp8_weights [--model random:llama-3.1-8b] [--quantizations none,fp8]
                                                [--batches 1,64] [--context 1024] [--kv-dtypes bfloat16]
                                                [--prefill 8192] [--linear-rows 1,64] [--out FILE]

Measured in the same run: the copy bandwidth, the bf16 matmul rate and the FP8 one (torch._scaled_mm,
a scale per row and per column, 8192^3). Each quantization (model.quantization) of the model then
runs as the workers run it:
- the decode step, one CUDA graph replay (services/decode/cuda_graphs.py) over a page table as wide
  as the decode worker's, at each batch size with every request at --context tokens, its pages in
  each of --kv-dtypes (kv.dtype): p50 of 100, beside its floor, the weight and KV bytes it reads at
  the copy bandwidth; and its kernels over ten steps of a graph captured without programmatic
  dependent launch, so that each kernel's time is its own (loadtest/lib/kernel_profile.py: device
  time by kind, the busiest kernels, the device's idle time);
- the prefill of a --prefill-token prompt, whole: p50 of 3, beside its bound, the linear layers'
  FLOPs at the matmul rate of their weights' type (the lm_head stays bf16) plus the causal
  attention's at the bf16 rate, and its kernels;
- with FP8 weights, the prefill and the steps again with the activations
  quantized by a kernel of their own (PagedLlama.fp8_rows_fused off, as before the norms and SiLU
  wrote them in FP8): the time, and whether the logits are equal to the fused way's;
- with FP8 weights, the prefill again with fast accumulation (quantization.fast_accumulation): the
  time, and its last-position logits against the default's (largest difference, beside the logits'
  spread, and whether the argmax is the same);
- each matmul of a layer and the lm_head alone at --linear-rows rows, as the decode step runs it
  (PagedLlama.linears, timed as shared/model/linear_choice.py times: graphed, the weight cold in
  L2), its weight bytes per second beside the copy bandwidth; with FP8 weights also the library's
  two parts, the activations' quantization and torch._scaled_mm.
The comparison the issue asks for closes the report: FP8 against bf16 for the batch-1 step, the
largest batch's tokens per second and the prefill, each FP8 step against the bf16 weights' step
with bf16 pages (for quantized pages too, what a deployment that quantizes both would gain).
"""

from __future__ import annotations

import argparse
import contextlib
import gc

import torch

from loadtest.lib.decode_batch import decode_batch
from loadtest.lib.device_rates import copy_bandwidth_gbs, cuda_time_ms, fp8_matmul_tflops, matmul_tflops
from loadtest.lib.kernel_profile import kernel_breakdown
from loadtest.lib.model_costs import kv_token_bytes, prefill_bound_s, weight_bytes_per_step
from loadtest.lib.percentiles import quantile
from loadtest.lib.report import emit
from services.decode.cuda_graphs import GraphedDecode
from shared.kernels.triton_support import allow_pdl
from shared.kv.pages import PageAllocator, pages_for
from shared.kv.pool import allocate_local_pool
from shared.model.linear_choice import time_per_call_ms
from shared.model import quantization
from shared.model.from_checkpoint import load_paged_llama
from shared.model.llama import PagedLlama
from shared.model.quantization import quantize_per_token
from shared.model.weights import QUANTIZED

PAGE_SIZE = 16


@contextlib.contextmanager
def quantization_apart(model: PagedLlama):
    """The activations of FP8 products quantized by a kernel of their own, as before the norms and SiLU did it."""
    model.fp8_rows_fused = False
    try:
        yield
    finally:
        model.fp8_rows_fused = True


@contextlib.contextmanager
def fast_accumulation():
    """torch._scaled_mm's products without the periodic promotion to fp32."""
    quantization.fast_accumulation = True
    try:
        yield
    finally:
        quantization.fast_accumulation = False


def bench_decode(model: PagedLlama, batches: list[int], context: int, bandwidth_gbs: float,
                 kv_dtype: str = "bfloat16") -> list[dict]:
    pages = max(batches) * pages_for(context + PAGE_SIZE, PAGE_SIZE) + 1
    pool, _ = allocate_local_pool(model.kv_layout(pages, PAGE_SIZE, kv_dtype), "cuda")
    weights, kv_per_token = weight_bytes_per_step(model), kv_token_bytes(model, kv_dtype, PAGE_SIZE)

    def graphed(batch: int) -> tuple[GraphedDecode, object]:
        """The step's graph over a page table as wide as the decode worker's (the model's context),
        which sets the attention's split count (services/decode/rank_engine.py)."""
        allocator = PageAllocator(pages)
        graphs = GraphedDecode(model, pool, allocator.allocate(1)[0], pages_for(model.max_context, PAGE_SIZE), [batch])
        return graphs, decode_batch(allocator, [context] * batch, PAGE_SIZE, "cuda").inputs

    def step(batch: int) -> tuple[float, torch.Tensor]:
        """The graphed step's p50 and its logits (the graph built and captured as the model is set now)."""
        graphs, inputs = graphed(batch)
        return quantile(cuda_time_ms(lambda: graphs.step(inputs), 100), 0.5), graphs.step(inputs).clone()

    def kernels(batch: int) -> dict:
        """The step's kernels over ten steps, captured without programmatic dependent launch: with it
        each kernel starts early and waits, and its time overlaps its neighbours' (in the profile the
        kernels of a step added up to 1.7-2.4 times its time, H100)."""
        allow_pdl(False)
        try:
            graphs, inputs = graphed(batch)
            return kernel_breakdown(lambda: graphs.step(inputs), calls=10)
        finally:
            allow_pdl(True)

    results = []
    for batch in batches:
        step_ms, logits = step(batch)
        floor_ms = (weights + batch * context * kv_per_token) / (bandwidth_gbs * 1e9) * 1e3
        result = {"kv_dtype": kv_dtype, "batch": batch, "context": context, "step_ms_p50": step_ms,
                  "floor_ms": floor_ms, "ratio_to_floor": step_ms / floor_ms, "tokens_per_s": batch / (step_ms / 1e3),
                  "weight_gb_per_step": weights / 1e9, "kernels_without_pdl": kernels(batch)}
        if model.weights.quantization == "fp8":
            with quantization_apart(model):
                apart_ms, apart_logits = step(batch)
            result |= {"quantization_apart_ms_p50": apart_ms, "fused_over_apart": step_ms / apart_ms,
                       "logits_equal_to_apart": bool(torch.equal(logits, apart_logits)),
                       "logits_max_abs_diff_to_apart": (logits - apart_logits).abs().max().item()}
        results.append(result)
    return results


def bench_prefill(model: PagedLlama, tokens: int, bf16_tflops: float, fp8_tflops: float) -> dict:
    pool, _ = allocate_local_pool(model.kv_layout(pages_for(tokens, PAGE_SIZE), PAGE_SIZE), "cuda")
    ids = torch.randint(0, model.vocab_size, (tokens,)).tolist()
    logits = {}

    def prompt_ms(way: str) -> float:
        def run():
            logits[way] = model.prefill(ids, pool, list(range(pages_for(tokens, PAGE_SIZE))))
        return quantile(cuda_time_ms(run, 3, 1), 0.5)

    ms = prompt_ms("fused")
    bound = prefill_bound_s(model, tokens, bf16_tflops, fp8_tflops)
    result = {"tokens": tokens, "ms_p50": ms, "bound_ms": bound["bound_s"] * 1e3,
              "ratio_to_bound": ms / (bound["bound_s"] * 1e3), **bound,
              "kernels": kernel_breakdown(lambda: model.prefill(ids, pool, list(range(pages_for(tokens, PAGE_SIZE)))))}
    if model.weights.quantization == "fp8":
        with quantization_apart(model):
            apart_ms = prompt_ms("apart")
        with fast_accumulation():
            fast_ms = prompt_ms("fast")
        fast, default = logits["fast"].float(), logits["fused"].float()
        result |= {"quantization_apart_ms_p50": apart_ms, "fused_over_apart": ms / apart_ms,
                   "logits_equal_to_apart": bool(torch.equal(logits["fused"], logits["apart"])),
                   "fast_accumulation_ms_p50": fast_ms, "fast_over_default": fast_ms / ms,
                   "fast_logits_max_abs_diff": (fast - default).abs().max().item(), "logits_std": default.std().item(),
                   "fast_same_argmax": bool(fast.argmax() == default.argmax())}
    return result


def bench_linears(model: PagedLlama, rows: list[int], bandwidth_gbs: float) -> list[dict]:
    layer = model.layers[0]
    weights = {name: (getattr(layer, name), getattr(layer, f"{name}_scale")) for name in QUANTIZED}
    weights["lm_head"] = (model.lm_head, None)
    results = []
    for count in rows:
        for name, (weight, scale) in weights.items():
            x = torch.randn(count, weight.shape[1], dtype=model.embed.dtype, device="cuda")
            candidates = {"linear": lambda w, x=x, scale=scale: model.linears.apply(x, w, scale=scale)}
            if scale is not None:
                x_fp8, x_scale = quantize_per_token(x)
                candidates["quantize"] = lambda w, x=x: quantize_per_token(x)
                for fast in (False, True):  # fast accumulation: Hopper's FP8 MMA without its periodic fp32 promotion
                    candidates["scaled_mm_fast_accum" if fast else "scaled_mm"] = (
                        lambda w, x_fp8=x_fp8, x_scale=x_scale, scale=scale, fast=fast: torch._scaled_mm(  # noqa: SLF001
                            x_fp8, w.t(), scale_a=x_scale, scale_b=scale[None, :], out_dtype=x.dtype, use_fast_accum=fast))
            times = time_per_call_ms(candidates, weight)
            gbs = weight.numel() * weight.element_size() / (times["linear"] / 1e3) / 1e9
            # What the decode's chooser timed for the shape: its GEMV and the library's.
            choice = model.linears.choices.get((count, *weight.shape, weight.dtype))
            chosen = {} if choice is None else {"chooser_gemv_us": choice.gemv_ms * 1e3,
                                                "chooser_library_us": choice.cublas_ms * 1e3,
                                                "chooser_gemv_config": str(choice.gemv_config),
                                                "chosen": "gemv" if choice.use_gemv else "library"}
            results.append({"weight": name, "rows": count, "n": weight.shape[0], "k": weight.shape[1],
                            **{f"{part}_us": ms * 1e3 for part, ms in times.items()}, **chosen,
                            "weight_gbs": gbs, "of_copy": gbs / bandwidth_gbs})
    return results


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m loadtest.engine.bench_fp8_weights")
    parser.add_argument("--model", default="random:llama-3.1-8b")
    parser.add_argument("--quantizations", default="none,fp8")
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--kv-dtypes", default="bfloat16", help="the decode's pages (kv.dtype), comma-separated")
    parser.add_argument("--prefill", type=int, default=8192, help="prompt tokens; 0 skips the prefill")
    parser.add_argument("--linear-rows", default="1,64", help="rows of the per-matmul timing; empty skips it")
    parser.add_argument("--out")
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    kv_dtypes = args.kv_dtypes.split(",")
    bandwidth, bf16_rate, fp8_rate = copy_bandwidth_gbs(), matmul_tflops(), fp8_matmul_tflops()
    report = {"model": args.model, "device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "copy_gbs": bandwidth, "bf16_matmul_tflops": bf16_rate, "fp8_matmul_tflops": fp8_rate, "runs": {}}
    for quantization in args.quantizations.split(","):
        model = load_paged_llama(args.model, "bfloat16", "cuda", quantization)
        run = {"memory_gib": torch.cuda.memory_allocated() / (1 << 30),
               "decode": [row for kv_dtype in kv_dtypes
                          for row in bench_decode(model, batches, args.context, bandwidth, kv_dtype)]}
        if args.prefill:
            run["prefill"] = bench_prefill(model, args.prefill, bf16_rate, fp8_rate)
        if args.linear_rows:
            run["linears"] = bench_linears(model, [int(r) for r in args.linear_rows.split(",")], bandwidth)
        report["runs"][quantization] = run
        del model
        gc.collect()
        torch.cuda.empty_cache()
    runs = report["runs"]
    if {"none", "fp8"} <= set(runs):
        report["fp8_against_bf16"] = fp8_against_bf16(runs["fp8"], runs["none"], kv_dtypes, batches)
    emit(report, args.out)


def fp8_against_bf16(ours: dict, theirs: dict, kv_dtypes: list[str], batches: list[int]) -> dict:
    """FP8's step against bf16's with bf16 pages (or the first kv.dtype run) at each batch, its largest
    batch's tokens per second, and the prefill; rows of quantized pages carry their kv.dtype in the key."""
    baseline_kv = "bfloat16" if "bfloat16" in kv_dtypes else kv_dtypes[0]
    base = {row["batch"]: row for row in theirs["decode"] if row["kv_dtype"] == baseline_kv}
    comparison, largest = {}, max(batches)
    for kv_dtype in kv_dtypes:
        rows = {row["batch"]: row for row in ours["decode"] if row["kv_dtype"] == kv_dtype}
        pages = "" if kv_dtype == baseline_kv else f"_{kv_dtype}_pages"
        comparison |= {f"batch_{batch}_step{pages}": rows[batch]["step_ms_p50"] / base[batch]["step_ms_p50"]
                       for batch in batches}
        comparison[f"largest_batch_tokens_per_s{pages}"] = rows[largest]["tokens_per_s"] / base[largest]["tokens_per_s"]
    if "prefill" in ours:
        comparison["prefill"] = ours["prefill"]["ms_p50"] / theirs["prefill"]["ms_p50"]
    return comparison


if __name__ == "__main__":
    main()
