"""Locust against pdserve's gRPC Generate stream: `make loadtest`, or

    .venv/bin/python -m locust -f loadtest/external/locustfile.py --headless --host 127.0.0.1:50051 \
        -u 4 -r 4 --run-time 60s --traffic closed|trace|curve [options below]

Every request fires three locust request events, named by workload class (long, short, trace):
TTFT, TPOT (only with more than one token) and E2E, as loadtest/lib/generate_client.py defines them.
A failed call fires E2E only, its error the gRPC status code, so the failure table groups by
code. Requests are greedy unless --temperature says otherwise. Traffic modes:
- closed: -u users, each sends the long/short mix back to back;
- trace: one dispatcher replays the Mooncake trace open loop (scaled, see loadtest/lib/workload.py);
- curve: one dispatcher sends the mix open loop at the rate of a t_seconds,requests_per_second
  CSV (--curve, default loadtest/curves/bursty.csv), the run's end set by a LoadTestShape.
When the test stops, no new request starts and those in flight are waited for (--drain-seconds,
then cancelled and counted as CANCELLED failures), so that every started request has its E2E
entry; at the end it logs "loadtest: N requests started, M finished".
"""

from __future__ import annotations

import itertools
import logging
import time
from pathlib import Path

import gevent
import grpc
import grpc.experimental.gevent as grpc_gevent
from gevent.pool import Group
from locust import LoadTestShape, User, constant, events, task
from locust.exception import StopUser
from locust.stats import CSV_STATS_INTERVAL_SEC
from pdserve.v1 import generation_pb2_grpc

from loadtest.external import traffic
from loadtest.lib import workload
from loadtest.lib.generate_client import GREEDY, StreamRecord, generate_request, read_stream

grpc_gevent.init_gevent()  # after locust's monkey patching, before any channel exists

logger = logging.getLogger("loadtest")
DEFAULT_CURVE = Path(__file__).resolve().parents[1] / "curves" / "bursty.csv"


def _bool(value: str) -> bool:
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {value}")


@events.init_command_line_parser.add_listener
def _add_arguments(parser):
    group = parser.add_argument_group("pdserve", "workload of loadtest/external/locustfile.py")
    group.add_argument("--traffic", choices=("closed", "trace", "curve"), default="closed",
                       help="closed: users loop; trace: replay the trace open loop; curve: follow --curve")
    group.add_argument("--long-fraction", type=float, default=0.7, help="share of long prompts in the mix")
    group.add_argument("--long-tokens", type=int, default=1024, help="prompt tokens of a long request")
    group.add_argument("--short-tokens", type=int, default=64, help="prompt tokens of a short request")
    group.add_argument("--max-tokens", type=int, default=128, help="output tokens of a mix request")
    group.add_argument("--ignore-eos", type=_bool, default=True, help="generate exactly max_tokens (true/false)")
    group.add_argument("--seed", type=int, default=0, help="seeds the prompts and the sampling")
    group.add_argument("--temperature", type=float, default=GREEDY,
                       help="0 (default): greedy, as every load tool; above 0 samples")
    group.add_argument("--request-timeout", type=float, default=300.0, help="gRPC deadline of one call (s)")
    group.add_argument("--drain-seconds", type=float, default=120.0,
                       help="at stop, wait this long for requests in flight before cancelling them")
    group.add_argument("--trace", default=str(workload.DEFAULT_TRACE), help="Mooncake-format trace (jsonl)")
    group.add_argument("--time-scale", type=float, default=1.0, help="multiplies trace times (0.1: 10x faster)")
    group.add_argument("--rate-scale", type=float, default=1.0,
                       help="below 1 keeps every k-th trace request, above 1 repeats them")
    group.add_argument("--length-scale", type=float, default=1.0,
                       help="multiplies trace input and output lengths and the 512-token block")
    group.add_argument("--max-input-tokens", type=int, default=workload.MODEL_CONTEXT - 1)
    group.add_argument("--max-output-tokens", type=int, default=workload.MODEL_CONTEXT - 1)
    group.add_argument("--context-tokens", type=int, default=workload.MODEL_CONTEXT, help="the model's context")
    group.add_argument("--replay-seconds", type=float, default=60.0, help="replay only this much (scaled) time")
    group.add_argument("--curve", default=str(DEFAULT_CURVE), help="CSV of t_seconds,requests_per_second")


class GrpcStatusError(Exception):
    """A failed call, named by its status code alone so that locust groups failures by code."""


class InFlight:
    """Every request of the process runs in this group; counts what started and what finished."""

    def __init__(self):
        self.group = Group()
        self.started = 0
        self.finished = 0
        self.stopping = False
        self.calls: set[grpc.Call] = set()

    def drain(self, timeout_s: float) -> None:
        self.stopping = True
        if not self.group.join(timeout=timeout_s):
            logger.warning("loadtest: cancelling %d requests still in flight after %.0f s", len(self.calls), timeout_s)
            for call in list(self.calls):
                call.cancel()
            self.group.join()


IN_FLIGHT = InFlight()
_channel: grpc.Channel | None = None


def _stub(host: str) -> generation_pb2_grpc.GenerationStub:
    global _channel
    if _channel is None:
        _channel = grpc.insecure_channel(host)
    return generation_pb2_grpc.GenerationStub(_channel)


