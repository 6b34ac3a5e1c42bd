"""python -m loadtest.stack.bench_serving: ways of serving side by side on one open-loop workload, in one run.

    python -m loadtest.stack.bench_serving [--modes disaggregated,colocated,transformers] [--out DIR] [--gpu]
    python -m loadtest.stack.bench_serving --topologies 1x1,2x1,1x2 [--devices 'prefill=0,1 decode=2'] ...
    python -m loadtest.stack.bench_serving --prefill 2 --prefix-cache on,off --routing prefix,load --rates '' ...

For each mode (loadtest/stack/serving_modes.py) it starts the processes, warms them up, replays every
workload, and stops them. The workloads, fixed before the first mode starts so every mode gets the
same requests at the same times:
- poisson-R: Poisson arrivals at R requests/s (seeded exponential gaps), fixed prompt and output
  lengths (or a long/short mix), greedy with EOS ignored;
- curve (with --curve): arrivals evenly paced along a requests-per-second curve, the same prompts;
- trace+burst and trace: the production trace replayed (scaled), with and without --burst-requests
  long prompts all arriving at --burst-at-s; the requests already decoding then have their TPOT
  compared with the same requests' TPOT in the replay without the burst;
- trace-xS (with --trace-speeds): the same replay S times as fast; the trace's goodput is found over
  the replays' rates, as the Poisson goodput over --rates.
No two workloads share a prompt prefix (loadtest/stack/serving_workloads.py salts each), so that with the
prefix cache on a workload is served cold, whatever ran before it.
The transformers floor serves one request at a time, so it gets only --floor-rates (default: the
lowest rate), each cut to --floor-requests-per-rate requests, and no trace.

--prefill N --decode M runs the disaggregated mode with that many workers of each role;
--topologies PxD,... runs it once per layout, each a mode of the report ("disaggregated-2P1D"), the
same workloads for all; --devices places them (stack.devices; by default every worker is on
model.device, cuda:0 with --gpu). These flags lay out the disaggregated mode only: the other modes
are one prefill and one decode by nature and are refused beside them. Each workload of a mode with a
router also reports its load balance (loadtest/stack/worker_balance.py): requests and prompt tokens the
router sent each worker during it, from the router's counters, and max / mean over each role.

--prefix-cache on,off runs each mode once with prefill.prefix_cache on and once off; --routing
prefix,load, with two or more prefills, once routed by prefix and once by load alone
(serving_modes.Mode.variants). Every workload reports the prompt tokens sent, taken from the cache
and computed, and the report pairs the variants (loadtest/stack/prefix_comparison.py): TTFT and goodput
with the cache against without, and hit rate and TTFT by routing.

The defaults fit a 2-core CPU with the embedded model (docs/BENCHMARKS.md says how long they take);
--gpu takes the GPU stack's settings (loadtest/lib/stack_settings.py) and adds the mps mode.

The JSON report goes to stdout and to DIR/serving.json (rewritten after every workload, so a run
cut short keeps what it measured); `python -m loadtest.stack.plot_serving DIR/serving.json` draws it.
Progress goes to stderr. The exit code is 1 when a mode failed, a request was lost, the mps workers
were not clients of the daemon, the router's counters could not be read, or something was skipped
for --time-limit-s.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from loadtest.lib.generate_client import StreamRecord
from loadtest.lib.stack_settings import MODEL_CACHE_DIR, gpu_stack_settings
from loadtest.stack import prefix_comparison
from loadtest.stack import serving_metrics as metrics
from loadtest.stack import worker_balance
from loadtest.stack.serving_args import parse_args
from loadtest.stack.serving_client import replay
from loadtest.stack.serving_modes import MODES, Mode, serving
from loadtest.stack.serving_workloads import Workload, mode_workloads, warm_up_schedule
from shared.config.schema import ConfigError, parse_devices

# A workload is expected to take its schedule plus this much to drain, when judging the time left.
DRAIN_ALLOWANCE_S = 15.0
FIRST_START_ESTIMATE_S = 60.0


def progress(message: str) -> None:
    print(f"[bench_serving] {message}", file=sys.stderr, flush=True)


# ---- one mode -------------------------------------------------------------------------------------

class Clock:
    """The run's time limit: a workload or a mode that would end past it is skipped, not cut short."""

    def __init__(self, limit_s: float):
        self.started = time.monotonic()
        self.limit_s = limit_s
        self.starts_s: list[float] = []

    def fits(self, seconds: float) -> bool:
        return not self.limit_s or time.monotonic() - self.started + seconds <= self.limit_s

    def start_estimate_s(self) -> float:
        return max(self.starts_s, default=FIRST_START_ESTIMATE_S)


