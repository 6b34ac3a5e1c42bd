"""What the serving benchmark reports about a run: latency percentiles, SLO attainment, goodput,
the stage breakdown, the prompt tokens served from the prefix cache, and the effect of a burst.
Pure functions over CallRecords.

TTFT, TPOT, ITL and E2E are every load tool's, on one client clock: StreamRecord's, in
loadtest/lib/generate_client.py, which says how each is measured.
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass

from loadtest.lib.generate_client import StreamRecord
from loadtest.lib.percentiles import quantile

# StageTimings of the last chunk, by the proto's field names. The first token is the prefill's,
# so these sum to the server-side TTFT (the hops between the processes are in the prefill queue)...
TTFT_STAGES = ("tokenize_s", "router_queue_s", "prefill_queue_s", "prefill_compute_s")
# ...and these to the time from the first token to the second at the router.
SECOND_TOKEN_STAGES = ("kv_handoff_s", "decode_queue_s", "first_decode_step_s")
SERVER_TTFT = "first_token_s"


@dataclass(kw_only=True)
class CallRecord(StreamRecord):
    """One call of a schedule; its times on the run's clock (0: its start)."""

    index: int                  # position in the schedule: the same request in two runs of it
    name: str                   # workload class (fixed, long, short, trace, burst)
    prompt_tokens: int
    scheduled_s: float


@dataclass(frozen=True)
class Slo:
    ttft_s: float
    tpot_s: float
    attainment: float = 0.9  # the share of requests that must meet both for a rate to count as goodput


# ---- distributions ------------------------------------------------------------------------------

def distribution(values: list[float]) -> dict | None:
    if not values:
        return None
    return {"p50": quantile(values, 0.5), "p90": quantile(values, 0.9), "p99": quantile(values, 0.99),
            "mean": statistics.fmean(values), "count": len(values)}


def cdf_points(values: list[float], points: int = 101) -> list[float]:
    """The values at evenly spaced quantiles 0..1: enough to draw a CDF without every sample."""
    return [quantile(values, i / (points - 1)) for i in range(points)] if values else []


def present(values) -> list[float]:
    return [v for v in values if v is not None]


# ---- counts, SLOs, goodput ------------------------------------------------------------------------

def counts(records: list[CallRecord]) -> dict:
    """sent = answered + lost; an answer is a success or an explicit gRPC error code."""
    codes = Counter(r.code for r in records if r.code is not None)
    answered = sum(codes.values())
    return {"sent": len(records), "ok": codes.pop("OK", 0), "errors": dict(sorted(codes.items())),
            "answered": answered, "lost": len(records) - answered}


def meets_slo(record: CallRecord, slo: Slo) -> bool:
    """A call with one token has no TPOT to miss; a failed or lost call misses both."""
    ttft, tpot = record.ttft_s, record.tpot_s
    return ttft is not None and ttft <= slo.ttft_s and (tpot is None or tpot <= slo.tpot_s)


def slo_attainment(records: list[CallRecord], slo: Slo) -> float:
    """Over every request sent: errors and lost requests count as misses."""
    return sum(meets_slo(r, slo) for r in records) / len(records) if records else 0.0


def goodput(attainment_by_rate: dict[float, float], slo: Slo) -> float:
    """The highest offered rate whose attainment reaches slo.attainment; 0 when none does."""
    return max((rate for rate, share in attainment_by_rate.items() if share >= slo.attainment), default=0.0)


# ---- where the time goes --------------------------------------------------------------------------

def stage_breakdown(records: list[CallRecord]) -> dict | None:
    """Mean and p50 of each stage over the successful calls that carry timings; None when none do.

    ttft_split: the server's stages of the first token, which sum to its TTFT, and
    client_transport_s (the client's TTFT less the server's: gRPC both ways). second_token_split:
    the decode side, over calls with a second token, beside the client's own first-to-second token gap.
    """
    timed = [r for r in records if r.ok and r.timings and r.chunk_times_s]
    if not timed:
        return None
    ttft_parts = {stage: [r.timings[stage] for r in timed] for stage in (*TTFT_STAGES, SERVER_TTFT)}
    ttft_parts["client_transport_s"] = [r.ttft_s - r.timings[SERVER_TTFT] for r in timed]
    ttft_parts["client_ttft_s"] = [r.ttft_s for r in timed]
    decoded = [r for r in timed if len(r.chunk_times_s) > 1]
    second_parts = {stage: [r.timings[stage] for r in decoded] for stage in SECOND_TOKEN_STAGES}
    second_parts["client_second_token_gap_s"] = [r.itls_s[0] for r in decoded]
    return {"requests": len(timed),
            "ttft_split": {name: mean_and_median(values) for name, values in ttft_parts.items()},
            "second_token_split": {name: mean_and_median(values) for name, values in second_parts.items()}}


