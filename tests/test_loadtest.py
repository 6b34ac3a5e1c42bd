"""The locust load test: its traffic building in-process, and each traffic mode against the stack."""

from __future__ import annotations

import csv
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

gevent = pytest.importorskip("gevent", reason="locust's gevent is a dev dependency")  # absent on the GPU image
from gevent.pool import Group  # noqa: E402

from loadtest.external import traffic  # noqa: E402
from loadtest.lib import workload  # noqa: E402
from tests.stack import REPO  # noqa: E402

LOCUST_RUN_S = 12
STARTED = re.compile(r"loadtest: (\d+) requests started, (\d+) finished")
SMALL_MIX = ["--long-tokens", "192", "--short-tokens", "24", "--max-tokens", "12"]


def record(ms: int, input_length: int = 40, output_length: int = 8, hash_ids=(1, 2, 3)) -> workload.TraceRecord:
    return workload.TraceRecord(ms, input_length, output_length, tuple(hash_ids))


# ---- workload.py, in-process ---------------------------------------------------------------------

def test_equal_hash_ids_give_equal_blocks_and_different_ids_differ():
    a = workload.trace_prompt([7, 8, 9], 48, 16)
    b = workload.trace_prompt([7, 8, 10], 48, 16)
    assert a[:32] == b[:32]
    assert a[32:] != b[32:]
    assert workload.trace_prompt([7], 16, 16) == a[:16]
    assert all(workload.TOKEN_ID_LOW <= t < workload.TOKEN_ID_HIGH for t in a + b)


def test_prompt_lengths_are_exact_and_clamped():
    assert len(workload.trace_prompt([1, 2, 3], 37, 16)) == 37
    scaling = workload.TraceScaling(length_scale=1 / 32, max_input_tokens=20, max_output_tokens=5)
    assert scaling.block_tokens == 16
    assert workload.scaled_lengths(record(0, 640, 320, (1, 2)), scaling) == (20, 5)
    assert workload.scaled_lengths(record(0, 6758, 500, range(14)), workload.TraceScaling()) == (6758, 500)
    long = workload.scaled_lengths(record(0, 120_000, 500, range(240)), workload.TraceScaling())
    assert long == (workload.MODEL_CONTEXT - 1, 1)
    mix = workload.Mix(long_fraction=0.5, long_tokens=100, short_tokens=10, max_tokens=7, seed=3)
    requests = [mix.request(i) for i in range(200)]
    assert {len(r.prompt_token_ids) for r in requests if r.name == "long"} == {100}
    assert {len(r.prompt_token_ids) for r in requests if r.name == "short"} == {10}
    assert 70 < sum(r.name == "long" for r in requests) < 130
    assert requests[5] == mix.request(5)


def test_trace_schedule_scales_time_and_rate_up_front():
    records = [record(ms) for ms in (0, 1000, 2000, 3000)]
    schedule = workload.trace_schedule(records, workload.TraceScaling(time_scale=0.5))
    assert [a.at_s for a in schedule] == [0.0, 0.5, 1.0, 1.5]
    assert len(workload.trace_schedule(records, workload.TraceScaling(rate_scale=0.5))) == 2
    doubled = workload.trace_schedule(records, workload.TraceScaling(rate_scale=2))
    assert [a.at_s for a in doubled] == [0.0, 0.0, 1.0, 1.0, 2.0, 2.0, 3.0, 3.0]
    assert doubled[0].spec.prompt_token_ids == doubled[1].spec.prompt_token_ids
    bounded = workload.trace_schedule(records, workload.TraceScaling(time_scale=0.5, replay_seconds=1.0))
    assert [a.at_s for a in bounded] == [0.0, 0.5]


# The production trace is handed to the project beside the checkout (../shared), as in CI.
needs_trace = pytest.mark.skipif(not workload.DEFAULT_TRACE.exists(),
                                 reason=f"no production trace at {workload.DEFAULT_TRACE}")


@needs_trace
def test_shared_trace_reads_and_scales_to_the_cpu():
    records = workload.read_trace()[:2000]
    scaling = workload.TraceScaling(time_scale=0.1, rate_scale=0.1, length_scale=1 / 32, max_input_tokens=256,
                                   max_output_tokens=16, replay_seconds=10)
    schedule = workload.trace_schedule(records, scaling)
    assert schedule and all(0 <= a.at_s < 10 for a in schedule)
    assert all(1 <= len(a.spec.prompt_token_ids) <= 256 and 1 <= a.spec.max_tokens <= 16 for a in schedule)


