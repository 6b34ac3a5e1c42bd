"""python -m loadtest.stack.bench_cpu: pdserve on the CPU against plain transformers, in one run.

Prints one JSON document to stdout; progress goes to stderr. Everything is measured in the same
run because the CPU machines are shared and noisy:
  1. the stack (router, prefill, decode as real processes) on 16/256/1024-token prompts, one
     request at a time: TTFT, decode tokens/s, end-to-end time, the server's stages (the last
     chunk's StageTimings), and the KV handoff from both sides (the server's kv_handoff_s, and
     the client's first-to-second token gap);
  2. the stack with 8 requests of 256 tokens started together;
  3. transformers' generate() on the same prompts, while the stack is idle;
  4. the memory read rate of one thread, which bounds any decode step from below.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import signal
import sys
import tempfile
import time
from pathlib import Path

import grpc
import torch
import transformers
from pdserve.v1 import generation_pb2_grpc

from loadtest.lib.generate_client import STAGE_FIELDS, StreamRecord, generate_or_raise
from loadtest.lib.model_costs import model_shape, weight_bytes_per_step
from loadtest.lib.percentiles import quantile
from loadtest.lib.report import emit
from loadtest.lib.stack_settings import MODEL_CACHE_DIR
from services.stack.local import LocalStack
from shared.model.loader import resolve_checkpoint
from shared.model.tokenizer import load_tokenizer

PROMPT_LENGTHS = (16, 256, 1024)
CONCURRENT_REQUESTS = 8
CONCURRENT_PROMPT_LENGTH = 256
REQUEST_TIMEOUT_S = 300.0
GIB = 1 << 30
# Real prose, so attention and the lm_head see ordinary token statistics; repeated to length.
SOURCE_TEXT = (
    "The river rose slowly through the spring, covering the low meadows where the cattle had grazed all "
    "winter. Farmers moved their herds to the hills and waited, counting the days until the water would "
    "fall again and leave behind the dark, rich silt that made the valley the most fertile in the region."
)


def progress(message: str) -> None:
    print(f"[bench_cpu] {message}", file=sys.stderr, flush=True)


def summary(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"median": round(quantile(values, 0.5), 6), "min": round(min(values), 6)}


def median_of(stats: dict | None) -> float | None:
    return stats["median"] if stats else None


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def make_prompts(tokenizer, lengths) -> dict[int, list[int]]:
    """Token ids of exactly each length, so the stack and transformers see the same input."""
    ids = tokenizer.encode(SOURCE_TEXT, add_special_tokens=False)
    return {n: (ids * (n // len(ids) + 1))[:n] for n in lengths}


# ---- the stack, through gRPC ----

def client_metrics(record: StreamRecord) -> dict[str, float]:
    return {
        "ttft_s": record.ttft_s,
        "e2e_s": record.e2e_s,
        "decode_tokens_per_s": 1 / record.tpot_s,
        # The prefill's token, then the first decode step's: KvReady -> router -> DecodeTask
        # -> page copy -> one decode step -> TokenBatch -> router -> client.
        "prefill_done_to_first_decode_token_s": record.itls_s[0],
        "steady_decode_step_s": quantile(record.itls_s[1:], 0.5),
    }


async def run_stack(address: str, prompts: dict[int, list[int]], max_tokens: int, repeats: int):
    """Sequential streams per prompt length, then the concurrent batch, with its wall time."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        sequential = {}
        for n, prompt in prompts.items():
            progress(f"stack: {n}-token prompt, {repeats} repetition(s)")
            await generate_or_raise(stub, prompt, 2, REQUEST_TIMEOUT_S, f"bench-warmup-{n}")
            sequential[n] = [await generate_or_raise(stub, prompt, max_tokens, REQUEST_TIMEOUT_S, f"bench-{n}-{r}")
                             for r in range(repeats)]
        progress(f"stack: {CONCURRENT_REQUESTS} concurrent {CONCURRENT_PROMPT_LENGTH}-token requests")
        prompt = prompts[CONCURRENT_PROMPT_LENGTH]
        started = time.perf_counter()
        concurrent = await asyncio.gather(*(generate_or_raise(stub, prompt, max_tokens, REQUEST_TIMEOUT_S,
                                                              f"bench-concurrent-{i}")
                                            for i in range(CONCURRENT_REQUESTS)))
        return sequential, concurrent, time.perf_counter() - started


def log_events(path: Path, event: str) -> list[dict]:
    """The JSON log lines of one event kind; other lines (library warnings) are skipped."""
    found = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and record.get("event") == event:
            found.append(record)
    return found