def mean_and_median(values: list[float]) -> dict | None:
    return {"mean": statistics.fmean(values), "p50": quantile(values, 0.5)} if values else None


def prompt_tokens(records: list[CallRecord]) -> dict | None:
    """Over the successful calls that carry timings: the prompt tokens sent, those the prefill took
    from its prefix cache (StageTimings.cached_prompt_tokens), and those it computed; None when no
    call carries timings (the transformers floor)."""
    timed = [r for r in records if r.ok and r.timings]
    if not timed:
        return None
    sent = sum(r.prompt_tokens for r in timed)
    cached = sum(round(r.timings["cached_prompt_tokens"]) for r in timed)
    return {"requests": len(timed), "sent": sent, "cached": cached, "computed": sent - cached,
            "hit_rate": cached / sent if sent else 0.0}


# ---- the burst --------------------------------------------------------------------------------------

def decoding_at(records: list[CallRecord], at_s: float) -> list[CallRecord]:
    """Successful calls that had their first token before at_s and their last after it."""
    return [r for r in records if r.ok and len(r.chunk_times_s) > 1 and r.chunk_times_s[0] < at_s < r.chunk_times_s[-1]]


def burst_effect(with_burst: list[CallRecord], without_burst: list[CallRecord], at_s: float) -> dict:
    """TPOT of the calls decoding when the burst arrived, beside the same calls' TPOT in a run of the
    same schedule without it; p99_ratio is P99 with over P99 without (the objective: at most 1.5)."""
    cohort = {r.index for r in decoding_at(with_burst, at_s)}
    with_tpot = present(r.tpot_s for r in with_burst if r.index in cohort)
    without_tpot = present(r.tpot_s for r in without_burst if r.index in cohort)
    with_dist, without_dist = distribution(with_tpot), distribution(without_tpot)
    both = with_dist is not None and without_dist is not None
    return {"at_s": at_s, "decoding_requests": sorted(cohort),
            "tpot_with_burst_s": with_dist, "tpot_without_burst_s": without_dist,
            "p50_ratio": with_dist["p50"] / without_dist["p50"] if both else None,
            "p99_ratio": with_dist["p99"] / without_dist["p99"] if both else None}


def itl_series(records: list[CallRecord], indices: set[int]) -> list[list[float]]:
    """[arrival time, gap] of every chunk after the first of the chosen calls: TPOT over time."""
    return sorted([[round(later, 4), round(later - earlier, 5)]
                   for r in records if r.index in indices
                   for earlier, later in zip(r.chunk_times_s, r.chunk_times_s[1:])])


# ---- one workload's summary -----------------------------------------------------------------------

def summarize(records: list[CallRecord], slo: Slo) -> dict:
    done = [r for r in records if r.ok]
    span_s = max((r.ended_s for r in done), default=0.0)  # the run's clock starts at 0
    itls = [gap for r in done for gap in r.itls_s]
    ttfts, tpots = present(r.ttft_s for r in done), present(r.tpot_s for r in done)
    lags = [r.started_s - r.scheduled_s for r in records if r.started_s is not None]
    return {
        "counts": counts(records),
        "ttft_s": distribution(ttfts), "tpot_s": distribution(tpots), "itl_s": distribution(itls),
        "e2e_s": distribution(present(r.e2e_s for r in done)),
        "output_tokens_per_s": sum(r.tokens for r in done) / span_s if span_s else 0.0,
        "requests_per_s": len(done) / span_s if span_s else 0.0,
        "slo_attainment": slo_attainment(records, slo),
        # How late the client started calls against their schedule: large means it could not keep up.
        "max_start_lag_s": max(lags, default=0.0),
        "stages": stage_breakdown(records),
        "prompt_tokens": prompt_tokens(records),
        "cdf": {"ttft_s": cdf_points(ttfts), "tpot_s": cdf_points(tpots), "itl_s": cdf_points(itls)},
        "requests": [request_row(r) for r in records],
    }


def request_row(record: CallRecord) -> dict:
    return {"index": record.index, "name": record.name, "prompt_tokens": record.prompt_tokens,
            "scheduled_s": record.scheduled_s, "code": record.code, "tokens": record.tokens,
            "ttft_s": record.ttft_s, "tpot_s": record.tpot_s, "e2e_s": record.e2e_s,
            "second_token_gap_s": record.itls_s[0] if record.ok and len(record.chunk_times_s) > 1 else None,
            "timings": record.timings}
