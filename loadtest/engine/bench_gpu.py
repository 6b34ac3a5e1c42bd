"""GPU benchmark of the engine pieces: decode step, prefill, KV handoff copy (JSON on stdout).

    python -m loadtest.engine.bench_gpu [--model random:llama-3.1-8b] [--out FILE]

Everything is measured in one run beside its physical limit, measured in the same run:
- the device's copy bandwidth (bytes read + written per second, a 4 GiB device-to-device copy),
  so a decode step's floor is (weight bytes + KV bytes it must read) / bandwidth;
- the bf16 matmul rate (8192^3), so a prefill's efficiency is its model FLOPs / time / that rate;
- transformers' own `generate` at batch 1 on the same weights, the baseline.
Each weight shape of a decode step is also read by cuBLAS and by the fastest Triton GEMV config
alone, timed as shared/model/linear_choice.py times them to choose.
Decode steps run as the decode worker runs them: one CUDA graph replay per step
(services/decode/cuda_graphs.py), with the Triton paged attention reading pages in place, its
Triton kernels launched with programmatic dependent launch (shared/kernels/triton_support.py); some
batches are timed again without it, with cuBLAS for every matmul and with the GEMV for every one.
A step is timed alone (p50 of 100, the host's launch included, as a decode that waits for each
step's tokens sees it) and ten at a time queued back to back (the device's time per step). Ten
steps and each prefill up to 64K tokens are then profiled: device time by kind of kernel and the
busiest kernels (loadtest/lib/kernel_profile.py), where a step spends what it takes over its floor.
"""

from __future__ import annotations

import argparse
import functools
import sys

import torch
import torch.nn.functional as F

from loadtest.lib.decode_batch import decode_batch
from loadtest.lib.device_rates import GIB, copy_bandwidth_gbs, cuda_time_ms, matmul_tflops
from loadtest.lib.kernel_profile import kernel_breakdown
from loadtest.lib.model_costs import kv_token_bytes, prefill_flops, weight_bytes_per_step
from loadtest.lib.percentiles import quantile
from loadtest.lib.report import emit, save
from services.decode.cuda_graphs import GraphedDecode
from shared.kernels import gemv_triton
from shared.kernels.triton_support import allow_pdl
from shared.kv.pages import PageAllocator, pages_for
from shared.kv.pool import allocate_local_pool, token_bytes
from shared.model import presets
from shared.model.linear_choice import LinearChooser, time_per_call_ms
from shared.model.llama import PagedLlama

_QUEUED_STEPS = 10
_LONG_PROMPT = 65536


def transformers_baseline(path: str, context: int) -> dict:
    hf = presets.random_hf_model(path, torch.bfloat16, "cuda")
    prompt = torch.randint(0, hf.config.vocab_size, (1, context), device="cuda")
    mask = torch.ones_like(prompt)

    def generate(n: int):
        return lambda: hf.generate(prompt, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False)

    one, many = quantile(cuda_time_ms(generate(1), 3, 1), 0.5), quantile(cuda_time_ms(generate(33), 3, 1), 0.5)
    return {"context": context, "ms_per_token": (many - one) / 32, "prefill_ms": one}


