"""The whole stack on one GPU: throughput, handoff and memory, beside transformers (JSON on stdout).

    python -m loadtest.bench_gpu_stack [--model random:llama-3.1-8b] [--out FILE]

In one run:
- throughput: 64 concurrent requests (1,024-token prompts, 128 output tokens, EOS ignored)
  through gRPC, output tokens per second of wall time;
- handoff: per prompt length, the client's gap between the first token (sampled by the
  prefill) and the second (the decode's first step), and the decode's page copy (kv_pull_s,
  from the router's log);
- memory: each process's GPU memory (nvidia-smi) with the decode mapping the prefill's weights
  and with a copy of its own;
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
from pdserve.v1 import generation_pb2, generation_pb2_grpc

from tests.stack import ServiceStack

CACHE_DIR = "~/.cache/pdserve"


def gpu_memory_mib(pids: dict[str, int]) -> dict[str, int]:
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout
    used = {int(pid): int(mib) for pid, mib in (line.split(", ") for line in out.strip().splitlines())}
    return {name: used.get(pid, 0) for name, pid in pids.items()}


async def one_request(stub, prompt: list[int], max_tokens: int) -> list[float]:
    """Arrival time of every token, relative to the call."""
    started = time.perf_counter()
    request = generation_pb2.GenerateRequest(prompt_token_ids=prompt, max_tokens=max_tokens, ignore_eos=True,
                                             temperature=0)
    times = []
    async for chunk in stub.Generate(request, timeout=600):
        times.extend([time.perf_counter() - started] * len(chunk.token_ids))
    return times


async def throughput(address: str, vocab: int, requests: int, prompt_len: int, max_tokens: int) -> dict:
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(requests)]
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        await one_request(stub, prompts[0][:64], 4)  # warm-up
        started = time.perf_counter()
        results = await asyncio.gather(*(one_request(stub, p, max_tokens) for p in prompts))
        wall = time.perf_counter() - started
    tokens = sum(map(len, results))
    ttfts = sorted(r[0] for r in results)
    return {"requests": requests, "prompt_tokens": prompt_len, "output_tokens": tokens, "wall_s": wall,
            "output_tokens_per_s": tokens / wall, "ttft_p50_s": ttfts[len(ttfts) // 2], "ttft_max_s": ttfts[-1]}


async def handoffs(address: str, vocab: int, lengths: list[int]) -> list[dict]:
    rng = random.Random(1)
    out = []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        for length in lengths:
            gaps, ttfts = [], []
            for _ in range(5):
                times = await one_request(stub, [rng.randrange(vocab) for _ in range(length)], 3)
                ttfts.append(times[0])
                gaps.append(times[1] - times[0])
            gaps.sort()
            ttfts.sort()
            out.append({"prompt_tokens": length, "first_to_second_token_ms_p50": gaps[2] * 1e3,
                        "ttft_ms_p50": ttfts[2] * 1e3})
    return out


def router_kv_pulls(log: Path) -> list[float]:
    pulls = []
    for line in log.read_text().splitlines():
        if '"request finished"' in line:
            record = json.loads(line)
            if "kv_pull_s" in record:
                pulls.append(record["kv_pull_s"])
    return pulls


def run_stack(model: str, shared_weights: bool, measure: bool) -> dict:
    settings = {"PDSERVE_MODEL_PATH": model, "PDSERVE_MODEL_DEVICE": "cuda:0", "PDSERVE_MODEL_DTYPE": "bfloat16",
                "PDSERVE_KV_PREFILL_PAGES": "6144", "PDSERVE_KV_DECODE_PAGES": "8192",
                "PDSERVE_PREFILL_CHUNK_TOKENS": "8192", "PDSERVE_DECODE_MAX_BATCH_SIZE": "128",
                "PDSERVE_DECODE_CUDA_GRAPH_BATCH_SIZES": "1,2,4,8,16,32,64,128",
                "PDSERVE_DECODE_WEIGHTS_FROM": "prefill-0" if shared_weights else ""}
    with tempfile.TemporaryDirectory() as workdir, ServiceStack(Path(workdir), CACHE_DIR, start_timeout_s=600,
                                                                **settings) as stack:
        pids = {name: p.pid for name, p in stack.processes.items()}
        result = {"shared_weights": shared_weights, "gpu_memory_mib": gpu_memory_mib(pids)}
        if measure:
            from shared.model.loader import load_hf_config

            vocab = load_hf_config(model).vocab_size
            result["handoff"] = asyncio.run(handoffs(stack.address, vocab, [1024, 4096, 8192, 16384, 32768]))
            result["throughput"] = asyncio.run(throughput(stack.address, vocab, 64, 1024, 128))
            result["gpu_memory_mib_after_load"] = gpu_memory_mib(pids)
            time.sleep(1.0)
            pulls = router_kv_pulls(stack.log_path("router"))
            result["kv_pull_ms_by_request"] = [round(p * 1e3, 3) for p in pulls[1:26]]  # the handoff runs
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
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench_gpu_stack")
    parser.add_argument("--model", default="random:llama-3.1-8b")
    parser.add_argument("--skip-baseline", action="store_true")
    parser.add_argument("--out")
    args = parser.parse_args()
    report = {"model": args.model, "shared": run_stack(args.model, shared_weights=True, measure=True)}
    print(json.dumps(report["shared"]), file=sys.stderr)
    report["separate"] = run_stack(args.model, shared_weights=False, measure=False)
    if not args.skip_baseline:
        report["transformers_generate_batch"] = transformers_batch(args.model, 64, 1024, 128)
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
