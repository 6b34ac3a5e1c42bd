"""One long prompt through the whole stack: its time to first token beside the compute bound, and the
decode's step at that context beside its memory floor (JSON on stdout).

    python -m loadtest.stack.bench_long_prompt --tokens 524224 --output-tokens 64 --kv-dtype int8 [--quantization fp8]
                                               [--out FILE]
    python -m loadtest.stack.bench_long_prompt --tokens 8192,131072 ...   # several prompts, one stack
    python -m loadtest.stack.bench_long_prompt --tokens 8192 --concurrency 32 --output-tokens 1024 --kv-dtype int8

The stack is the real one (services/stack/local.py: router, one prefill, one decode; on a GPU the
decode maps the prefill's weights), with both KV pools sized to the prompt plus its output, the
router's limits opened to its bytes and its timeouts to its length. Each prompt of random token ids
goes through gRPC as prompt_token_ids, EOS ignored, one after another, after a warm-up prompt of two
chunks (so the first-call costs and the path of a chunk attending to earlier pages are paid before).
With several lengths the stack is sized for the longest and started once.

With --concurrency N, N prompts of each length (different ones) go at once, and the pools hold all
N. The decode is then measured while all N decode: the gaps between tokens after the last request's
first decoded token and before the first request ends (so --output-tokens must outlast the N
prefills), beside the floor of a step of batch N. The prefill side reports each request's TTFT,
the last one beside the bound of all N prompts.

In the same run, before the stack starts (it would share the device otherwise):
- the matmul rate, so the bound on the TTFT is the prompt's matmul FLOPs (linear layers plus
  causal attention, loadtest/lib/model_costs.prefill_bound_s) at that rate (with FP8 weights, the
  layers' linears at the FP8 rate, measured too);
- the copy bandwidth, so a decode step's floor is (weight bytes + the context's KV bytes, scales
  included: shared/kv/pool.py token_bytes) / bandwidth, at the mean context of the decoded tokens.
On a GPU both are loadtest/lib/device_rates.py's (bf16 8192^3, a 4 GiB device copy). On the CPU they are a
float32 matmul and a host copy on this process's threads, labelled so: the services compute on
their own pinned cores, so the CPU ratios show that the script works, not how close pdserve is.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from pathlib import Path

import grpc
import torch

from loadtest.lib.device_rates import copy_bandwidth_gbs, fp8_matmul_tflops, matmul_tflops, sustained_matmul_tflops
from loadtest.lib.generate_client import StreamRecord, generate_or_raise
from loadtest.lib.model_costs import kv_token_bytes, model_shape, prefill_bound_s, prefill_flops, weight_bytes_per_step
from loadtest.lib.percentiles import quantile
from loadtest.lib.report import emit
from loadtest.lib.stack_settings import MODEL_CACHE_DIR, gpu_stack_settings
from pdserve.v1 import generation_pb2_grpc
from services.stack.local import SERVICES, LocalStack
from shared.config.schema import QUANTIZATIONS, KvConfig, RouterConfig
from shared.kv.pages import decode_pages_needed
from shared.model.llama import PagedLlama
from shared.model.loader import load_hf_config, resolve_checkpoint

GRPC_BYTES_PER_TOKEN_ID = 5  # a packed varint of up to 32 bits
_CPU_MATMUL = 2048


def cpu_rates() -> dict:
    """A float32 matmul and a 256 MiB host copy, best of five, on this process's threads."""
    def best_s(fn) -> float:
        fn()
        times = []
        for _ in range(5):
            started = time.perf_counter()
            fn()
            times.append(time.perf_counter() - started)
        return min(times)

    a, b = torch.randn(_CPU_MATMUL, _CPU_MATMUL), torch.randn(_CPU_MATMUL, _CPU_MATMUL)
    src = torch.empty(256 << 20, dtype=torch.uint8)
    dst = torch.empty_like(src)
    return {"matmul_tflops": 2 * _CPU_MATMUL ** 3 / best_s(lambda: a @ b) / 1e12,
            "copy_bandwidth_gbs": 2 * src.numel() / best_s(lambda: dst.copy_(src)) / 1e9,
            "measured": f"cpu: float32 {_CPU_MATMUL}^3 matmul and a 256 MiB host copy on "
                        f"{torch.get_num_threads()} threads of the benchmark process, not the services' cores"}


