"""python -m loadtest.bench_serving: ways of serving side by side on one open-loop workload, in one run.

    python -m loadtest.bench_serving [--modes disaggregated,colocated,transformers] [--out DIR] [--gpu]

For each mode (loadtest/serving_modes.py) it starts the processes, warms them up, replays every
workload, and stops them. The workloads, fixed before the first mode starts so every mode gets the
same requests at the same times:
- poisson-R: Poisson arrivals at R requests/s (seeded exponential gaps), fixed prompt and output
  lengths (or a long/short mix), greedy with EOS ignored;
- curve (with --curve): arrivals evenly paced along a requests-per-second curve, the same prompts;
- trace+burst and trace: the production trace replayed (scaled), with and without --burst-requests
  long prompts all arriving at --burst-at-s; the requests already decoding then have their TPOT
  compared with the same requests' TPOT in the replay without the burst.
The transformers floor serves one request at a time, so it gets only --floor-rates (default: the
lowest rate), each cut to --floor-requests-per-rate requests, and no trace.

The defaults fit a 2-core CPU with the embedded model (about 5 minutes); --gpu takes the GPU stack
bench's settings (loadtest/bench_gpu_stack.py) and adds the mps mode.

The JSON report goes to stdout and to DIR/serving.json (rewritten after every workload, so a run
cut short keeps what it measured); `python -m loadtest.plot_serving DIR/serving.json` draws it.
Progress goes to stderr. The exit code is 1 when a mode failed, a request was lost, the mps workers
were not clients of the daemon, or something was skipped for --time-limit-s.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from loadtest import serving_metrics as metrics
from loadtest.bench_gpu_stack import gpu_stack_settings
from loadtest.generate_client import StreamRecord
from loadtest.serving_client import replay
from loadtest.serving_modes import MODES, Mode, MpsSplit, serving
from loadtest.serving_workloads import Workload, mode_workloads, warm_up_schedule
from loadtest.workload import DEFAULT_TRACE, MODEL_CONTEXT

CACHE_DIR = os.environ.get("PDSERVE_MODEL_CACHE_DIR", "~/.cache/pdserve")
CPU_MODES = "disaggregated,colocated,transformers"
GPU_MODES = "disaggregated,colocated,mps,transformers"
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
        except (RuntimeError, TimeoutError, OSError) as error:
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
    with serving(mode, work, CACHE_DIR, stack_settings(args, mode), args.mps_split, args.start_timeout_s) as (
            stack, facts):
        entry["start_s"] = time.monotonic() - began
        clock.starts_s.append(entry["start_s"])
        entry.update(facts)
        progress(f"{mode.name}: serving after {entry['start_s']:.0f} s; warming up")
        warm_up(stack.address, workloads, args)
        for load in workloads:
            if not clock.fits(load.length_s + min(args.drain_timeout_s, DRAIN_ALLOWANCE_S)):
                entry["skipped_for_time"].append(load.name)
                continue
            records[load.name] = run_workload(stack.address, mode, load, args)
            entry["workloads"][load.name] = workload_report(load, records[load.name], args.slo)
            save()
        entry["exit_codes"] = stack.stop()


def stack_settings(args, mode: Mode) -> dict[str, str]:
    if args.gpu:
        return gpu_stack_settings(args.model, mode.services)
    return {"PDSERVE_MODEL_PATH": args.model}


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
    return {"offered_rps": load.offered_rps, "schedule_s": load.length_s, **metrics.summarize(records, slo)}


def mode_summary(entry: dict, records: dict[str, list[metrics.CallRecord]], args) -> dict:
    attainment = {w["offered_rps"]: w["slo_attainment"] for w in entry["workloads"].values() if w["offered_rps"]}
    found = metrics.goodput(attainment, args.slo) if attainment else None
    summary = {"attainment_by_rate": {f"{rate:g}": share for rate, share in attainment.items()},
               "goodput_rps": found,
               # The highest rate tried met the objective: the real goodput is that or more.
               "goodput_may_be_higher": bool(attainment) and found == max(attainment)}
    if "trace+burst" in records and "trace" in records:
        effect = metrics.burst_effect(records["trace+burst"], records["trace"], args.burst_at_s)
        cohort = set(effect["decoding_requests"])
        effect["itl_series"] = {"with_burst": metrics.itl_series(records["trace+burst"], cohort),
                                "without_burst": metrics.itl_series(records["trace"], cohort)}
        summary["burst"] = effect
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

    return {name: {"goodput_rps": e.get("goodput_rps"),
                   "burst_p99_tpot_ratio": e.get("burst", {}).get("p99_ratio"),
                   "sent": total(e, "sent"), "lost": total(e, "lost"),
                   "errors": sum(sum(w["counts"]["errors"].values()) for w in e["workloads"].values()),
                   "failed": e.get("error")} for name, e in modes.items()}


def problems(modes: dict[str, dict]) -> list[str]:
    found = [f"{name}: {e['error']}" for name, e in modes.items() if "error" in e]
    found += [f"{name}: {w}: {wl['counts']['lost']} requests lost" for name, e in modes.items()
              for w, wl in e["workloads"].items() if wl["counts"]["lost"]]
    found += [f"{name}: the workers are not clients of the MPS daemon" for name, e in modes.items()
              if "mps" in e and not e["mps"]["workers_are_clients"]]
    found += [f"{name}: skipped for time: {e['skipped_for_time']}" for name, e in modes.items()
              if e["skipped_for_time"]]
    return found


def settings_record(args) -> dict:
    record = {key: value for key, value in vars(args).items() if key not in ("slo", "mps_split", "out", "logs_dir")}
    record["mps_split"] = {"decode_percent": args.mps_split.decode_percent,
                           "prefill_percent": args.mps_split.prefill_percent}
    return record


def run(args) -> dict:
    report = {"benchmark": "serving", "settings": settings_record(args),
              "slo": {"ttft_s": args.slo.ttft_s, "tpot_s": args.slo.tpot_s, "attainment": args.slo.attainment},
              "definitions": inspect.cleandoc(StreamRecord.__doc__), "modes": {}}
    clock = Clock(args.time_limit_s)

    def save() -> None:
        report["wall_s"] = time.monotonic() - clock.started
        if args.out:
            (args.out / "serving.json").write_text(json.dumps(report, indent=1))

    for name in args.modes:
        progress(f"{name}: starting")
        entry = report["modes"].setdefault(name, {})
        entry.update(mode_summary(entry, run_mode(MODES[name], entry, args, clock, save), args))
        save()
    report["comparison"] = comparison(report["modes"])
    report["problems"] = problems(report["modes"])
    save()
    return report


# ---- the command line -----------------------------------------------------------------------------

def floats(text: str) -> list[float]:
    return [float(part) for part in text.split(",") if part.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m loadtest.bench_serving", description=__doc__.split("\n")[0])
    parser.add_argument("--modes", help=f"comma-separated, of {', '.join(MODES)} (default: {CPU_MODES}; "
                                        f"with --gpu: {GPU_MODES})")
    parser.add_argument("--gpu", action="store_true", help="the stack on cuda:0 with the GPU bench's settings")
    parser.add_argument("--model", help="default: embedded (CPU), random:llama-3.1-8b (--gpu)")
    parser.add_argument("--out", type=Path, help="folder for serving.json")
    parser.add_argument("--logs-dir", type=Path, help="the services' logs go to LOGS_DIR/<mode>/ (default: OUT/logs)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the arrivals and the prompts")
    load = parser.add_argument_group("Poisson workloads")
    load.add_argument("--rates", type=floats, default=floats("0.5,1,2"), help="requests/s, comma-separated; '' none")
    load.add_argument("--duration-s", type=float, default=15.0, help="arrivals within this many seconds per rate")
    load.add_argument("--requests-per-rate", type=int, help="instead of --duration-s: this many arrivals per rate")
    load.add_argument("--prompt-tokens", type=int, default=128)
    load.add_argument("--output-tokens", type=int, default=32, help="exact: EOS is ignored")
    load.add_argument("--long-fraction", type=float, default=1.0,
                      help="below 1: a mix, this share with --prompt-tokens, the rest --short-prompt-tokens")
    load.add_argument("--short-prompt-tokens", type=int, default=64)
    load.add_argument("--curve", default="", help="also a rate curve: a CSV of t_seconds,requests_per_second "
                      "(e.g. loadtest/curves/bursty.csv), arrivals evenly paced along it, the same prompts")
    load.add_argument("--curve-seconds", type=float, default=30.0, help="follow the curve this long at most")
    trace = parser.add_argument_group("trace replay (loadtest/workload.py TraceScaling)")
    trace.add_argument("--trace", default=str(DEFAULT_TRACE) if DEFAULT_TRACE.exists() else "",
                       help="Mooncake-format jsonl; '' skips the replay")
    trace.add_argument("--time-scale", type=float, default=1.0, help="multiplies trace times (0.5: 2x faster)")
    trace.add_argument("--rate-scale", type=float, default=0.5, help="below 1 keeps every k-th request")
    trace.add_argument("--length-scale", type=float, default=1 / 8, help="multiplies input and output lengths")
    trace.add_argument("--max-input-tokens", type=int, default=256)
    trace.add_argument("--max-output-tokens", type=int, default=64)
    trace.add_argument("--context-tokens", type=int, default=MODEL_CONTEXT, help="the model's context")
    trace.add_argument("--replay-seconds", type=float, default=20.0, help="replay this much (scaled) time")
    trace.add_argument("--burst-at-s", type=float, default=8.0)
    trace.add_argument("--burst-requests", type=int, default=3, help="0: no burst (and no second replay)")
    trace.add_argument("--burst-prompt-tokens", type=int, default=512)
    trace.add_argument("--burst-output-tokens", type=int, default=8)
    slo = parser.add_argument_group("objectives")
    slo.add_argument("--slo-ttft-s", type=float, default=1.0)
    slo.add_argument("--slo-tpot-s", type=float, default=0.1)
    slo.add_argument("--slo-attainment", type=float, default=0.9, help="share of requests that must meet both")
    floor = parser.add_argument_group("the transformers floor")
    floor.add_argument("--floor-rates", type=floats, help="default: the lowest of --rates")
    floor.add_argument("--floor-requests-per-rate", type=int, default=4)
    running = parser.add_argument_group("the run")
    running.add_argument("--request-timeout-s", type=float, default=120.0, help="gRPC deadline of each call")
    running.add_argument("--drain-timeout-s", type=float, default=60.0,
                         help="after the last arrival, wait this long, then cancel what is open (lost)")
    running.add_argument("--channels", type=int, default=2, help="gRPC connections the calls spread over")
    running.add_argument("--start-timeout-s", type=float, default=600.0, help="for a mode to become SERVING")
    running.add_argument("--time-limit-s", type=float, default=0.0,
                         help="skip what would end past this many seconds from the start; 0: no limit")
    running.add_argument("--mps-split", type=MpsSplit.parse, default=MpsSplit(), metavar="D,P",
                         help="SM percent of decode and prefill in the mps mode; 100: unlimited (default 100,30)")
    args = parser.parse_args(argv)
    args.modes = [m.strip() for m in (args.modes or (GPU_MODES if args.gpu else CPU_MODES)).split(",") if m.strip()]
    unknown = [m for m in args.modes if m not in MODES]
    if unknown:
        parser.error(f"unknown modes {unknown}: choose from {list(MODES)}")
    if "mps" in args.modes and not args.gpu:
        parser.error("the mps mode needs --gpu")
    args.model = args.model or ("random:llama-3.1-8b" if args.gpu else "embedded")
    args.floor_rates = sorted(args.rates)[:1] if args.floor_rates is None else args.floor_rates
    if any(r <= 0 for r in args.rates + args.floor_rates):
        parser.error("rates must be positive")
    if not args.rates and not args.trace and not args.curve:
        parser.error("nothing to run: no --rates, --trace or --curve")
    args.slo = metrics.Slo(args.slo_ttft_s, args.slo_tpot_s, args.slo_attainment)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    args.logs_dir = args.logs_dir or (args.out / "logs" if args.out else None)
    return args


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