def run_mode(mode: Mode, entry: dict, args, clock: Clock, save) -> dict[str, list[metrics.CallRecord]]:
    """Fills entry, the mode's part of the report (already in it, so every save shows the progress);
    returns the calls of each workload run."""
    workloads = mode_workloads(mode, args)
    entry.update(services=list(mode.services), sends_timings=mode.sends_timings, workloads={}, skipped_for_time=[])
    if mode.topology is not None:
        entry.update(topology=mode.topology.label, devices=args.devices)
    if mode.variant_of is not None:
        entry.update(variant_of=mode.variant_of, prefix_cache=mode.prefix_cache, prefix_routing=mode.prefix_routing)
    missing = mode.missing_modules()
    if missing:
        entry["error"] = f"not in this checkout: {missing}"
        return {}
    if not workloads or not clock.fits(clock.start_estimate_s() + min(w.length_s for w in workloads)):
        entry["skipped_for_time"] = [w.name for w in workloads]
        return {}
    records: dict[str, list[metrics.CallRecord]] = {}
    with tempfile.TemporaryDirectory(prefix=f"pdserve-serving-{mode.name}-") as work:
        try:
            measure(mode, workloads, Path(work), args, clock, entry, records, save)
        except (RuntimeError, TimeoutError, OSError, ConfigError) as error:
            entry["error"] = f"{type(error).__name__}: {error}"
            progress(f"{mode.name}: FAILED: {entry['error']}")
        finally:
            keep_logs(Path(work), args.logs_dir, mode.name)
    return records


def measure(mode: Mode, workloads: list[Workload], work: Path, args, clock: Clock, entry: dict,
            records: dict[str, list[metrics.CallRecord]], save) -> None:
    """Starts the mode, warms it up, replays each workload that fits in the time left, and stops it;
    fills entry (its report) and records (the calls, for the burst comparison) as it goes."""
    began = time.monotonic()
    with serving(mode, work, MODEL_CACHE_DIR, stack_settings(args, mode), args.mps_split, args.start_timeout_s,
                 args.devices) as (stack, facts):
        entry["start_s"] = time.monotonic() - began
        clock.starts_s.append(entry["start_s"])
        entry.update(facts)
        progress(f"{mode.name}: serving after {entry['start_s']:.0f} s; warming up")
        warm_up(stack.address, workloads, args)
        counters = router_counters(stack, mode)
        for load in workloads:
            if not clock.fits(load.length_s + min(args.drain_timeout_s, DRAIN_ALLOWANCE_S)):
                entry["skipped_for_time"].append(load.name)
                continue
            before = counters.read() if counters else None
            records[load.name] = run_workload(stack.address, mode, load, args)
            entry["workloads"][load.name] = workload_report(load, records[load.name], args.slo)
            if counters:
                entry["workloads"][load.name]["load_balance"] = balance = counters.since(before)
                progress(f"{mode.name}: {load.name}: routed {balance_line(balance)}")
            save()
        entry["exit_codes"] = dict(stack.stop())


def router_counters(stack, mode: Mode) -> worker_balance.RouterCounters | None:
    """The router's per-worker counters, with every worker it lists (so an idle one shows as 0)."""
    if "router" not in mode.services:
        return None
    roles = {worker.worker_id: worker.role for worker in stack.workers()}
    return worker_balance.RouterCounters(stack.metrics_url("router"), roles)


def balance_line(balance: dict) -> str:
    if "error" in balance:
        return f"unknown: {balance['error']}"
    workers = ", ".join(f"{w} {c['requests']} req/{c['prompt_tokens']} tok" for w, c in balance["workers"].items())
    return (f"{workers}; max/mean prefill tokens {balance['prefill_prompt_tokens_max_over_mean']}, "
            f"decode requests {balance['decode_requests_max_over_mean']}")