def generate(stub, spec: workload.RequestSpec, options) -> None:
    """One Generate stream, reported as TTFT, TPOT and E2E events under spec.name."""
    IN_FLIGHT.started += 1
    request = generate_request(spec, ignore_eos=options.ignore_eos, temperature=options.temperature)
    record = StreamRecord(started_s=time.perf_counter())
    call = stub.Generate(request, timeout=options.request_timeout)
    IN_FLIGHT.calls.add(call)
    try:
        read_stream(call, record)
    finally:
        IN_FLIGHT.calls.discard(call)
    if not record.ok:
        logger.debug("loadtest: %s request failed: %s %s", spec.name, record.code, record.details)
        _fire_e2e(spec.name, record.ended_s - record.started_s, record.tokens, GrpcStatusError(record.code))
        return
    _fire("TTFT", spec.name, record.ttft_s, len(spec.prompt_token_ids))
    if record.tpot_s is not None:
        _fire("TPOT", spec.name, record.tpot_s, record.tokens)
    _fire_e2e(spec.name, record.e2e_s, record.tokens)


def _fire_e2e(name: str, seconds: float, tokens: int, exception: Exception | None = None) -> None:
    IN_FLIGHT.finished += 1
    _fire("E2E", name, seconds, tokens, exception)


def _fire(metric: str, name: str, seconds: float, length: int, exception: Exception | None = None) -> None:
    events.request.fire(request_type=metric, name=name, response_time=seconds * 1000, response_length=length,
                        exception=exception, context={})


class GenerateUser(User):
    """In closed mode a user sends back to back; in trace and curve mode the one user dispatches."""

    wait_time = constant(0)
    _numbers = itertools.count()

    def on_start(self):
        self.options = self.environment.parsed_options
        self.stub = _stub(self.environment.host or "127.0.0.1:50051")
        self.mix = workload.Mix(self.options.long_fraction, self.options.long_tokens, self.options.short_tokens,
                               self.options.max_tokens, self.options.seed)

    @task
    def send(self):
        if IN_FLIGHT.stopping:
            raise StopUser()
        if self.options.traffic == "closed":
            # The call runs in IN_FLIGHT's group so that stopping the user cannot cut it off uncounted.
            IN_FLIGHT.group.spawn(generate, self.stub, self.mix.request(next(self._numbers)), self.options).join()
            return
        shape = self.environment.shape_class
        traffic.dispatch_open_loop(shape.schedule, lambda spec: generate(self.stub, spec, self.options),
                                   IN_FLIGHT.group, stopped=lambda: IN_FLIGHT.stopping)
        shape.dispatched = True
        raise StopUser()


class ReplayShape(LoadTestShape):
    """One dispatcher user until the schedule has been sent or --run-time is up; then the test stops."""

    abstract = True  # chosen by --traffic in _select_shape, never picked up by locust on its own
    use_common_options = True  # it reads --run-time

    def __init__(self, schedule: list[workload.Arrival], run_time_s: float | None):
        super().__init__()
        self.schedule = schedule
        self.run_time_s = run_time_s
        self.dispatched = False

    def tick(self):
        if self.dispatched or (self.run_time_s and self.get_run_time() >= self.run_time_s):
            return None
        return 1, 1


class CurveShape(ReplayShape):
    """A t_seconds,requests_per_second curve, sent open loop as evenly paced arrivals of the mix."""

    abstract = True

    def __init__(self, options):
        curve = workload.read_curve(options.curve)
        mix = workload.Mix(options.long_fraction, options.long_tokens, options.short_tokens, options.max_tokens,
                          options.seed)
        super().__init__(workload.curve_schedule(curve, mix, options.replay_seconds), options.run_time)


def trace_shape(options) -> ReplayShape:
    scaling = workload.TraceScaling(options.time_scale, options.rate_scale, options.length_scale,
                                   options.max_input_tokens, options.max_output_tokens, options.context_tokens,
                                   options.replay_seconds)
    return ReplayShape(workload.trace_schedule(workload.read_trace(options.trace), scaling), options.run_time)


@events.init.add_listener
def _select_shape(environment, runner, **_kwargs):
    options = environment.parsed_options
    if options is None or options.traffic == "closed":
        return
    shape = CurveShape(options) if options.traffic == "curve" else trace_shape(options)
    logger.info("loadtest: %s schedule of %d requests over %.1f s", options.traffic, len(shape.schedule),
                shape.schedule[-1].at_s if shape.schedule else 0.0)
    shape.runner = runner
    environment.shape_class = shape


@events.test_stopping.add_listener
def _drain(environment, **_kwargs):
    IN_FLIGHT.drain(environment.parsed_options.drain_seconds)
    if environment.parsed_options.csv_prefix:
        # The CSV writer samples the stats once per interval; let it see the last E2E events.
        gevent.sleep(CSV_STATS_INTERVAL_SEC + 0.5)
    logger.info("loadtest: %d requests started, %d finished", IN_FLIGHT.started, IN_FLIGHT.finished)
    if IN_FLIGHT.started != IN_FLIGHT.finished:
        environment.process_exit_code = 1