def device_rates(device: str, quantization: str) -> dict:
    if not device.startswith("cuda"):
        return cpu_rates()
    rates = {"matmul_tflops": matmul_tflops(), "matmul_tflops_sustained": sustained_matmul_tflops(),
             "copy_bandwidth_gbs": copy_bandwidth_gbs(),
             "measured": f"{torch.cuda.get_device_name()}: bf16 8192^3 matmul (a burst, and back to back at the "
                         "power limit) and a 4 GiB device copy (loadtest/lib/device_rates.py), before the stack "
                         "started"}
    if quantization == "fp8":
        rates["fp8_matmul_tflops"] = fp8_matmul_tflops()
    torch.cuda.empty_cache()  # the stack needs the memory
    return rates


def stack_settings(args, pages: int) -> dict[str, str]:
    """On a GPU, the stack's settings there (loadtest/lib/stack_settings.py); then pools of `pages`,
    and the limits and timeouts of the router opened to one prompt of the longest length taking up
    to args.request_timeout_s."""
    base = {"PDSERVE_MODEL_DEVICE": args.device}
    if args.device.startswith("cuda"):  # one request at a time: one graph, batch 1
        # "cuda" alone: a GPU for each worker (services/stack/topology.py), each with its own weights.
        base = gpu_stack_settings(args.model, SERVICES, shared_weights=args.device != "cuda") | base
        if args.concurrency == 1:
            base["PDSERVE_DECODE_CUDA_GRAPH_BATCH_SIZES"] = "1"
    timeout, tokens = str(args.request_timeout_s), max(args.tokens)
    return base | {
        "PDSERVE_MODEL_PATH": args.model, "PDSERVE_MODEL_QUANTIZATION": args.quantization,
        "PDSERVE_KV_DTYPE": args.kv_dtype,
        "PDSERVE_KV_PREFILL_PAGES": str(pages), "PDSERVE_KV_DECODE_PAGES": str(pages),
        "PDSERVE_PREFILL_CHUNK_TOKENS": str(args.chunk_tokens),
        # Random prompts share nothing; without the cache the warm-up's pages go back to the pool.
        "PDSERVE_PREFILL_PREFIX_CACHE": "false",
        "PDSERVE_ROUTER_MAX_PROMPT_BYTES": str(max(RouterConfig.max_prompt_bytes, 4 * tokens)),
        "PDSERVE_ROUTER_MAX_REQUEST_BYTES": str(max(RouterConfig.max_request_bytes,
                                                    GRPC_BYTES_PER_TOKEN_ID * tokens + 65536)),
        # One prefill chunk late in a long prompt is one step of the prefill's loop.
        "PDSERVE_ROUTER_PREFILL_TIMEOUT_S": timeout, "PDSERVE_ROUTER_PROGRESS_TIMEOUT_S": timeout,
    }