def stack_prompt_report(prompt_tokens: int, records: list[StreamRecord]) -> dict:
    metrics = [client_metrics(r) for r in records]
    client = {key: summary([m[key] for m in metrics]) for key in metrics[0]}
    return {
        "prompt_tokens": prompt_tokens,
        "output_tokens": records[0].tokens,
        "repetitions": len(records),
        "ttft_s": client["ttft_s"],
        "decode_tokens_per_s": client["decode_tokens_per_s"],
        "e2e_s": client["e2e_s"],
        "kv_handoff": {
            # The server's: from the prefill's KV being complete to the pages in the decode's pool
            # (the router's hop and the decode's page copy).
            "kv_handoff_s": summary([r.timings["kv_handoff_s"] for r in records]),
            "prefill_done_to_first_decode_token_s": client["prefill_done_to_first_decode_token_s"],
            "steady_decode_step_s": client["steady_decode_step_s"],
        },
        "server_stages_s": {name: summary([r.timings[name] for r in records]) for name in STAGE_FIELDS},
    }


def concurrent_report(records: list[StreamRecord], wall_s: float) -> dict:
    metrics = [client_metrics(r) for r in records]
    ttfts = [m["ttft_s"] for m in metrics]
    return {
        "requests": len(records),
        "prompt_tokens": CONCURRENT_PROMPT_LENGTH,
        "output_tokens_each": records[0].tokens,
        "wall_s": round(wall_s, 6),
        "aggregate_output_tokens_per_s": round(sum(r.tokens for r in records) / wall_s, 3),
        "ttft_s": {"p50": round(quantile(ttfts, 0.5), 6), "max": round(max(ttfts), 6)},
        "decode_tokens_per_s_per_request": summary([m["decode_tokens_per_s"] for m in metrics]),
    }


def worker_cores(stack: LocalStack, service: str) -> list[int]:
    loaded = log_events(stack.log_path(service), "model ready")
    return loaded[-1]["cores"] if loaded else []


# ---- transformers, the baseline ----

def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def transformers_generate(model, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    # An explicit mask: the model's pad id equals a token of chat prompts, so guessing one is wrong.
    return model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                          max_new_tokens=new_tokens, min_new_tokens=new_tokens)


def transformers_prompt_report(model, prompt: list[int], max_tokens: int, repeats: int) -> tuple[dict, list[int]]:
    ids = torch.tensor([prompt])
    transformers_generate(model, ids, 2)  # warm-up
    # Each repetition times one token, then all: a noisy moment spoils one pair, not the rate.
    pairs = [(timed(lambda: transformers_generate(model, ids, 1)),
              timed(lambda: transformers_generate(model, ids, max_tokens)))
             for _ in range(repeats)]
    first, full = [p[0] for p in pairs], [p[1] for p in pairs]
    # With two threads and anything else on the machine, one token can outlast all of them.
    valid = [(t, f) for t, f in pairs if f > t]
    report = {
        "prompt_tokens": len(prompt),
        "output_tokens": max_tokens,
        "repetitions": repeats,
        "ttft_s": summary(first),
        "decode_tokens_per_s": summary([(max_tokens - 1) / (f - t) for t, f in valid]),
        "decode_pairs_discarded_as_noise": len(pairs) - len(valid),
        "e2e_s": summary(full),
    }
    return report, transformers_generate(model, ids, max_tokens)[0, len(prompt):].tolist()


# ---- the physical floor ----