def stack_settings(args, mode: Mode) -> dict[str, str]:
    if args.gpu:
        settings = gpu_stack_settings(args.model, mode.services, shared_weights=decodes_share_weights(args.devices))
    else:
        settings = {"PDSERVE_MODEL_PATH": args.model}
    return {**settings, **mode.settings()}


def decodes_share_weights(devices: str) -> bool:
    """Whether every decode may map prefill-0's weights (decode.weights_from), which works on its GPU
    only: always with every worker on model.device (cuda:0); with --devices, where every decode is
    placed on prefill-0's GPU. The other prefills load their own copy either way."""
    placed = parse_devices(devices)
    if not placed:
        return True
    prefill_0 = placed.get("prefill", ["cuda:0"])[0]
    return set(placed.get("decode", ["cuda:0"])) == {prefill_0}


def warm_up(address: str, workloads: list[Workload], args) -> None:
    answers = asyncio.run(replay(address, warm_up_schedule(workloads), label="warmup",
                                 timeout_s=args.request_timeout_s, drain_timeout_s=args.request_timeout_s))
    if not all(r.ok for r in answers):
        raise RuntimeError(f"warm-up failed: {[r.code for r in answers]}")


def run_workload(address: str, mode: Mode, load: Workload, args) -> list[metrics.CallRecord]:
    progress(f"{mode.name}: {load.name}: {len(load.schedule)} requests over {load.length_s:.1f} s")
    records = asyncio.run(replay(address, load.schedule, label=f"{mode.name}-{load.name}",
                                 timeout_s=args.request_timeout_s, drain_timeout_s=args.drain_timeout_s,
                                 channels=args.channels))
    summary = metrics.counts(records)
    progress(f"{mode.name}: {load.name}: {summary}, SLO attainment "
             f"{metrics.slo_attainment(records, args.slo):.2f}")
    return records


def workload_report(load: Workload, records: list[metrics.CallRecord], slo: metrics.Slo) -> dict:
    return {"family": load.family, "offered_rps": load.offered_rps, "schedule_s": load.length_s,
            **metrics.summarize(records, slo)}


def goodput_fields(entry: dict, family: str, slo: metrics.Slo, prefix: str = "") -> dict:
    """The goodput over the rates of one family of workloads (the Poisson rates, the trace's speeds)."""
    attainment = {w["offered_rps"]: w["slo_attainment"] for w in entry["workloads"].values()
                  if w["family"] == family and w["offered_rps"]}
    found = metrics.goodput(attainment, slo) if attainment else None
    return {f"{prefix}attainment_by_rate": {f"{rate:g}": share for rate, share in attainment.items()},
            f"{prefix}goodput_rps": found,
            # The highest rate tried met the objective: the real goodput is that or more.
            f"{prefix}goodput_may_be_higher": bool(attainment) and found == max(attainment)}


def mode_summary(entry: dict, records: dict[str, list[metrics.CallRecord]], args) -> dict:
    summary = {**goodput_fields(entry, "poisson", args.slo), **goodput_fields(entry, "trace", args.slo, "trace_")}
    if "trace+burst" in records and "trace" in records:
        effect = metrics.burst_effect(records["trace+burst"], records["trace"], args.burst_at_s)
        cohort = set(effect["decoding_requests"])
        effect["itl_series"] = {"with_burst": metrics.itl_series(records["trace+burst"], cohort),
                                "without_burst": metrics.itl_series(records["trace"], cohort)}
        summary["burst"] = effect
    balances = [w["load_balance"] for w in entry["workloads"].values() if "workers" in w.get("load_balance", {})]
    if balances:
        summary["load_balance"] = worker_balance.combined(balances)
    return summary


def keep_logs(work: Path, logs_dir: Path | None, mode: str) -> None:
    """The services' logs, kept (the run folder itself is short-lived: it holds sockets)."""
    if logs_dir is None:
        return
    target = logs_dir / mode
    target.mkdir(parents=True, exist_ok=True)
    for log in work.glob("*.log"):
        shutil.copy(log, target / log.name)