def bench_decode(model: PagedLlama, batches: list[int], contexts: list[int], bandwidth_gbs: float,
                 budget_bytes: int) -> list[dict]:
    page_size = 16
    kv_per_token = kv_token_bytes(model, "bfloat16", page_size)
    feasible = [(b, c) for b in batches for c in contexts if b * (c + page_size) * kv_per_token < budget_bytes]
    pages = max(b * pages_for(c + page_size, page_size) for b, c in feasible) + 1
    pool, _ = allocate_local_pool(model.kv_layout(pages, page_size), "cuda")
    max_pages = pages_for(max(contexts) + page_size, page_size)
    results = []
    for batch in batches:
        if not any(b == batch for b, _ in feasible):
            continue
        allocator = PageAllocator(pages)
        graphs = GraphedDecode(model, pool, allocator.allocate(1)[0], max_pages, [batch])
        for context in contexts:
            if (batch, context) not in feasible:
                continue
            # Tokens of their own: the rows of a mixture of experts go to the experts they would.
            tokens = torch.randint(0, model.vocab_size, (batch,), generator=torch.Generator().manual_seed(batch))
            batched = decode_batch(allocator, [context] * batch, page_size, "cuda", last_tokens=tokens.tolist())
            inputs = batched.inputs
            graphed = cuda_time_ms(lambda: graphs.step(inputs), 100)
            # Steps queued back to back: the device's time per step, without the host's launch gap
            # between the start event and each step (a single step's timing includes it).
            queued = cuda_time_ms(lambda: [graphs.step(inputs) for _ in range(_QUEUED_STEPS)], 10)
            eager = cuda_time_ms(lambda: model.decode(inputs.token_ids, inputs.positions, inputs.page_table, pool), 5)
            # A mixture of experts reads the experts its batch is routed to: more of them as it grows.
            floor_ms = (weight_bytes_per_step(model, batch) + batch * context * kv_per_token) / (bandwidth_gbs * 1e9) * 1e3
            graph_ms, queued_ms = quantile(graphed, 0.5), quantile(queued, 0.5) / _QUEUED_STEPS
            results.append({"batch": batch, "context": context, "graph_ms_p50": graph_ms,
                            "graph_ms_min": graphed[0], "eager_ms_p50": quantile(eager, 0.5), "floor_ms": floor_ms,
                            "ratio_to_floor": graph_ms / floor_ms, "tokens_per_s": batch / (graph_ms / 1e3),
                            "queued_ms_per_step": queued_ms, "queued_ratio_to_floor": queued_ms / floor_ms,
                            "all_matmuls_on_gemv": batch in model.linears.gemv_rows,
                            "capture_timings": graphs.matmul_timings.get(batch),
                            "kernels": kernel_breakdown(lambda: graphs.step(inputs), calls=_QUEUED_STEPS)})
            for request in batched.requests:
                allocator.free(request.pages)
    skipped = [{"batch": b, "context": c, "kv_gib": b * c * kv_per_token / GIB}
               for b in batches for c in contexts if (b, c) not in feasible]
    return results + [{"skipped_kv_does_not_fit": skipped}] if skipped else results


def bench_linears(model: PagedLlama, rows: list[int], bandwidth_gbs: float) -> list[dict]:
    """Each weight shape of a decode step, read by cuBLAS and by the fastest Triton GEMV config, as
    the decode's LinearChooser times them: weight bytes per second, and that as a fraction of the
    copy bandwidth."""
    layer = model.layers[0]
    weights = {"qkv": layer.qkv, "o_proj": layer.o_proj, "gate_up": layer.gate_up, "down": layer.down,
               "lm_head": model.lm_head}
    weights = {name: weight for name, weight in weights.items() if weight is not None}  # experts: no dense MLP
    chooser = LinearChooser()
    results = []
    for batch in rows:
        for name, weight in weights.items():
            x = torch.randn(batch, weight.shape[1], dtype=weight.dtype, device="cuda")
            entry = {"weight": name, "n": weight.shape[0], "k": weight.shape[1], "rows": batch}
            if gemv_triton.supports(x, weight):
                choice = chooser.choice(x, weight)
                timed = {"cublas": choice.cublas_ms, "gemv": choice.gemv_ms}
                entry["gemv_config"] = str(choice.gemv_config)
            else:
                timed = time_per_call_ms({"cublas": functools.partial(F.linear, x)}, weight)
            for backend, ms in timed.items():
                gbs = weight.numel() * weight.element_size() / (ms / 1e3) / 1e9
                entry |= {f"{backend}_us": ms * 1e3, f"{backend}_gbs": gbs, f"{backend}_of_copy": gbs / bandwidth_gbs}
            results.append(entry)
    return results


def bench_prefill(model: PagedLlama, lengths: list[int], tflops: float, chunk: int) -> list[dict]:
    page_size = 16
    pool, _ = allocate_local_pool(model.kv_layout(pages_for(max(lengths), page_size), page_size), "cuda")
    results = []
    for length in lengths:
        ids = torch.randint(0, model.vocab_size, (length,)).tolist()
        pages = list(range(pages_for(length, page_size)))
        long = length > _LONG_PROMPT  # one run: the shorter prompts before it warmed every kernel up
        times = cuda_time_ms(lambda: model.prefill(ids, pool, pages, chunk), *((1, 0) if long else (3, 1)))
        prompt_ms = quantile(times, 0.5)
        achieved = prefill_flops(model, length) / (prompt_ms / 1e3) / 1e12
        results.append({"tokens": length, "ms_p50": prompt_ms, "tflops": achieved,
                        "fraction_of_matmul_rate": achieved / tflops, "chunk_tokens": chunk}
                       | ({} if long else {"kernels": kernel_breakdown(lambda: model.prefill(ids, pool, pages, chunk))}))
    return results