def memory_bandwidth_gbs(repeats: int = 5) -> float:
    """Read rate of one thread (the decode worker's share of a 2-core machine), best of several."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        x = torch.ones(GIB // 4, dtype=torch.float32)
        x.sum()  # warm-up, off the clock
        best = min(timed(x.sum) for _ in range(repeats))
    finally:
        torch.set_num_threads(threads)
    return x.nbytes / best / 1e9


# ---- the report ----

def comparison(stack: dict, baseline: dict, floor_tokens_per_s: float, same_tokens: dict[int, bool]) -> dict:
    result = {}
    for n, same in same_tokens.items():
        s, t = stack[f"prompt_{n}"], baseline[f"prompt_{n}"]
        ratios = {f"{key}_stack_over_transformers": ratio(median_of(s[key]), median_of(t[key]))
                  for key in ("ttft_s", "decode_tokens_per_s", "e2e_s")}
        result[f"prompt_{n}"] = {
            **ratios,
            "stack_decode_fraction_of_floor": ratio(median_of(s["decode_tokens_per_s"]), floor_tokens_per_s),
            "transformers_decode_fraction_of_floor": ratio(median_of(t["decode_tokens_per_s"]), floor_tokens_per_s),
            "same_greedy_tokens": same,
        }
    return result


def machine_info() -> dict:
    cpu_model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                      if line.startswith("model name")), platform.processor())
    return {
        "cpu_model": cpu_model,
        "logical_cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)),
        "load_average_at_start": os.getloadavg(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "torch_default_threads": torch.get_num_threads(),
    }


def bench_stack(stack: LocalStack, prompts: dict[int, list[int]], max_tokens: int, repeats: int):
    """The stack's part of the report, and its streams (their tokens are checked against transformers)."""
    try:
        sequential, concurrent, wall_s = asyncio.run(run_stack(stack.address, prompts, max_tokens, repeats))
    except RuntimeError as exc:
        raise RuntimeError(f"{exc}\n{stack.tail('router')}") from None
    prefill_cores, decode_cores = worker_cores(stack, "prefill"), worker_cores(stack, "decode")
    part = {
        "stack_threads": {"prefill_cores": prefill_cores, "prefill_torch_threads": len(prefill_cores),
                          "decode_cores": decode_cores, "decode_torch_threads": len(decode_cores),
                          "router": "unpinned"},
        "stack": {f"prompt_{n}": stack_prompt_report(n, records) for n, records in sequential.items()},
        "stack_concurrent": concurrent_report(concurrent, wall_s),
    }
    return part, sequential


def bench_transformers(model, prompts: dict[int, list[int]], max_tokens: int, repeats: int):
    """The baseline's report per prompt, and its greedy tokens per prompt length."""
    reports, tokens = {}, {}
    with torch.inference_mode():
        for n, prompt in prompts.items():
            progress(f"transformers: {n}-token prompt")
            reports[f"prompt_{n}"], tokens[n] = transformers_prompt_report(model, prompt, max_tokens, repeats)
    return reports, tokens


def decode_floor(checkpoint) -> dict:
    progress("memory bandwidth, one thread")
    bandwidth, weight_bytes = memory_bandwidth_gbs(), weight_bytes_per_step(model_shape(checkpoint, torch.float32))
    return {"memory_bandwidth_gbs": round(bandwidth, 3), "memory_bandwidth_threads": 1,
            "weight_bytes_per_decode_step": weight_bytes,
            "decode_floor_ms_per_token": round(weight_bytes / (bandwidth * 1e9) * 1e3, 3)}


def run(quick: bool) -> dict:
    repeats, max_tokens = (1, 8) if quick else (5, 32)
    report = {"machine": machine_info(), "settings": {"quick": quick, "repetitions": repeats,
                                                       "max_tokens": max_tokens, "greedy": True, "ignore_eos": True}}
    checkpoint = resolve_checkpoint("embedded", MODEL_CACHE_DIR)  # converted here once, before three processes race
    prompts = make_prompts(load_tokenizer(checkpoint), PROMPT_LENGTHS)
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-") as work:
        progress("starting the stack")
        # The model is pinned to the baseline's; other PDSERVE_* variables (pinning, pools) pass through.
        with LocalStack(Path(work), MODEL_CACHE_DIR, PDSERVE_MODEL_PATH="embedded") as stack:
            part, sequential = bench_stack(stack, prompts, max_tokens, repeats)
            report["machine"]["stack_threads"] = part.pop("stack_threads")
            report.update(part)
            progress("transformers baseline (the stack is idle)")
            model = transformers.AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
            report["machine"]["transformers_torch_threads"] = torch.get_num_threads()
            report["transformers"], tokens = bench_transformers(model, prompts, max_tokens, repeats)
            report.update(decode_floor(checkpoint))
            progress("stopping the stack")
    same_tokens = {n: tokens[n] == sequential[n][0].token_ids for n in prompts}
    floor_tokens_per_s = 1e3 / report["decode_floor_ms_per_token"]
    report["comparison"] = comparison(report["stack"], report["transformers"], floor_tokens_per_s, same_tokens)
    report["machine"]["load_average_at_end"] = os.getloadavg()  # other work on the machine skews every number
    return report


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.stack.bench_cpu", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one repetition, 8 output tokens: a smoke run")
    parser.add_argument("--out", type=Path, help="also write the JSON document to this file")
    args = parser.parse_args()
    # SIGTERM unwinds like an error, so the stack's processes are stopped, not orphaned.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        report = run(args.quick)
    except (RuntimeError, TimeoutError) as exc:
        print(f"bench_cpu: {exc}", file=sys.stderr)
        return 1
    emit(report, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