# ---- the report ---------------------------------------------------------------------------------

def comparison(modes: dict[str, dict]) -> dict:
    """The headline numbers of every mode side by side."""
    def total(entry: dict, key: str) -> int:
        return sum(w["counts"][key] for w in entry["workloads"].values())

    return {name: {"topology": e.get("topology"), "goodput_rps": e.get("goodput_rps"),
                   "trace_goodput_rps": e.get("trace_goodput_rps"),
                   "burst_p99_tpot_ratio": e.get("burst", {}).get("p99_ratio"),
                   "sent": total(e, "sent"), "lost": total(e, "lost"),
                   "errors": sum(sum(w["counts"]["errors"].values()) for w in e["workloads"].values()),
                   "prefill_prompt_tokens_max_over_mean":
                       e.get("load_balance", {}).get("prefill_prompt_tokens_max_over_mean"),
                   "decode_requests_max_over_mean": e.get("load_balance", {}).get("decode_requests_max_over_mean"),
                   "failed": e.get("error")} for name, e in modes.items()}


def problems(modes: dict[str, dict]) -> list[str]:
    found = [f"{name}: {e['error']}" for name, e in modes.items() if "error" in e]
    found += [f"{name}: {w}: {wl['counts']['lost']} requests lost" for name, e in modes.items()
              for w, wl in e["workloads"].items() if wl["counts"]["lost"]]
    found += [f"{name}: the workers are not clients of the MPS daemon" for name, e in modes.items()
              if "mps" in e and not e["mps"]["workers_are_clients"]]
    found += [f"{name}: skipped for time: {e['skipped_for_time']}" for name, e in modes.items()
              if e["skipped_for_time"]]
    found += [f"{name}: {w}: load balance not read: {wl['load_balance']['error']}" for name, e in modes.items()
              for w, wl in e["workloads"].items() if "error" in wl.get("load_balance", {})]
    return found


def settings_record(args) -> dict:
    record = {key: value for key, value in vars(args).items()
              if key not in ("slo", "mps_split", "out", "logs_dir", "topologies")}
    record["mps_split"] = {"decode_percent": args.mps_split.decode_percent,
                           "prefill_percent": args.mps_split.prefill_percent}
    record["topologies"] = [t.label for t in args.topologies]
    return record


def modes_to_run(args) -> list[Mode]:
    """The modes named, the disaggregated one once per topology where there are topologies, each as
    the variants that --prefix-cache and --routing ask for."""
    if not args.topologies:
        named = [MODES[name] for name in args.modes]
    else:
        named = [MODES[name].laid_out(topology) for name in args.modes for topology in args.topologies]
    return [variant for mode in named for variant in mode.variants(args.prefix_cache, args.routing)]


def run(args) -> dict:
    report = {"benchmark": "serving", "settings": settings_record(args),
              "slo": {"ttft_s": args.slo.ttft_s, "tpot_s": args.slo.tpot_s, "attainment": args.slo.attainment},
              "definitions": inspect.cleandoc(StreamRecord.__doc__), "modes": {}}
    clock = Clock(args.time_limit_s)

    def save() -> None:
        report["wall_s"] = time.monotonic() - clock.started
        if args.out:
            (args.out / "serving.json").write_text(json.dumps(report, indent=1))

    for mode in modes_to_run(args):
        progress(f"{mode.name}: starting")
        entry = report["modes"].setdefault(mode.name, {})
        entry.update(mode_summary(entry, run_mode(mode, entry, args, clock, save), args))
        save()
    report["comparison"] = comparison(report["modes"])
    report["prefix_cache"] = prefix_comparison.cache_comparisons(report["modes"])
    report["routing"] = prefix_comparison.routing_comparisons(report["modes"])
    for line in prefix_comparison.summary_lines(report["prefix_cache"], report["routing"]):
        progress(line)
    report["problems"] = problems(report["modes"])
    save()
    return report


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM unwinds like an error, so every mode's processes (and the MPS daemon) are stopped.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    report = run(args)
    print(json.dumps(report, indent=1))
    for problem in report["problems"]:
        progress(f"PROBLEM: {problem}")
    return 1 if report["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
