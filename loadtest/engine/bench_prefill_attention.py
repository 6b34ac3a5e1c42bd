"""The prefill's causal attention, one layer of the 8B shape, by every SDPA backend the device has (JSON on stdout).

    python -m loadtest.engine.bench_prefill_attention [--tokens 8192,32768,131072] [--after 0,122880] [--out FILE]

Two cases, each per --tokens T:
- a whole prompt (or its first chunk): T queries on their own T keys, causal from the top left;
- a later chunk: T queries after --after keys already in the pages (a cached prefix or the
  earlier chunks), causal from the bottom right, as shared/model/attention.py asks for it.
Backends, one at a time under torch.nn.attention.sdpa_kernel: flash (with GQA), cuDNN and
memory-efficient (their KV heads repeated when they refuse GQA). A backend that refuses a case
is reported with its reason, not left out. Each time is the mean of --repeats calls after 3
warm-ups, beside the time at the bf16 matmul rate measured in the same run (the FLOPs of causal
attention at that rate: the bound), and each output's largest difference from the math
backend's on a short prompt (exact enough?).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from loadtest.lib.device_rates import cuda_time_ms, matmul_tflops
from loadtest.lib.report import emit

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128  # Llama-3.1-8B
BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}
CHECK_TOKENS = 1024


def attention_flops(queries: int, before: int) -> float:
    """QK^T and PV over the keys each query sees: `before` earlier ones and the causal part of its own chunk."""
    seen = queries * before + queries * (queries + 1) / 2
    return 4 * HEADS * HEAD_DIM * seen


def inputs(queries: int, before: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, HEADS, queries, HEAD_DIM, device="cuda", dtype=torch.bfloat16, generator=generator)
    k, v = (torch.randn(1, KV_HEADS, before + queries, HEAD_DIM, device="cuda", dtype=torch.bfloat16,
                        generator=generator) for _ in range(2))
    return q, k, v


def attend(backend: SDPBackend | None, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
           repeat_kv: bool) -> torch.Tensor:
    queries, keys = q.shape[2], k.shape[2]
    mask = {"is_causal": True} if queries == keys else {"attn_mask": causal_lower_right(queries, keys)}
    if repeat_kv:
        k, v = (t.repeat_interleave(HEADS // KV_HEADS, dim=1) for t in (k, v))
    gqa = {} if repeat_kv else {"enable_gqa": True}
    if backend is None:
        return F.scaled_dot_product_attention(q, k, v, **mask, **gqa)
    with sdpa_kernel(backend):
        return F.scaled_dot_product_attention(q, k, v, **mask, **gqa)


def run_backend(name: str, queries: int, before: int, repeats: int, rate_tflops: float) -> dict:
    backend = BACKENDS[name]
    q, k, v = inputs(queries, before)
    for repeat_kv in (False, True):  # GQA as is first; repeated KV heads where the backend needs them
        try:
            times = cuda_time_ms(lambda: attend(backend, q, k, v, repeat_kv), repeats)
        except RuntimeError as exc:
            reason = str(exc).splitlines()[0]
            continue
        mean_ms = sum(times) / len(times)
        bound_ms = attention_flops(queries, before) / (rate_tflops * 1e12) * 1e3
        return {"ms": round(mean_ms, 3), "tflops": round(attention_flops(queries, before) / mean_ms / 1e9, 1),
                "bound_ms": round(bound_ms, 3), "kv_heads_repeated": repeat_kv,
                "max_abs_diff_vs_math": max_diff(backend, before > 0, repeat_kv)}
    return {"refused": reason}


def max_diff(backend: SDPBackend, after_context: bool, repeat_kv: bool) -> float:
    q, k, v = inputs(CHECK_TOKENS, CHECK_TOKENS if after_context else 0)
    reference = attend(SDPBackend.MATH, q.float(), k.float(), v.float(), repeat_kv=True)
    return (attend(backend, q, k, v, repeat_kv).float() - reference).abs().max().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="8192,32768,131072")
    parser.add_argument("--after", default="0,122880", help="keys already in the pages before the queries")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--out")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    rate = matmul_tflops()
    cases = []
    for before in (int(a) for a in args.after.split(",")):
        for queries in (int(t) for t in args.tokens.split(",")):
            case = {"queries": queries, "keys_before": before}
            for name in BACKENDS:
                case[name] = run_backend(name, queries, before, args.repeats, rate)
                torch.cuda.empty_cache()
            cases.append(case)
    emit({"benchmark": "prefill attention, one layer", "device": torch.cuda.get_device_name(),
          "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(),
          "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "dtype": "bfloat16"},
          "matmul_tflops": round(rate, 1), "cases": cases}, args.out)


if __name__ == "__main__":
    main()
