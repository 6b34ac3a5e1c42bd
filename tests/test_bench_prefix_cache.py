"""The serving benchmark's prefix cache comparison: the variants its flags make and the settings they
pass, the trace replayed at several speeds with prompts of its own per workload, whole conversations
kept, the cached prompt tokens counted, the pairs compared, and one real run on the CPU."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from dataclasses import replace

import pytest

from loadtest.lib import workload
from loadtest.lib.generate_client import STAGE_FIELDS
from loadtest.stack import prefix_comparison
from loadtest.stack import serving_metrics as metrics
from loadtest.stack.bench_serving import goodput_fields, modes_to_run, parse_args, stack_settings
from loadtest.stack.serving_workloads import mode_workloads, warm_up_schedule
from shared.config.loading import load_config
from tests.stack import REPO

SLO = metrics.Slo(ttft_s=1.0, tpot_s=0.1)
PAGE = 16
LENGTH_SCALE = 1 / 32  # a trace block of 512 tokens becomes one page


def write_trace(path, rows) -> str:
    """rows: (ms, prompt tokens once scaled, hash ids); three output tokens once scaled."""
    path.write_text("".join(json.dumps({"timestamp": ms, "input_length": round(tokens / LENGTH_SCALE),
                                        "output_length": round(3 / LENGTH_SCALE), "hash_ids": list(ids)}) + "\n"
                            for ms, tokens, ids in rows))
    return str(path)


# ---- the variants -----------------------------------------------------------------------------------

def test_prefix_cache_and_routing_flags_make_paired_variants_with_their_settings():
    args = parse_args(["--topologies", "1x1,2x1", "--prefix-cache", "on,off", "--routing", "prefix,load",
                       "--trace", ""])
    modes = modes_to_run(args)
    assert [m.name for m in modes] == [
        "disaggregated-1P1D-cache-on", "disaggregated-1P1D-cache-off",
        "disaggregated-2P1D-cache-on-route-prefix", "disaggregated-2P1D-cache-on-route-load",
        "disaggregated-2P1D-cache-off"]
    assert [m.variant_of for m in modes] == ["disaggregated-1P1D"] * 2 + ["disaggregated-2P1D"] * 3
    # As the services will read them: the variant's settings through the one config loader.
    configs = {m.name: load_config(None, stack_settings(args, m)) for m in modes}
    assert [c.prefill.prefix_cache for c in configs.values()] == [True, False, True, True, False]
    assert [c.routing.prefix_aware for c in configs.values()] == [True, True, True, False, True]
    assert stack_settings(args, modes[1])["PDSERVE_MODEL_PATH"] == "embedded"
    gpu = parse_args(["--gpu", "--prefill", "2", "--routing", "load", "--trace", ""])
    [load_routed] = modes_to_run(gpu)
    settings = stack_settings(gpu, load_routed)
    assert settings["PDSERVE_ROUTING_PREFIX_AWARE"] == "false" and settings["PDSERVE_MODEL_DEVICE"] == "cuda:0"
    assert "PDSERVE_PREFILL_PREFIX_CACHE" not in settings  # not varied: as configured
    plain = parse_args(["--prefix-cache", "off,on", "--trace", ""])
    assert [m.name for m in modes_to_run(plain)] == ["disaggregated-cache-off", "disaggregated-cache-on"]
    assert [m.name for m in modes_to_run(parse_args(["--trace", ""]))] == ["disaggregated", "colocated",
                                                                            "transformers"]


@pytest.mark.parametrize("refused", [
    ["--prefix-cache", "maybe"], ["--prefix-cache", "on,on"], ["--prefix-cache", ","],
    ["--routing", "prefix,load"],                                        # one prefill: nothing to choose
    ["--topologies", "1x1,1x2", "--routing", "load"],
    ["--prefill", "2", "--routing", "load", "--prefix-cache", "off"],     # routing by prefix needs the cache
    ["--modes", "disaggregated,transformers", "--prefix-cache", "on,off"],  # the floor has no prefill
    ["--trace-speeds", "0"], ["--trace-speeds", "1,1"],
    ["--trace", "t.jsonl", "--trace-speeds", "2"],                       # the burst is compared at speed 1
])
def test_flags_that_cannot_make_a_comparison_are_refused(refused):
    with pytest.raises(SystemExit):
        parse_args((["--trace", ""] if "--trace" not in refused else []) + refused)


# ---- the workloads ------------------------------------------------------------------------------------

def test_trace_speeds_replay_the_same_requests_faster_each_with_prompts_of_its_own(tmp_path):
    # Three turns of one conversation (each repeats the blocks before it), then another conversation.
    trace = write_trace(tmp_path / "trace.jsonl", [(0, 32, (0, 1)), (1000, 48, (0, 1, 2)), (2000, 64, (0, 1, 2, 3)),
                                                   (3000, 32, (0, 9, 10))])
    args = parse_args(["--rates", "1,2", "--requests-per-rate", "3", "--trace", trace, "--rate-scale", "1",
                       "--length-scale", str(LENGTH_SCALE), "--replay-seconds", "4",
                       "--trace-speeds", "1,2", "--burst-requests", "0", "--prefix-cache", "on,off"])
    loads = {w.name: w for w in mode_workloads(modes_to_run(args)[0], args)}
    assert list(loads) == ["poisson-1", "poisson-2", "trace", "trace-x2"]
    once, twice = loads["trace"], loads["trace-x2"]
    assert [a.at_s / 2 for a in once.schedule] == [a.at_s for a in twice.schedule] == [0.0, 0.5, 1.0, 1.5]
    assert once.offered_rps == 1.0 and twice.offered_rps == 2.0 and {once.family, twice.family} == {"trace"}
    for load in (once, twice):
        first, second, third, other = (a.spec.prompt_token_ids for a in load.schedule)
        assert second[:32] == first[:32] and third[:48] == second[:48]  # equal ids, equal blocks (of 16 here)
        assert other[:16] == first[:16] and other[16:32] != first[16:32]
    assert [len(a.spec.prompt_token_ids) for a in once.schedule] == [len(a.spec.prompt_token_ids)
                                                                      for a in twice.schedule]
    # No workload shares a first page with another, nor with the warm-up.
    first_pages = {name: {a.spec.prompt_token_ids[:PAGE] for a in w.schedule} for name, w in loads.items()}
    warm = warm_up_schedule(list(loads.values()))
    first_pages["warmup"] = {a.spec.prompt_token_ids[:PAGE] for a in warm}
    names = list(first_pages)
    assert all(not first_pages[a] & first_pages[b] for i, a in enumerate(names) for b in names[i + 1:])
    lengths = sorted(len(a.spec.prompt_token_ids) for w in loads.values() for a in w.schedule)
    assert [len(a.spec.prompt_token_ids) for a in warm] == [lengths[0], lengths[-1]]
    # The Poisson rates send prompts of the same lengths, with different tokens.
    slow, fast = loads["poisson-1"].schedule, loads["poisson-2"].schedule
    assert [len(a.spec.prompt_token_ids) for a in slow] == [len(a.spec.prompt_token_ids) for a in fast]
    assert all(a.spec.prompt_token_ids != b.spec.prompt_token_ids for a, b in zip(slow, fast))


def test_whole_conversations_keep_every_turn_of_the_conversations_kept():
    # 200 conversations of five turns; a prompt's second block (tokens 16-31 once scaled) names its conversation.
    conversations = {c: [workload.TraceRecord(100 * (c + 5 * t), 1024, 128, (0, 1000 + c, 2000 + t))
                         for t in range(5)] for c in range(200)}
    records = sorted((r for turns in conversations.values() for r in turns), key=lambda r: r.timestamp_ms)
    whole = workload.TraceScaling(rate_scale=0.25, length_scale=LENGTH_SCALE, replay_seconds=1e9,
                                  whole_conversations=True)
    def turns_kept(scaling: workload.TraceScaling) -> Counter:
        return Counter(a.spec.prompt_token_ids[16:32] for a in workload.trace_schedule(records, scaling))

    kept = turns_kept(whole)
    assert set(kept.values()) == {5}  # each conversation kept has all five turns
    assert 30 <= len(kept) <= 70  # about a quarter of 200
    by_request = turns_kept(workload.TraceScaling(rate_scale=0.25, length_scale=LENGTH_SCALE, replay_seconds=1e9))
    assert sum(by_request.values()) == 250 and set(by_request.values()) != {5}  # every 4th: turns lost


# ---- the cached tokens and the comparison -----------------------------------------------------------------

def call(index: int, prompt_tokens: int, cached: int | None, ttft: float = 0.5, code: str = "OK"):
    timings = None if cached is None else {**dict.fromkeys(STAGE_FIELDS, 0.0), "first_token_s": ttft,
                                           "cached_prompt_tokens": float(cached)}
    return metrics.CallRecord(index=index, name="trace", prompt_tokens=prompt_tokens, scheduled_s=0.0, started_s=0.0,
                              chunk_times_s=[ttft, ttft + 0.05], token_ids=[1, 2], ended_s=ttft + 0.05, code=code,
                              timings=timings)


def test_prompt_tokens_come_from_the_timings_of_the_calls_that_succeeded():
    records = [call(0, 100, 0), call(1, 100, 64), call(2, 60, 48), call(3, 500, 400, code="INTERNAL")]
    assert metrics.prompt_tokens(records) == {"requests": 3, "sent": 260, "cached": 112, "computed": 148,
                                              "hit_rate": pytest.approx(112 / 260)}
    assert metrics.prompt_tokens([call(0, 100, None)]) is None  # no timings: the transformers floor
    assert metrics.summarize(records, SLO)["prompt_tokens"]["cached"] == 112


def load(family: str, rate: float | None, attainment: float, p50: float, hit: float = 0.0) -> dict:
    sent = 1000
    return {"family": family, "offered_rps": rate, "slo_attainment": attainment,
            "ttft_s": {"p50": p50, "p99": 3 * p50},
            "prompt_tokens": {"requests": 10, "sent": sent, "cached": round(hit * sent),
                              "computed": sent - round(hit * sent), "hit_rate": hit}}


def entry(workloads: dict, **variant) -> dict:
    mode = {"workloads": workloads, "load_balance": {"prefill_prompt_tokens_max_over_mean": 1.1}, **variant}
    mode.update(goodput_fields(mode, "poisson", SLO))
    mode.update(goodput_fields(mode, "trace", SLO, "trace_"))
    return mode


def test_goodput_is_found_within_a_family_of_workloads():
    mode = entry({"poisson-1": load("poisson", 1.0, 1.0, 0.2), "poisson-4": load("poisson", 4.0, 0.95, 0.4),
                  "trace": load("trace", 0.5, 0.95, 0.3), "trace-x2": load("trace", 1.0, 0.5, 2.0),
                  "trace+burst": load("trace+burst", None, 0.0, 5.0)})
    assert mode["goodput_rps"] == 4.0 and mode["goodput_may_be_higher"]
    assert mode["trace_attainment_by_rate"] == {"0.5": 0.95, "1": 0.5}
    assert mode["trace_goodput_rps"] == 0.5 and not mode["trace_goodput_may_be_higher"]


def test_the_cache_on_is_compared_with_off_and_prefix_routing_with_load_routing():
    base1, base2 = "disaggregated-1P1D", "disaggregated-2P1D"
    modes = {
        f"{base1}-cache-on": entry({"trace": load("trace", 0.5, 1.0, 0.4, hit=0.3),
                                    "trace-x2": load("trace", 1.0, 0.9, 0.5, hit=0.3)},
                                   variant_of=base1, prefix_cache=True, prefix_routing=None),
        f"{base1}-cache-off": entry({"trace": load("trace", 0.5, 0.9, 1.0), "trace-x2": load("trace", 1.0, 0.2, 4.0)},
                                    variant_of=base1, prefix_cache=False, prefix_routing=None),
        f"{base2}-cache-on-route-prefix": entry({"trace": load("trace", 0.5, 1.0, 0.3, hit=0.3)},
                                                variant_of=base2, prefix_cache=True, prefix_routing=True),
        f"{base2}-cache-on-route-load": entry({"trace": load("trace", 0.5, 1.0, 0.6, hit=0.1)},
                                              variant_of=base2, prefix_cache=True, prefix_routing=False),
        f"{base2}-cache-off": entry({"trace": load("trace", 0.5, 1.0, 0.9)},
                                    variant_of=base2, prefix_cache=False, prefix_routing=None),
        "colocated": entry({"trace": load("trace", 0.5, 1.0, 0.9)}),
    }
    caches = prefix_comparison.cache_comparisons(modes)
    assert set(caches) == {base1, base2}
    one = caches[base1]
    assert (one["on"], one["off"]) == (f"{base1}-cache-on", f"{base1}-cache-off")
    assert one["workloads"]["trace"]["ttft_p50_off_over_on"] == pytest.approx(2.5)
    assert one["workloads"]["trace"]["ttft_p50_target_met"] is True
    assert one["workloads"]["trace-x2"]["ttft_p50_off_over_on"] == pytest.approx(8.0)
    assert one["workloads"]["trace"]["on"]["prompt_tokens"]["computed"] == 700
    assert one["trace_goodput_rps"] == {"on": 1.0, "off": 0.5} and one["trace_goodput_on_over_off"] == 2.0
    # The cache-on run met the SLO at the highest rate: 2x is a floor, and over the 1.5x target.
    assert one["trace_goodput_target_met"] is True
    two = caches[base2]
    assert two["on"] == f"{base2}-cache-on-route-prefix"  # the cache is judged with routing by prefix
    assert two["workloads"]["trace"]["ttft_p50_off_over_on"] == pytest.approx(3.0)
    assert two["trace_goodput_target_met"] is None  # both met the SLO at the only rate: the run cannot tell
    routings = prefix_comparison.routing_comparisons(modes)
    assert list(routings) == [base2]
    routed = routings[base2]
    assert (routed["prefix"], routed["load"]) == (f"{base2}-cache-on-route-prefix", f"{base2}-cache-on-route-load")
    trace = routed["workloads"]["trace"]
    assert trace["prefix"]["prompt_tokens"]["hit_rate"] == 0.3 and trace["load"]["prompt_tokens"]["hit_rate"] == 0.1
    assert trace["ttft_p50_load_over_prefix"] == pytest.approx(2.0)
    assert routed["prefill_prompt_tokens_max_over_mean"] == {"prefix": 1.1, "load": 1.1}
    lines = prefix_comparison.summary_lines(caches, routings)
    assert any("routed by prefix/load: TTFT p50 0.300 / 0.600 s, hit rate 0.30 / 0.10" in line for line in lines)


@pytest.mark.parametrize("on, off, met", [
    ((0.5, False), (0.0, False), True),    # no rate met without the cache, one with it
    ((1.0, False), (0.75, False), False),  # 1.33x
    ((1.0, True), (0.75, False), None),    # 1.33x, but the cache-on goodput may be higher
    ((2.0, True), (2.0, True), None),      # both met the SLO at the highest rate
    ((0.0, False), (0.0, False), False),
])
def test_the_goodput_target_is_met_unmet_or_undecided(on, off, met):
    def goodput(rps, may_be_higher):
        return {"trace_goodput_rps": rps, "trace_goodput_may_be_higher": may_be_higher}

    assert prefix_comparison.goodput_met(goodput(*on), goodput(*off)) is met


# ---- one real run on the CPU ----------------------------------------------------------------------------

@pytest.mark.e2e
@pytest.mark.slow
def test_cache_on_off_and_routing_by_prefix_or_load_in_one_run(checkpoint, tmp_path):
    # Every request shares its first two blocks (32 tokens, two pages) with the one before it.
    trace = write_trace(tmp_path / "trace.jsonl", [(600 * i, 48, (1, 2, 100 + i)) for i in range(5)])
    out = tmp_path / "out"
    command = [sys.executable, "-m", "loadtest.stack.bench_serving", "--prefill", "2", "--prefix-cache", "on,off",
               "--routing", "prefix,load", "--out", str(out), "--rates", "", "--trace", trace, "--rate-scale", "1",
               "--length-scale", str(LENGTH_SCALE), "--replay-seconds", "3",
               "--trace-speeds", "1,2", "--burst-requests", "0", "--slo-ttft-s", "30", "--slo-tpot-s", "30",
               "--drain-timeout-s", "60"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=420)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads((out / "serving.json").read_text())
    base = "disaggregated-2P1D"
    names = [f"{base}-cache-on-route-prefix", f"{base}-cache-on-route-load", f"{base}-cache-off"]
    assert report["problems"] == [] and list(report["modes"]) == names
    tokens = {name: {w: load["prompt_tokens"] for w, load in report["modes"][name]["workloads"].items()}
              for name in names}
    for name in names:
        assert set(tokens[name]) == {"trace", "trace-x2"}
        for counted in tokens[name].values():
            assert counted["requests"] == 5 and counted["sent"] == 5 * 48
            assert counted["computed"] == counted["sent"] - counted["cached"]
            assert 0 <= counted["cached"] <= 4 * 32  # the first request of a replay finds nothing
    assert all(counted["cached"] == 0 for counted in tokens[f"{base}-cache-off"].values())
    # Routed by prefix, a request goes where the one before it left the shared pages.
    assert all(counted["cached"] > 0 for counted in tokens[f"{base}-cache-on-route-prefix"].values())
    compared = report["prefix_cache"][base]
    assert (compared["on"], compared["off"]) == (names[0], names[2])
    for w, pair in compared["workloads"].items():
        on = report["modes"][names[0]]["workloads"][w]["ttft_s"]["p50"]
        off = report["modes"][names[2]]["workloads"][w]["ttft_s"]["p50"]
        assert pair["ttft_p50_off_over_on"] == pytest.approx(off / on)
    assert compared["trace_goodput_rps"] == {"on": 10 / 3, "off": 10 / 3}  # the SLO is loose: the highest rate
    assert compared["trace_goodput_target_met"] is None
    routed = report["routing"][base]
    assert (routed["prefix"], routed["load"]) == (names[0], names[1])
    assert routed["workloads"]["trace"]["prefix"]["prompt_tokens"] == tokens[names[0]]["trace"]


@pytest.mark.skipif(not workload.DEFAULT_TRACE.exists(), reason=f"no production trace at {workload.DEFAULT_TRACE}")
def test_the_h200_slice_replays_as_the_full_trace_thinned_by_conversation():
    """loadtest/traces/conversation_h200.jsonl, as its README makes it: the device cannot read ../shared."""
    scaling = workload.TraceScaling(time_scale=16 / 1800, length_scale=1.0, max_input_tokens=8192, max_output_tokens=64,
                                    context_tokens=131072, replay_seconds=16)
    sliced = workload.trace_schedule(workload.read_trace(REPO / "loadtest/traces/conversation_h200.jsonl"), scaling)
    thinned = workload.trace_schedule(workload.read_trace(), replace(scaling, rate_scale=0.01, whole_conversations=True))
    assert len(sliced) == 59
    assert [(a.at_s, a.spec.prompt_token_ids, a.spec.max_tokens) for a in sliced] == [
        (a.at_s, a.spec.prompt_token_ids, a.spec.max_tokens) for a in thinned]
