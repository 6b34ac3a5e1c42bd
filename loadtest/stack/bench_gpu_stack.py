"""The whole stack on one GPU: throughput, handoff and memory, beside transformers (JSON on stdout).

    python -m loadtest.stack.bench_gpu_stack [--model random:llama-3.1-8b] [--out FILE]

In one run:
- throughput: 64 concurrent requests (1,024-token prompts, 128 output tokens, EOS ignored)
  through gRPC, output tokens per second of wall time;
- handoff: per prompt length, from the last chunk's StageTimings, the time from the prefill's
  KV being complete to the pages in the decode's pool (kv_handoff_s: router hop, page copy) and
  on to the start (on the host) of the decode's first step for that request (handoff_s: plus
  the decode's queue; on the device the step waits for the copy on its stream); and on the
  client, the gap between the first token (sampled by the prefill) and the second (the decode's
  first step), which includes all of it;
- memory: each process's GPU memory (nvidia-smi) with the decode mapping the prefill's weights
  and with a copy of its own;
- with --colocated, throughput and handoff also for the colocated mode (services/colocated);
- the baseline: transformers' continuous batching (`generate_batch`, paged sdpa attention) on
  the same workload, after the stack is stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
from pdserve.v1 import generation_pb2_grpc

from loadtest.lib.generate_client import StreamRecord, generate_or_raise
from loadtest.lib.percentiles import quantile
from loadtest.lib.report import emit
from loadtest.lib.stack_settings import MODEL_CACHE_DIR, gpu_stack_settings
from services.stack.local import SERVICES, LocalStack

REQUEST_TIMEOUT_S = 600.0


def gpu_memory_mib(pids: dict[str, int]) -> dict[str, int]:
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout
    used = {int(pid): int(mib) for pid, mib in (line.split(", ") for line in out.strip().splitlines())}
    return {name: used.get(pid, 0) for name, pid in pids.items()}


async def throughput(address: str, vocab: int, requests: int, prompt_len: int, max_tokens: int) -> dict:
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(requests)]
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        await generate_or_raise(stub, prompts[0][:64], 4, REQUEST_TIMEOUT_S)  # warm-up
        started = time.perf_counter()
        results = await asyncio.gather(*(generate_or_raise(stub, p, max_tokens, REQUEST_TIMEOUT_S) for p in prompts))
        wall = time.perf_counter() - started
    tokens = sum(r.tokens for r in results)
    ttfts = [r.ttft_s for r in results]
    return {"requests": requests, "prompt_tokens": prompt_len, "output_tokens": tokens, "wall_s": wall,
            "output_tokens_per_s": tokens / wall, "ttft_p50_s": quantile(ttfts, 0.5), "ttft_max_s": max(ttfts)}


async def handoffs(address: str, vocab: int, lengths: list[int], repeats: int = 5) -> dict[int, list[StreamRecord]]:
    """Per prompt length, `repeats` requests of three tokens: the second is the decode's first."""
    rng = random.Random(1)
    out: dict[int, list[StreamRecord]] = {}
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        for length in lengths:
            for _ in range(repeats):
                prompt = [rng.randrange(vocab) for _ in range(length)]
                out.setdefault(length, []).append(await generate_or_raise(stub, prompt, 3, REQUEST_TIMEOUT_S))
    return out


def handoff_report(runs: dict[int, list[StreamRecord]]) -> list[dict]:
    def p50_ms(values: list[float]) -> float:
        return quantile(values, 0.5) * 1e3

    return [{"prompt_tokens": length,
             "handoff_ms_p50": p50_ms([r.timings["kv_handoff_s"] + r.timings["decode_queue_s"] for r in records]),
             "kv_handoff_ms_p50": p50_ms([r.timings["kv_handoff_s"] for r in records]),
             "first_to_second_token_ms_p50": p50_ms([r.itls_s[0] for r in records]),
             "ttft_ms_p50": p50_ms([r.ttft_s for r in records])}
            for length, records in runs.items()]


def run_stack(model: str, shared_weights: bool, measure: bool, colocated: bool = False, repeats: int = 5) -> dict:
    """colocated: the router and services/colocated (one process, one copy of the weights)."""
    services = ("router", "colocated") if colocated else SERVICES
    settings = gpu_stack_settings(model, services, shared_weights)
    with tempfile.TemporaryDirectory() as workdir, LocalStack(Path(workdir), MODEL_CACHE_DIR, services=services,
                                                              start_timeout_s=600, **settings) as stack:
        pids = {name: p.pid for name, p in stack.processes.items()}
        result = {"services": list(services), "shared_weights": shared_weights or colocated,
                  "gpu_memory_mib": gpu_memory_mib(pids)}
        if measure:
            from shared.model.loader import load_hf_config

            vocab = load_hf_config(model).vocab_size
            runs = asyncio.run(handoffs(stack.address, vocab, [1024, 4096, 8192, 16384, 32768], repeats))
            result["throughput"] = asyncio.run(throughput(stack.address, vocab, 64, 1024, 128))
            result["gpu_memory_mib_after_load"] = gpu_memory_mib(pids)
            result["handoff"] = handoff_report(runs)
    return result


def transformers_batch(model: str, requests: int, prompt_len: int, max_tokens: int) -> dict:
    import torch
    from transformers import GenerationConfig

    from shared.model import presets

    hf = presets.random_hf_model(model, torch.bfloat16, "cuda")
    try:
        hf.set_attn_implementation("paged|sdpa")
        rng = random.Random(0)
        prompts = [[rng.randrange(hf.config.vocab_size) for _ in range(prompt_len)] for _ in range(requests)]
        config = GenerationConfig(max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False,
                                  eos_token_id=None)
        torch.cuda.synchronize()
        started = time.perf_counter()
        outputs = hf.generate_batch(inputs=prompts, generation_config=config)
        torch.cuda.synchronize()
        wall = time.perf_counter() - started
        tokens = sum(len(o.generated_tokens) for o in outputs.values())
        return {"output_tokens": tokens, "wall_s": wall, "output_tokens_per_s": tokens / wall}
    except Exception as exc:  # report, do not hide the stack's numbers
        return {"error": f"{type(exc).__name__}: {exc}"}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m loadtest.stack.bench_gpu_stack")
    parser.add_argument("--model", default="random:llama-3.1-8b")
    parser.add_argument("--skip-baseline", action="store_true")
    parser.add_argument("--skip-separate", action="store_true", help="skip the memory run without shared weights")
    parser.add_argument("--colocated", action="store_true", help="also measure the colocated mode")
    parser.add_argument("--handoff-repeats", type=int, default=5, help="requests per prompt length")
    parser.add_argument("--out")
    args = parser.parse_args()
    report = {"model": args.model, "shared": run_stack(args.model, shared_weights=True, measure=True,
                                                          repeats=args.handoff_repeats)}
    print(json.dumps(report["shared"]), file=sys.stderr)
    if args.colocated:
        report["colocated"] = run_stack(args.model, shared_weights=False, measure=True, colocated=True,
                                         repeats=args.handoff_repeats)
        print(json.dumps(report["colocated"]), file=sys.stderr)
    if not args.skip_separate:
        report["separate"] = run_stack(args.model, shared_weights=False, measure=False)
    if not args.skip_baseline:
        report["transformers_generate_batch"] = transformers_batch(args.model, 64, 1024, 128)
    emit(report, args.out)


if __name__ == "__main__":
    main()
