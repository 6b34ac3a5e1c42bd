"""The serving benchmark's command line (loadtest/stack/bench_serving.py says what each part runs)."""

from __future__ import annotations

import argparse
from pathlib import Path

from loadtest.lib.workload import DEFAULT_TRACE, MODEL_CONTEXT
from loadtest.stack import serving_metrics as metrics
from loadtest.stack.serving_modes import CACHE_SETTINGS, CACHED_MODES, LAYOUT_MODES, MODES, ROUTINGS, MpsSplit, Topology
from shared.config.schema import ConfigError, parse_devices

CPU_MODES = "disaggregated,colocated,transformers"
GPU_MODES = "disaggregated,colocated,mps,transformers"


def floats(text: str) -> list[float]:
    return [float(part) for part in text.split(",") if part.strip()]


def named_settings(names: dict[str, bool]):
    """A comma-separated list of these names, each at most once, as their values in the order given."""
    def parse(text: str) -> list[bool]:
        given = [part.strip() for part in text.split(",") if part.strip()]
        unknown = [part for part in given if part not in names]
        if unknown or len(set(given)) < len(given) or not given:
            raise argparse.ArgumentTypeError(f"a list of {', '.join(names)}, each once, got {text!r}")
        return [names[part] for part in given]
    return parse


def topologies(text: str) -> list[Topology]:
    try:
        return [Topology.parse(part) for part in text.split(",") if part.strip()]
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m loadtest.stack.bench_serving",
                                     description="Ways of serving side by side on one open-loop workload, in one run.")
    parser.add_argument("--modes", help=f"comma-separated, of {', '.join(MODES)} (default: {CPU_MODES}; "
                                        f"with --gpu: {GPU_MODES})")
    parser.add_argument("--gpu", action="store_true", help="the stack on cuda:0 with the GPU bench's settings")
    parser.add_argument("--model", help="default: embedded (CPU), random:llama-3.1-8b (--gpu)")
    parser.add_argument("--out", type=Path, help="folder for serving.json")
    parser.add_argument("--logs-dir", type=Path, help="the services' logs go to LOGS_DIR/<mode>/ (default: OUT/logs)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the arrivals and the prompts")
    layout = parser.add_argument_group("the disaggregated mode's workers (services/stack/topology.py)")
    layout.add_argument("--prefill", type=int, help="prefill workers (default 1); one topology with --decode")
    layout.add_argument("--decode", type=int, help="decode workers (default 1)")
    layout.add_argument("--topologies", type=topologies, default=[], metavar="PxD,...",
                        help="one disaggregated run per layout in one report, e.g. 1x1,2x1,1x2")
    layout.add_argument("--devices", default="", help="with --gpu: stack.devices, e.g. 'prefill=0,1 decode=2' "
                        "(default: every worker on model.device, cuda:0)")
    cache = parser.add_argument_group("the prefix cache: each mode once per setting, side by side, compared")
    cache.add_argument("--prefix-cache", type=named_settings(CACHE_SETTINGS), default=[], metavar="on,off",
                       help="prefill.prefix_cache of each run (default: as configured, one run)")
    cache.add_argument("--routing", type=named_settings(ROUTINGS), default=[], metavar="prefix,load",
                       help="with two or more prefills and the cache on: routing.prefix_aware of each run; load: "
                            "by queued prompt tokens alone (default: as configured, one run)")
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
                      "(e.g. loadtest/curves/bursty.csv), arrivals evenly paced along it, the same mix")
    load.add_argument("--curve-seconds", type=float, default=30.0, help="follow the curve this long at most")
    trace = parser.add_argument_group("trace replay (loadtest/lib/workload.py TraceScaling)")
    trace.add_argument("--trace", default=str(DEFAULT_TRACE) if DEFAULT_TRACE.exists() else "",
                       help="Mooncake-format jsonl; '' skips the replay")
    trace.add_argument("--time-scale", type=float, default=1.0, help="multiplies trace times (0.5: 2x faster)")
    trace.add_argument("--rate-scale", type=float, default=0.5, help="below 1 keeps every k-th request")
    trace.add_argument("--length-scale", type=float, default=1 / 8, help="multiplies input and output lengths")
    trace.add_argument("--max-input-tokens", type=int, default=256)
    trace.add_argument("--max-output-tokens", type=int, default=64)
    trace.add_argument("--context-tokens", type=int, default=MODEL_CONTEXT, help="the model's context")
    trace.add_argument("--replay-seconds", type=float, default=20.0, help="replay this much (scaled) time")
    trace.add_argument("--whole-conversations", action="store_true",
                       help="--rate-scale below 1 keeps that share of the conversations whole, not every k-th request")
    trace.add_argument("--trace-speeds", type=floats, default=[1.0],
                       help="replay the same requests once per speed, times divided by it (1,2: as scaled, then "
                            "twice as fast); the trace's goodput is found over these rates")
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
    laid_out = parse_layout(parser, args)
    varied = bool(args.prefix_cache or args.routing)
    default_modes = ",".join(LAYOUT_MODES) if laid_out or varied else GPU_MODES if args.gpu else CPU_MODES
    args.modes = [m.strip() for m in (args.modes or default_modes).split(",") if m.strip()]
    unknown = [m for m in args.modes if m not in MODES]
    if unknown:
        parser.error(f"unknown modes {unknown}: choose from {list(MODES)}")
    fixed = [m for m in args.modes if m not in LAYOUT_MODES]
    if laid_out and fixed:
        parser.error(f"--prefill, --decode, --topologies and --devices lay out the {', '.join(LAYOUT_MODES)} mode "
                     f"only; {', '.join(fixed)}: one prefill and one decode by nature, run without these flags")
    if "mps" in args.modes and not args.gpu:
        parser.error("the mps mode needs --gpu")
    check_variants(parser, args)
    args.model = args.model or ("random:llama-3.1-8b" if args.gpu else "embedded")
    args.floor_rates = sorted(args.rates)[:1] if args.floor_rates is None else args.floor_rates
    if any(r <= 0 for r in args.rates + args.floor_rates):
        parser.error("rates must be positive")
    if any(s <= 0 for s in args.trace_speeds) or len(set(args.trace_speeds)) < len(args.trace_speeds):
        parser.error("--trace-speeds must be positive, each once")
    if args.trace and args.burst_requests and 1 not in args.trace_speeds:
        parser.error("the burst is compared with the replay at speed 1: add 1 to --trace-speeds or --burst-requests 0")
    if not args.rates and not args.trace and not args.curve:
        parser.error("nothing to run: no --rates, --trace or --curve")
    args.slo = metrics.Slo(args.slo_ttft_s, args.slo_tpot_s, args.slo_attainment)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    args.logs_dir = args.logs_dir or (args.out / "logs" if args.out else None)
    return args