async def send_in_turn(address: str, warm: list[int] | None, batches: list[list[list[int]]], output_tokens: int,
                       timeout_s: float) -> list[list[StreamRecord]]:
    """The warm-up prompt, then each batch of prompts at once, the next when it is done, all over one
    channel: the connection is open before the measured calls, as a serving client's is (a channel
    per call put its connection's set-up into every time to first token)."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        if warm:
            await prompts_at_once(stub, [warm], min(3, output_tokens), timeout_s)
        return [await prompts_at_once(stub, prompts, output_tokens, timeout_s) for prompts in batches]


async def prompts_at_once(stub, prompts: list[list[int]], output_tokens: int, timeout_s: float) -> list[StreamRecord]:
    return list(await asyncio.gather(*(generate_or_raise(stub, prompt, output_tokens, timeout_s, f"bench-{i}")
                                       for i, prompt in enumerate(prompts))))


def prefill_report(record: StreamRecord, model: PagedLlama, tokens: int, rates: dict) -> dict:
    """The TTFT beside the bound, and the bound's two parts: at 512K the causal attention is most of it.
    On a GPU with bf16 weights, also beside the bound at the rate of matmuls back to back at the power limit."""
    bound = prefill_bound_s(model, tokens, rates["matmul_tflops"], rates.get("fp8_matmul_tflops"))
    report = {"ttft_s": record.ttft_s, "stage_timings_s": record.timings, "flops": prefill_flops(model, tokens), **bound,
              "ttft_over_bound": record.ttft_s / bound["bound_s"],
              "prefill_compute_over_bound": (record.timings["prefill_compute_s"] / bound["bound_s"]
                                             if record.timings else None)}
    if "matmul_tflops_sustained" in rates and model.weights.quantization == "none":
        sustained = prefill_bound_s(model, tokens, rates["matmul_tflops_sustained"])["bound_s"]
        report |= {"sustained_bound_s": sustained, "ttft_over_sustained_bound": record.ttft_s / sustained}
    return report


def decode_report(record: StreamRecord, model: PagedLlama, tokens: int, kv_bytes: int, bandwidth_gbs: float) -> dict:
    """The gaps after the decode's first token (the one before it holds the handoff): at batch 1 one
    chunk is one step. The floor is at the mean context of those steps."""
    gaps = record.itls_s[1:]
    if not gaps:
        return {"skipped": "needs at least 3 output tokens"}
    context = tokens + record.tokens / 2
    weights = weight_bytes_per_step(model)
    floor_s = (weights + context * kv_bytes) / (bandwidth_gbs * 1e9)
    p50 = quantile(gaps, 0.5)
    return {"steps": len(gaps), "mean_context": context, "ms_per_token_p50": p50 * 1e3,
            "ms_per_token_min": min(gaps) * 1e3, "weight_bytes": weights, "kv_bytes_per_token": kv_bytes,
            "floor_ms": floor_s * 1e3, "p50_over_floor": p50 / floor_s,
            "tpot_s": record.tpot_s, "first_to_second_token_s": record.itls_s[0]}


def concurrent_prefill_report(records: list[StreamRecord], model: PagedLlama, tokens: int, rates: dict) -> dict:
    """Each request's TTFT; the last beside the bound of every prompt's FLOPs, since the prompts share
    the prefill."""
    bound_s = prefill_bound_s(model, tokens, rates["matmul_tflops"], rates.get("fp8_matmul_tflops"))["bound_s"]
    ttfts = sorted(record.ttft_s for record in records)
    return {"ttft_s": ttfts, "ttft_s_p50": quantile(ttfts, 0.5), "last_ttft_s": ttfts[-1], "bound_s_each": bound_s,
            "bound_s_all": len(records) * bound_s, "last_ttft_over_bound_all": ttfts[-1] / (len(records) * bound_s)}


def all_decoding_report(records: list[StreamRecord], model: PagedLlama, tokens: int, kv_bytes: int,
                        bandwidth_gbs: float) -> dict:
    """The gaps between tokens while every request decodes: after the last request's first decoded
    token (its second; the first is the prefill's) and up to the first request's end. A gap's
    context is the prompt plus the tokens before it (one token a chunk); the floor is a step of the
    whole batch at the mean of those contexts."""
    skipped = {"skipped": "no two tokens came while every request decoded: more --output-tokens"}
    if any(len(record.chunk_times_s) < 3 for record in records):
        return skipped
    begin, end = max(record.chunk_times_s[1] for record in records), min(record.ended_s for record in records)
    gaps, contexts = [], []
    for record in records:
        for i, (earlier, later) in enumerate(zip(record.chunk_times_s, record.chunk_times_s[1:])):
            if begin <= earlier and later <= end:
                gaps.append(later - earlier)
                contexts.append(tokens + i + 1)
    if not gaps:
        return skipped
    batch, context = len(records), sum(contexts) / len(contexts)
    weights = weight_bytes_per_step(model)
    floor_s = (weights + batch * context * kv_bytes) / (bandwidth_gbs * 1e9)
    p50 = quantile(gaps, 0.5)
    return {"batch": batch, "gaps": len(gaps), "window_s": end - begin, "mean_context": context,
            "ms_per_token_p50": p50 * 1e3, "weight_bytes": weights, "kv_bytes_per_token": kv_bytes,
            "floor_ms": floor_s * 1e3, "p50_over_floor": p50 / floor_s}


def prompt_report(records: list[StreamRecord], model: PagedLlama, tokens: int, kv_bytes: int, rates: dict) -> dict:
    if len(records) == 1:
        return {"tokens": tokens, "output_tokens": records[0].tokens,
                "prefill": prefill_report(records[0], model, tokens, rates),
                "decode": decode_report(records[0], model, tokens, kv_bytes, rates["copy_bandwidth_gbs"])}
    return {"tokens": tokens, "concurrency": len(records), "output_tokens": records[0].tokens,
            "prefill": concurrent_prefill_report(records, model, tokens, rates),
            "decode": all_decoding_report(records, model, tokens, kv_bytes, rates["copy_bandwidth_gbs"])}


def run(args) -> dict:
    rates = device_rates(args.device, args.quantization)
    print(f"rates: {rates}", file=sys.stderr)
    dtype = torch.bfloat16 if args.device.startswith("cuda") else torch.float32
    page_size = KvConfig.page_size
    pages = args.kv_pages or args.concurrency * decode_pages_needed(max(args.tokens), args.output_tokens, page_size)
    model = model_shape(resolve_checkpoint(args.model, MODEL_CACHE_DIR), dtype, args.quantization)
    rng = random.Random(0)
    warm = [rng.randrange(model.vocab_size) for _ in range(args.warmup_tokens)]
    batches = [[[rng.randrange(model.vocab_size) for _ in range(tokens)] for _ in range(args.concurrency)]
               for tokens in args.tokens]
    with tempfile.TemporaryDirectory() as workdir, LocalStack(Path(workdir), MODEL_CACHE_DIR,
                                                              start_timeout_s=args.start_timeout_s,
                                                              **stack_settings(args, pages)) as stack:
        try:
            records = asyncio.run(send_in_turn(stack.address, warm, batches, args.output_tokens,
                                               args.request_timeout_s))
        except RuntimeError:  # the services' logs go with the work folder: their last lines say why
            for name in stack.processes:
                print(f"--- the end of {name}'s log\n{stack.tail(name, 60)}", file=sys.stderr)
            raise
    kv_bytes = kv_token_bytes(model, args.kv_dtype, page_size)
    return {
        "model": args.model, "device": args.device, "quantization": args.quantization, "kv_dtype": args.kv_dtype,
        "chunk_tokens": args.chunk_tokens, "warmup_tokens": args.warmup_tokens, "concurrency": args.concurrency,
        "pool_pages": pages, "page_size": page_size, "pool_gb": pages * page_size * kv_bytes / 1e9,
        "rates": rates,
        "prompts": [prompt_report(batch, model, tokens, kv_bytes, rates) for tokens, batch in zip(args.tokens, records)],
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m loadtest.stack.bench_long_prompt")
    parser.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu",
                        help="the stack's device; \"cuda\": the prefill and the decode on GPUs of their own")
    parser.add_argument("--model", help="default: random:llama-3.1-8b-512k on a GPU, embedded on the CPU")
    parser.add_argument("--tokens", type=token_counts, default=[131072],
                        help="prompt tokens; several, comma-separated, go through one stack in turn")
    parser.add_argument("--output-tokens", type=int, default=64, help="generated, EOS ignored")
    parser.add_argument("--concurrency", type=int, default=1, help="prompts of each length sent at once")
    parser.add_argument("--kv-dtype", default="bfloat16", choices=("bfloat16", "int8", "float8_e4m3"))
    parser.add_argument("--quantization", default="none", choices=QUANTIZATIONS, help="model.quantization")
    parser.add_argument("--chunk-tokens", type=int, default=8192,
                        help="prefill.chunk_tokens; 0: whole (8K ran the long contexts fastest: docs/BENCHMARKS.md)")
    parser.add_argument("--kv-pages", type=int, default=0,
                        help="pages of each pool; 0: just the prompt plus its output")
    parser.add_argument("--warmup-tokens", type=int,
                        help="the warm-up prompt; default two chunks (at most the prompt), 0: none")
    parser.add_argument("--start-timeout-s", type=float, default=600.0)
    parser.add_argument("--request-timeout-s", type=float, default=600.0)
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    args.model = args.model or ("random:llama-3.1-8b-512k" if args.device.startswith("cuda") else "embedded")
    if min(args.tokens) < 1 or args.output_tokens < 1 or args.concurrency < 1:
        parser.error("--tokens, --output-tokens and --concurrency must be positive")
    if args.warmup_tokens is None:
        longest = max(args.tokens)
        args.warmup_tokens = min(longest, 2 * args.chunk_tokens) if args.chunk_tokens else min(longest, 1024)
    return args


def token_counts(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of token counts") from None


def main() -> None:
    args = parse_args()
    context = load_hf_config(resolve_checkpoint(args.model, MODEL_CACHE_DIR)).max_position_embeddings
    if max(args.tokens) + args.output_tokens > context:
        sys.exit(f"--tokens + --output-tokens ({max(args.tokens) + args.output_tokens}) exceed {args.model}'s "
                 f"context of {context}")
    emit(run(args), args.out)


if __name__ == "__main__":
    main()
