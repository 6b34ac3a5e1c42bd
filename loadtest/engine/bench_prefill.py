"""One prompt's prefill on the GPU, the model alone in this process: its time beside its bound, and
where the time goes (JSON on stdout). Imports no service, socket or RPC library.

    python -m loadtest.engine.bench_prefill [--model random:llama-3.1-8b] [--prompts 8192:0,131072:32768]
        [--repeats 5] [--ways today,cudnn] [--out FILE]

A prompt TOKENS:CHUNK of random ids runs through PagedLlama.prefill into a bf16 pool, in chunks of
CHUNK tokens (0: whole), these ways in one run:
- today: the prefill as it was until the fused kernels, kept here as the baseline (todays_prefill);
- fused_masked: the prefill now with its attention held to that same masked SDPA call
  (attention.hold_prefill_to("sdpa")): what the fused kernels and the layer-by-layer staging change alone;
- cudnn: the prefill now with its attention held to cuDNN (a chunk after earlier keys split in two);
- adds_apart: the prefill now with its residual adds out of the matmuls (PagedLlama.adds_in_matmuls off):
  the first with the post-attention norm, the second a kernel of its own, as before they moved there;
- chosen: the prefill now (FlashInfer's Hopper kernel where it is installed, else as cudnn).
Each is the median of --repeats runs after one warm-up (fewer for long prompts: --long-repeats),
with its last-position logits beside today's, and beside the bound: the prompt's matmul FLOPs (linear layers plus causal attention,
loadtest/lib/model_costs.py) at the bf16 matmul rate measured in the same run. The 8K prompt's
target is at most 190 ms. That rate is a burst's, at the top clock; a second bound takes the rate of
matmuls back to back at the board's power limit (device_rates.sustained_matmul_tflops).

For the chosen way, where its time goes:
- linears_alone: the prompt's matmuls (each layer's four per chunk) timed by themselves: their time,
  their share of the prefill and their rate against the matmul rate (target: at least 0.85), also
  with cuBLASLt preferred, and every layer's back to back (back_to_back_ms);
- attention_alone: the prompt's attention calls (each chunk after its earlier keys), by themselves;
- rest_ms: the prefill less those two (norms, RoPE and the KV write, SiLU, the merge, host gaps);
- issue_ms: how long the host took to issue the whole prefill, against wall_ms until it finished
  (a host issuing as slowly as the device runs would bound it);
- kernels: one run under torch.profiler: device time by kind of kernel (matmul, attention, other),
  the busiest kernels by name, and how much of the run the device sat idle.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from loadtest.lib.device_rates import GIB, cuda_time_ms, matmul_tflops, sustained_matmul_tflops
from loadtest.lib.kernel_profile import issue_and_wall_ms, kernel_breakdown
from loadtest.lib.model_costs import attention_flops, linear_flops, prefill_flops
from loadtest.lib.percentiles import quantile
from loadtest.lib.report import emit
from shared.kv.pages import pages_for
from shared.kv.pool import allocate_local_pool
from shared.model import attention, presets
from shared.model.llama import PagedLlama

PAGE_SIZE = 16
TARGET_8K_MS = 190.0


@torch.inference_mode()
def todays_prefill(model: PagedLlama, token_ids: list[int], pool, page_ids: list[int], chunk_tokens: int):
    """The prefill as shared/model/llama.py ran it until this benchmark's commit: chunk by chunk
    through every layer, the chunk's K/V written to the pages and the earlier chunks' gathered back
    from them, PyTorch's unfused norms, RoPE and SiLU, one masked SDPA call."""
    chunk = chunk_tokens or len(token_ids)
    ids, pages = torch.tensor(token_ids, device=model.device), torch.tensor(page_ids, device=model.device)
    for start in range(0, len(token_ids), chunk):
        end = min(start + chunk, len(token_ids))
        positions = torch.arange(start, end, device=model.device)
        chunk_pages, offsets = pages[positions // PAGE_SIZE], positions % PAGE_SIZE
        x = model.embed[ids[start:end]]
        for i, layer in enumerate(model.layers):
            q, k, v = model._qkv(layer, x, positions)
            pool.write(i, chunk_pages, offsets, k, v)
            if start > 0:
                used = pages[: -(-end // PAGE_SIZE)]
                k, v = (pool.kv[shard][used].flatten(0, 1)[:end] for shard in (2 * i, 2 * i + 1))
            out = attention.masked_attention(q, k, v, model.scale)
            x = model._mlp_block(layer, x + F.linear(out.reshape(end - start, -1), layer.o_proj))
    return model._logits(x[-1:])[0]


def ways(model: PagedLlama, pool, chunk: int) -> dict:
    def held_to(way: str | None):
        def run(ids, pages):
            attention.hold_prefill_to(way)
            try:
                return model.prefill(ids, pool, pages, chunk)
            finally:
                attention.hold_prefill_to(None)
        return run

    def adds_apart(ids, pages):
        model.adds_in_matmuls = False
        try:
            return model.prefill(ids, pool, pages, chunk)
        finally:
            model.adds_in_matmuls = True

    return {"today": lambda ids, pages: todays_prefill(model, ids, pool, pages, chunk),
            "fused_masked": held_to("sdpa"), "cudnn": held_to("cudnn"), "adds_apart": adds_apart,
            "chosen": held_to(None)}


def chunks_of(tokens: int, chunk: int) -> list[tuple[int, int]]:
    """(first position, length) of each chunk."""
    step = chunk or tokens
    return [(begin, min(step, tokens - begin)) for begin in range(0, tokens, step)]


def linears_alone(model: PagedLlama, tokens: int, chunk: int, prefill_ms: float, rate: float) -> dict:
    """Each layer's four matmuls per chunk, on layer 0's weights, timed by themselves; again with
    cuBLASLt preferred (PyTorch's other BLAS path), in case its kernels suit these shapes better;
    and every layer's own, back to back as the prefill runs them (long enough to draw the power limit)."""
    flops = linear_flops(model, tokens)
    total_ms = linear_layers_ms(model, tokens, chunk)
    back_to_back_ms = linear_layers_ms(model, tokens, chunk, back_to_back=True)
    result = {"ms": total_ms, "share_of_prefill": total_ms / prefill_ms, "tflops": flops / (total_ms / 1e3) / 1e12,
              "fraction_of_matmul_rate": flops / (total_ms / 1e3) / 1e12 / rate,
              "back_to_back_ms": back_to_back_ms}
    previous = torch.backends.cuda.preferred_blas_library()
    try:
        torch.backends.cuda.preferred_blas_library("cublaslt")
        cublaslt_ms = linear_layers_ms(model, tokens, chunk)
    except RuntimeError as exc:  # a build without cuBLASLt
        return result | {"cublaslt": f"refused: {exc}"}
    finally:
        torch.backends.cuda.preferred_blas_library(previous)
    return result | {"cublaslt_ms": cublaslt_ms,
                     "cublaslt_fraction_of_matmul_rate": flops / (cublaslt_ms / 1e3) / 1e12 / rate}


def linear_layers_ms(model: PagedLlama, tokens: int, chunk: int, back_to_back: bool = False) -> float:
    """Layer 0's matmuls per chunk times the layers, or (back_to_back) every layer's in one go."""
    first = model.layers[0]
    total_ms = 0.0
    for _, length in chunks_of(tokens, chunk):
        x = torch.randn(length, first.qkv.shape[1], dtype=first.qkv.dtype, device=model.device)
        attn_out = torch.randn(length, first.o_proj.shape[1], dtype=x.dtype, device=model.device)
        act = torch.randn(length, first.down.shape[1], dtype=x.dtype, device=model.device)

        def one_layer(layer):
            F.linear(x, layer.qkv, layer.qkv_bias)
            F.linear(attn_out, layer.o_proj)
            F.linear(x, layer.gate_up)
            F.linear(act, layer.down)
        if back_to_back:
            total_ms += quantile(cuda_time_ms(lambda: [one_layer(layer) for layer in model.layers], 3), 0.5)
        else:
            total_ms += quantile(cuda_time_ms(lambda: one_layer(first), 5), 0.5) * model.num_layers
    return total_ms


def attention_alone(model: PagedLlama, tokens: int, chunk: int, prefill_ms: float, rate: float) -> dict:
    """Each chunk's attention after its earlier keys, as the prefill calls it, times the layers."""
    generator = torch.Generator(device=model.device).manual_seed(0)
    shape = (tokens, model.num_kv_heads, model.head_dim)
    k, v = (torch.randn(shape, generator=generator, device=model.device, dtype=model.embed.dtype) for _ in range(2))
    total_ms = 0.0
    for begin, length in chunks_of(tokens, chunk):
        q = torch.randn((length, model.num_heads, model.head_dim), generator=generator, device=model.device,
                        dtype=model.embed.dtype)
        end = begin + length
        call = lambda: attention.prefill_attention(q, k[:end], v[:end], model.scale)  # noqa: E731
        total_ms += quantile(cuda_time_ms(call, 3), 0.5) * model.num_layers
    tflops = attention_flops(model, tokens) / (total_ms / 1e3) / 1e12
    return {"ms": total_ms, "share_of_prefill": total_ms / prefill_ms, "tflops": tflops,
            "fraction_of_matmul_rate": tflops / rate}


def logits_difference(logits: torch.Tensor, baseline: torch.Tensor) -> dict:
    """How far a way's last-position logits are from today's: bf16 rounding, not a different model."""
    return {"max_abs_diff": (logits - baseline).abs().max().item(), "max_abs_logit": baseline.abs().max().item(),
            "same_argmax": bool(logits.argmax() == baseline.argmax())}


def bench_prompt(model: PagedLlama, pool, tokens: int, chunk: int, repeats: int, rate: float, sustained_rate: float,
                 only: list[str] | None = None) -> dict:
    ids = torch.randint(0, model.vocab_size, (tokens,)).tolist()
    pages = list(range(pages_for(tokens, PAGE_SIZE)))
    bound_ms = prefill_flops(model, tokens) / (rate * 1e12) * 1e3
    sustained_bound_ms = prefill_flops(model, tokens) / (sustained_rate * 1e12) * 1e3
    result = {"tokens": tokens, "chunk_tokens": chunk, "bound_ms": bound_ms, "sustained_bound_ms": sustained_bound_ms,
              "linear_bound_ms": linear_flops(model, tokens) / (rate * 1e12) * 1e3,
              "attention_bound_ms": attention_flops(model, tokens) / (rate * 1e12) * 1e3}
    logits = {}
    for name, run in ways(model, pool, chunk).items():
        if only and name not in only and name != "chosen":
            continue
        torch.cuda.reset_peak_memory_stats()
        ms = quantile(cuda_time_ms(lambda: logits.update({name: run(ids, pages)}), repeats, warmup=1), 0.5)
        result[name] = {"ms_p50": ms, "over_bound": ms / bound_ms, "over_sustained_bound": ms / sustained_bound_ms,
                        "peak_memory_gib": torch.cuda.max_memory_allocated() / GIB}
        print(f"{tokens}:{chunk} {name} {ms:.1f} ms (bound {bound_ms:.1f})", file=sys.stderr)
    baseline = next(iter(logits))
    for name in list(logits)[1:]:
        result[name][f"logits_vs_{baseline}"] = logits_difference(logits[name], logits[baseline])
    chosen_ms = result["chosen"]["ms_p50"]
    run = ways(model, pool, chunk)["chosen"]
    result["chosen"] |= {
        "linears_alone": linears_alone(model, tokens, chunk, chosen_ms, rate),
        "attention_alone": attention_alone(model, tokens, chunk, chosen_ms, rate),
        **issue_and_wall_ms(lambda: run(ids, pages)),
        "kernels": kernel_breakdown(lambda: run(ids, pages)),
    }
    alone = result["chosen"]["linears_alone"]["ms"] + result["chosen"]["attention_alone"]["ms"]
    result["chosen"]["rest_ms"] = chosen_ms - alone
    if tokens == 8192:
        result["target_ms"], result["meets_target"] = TARGET_8K_MS, chosen_ms <= TARGET_8K_MS
    return result


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m loadtest.engine.bench_prefill", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="random:llama-3.1-8b")
    parser.add_argument("--prompts", default="8192:0,131072:32768", help="TOKENS:CHUNK (0: whole), comma-separated")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--long-repeats", type=int, default=1, help="repeats of prompts above 16K tokens")
    parser.add_argument("--ways", help="only these ways beside chosen, comma-separated (default: all; the first "
                                       "run is the others' logits baseline)")
    parser.add_argument("--out")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    prompts = [tuple(int(n) for n in p.split(":")) for p in args.prompts.split(",")]
    rate, sustained_rate = matmul_tflops(), sustained_matmul_tflops()
    model = PagedLlama.from_hf(presets.random_hf_model(args.model, torch.bfloat16, "cuda"), "cuda")
    torch.cuda.empty_cache()  # the unfused q/k/v and gate/up weights went with the HF module
    most = max(tokens for tokens, _ in prompts)
    pool, _ = allocate_local_pool(model.kv_layout(pages_for(most, PAGE_SIZE), PAGE_SIZE), "cuda")
    only = args.ways.split(",") if args.ways else None
    results = [bench_prompt(model, pool, tokens, chunk, args.repeats if tokens <= 16384 else args.long_repeats, rate,
                            sustained_rate, only)
               for tokens, chunk in prompts]
    emit({"benchmark": "prefill alone", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
          "model": args.model, "matmul_bf16_tflops": rate, "matmul_bf16_tflops_sustained": sustained_rate,
          "prompts": results}, args.out)


if __name__ == "__main__":
    main()
