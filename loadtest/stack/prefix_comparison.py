"""The prefix cache's part of a serving report: a mode run with the cache on beside the same mode
with it off, and, with two or more prefills, routed by prefix beside routed by load alone (the
variants of loadtest/stack/serving_modes.py, paired by their variant_of). Pure functions over the
report's modes.

The objectives, on the production trace's replay at the same rate: TTFT p50 with the cache at most
half of that without it (off / on at least 2), and goodput at the SLO at least 1.5 times (on / off).
"""

from __future__ import annotations

TTFT_P50_OFF_OVER_ON = 2.0
GOODPUT_ON_OVER_OFF = 1.5


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    return numerator / denominator if numerator is not None and denominator else None


def workload_numbers(load: dict) -> dict:
    ttft = load["ttft_s"] or {}
    return {"offered_rps": load["offered_rps"], "ttft_p50_s": ttft.get("p50"), "ttft_p99_s": ttft.get("p99"),
            "slo_attainment": load["slo_attainment"], "prompt_tokens": load["prompt_tokens"]}


def variants_by(modes: dict[str, dict], key: str, other: str) -> dict[str, dict[bool, str]]:
    """Per mode varied, its two variants' names by their setting of key ("prefix_cache" or
    "prefix_routing"), among those whose other setting is not off: routing by prefix is compared with
    the cache on, and the cache with routing by prefix."""
    found: dict[str, dict[bool, str]] = {}
    for name, entry in modes.items():
        if entry.get("variant_of") and entry.get(key) is not None and entry.get(other) is not False:
            found.setdefault(entry["variant_of"], {})[entry[key]] = name
    return {base: named for base, named in found.items() if set(named) == {True, False}}


def goodput_met(on: dict, off: dict) -> bool | None:
    """Whether goodput with the cache is at least GOODPUT_ON_OVER_OFF times that without; None when
    the rates tried cannot tell: the cache-off run met the SLO at the highest rate (its real goodput
    may be higher), or the cache-on run did and the ratio found is short of the target."""
    on_rps, off_rps = on.get("trace_goodput_rps"), off.get("trace_goodput_rps")
    if on_rps is None or off_rps is None or off["trace_goodput_may_be_higher"]:
        return None
    if on_rps > 0 and on_rps >= GOODPUT_ON_OVER_OFF * off_rps:
        return True
    return None if on["trace_goodput_may_be_higher"] else False


def cache_comparison(names: dict[bool, str], modes: dict[str, dict]) -> dict:
    """The cache on against off, per workload both ran (TTFT, prompt tokens computed against sent),
    and the trace's goodput."""
    on, off = modes[names[True]], modes[names[False]]
    workloads = {}
    for name in on["workloads"].keys() & off["workloads"].keys():
        with_cache, without = workload_numbers(on["workloads"][name]), workload_numbers(off["workloads"][name])
        speedup = ratio(without["ttft_p50_s"], with_cache["ttft_p50_s"])
        workloads[name] = {"on": with_cache, "off": without, "ttft_p50_off_over_on": speedup,
                           "ttft_p50_target_met": None if speedup is None else speedup >= TTFT_P50_OFF_OVER_ON}
    return {"on": names[True], "off": names[False], "workloads": dict(sorted(workloads.items())),
            "trace_goodput_rps": {"on": on.get("trace_goodput_rps"), "off": off.get("trace_goodput_rps")},
            "trace_goodput_on_over_off": ratio(on.get("trace_goodput_rps"), off.get("trace_goodput_rps")),
            "trace_goodput_target_met": goodput_met(on, off),
            "targets": {"ttft_p50_off_over_on_at_least": TTFT_P50_OFF_OVER_ON,
                        "goodput_on_over_off_at_least": GOODPUT_ON_OVER_OFF}}


def routing_comparison(names: dict[bool, str], modes: dict[str, dict]) -> dict:
    """Routed by prefix against by load alone, per workload both ran: hit rate and TTFT; and how
    evenly the prefills' computed prompt tokens were spread (max / mean, from the router's counters)."""
    by_prefix, by_load = modes[names[True]], modes[names[False]]
    workloads = {}
    for name in by_prefix["workloads"].keys() & by_load["workloads"].keys():
        prefix, load = workload_numbers(by_prefix["workloads"][name]), workload_numbers(by_load["workloads"][name])
        workloads[name] = {"prefix": prefix, "load": load,
                           "ttft_p50_load_over_prefix": ratio(load["ttft_p50_s"], prefix["ttft_p50_s"])}
    return {"prefix": names[True], "load": names[False], "workloads": dict(sorted(workloads.items())),
            "trace_goodput_rps": {"prefix": by_prefix.get("trace_goodput_rps"),
                                  "load": by_load.get("trace_goodput_rps")},
            "prefill_prompt_tokens_max_over_mean": {
                "prefix": by_prefix.get("load_balance", {}).get("prefill_prompt_tokens_max_over_mean"),
                "load": by_load.get("load_balance", {}).get("prefill_prompt_tokens_max_over_mean")}}


def cache_comparisons(modes: dict[str, dict]) -> dict[str, dict]:
    return {base: cache_comparison(names, modes)
            for base, names in variants_by(modes, "prefix_cache", "prefix_routing").items()}


def routing_comparisons(modes: dict[str, dict]) -> dict[str, dict]:
    return {base: routing_comparison(names, modes)
            for base, names in variants_by(modes, "prefix_routing", "prefix_cache").items()}


def hit_rate(numbers: dict) -> str:
    tokens = numbers["prompt_tokens"]
    return f"{tokens['hit_rate']:.2f}" if tokens else "?"


def seconds(value: float | None) -> str:
    return "?" if value is None else f"{value:.3f}"


def summary_lines(caches: dict[str, dict], routings: dict[str, dict]) -> list[str]:
    """One line per workload compared, for the progress log."""
    lines = []
    for base, compared in caches.items():
        for name, w in compared["workloads"].items():
            lines.append(f"{base}: {name}: cache on/off: TTFT p50 {seconds(w['on']['ttft_p50_s'])} / "
                         f"{seconds(w['off']['ttft_p50_s'])} s, hit rate {hit_rate(w['on'])} / {hit_rate(w['off'])}")
        goodput = compared["trace_goodput_rps"]
        lines.append(f"{base}: trace goodput on/off {goodput['on']} / {goodput['off']} req/s, "
                     f"target met: {compared['trace_goodput_target_met']}")
    for base, compared in routings.items():
        for name, w in compared["workloads"].items():
            lines.append(f"{base}: {name}: routed by prefix/load: TTFT p50 {seconds(w['prefix']['ttft_p50_s'])} / "
                         f"{seconds(w['load']['ttft_p50_s'])} s, hit rate {hit_rate(w['prefix'])} / "
                         f"{hit_rate(w['load'])}")
    return lines
