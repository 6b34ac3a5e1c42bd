"""The workloads of the serving benchmark, built from its command line before any mode starts, so
every mode gets the same requests at the same times (loadtest/stack/bench_serving.py says which).

Each workload's prompts are salted with its name: two workloads share no prefix, so with the prefix
cache on no workload finds its prompts cached by the one before it (nor by the warm-up). Within a
trace replay, equal hash ids still make equal blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from loadtest.lib.workload import (Arrival, Mix, RequestSpec, TraceScaling, burst, curve_schedule, poisson_schedule,
                                   random_tokens, read_curve, read_trace, trace_schedule)
from loadtest.stack.serving_modes import Mode

WARMUP_TOKENS = 4


@dataclass(frozen=True)
class Workload:
    name: str                         # poisson-<rate>, curve, trace+burst, trace or trace-x<speed>: the report's key
    schedule: list[Arrival]
    offered_rps: float | None = None  # set for the families that find a goodput over their rates
    family: str = "poisson"           # poisson, curve, trace or trace+burst: goodput is found within one

    @property
    def length_s(self) -> float:
        return max((a.at_s for a in self.schedule), default=0.0)


def _mix(args) -> Mix:
    return Mix(args.long_fraction, args.prompt_tokens, args.short_prompt_tokens, args.output_tokens, args.seed)


def poisson_workloads(args, rates: list[float], cap: int | None = None) -> list[Workload]:
    length = {"count": args.requests_per_rate} if args.requests_per_rate else {"duration_s": args.duration_s}
    named = {rate: f"poisson-{rate:g}" for rate in rates}
    return [Workload(name, poisson_schedule(rate, _mix(args), **length, salt=name)[:cap], rate)
            for rate, name in named.items()]


def curve_workloads(args) -> list[Workload]:
    if not args.curve:
        return []
    schedule = curve_schedule(read_curve(args.curve), _mix(args), args.curve_seconds, salt="curve")
    return [Workload("curve", schedule, family="curve")]


def trace_name(speed: float) -> str:
    return "trace" if speed == 1 else f"trace-x{speed:g}"


def trace_workloads(args) -> list[Workload]:
    """One replay of the same trace requests per speed (--trace-speeds), the burst's first: the burst
    laid over the replay at speed 1, then that replay without it (same requests, same times)."""
    if not args.trace:
        return []
    scaling = TraceScaling(args.time_scale, args.rate_scale, args.length_scale, args.max_input_tokens,
                           args.max_output_tokens, args.context_tokens, args.replay_seconds, args.whole_conversations)
    records = read_trace(args.trace)
    loads = []
    if args.burst_requests:
        # Appended, not merged: schedule index i is the same request in both replays.
        extra = burst(args.burst_at_s, args.burst_requests, args.burst_prompt_tokens, args.burst_output_tokens,
                      args.seed)
        loads.append(Workload("trace+burst", trace_schedule(records, scaling, salt="trace+burst") + extra,
                              family="trace+burst"))
    for speed in args.trace_speeds:
        # The same window of the trace, its times divided by the speed: the same requests, faster.
        faster = replace(scaling, time_scale=scaling.time_scale / speed, replay_seconds=scaling.replay_seconds / speed)
        schedule = trace_schedule(records, faster, salt=trace_name(speed))
        loads.append(Workload(trace_name(speed), schedule, len(schedule) / faster.replay_seconds, family="trace"))
    return loads


def mode_workloads(mode: Mode, args) -> list[Workload]:
    if mode.name == "transformers":
        return poisson_workloads(args, args.floor_rates, cap=args.floor_requests_per_rate)
    return poisson_workloads(args, args.rates) + curve_workloads(args) + trace_workloads(args)


def warm_up_schedule(workloads: list[Workload]) -> list[Arrival]:
    """Prompts as short and as long as the run's shortest and longest, a few tokens each: first-call
    costs (allocation, kernel autotuning) are paid before anything is measured. Their tokens are
    the warm-up's own, so that no measured prompt finds its prefix cached by the warm-up."""
    lengths = sorted({len(a.spec.prompt_token_ids) for w in workloads for a in w.schedule})
    return [Arrival(0.0, RequestSpec("warmup", random_tokens(f"warmup/{length}", length), WARMUP_TOKENS, seed=0))
            for length in dict.fromkeys(lengths[:1] + lengths[-1:])]