def test_curve_is_a_step_function_of_rate(tmp_path):
    path = tmp_path / "curve.csv"
    path.write_text("# comment\nt_seconds,requests_per_second\n0,2\n5,0\n10,1\n12,0\n")
    curve = workload.read_curve(path)
    times = workload.curve_arrival_times(curve)
    assert len(times) == 12  # 2/s for 5 s, nothing for 5 s, 1/s for 2 s
    assert times[:2] == [0.25, 0.75] and not any(5 < t < 10 for t in times)
    assert len(workload.curve_arrival_times(curve, limit_s=5)) == 10
    shipped = workload.read_curve(Path(workload.__file__).parents[1] / "curves" / "bursty.csv")
    assert max(rate for _, rate in shipped) == 2.3 and min(rate for _, rate in shipped[:-1]) == 0.12


def test_open_loop_starts_on_time_whatever_the_server_takes():
    schedule = [workload.Arrival(i * 0.05, workload.RequestSpec("x", (1,), 1, i)) for i in range(6)]
    starts: dict[int, float] = {}

    def slow_server(spec: workload.RequestSpec) -> None:
        starts[spec.seed] = time.monotonic() - began
        gevent.sleep(1.0)

    group = Group()
    began = time.monotonic()
    traffic.dispatch_open_loop(schedule, slow_server, group)
    dispatched = time.monotonic() - began
    group.join()
    assert dispatched < 0.6
    assert all(abs(starts[a.spec.seed] - a.at_s) < 0.15 for a in schedule), starts


# ---- locust against the real stack --------------------------------------------------------------

def run_locust(stack, tmp_path: Path, traffic_args: list[str], users: int = 1) -> tuple[dict, list[dict], int]:
    """Runs locust headless; returns the stats rows by (type, name), the failures, and requests started."""
    prefix = tmp_path / "locust"
    command = [sys.executable, "-m", "locust", "-f", "loadtest/external/locustfile.py", "--headless",
               "--host", stack.address, "-u", str(users), "-r", str(users), "--run-time", f"{LOCUST_RUN_S}s",
               "--csv", str(prefix), "--html", str(tmp_path / "locust.html"), "--drain-seconds", "60", *traffic_args]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=LOCUST_RUN_S + 90)
    assert done.returncode == 0, done.stderr[-4000:]
    counts = STARTED.findall(done.stderr)
    assert counts, done.stderr[-4000:]
    started, finished = map(int, counts[-1])
    assert started == finished
    with open(f"{prefix}_stats.csv") as file:
        stats = {(row["Type"], row["Name"]): row for row in csv.DictReader(file) if row["Name"] != "Aggregated"}
    with open(f"{prefix}_failures.csv") as file:
        failures = list(csv.DictReader(file))
    assert (tmp_path / "locust.html").exists()
    return stats, failures, started


def assert_complete(stats: dict, failures: list[dict], started: int, names: set[str]) -> None:
    assert started > 0
    assert {metric for metric, _ in stats} == {"TTFT", "TPOT", "E2E"}
    assert {name for _, name in stats} <= names
    e2e = sum(int(row["Request Count"]) for (metric, _), row in stats.items() if metric == "E2E")
    assert e2e == started, (e2e, started, stats)
    assert failures == [] and all(int(row["Failure Count"]) == 0 for row in stats.values()), failures


@pytest.mark.e2e
@pytest.mark.slow
def test_closed_loop_users(stack, tmp_path):
    stats, failures, started = run_locust(stack, tmp_path, ["--traffic", "closed", *SMALL_MIX], users=2)
    assert_complete(stats, failures, started, {"long", "short"})


@pytest.mark.e2e
@pytest.mark.slow
@needs_trace
def test_trace_replay(stack, tmp_path):
    args = ["--traffic", "trace", "--time-scale", "0.1", "--rate-scale", "0.05", "--length-scale", "0.03125",
            "--max-input-tokens", "256", "--max-output-tokens", "16", "--replay-seconds", "8"]
    stats, failures, started = run_locust(stack, tmp_path, args, users=3)  # still one dispatcher
    assert_complete(stats, failures, started, {"trace"})
    records = workload.read_trace()[:2000]
    expected = workload.trace_schedule(records, workload.TraceScaling(
        time_scale=0.1, rate_scale=0.05, length_scale=0.03125, max_input_tokens=256, max_output_tokens=16,
        replay_seconds=8))
    assert started == len(expected)


@pytest.mark.e2e
@pytest.mark.slow
def test_rate_curve(stack, tmp_path):
    curve = tmp_path / "curve.csv"
    curve.write_text("t_seconds,requests_per_second\n0,1\n4,2\n4.4,0.5\n8,0\n")
    stats, failures, started = run_locust(stack, tmp_path, ["--traffic", "curve", "--curve", str(curve), *SMALL_MIX])
    assert_complete(stats, failures, started, {"long", "short"})
    assert started == len(workload.curve_arrival_times(workload.read_curve(curve)))