def bench_handoff(model: PagedLlama, lengths: list[int], bandwidth_gbs: float) -> list[dict]:
    """The decode's pull: one batched gather of a request's pages from the prefill pool."""
    page_size = 16
    pages = pages_for(max(lengths), page_size)
    layout = model.kv_layout(pages, page_size)
    src, _ = allocate_local_pool(layout, "cuda")
    dst, _ = allocate_local_pool(layout, "cuda")
    results = []
    for length in lengths:
        count = pages_for(length, page_size)
        src_ids = torch.randperm(pages, device="cuda")[:count]
        dst_ids = torch.randperm(pages, device="cuda")[:count]
        times = cuda_time_ms(lambda: dst.copy_pages_from(src, src_ids, dst_ids), 20)
        nbytes = count * page_size * token_bytes(layout)
        results.append({"tokens": length, "kv_mib": nbytes / (1 << 20), "copy_ms_p50": quantile(times, 0.5),
                        "floor_ms": 2 * nbytes / (bandwidth_gbs * 1e9) * 1e3})
    return results


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m loadtest.engine.bench_gpu")
    parser.add_argument("--model", default="random:llama-3.1-8b")
    parser.add_argument("--batches", default="1,8,32,128")
    parser.add_argument("--contexts", default="1024,8192")
    parser.add_argument("--prefill", default="1024,8192,32768")
    parser.add_argument("--chunk-tokens", type=int, default=8192)
    parser.add_argument("--linear-rows", default="1,8", help="batch sizes of the per-weight cuBLAS/GEMV comparison")
    parser.add_argument("--cublas-batches", default="1,8",
                        help="batch sizes whose decode step is also timed with cuBLAS for every matmul; empty: skip")
    parser.add_argument("--gemv-batches", default="1,8",
                        help="batch sizes whose decode step is also timed with the Triton GEMV for every matmul")
    parser.add_argument("--no-pdl-batches", default="1,8",
                        help="batch sizes whose decode step is also timed without programmatic dependent launch")
    parser.add_argument("--out")
    args = parser.parse_args()
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    bandwidth, tflops = copy_bandwidth_gbs(), matmul_tflops()
    print(f"copy {bandwidth:.0f} GB/s, matmul {tflops:.0f} TFLOP/s", file=sys.stderr)
    baseline = transformers_baseline(args.model, 1024)
    torch.cuda.empty_cache()  # the baseline's copy of the weights is gone with its function
    print(f"transformers {baseline}", file=sys.stderr)
    model = PagedLlama.from_hf(presets.random_hf_model(args.model, torch.bfloat16, "cuda"), "cuda")
    torch.cuda.empty_cache()  # the unfused q/k/v and gate/up weights went with the HF module
    report = {
        "device": torch.cuda.get_device_name(), "torch": torch.__version__, "model": args.model,
        "copy_bandwidth_gbs": bandwidth, "matmul_bf16_tflops": tflops,
        "weight_gb_per_step_of_batch": {b: weight_bytes_per_step(model, b) / 1e9 for b in ints(args.batches)},
        "transformers_generate": baseline,
        "linears": bench_linears(model, ints(args.linear_rows), bandwidth),
    }
    # The decode steps come before the prefill: right after it, the first decode steps ran slower
    # than the same steps later in the run (docs/BENCHMARKS.md, Decode step).
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    report["decode"] = bench_decode(model, ints(args.batches), ints(args.contexts), bandwidth, int(free * 0.85))
    save(report, args.out)
    report["linear_choices"] = [vars(c) | {"gemv_config": str(c.gemv_config)}
                                for c in model.linears.choices.values()]
    if args.no_pdl_batches:  # the same steps, each kernel launched only once the last has drained
        allow_pdl(False)
        report["decode_without_pdl"] = bench_decode(model, ints(args.no_pdl_batches), ints(args.contexts),
                                                    bandwidth, int(free * 0.85))
        allow_pdl(True)
    if args.cublas_batches:  # the same steps with every matmul on cuBLAS: what the GEMV choice gains
        model.linears = LinearChooser("cublas")
        report["decode_cublas_only"] = bench_decode(model, ints(args.cublas_batches), ints(args.contexts),
                                                    bandwidth, int(free * 0.85))
    if args.gemv_batches:  # every matmul on the GEMV: the chain of PDL launches is never broken by cuBLAS
        model.linears = LinearChooser("gemv")
        report["decode_gemv_only"] = bench_decode(model, ints(args.gemv_batches), ints(args.contexts),
                                                  bandwidth, int(free * 0.85))
    torch.cuda.empty_cache()
    report["prefill"] = []
    for length in ints(args.prefill):
        report["prefill"] += bench_prefill(model, [length], tflops, args.chunk_tokens)
        save(report, args.out)
    report["handoff_copy"] = bench_handoff(model, [1024, 4096, 8192, 16384, 32768], bandwidth)
    report["peak_memory_gib"] = torch.cuda.max_memory_allocated() / GIB
    emit(report, args.out)


if __name__ == "__main__":
    main()
