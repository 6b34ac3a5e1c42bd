"""Sweep of the MoE grouped GEMM's tile configs for a decode step's pairs (JSON on stdout).

    python -m loadtest.engine.bench_moe_configs [--models deepseek-v2-lite,qwen3-30b-a3b]
        [--tokens 1,8,64] [--warps 4] [--stages 3,4,5] [--top 6] [--out FILE]

What is to choose shared/kernels/fused_moe_triton.SHORT_RUN_CONFIG: each config of a grid runs a
preset's gate_up GEMM and its down GEMM (with the routing weights) for the pairs of T tokens,
timed as the decode's LinearChooser times its candidates (back to back in a CUDA graph). Each call
takes the next of several random routings, so that the chosen experts' weights come from HBM as in
a step, where every layer has experts of its own. In the same run: the shipped config, and the
floor, the bytes of the experts the routings choose over the device's copy bandwidth (bytes read +
written per second of a 4 GiB device-to-device copy).
"""

from __future__ import annotations

import argparse
import itertools
from dataclasses import dataclass

import torch

from loadtest.lib.device_rates import copy_bandwidth_gbs
from loadtest.lib.report import emit, save
from shared.kernels import fused_moe_triton
from shared.model.linear_choice import time_per_call_ms
from shared.model.presets import PRESETS

ROUTINGS = 16  # drawn per row: more experts than a wave of calls could find in L2
BLOCK_M = fused_moe_triton.SHORT_RUN_CONFIG["BLOCK_M"]  # a decode's runs of a few pairs


@dataclass(frozen=True)
class Experts:
    experts: int
    hidden: int
    inter: int
    choices: int

    @classmethod
    def of(cls, preset: dict) -> "Experts":
        return cls(preset.get("n_routed_experts") or preset["num_experts"], preset["hidden_size"],
                   preset["moe_intermediate_size"], preset["num_experts_per_tok"])


@dataclass(frozen=True)
class Routing:
    sorted_pairs: torch.Tensor
    expert_of_block: torch.Tensor
    pair_weights: torch.Tensor
    distinct: int  # experts chosen


def grid(warps: list[int], stages: list[int]) -> list[dict]:
    """A decode's row blocks by tile widths, warps and pipeline stages."""
    tiles = [(n, k) for n, k in itertools.product([32, 64, 128], [64, 128, 256]) if n * k <= 16384]
    return [{"BLOCK_M": BLOCK_M, "BLOCK_N": n, "BLOCK_K": k, "num_warps": w, "num_stages": s}
            for (n, k), w, s in itertools.product(tiles, warps, stages)]


def routings(shape: Experts, tokens: int) -> list[Routing]:
    drawn = []
    for _ in range(ROUTINGS):
        ids = torch.stack([torch.randperm(shape.experts, device="cuda")[:shape.choices] for _ in range(tokens)])
        sorted_pairs, expert_of_block = fused_moe_triton.align_pairs_in_one_program(ids, shape.experts, BLOCK_M)
        weights = torch.rand(tokens * shape.choices, device="cuda")
        drawn.append(Routing(sorted_pairs, expert_of_block, weights, ids.unique().numel()))
    return drawn


def _gemm_calls(gemm: str, shape: Experts, tokens: int, drawn: list[Routing], config: dict):
    """fn(weights) for time_per_call_ms: one GEMM for the next routing of the cycle."""
    pairs = tokens * shape.choices
    if gemm == "gate_up":
        a = torch.randn(tokens, shape.hidden, dtype=torch.bfloat16, device="cuda")
        out = torch.empty(pairs, 2 * shape.inter, dtype=torch.bfloat16, device="cuda")
        per_a_row, weighted = shape.choices, False
    else:
        a = torch.randn(pairs, shape.inter, dtype=torch.bfloat16, device="cuda")
        out = torch.empty(pairs, shape.hidden, dtype=torch.bfloat16, device="cuda")
        per_a_row, weighted = 1, True
    cycle = itertools.cycle(drawn)

    def call(weights: torch.Tensor) -> torch.Tensor:
        r = next(cycle)
        fused_moe_triton.grouped_gemm(a, weights, out, r.sorted_pairs, r.expert_of_block, per_a_row, config,
                                      pair_weights=r.pair_weights if weighted else None)
        return out

    return call


def sweep(model: str, tokens: int, configs: list[dict], top: int, bandwidth_gbs: float) -> list[dict]:
    shape = Experts.of(PRESETS[model])
    shipped = fused_moe_triton.block_config(tokens * shape.choices, shape.experts)
    if shipped["BLOCK_M"] != BLOCK_M:
        raise SystemExit(f"{model} at {tokens} tokens runs the prefill's config: this sweep is a decode's")
    drawn = routings(shape, tokens)
    mean_distinct = sum(r.distinct for r in drawn) / len(drawn)
    results = []
    for gemm, (n, k) in {"gate_up": (2 * shape.inter, shape.hidden), "down": (shape.hidden, shape.inter)}.items():
        weights = torch.randn(shape.experts, n, k, dtype=torch.bfloat16, device="cuda")
        candidates = {i: _gemm_calls(gemm, shape, tokens, drawn, c) for i, c in enumerate(configs)}
        candidates["shipped"] = _gemm_calls(gemm, shape, tokens, drawn, shipped)
        times = time_per_call_ms(candidates, weights)
        ranked = sorted((i for i in times if i != "shipped"), key=times.__getitem__)[:top]
        results.append({
            "model": model, "tokens": tokens, "gemm": gemm, "experts": shape.experts, "n": n, "k": k,
            "experts_chosen": mean_distinct,
            "floor_us": mean_distinct * n * k * weights.element_size() / (bandwidth_gbs * 1e9) * 1e6,
            "shipped": {"us": times["shipped"] * 1e3, "config": shipped},
            "fastest": [{"us": times[i] * 1e3, "config": configs[i]} for i in ranked],
        })
        del weights
    return results


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m loadtest.engine.bench_moe_configs")
    parser.add_argument("--models", default="deepseek-v2-lite,qwen3-30b-a3b", help="MoE presets")
    parser.add_argument("--tokens", default="1,8,64", help="decode batch sizes")
    parser.add_argument("--warps", default="4")
    parser.add_argument("--stages", default="3,4,5")
    parser.add_argument("--top", type=int, default=6, help="fastest configs reported per GEMM")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    configs = grid([int(w) for w in args.warps.split(",")], [int(s) for s in args.stages.split(",")])
    bandwidth = copy_bandwidth_gbs()
    report = {"device": torch.cuda.get_device_name(), "copy_bandwidth_gbs": bandwidth, "sweeps": []}
    for model, tokens in itertools.product(args.models.split(","), (int(t) for t in args.tokens.split(","))):
        report["sweeps"] += sweep(model, tokens, configs, args.top, bandwidth)
        save(report, args.out)  # a call cut short keeps the rows it measured
    emit(report, args.out)


if __name__ == "__main__":
    main()
