"""The workloads of the serving benchmark, built from its command line before any mode starts, so
every mode gets the same requests at the same times (loadtest/bench_serving.py says which)."""

from __future__ import annotations

from dataclasses import dataclass

from loadtest.serving_modes import Mode
from loadtest.workload import (Arrival, Mix, RequestSpec, TraceScaling, burst, curve_schedule, poisson_schedule,
                               read_curve, read_trace, trace_schedule)

WARMUP_TOKENS = 4


@dataclass(frozen=True)
class Workload:
    name: str                         # poisson-<rate>, curve, trace+burst or trace: the report's key
    schedule: list[Arrival]
    offered_rps: float | None = None  # a Poisson workload's rate; None for the trace

    @property
    def length_s(self) -> float:
        return max((a.at_s for a in self.schedule), default=0.0)


def _mix(args) -> Mix:
    return Mix(args.long_fraction, args.prompt_tokens, args.short_prompt_tokens, args.output_tokens, args.seed)


def poisson_workloads(args, rates: list[float], cap: int | None = None) -> list[Workload]:
    length = {"count": args.requests_per_rate} if args.requests_per_rate else {"duration_s": args.duration_s}
    return [Workload(f"poisson-{rate:g}", poisson_schedule(rate, _mix(args), **length)[:cap], rate) for rate in rates]


def curve_workloads(args) -> list[Workload]:
    if not args.curve:
        return []
    return [Workload("curve", curve_schedule(read_curve(args.curve), _mix(args), args.curve_seconds))]


def trace_workloads(args) -> list[Workload]:
    """The replay with the burst first, then the same schedule without it (same requests, same times)."""
    if not args.trace:
        return []
    scaling = TraceScaling(args.time_scale, args.rate_scale, args.length_scale, args.max_input_tokens,
                           args.max_output_tokens, args.context_tokens, args.replay_seconds)
    schedule = trace_schedule(read_trace(args.trace), scaling)
    if not args.burst_requests:
        return [Workload("trace", schedule)]
    # Appended, not merged: schedule index i is the same request in both replays.
    extra = burst(args.burst_at_s, args.burst_requests, args.burst_prompt_tokens, args.burst_output_tokens, args.seed)
    return [Workload("trace+burst", schedule + extra), Workload("trace", schedule)]


def mode_workloads(mode: Mode, args) -> list[Workload]:
    if mode.name == "transformers":
        return poisson_workloads(args, args.floor_rates, cap=args.floor_requests_per_rate)
    return poisson_workloads(args, args.rates) + curve_workloads(args) + trace_workloads(args)


def warm_up_schedule(workloads: list[Workload]) -> list[Arrival]:
    """The shortest and the longest prompt of the run at once, a few tokens each: first-call costs
    (allocation, kernel autotuning) are paid before anything is measured."""
    specs = sorted((a.spec for w in workloads for a in w.schedule), key=lambda s: len(s.prompt_token_ids))
    ends = {len(s.prompt_token_ids): s for s in (specs[0], specs[-1])} if specs else {}
    return [Arrival(0.0, RequestSpec("warmup", s.prompt_token_ids, WARMUP_TOKENS, s.seed)) for s in ends.values()]