def parse_layout(parser: argparse.ArgumentParser, args: argparse.Namespace) -> bool:
    """Turns --prefill/--decode into one topology; True when the run is laid out."""
    if args.topologies and (args.prefill or args.decode):
        parser.error("give either --topologies or --prefill/--decode")
    if any(count is not None and count < 1 for count in (args.prefill, args.decode)):
        parser.error("--prefill and --decode take at least 1")
    if args.prefill or args.decode or args.devices:
        args.topologies = args.topologies or [Topology(args.prefill or 1, args.decode or 1)]
    if len(set(args.topologies)) < len(args.topologies):
        parser.error(f"a topology given twice: {[t.label for t in args.topologies]}")
    if args.devices and not args.gpu:
        parser.error("--devices places workers on GPUs: it needs --gpu")
    try:
        parse_devices(args.devices)
    except ConfigError as error:
        parser.error(f"--devices: {error}")
    return bool(args.topologies)


def check_variants(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--prefix-cache needs modes with a prefill; --routing, a layout with two prefills to choose from."""
    without_cache = [m for m in args.modes if m not in CACHED_MODES]
    if (args.prefix_cache or args.routing) and without_cache:
        parser.error(f"--prefix-cache and --routing vary the prefill: {', '.join(without_cache)} has none")
    if args.routing and not any(t.prefill > 1 for t in args.topologies):
        parser.error("--routing chooses among prefills: give --prefill 2 or a topology of two or more (2x1)")
    if args.routing and args.prefix_cache == [False]:
        parser.error("--routing by prefix needs the prefix cache on")
