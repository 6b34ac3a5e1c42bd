"""The serving benchmark: its metrics on constructed calls, its open-loop client against a fake
server, its topologies and per-worker balance, and real runs on the CPU with the embedded model:
every mode, plots included, and the disaggregated mode laid out as two prefills and one decode."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import grpc
import pytest
from prometheus_client import CollectorRegistry, Counter, generate_latest

from loadtest.lib import workload
from loadtest.lib.percentiles import quantile
from loadtest.lib.stack_settings import gpu_stack_settings
from loadtest.stack import serving_metrics as metrics
from loadtest.stack import worker_balance
from loadtest.stack.bench_serving import decodes_share_weights, modes_to_run, parse_args, stack_settings
from loadtest.stack.serving_client import replay
from loadtest.stack.serving_modes import MODES, MpsSplit, Topology
from loadtest.stack.serving_workloads import mode_workloads
from pdserve.v1 import generation_pb2, generation_pb2_grpc
from services.stack.topology import plan_workers
from shared.config.loading import env_name, load_config
from tests.stack import REPO, free_port

SLO = metrics.Slo(ttft_s=1.0, tpot_s=0.1)


def call(index: int = 0, started: float = 1.0, chunks=(1.5, 1.6, 1.8), tokens: int = 4, ended: float = 1.9,
         code: str | None = "OK", timings: dict | None = None) -> metrics.CallRecord:
    return metrics.CallRecord(index=index, name="fixed", prompt_tokens=16, scheduled_s=started, started_s=started,
                              chunk_times_s=list(chunks), token_ids=list(range(tokens)), ended_s=ended, code=code,
                              timings=timings)


# ---- the metrics ----------------------------------------------------------------------------------

def test_percentiles_interpolate_between_ranks():
    values = [float(v) for v in range(100, 0, -1)]
    summary = metrics.distribution(values)
    assert summary["p50"] == pytest.approx(50.5)
    assert summary["p90"] == pytest.approx(90.1)
    assert summary["p99"] == pytest.approx(99.01)
    assert summary["mean"] == pytest.approx(50.5) and summary["count"] == 100
    assert metrics.distribution([]) is None
    assert metrics.cdf_points([3.0, 1.0, 2.0], points=5) == [1.0, 1.5, 2.0, 2.5, 3.0]


def test_ttft_tpot_and_itl_follow_the_locust_client():
    record = call()  # 4 tokens: one each at 1.5 and 1.6, two at 1.8; the stream ends at 1.9
    assert record.ttft_s == pytest.approx(0.5)
    assert record.tpot_s == pytest.approx((1.9 - 1.5) / 3)  # from the first token to the end, per later token
    assert record.itls_s == pytest.approx([0.1, 0.2])  # one gap per chunk, however many tokens it holds
    assert record.e2e_s == pytest.approx(0.9)
    one_token = call(chunks=(1.5,), tokens=1, ended=1.5)
    assert one_token.tpot_s is None and one_token.itls_s == []
    failed = call(code="UNAVAILABLE")
    assert failed.ttft_s is None and failed.tpot_s is None and failed.e2e_s is None


def test_counts_every_request_as_answered_or_lost():
    records = [call(0), call(1), call(2, code="DEADLINE_EXCEEDED"), call(3, code="RESOURCE_EXHAUSTED"),
               call(4, code="DEADLINE_EXCEEDED"), call(5, chunks=(), tokens=0, ended=None, code=None)]
    assert metrics.counts(records) == {"sent": 6, "ok": 2, "errors": {"DEADLINE_EXCEEDED": 2, "RESOURCE_EXHAUSTED": 1},
                                       "answered": 5, "lost": 1}


def test_slo_attainment_counts_failures_as_misses_and_goodput_takes_the_highest_passing_rate():
    fast = call(chunks=(1.2, 1.25, 1.3), ended=1.35)                # TTFT 0.2 s, TPOT 0.05 s
    slow_first = call(chunks=(2.5, 2.6), tokens=2, ended=2.6)        # TTFT 1.5 s
    slow_decode = call(chunks=(1.2, 1.9), tokens=2, ended=1.9)       # TPOT 0.7 s
    one_token = call(chunks=(1.2,), tokens=1, ended=1.2)              # no TPOT to miss
    assert [metrics.meets_slo(r, SLO) for r in (fast, slow_first, slow_decode, one_token)] == [True, False, False,
                                                                                              True]
    assert metrics.slo_attainment([fast, one_token, call(code="INTERNAL"), call(code=None)], SLO) == 0.5
    assert metrics.goodput({0.5: 1.0, 1.0: 0.95, 2.0: 0.5, 4.0: 0.2}, SLO) == 1.0
    assert metrics.goodput({0.5: 0.95, 1.0: 0.8, 2.0: 0.9}, SLO) == 2.0  # the highest rate that passes
    assert metrics.goodput({1.0: 0.89}, SLO) == 0.0


def test_stage_breakdown_splits_ttft_and_the_second_token():
    timings = {"tokenize_s": 0.01, "router_queue_s": 0.02, "prefill_queue_s": 0.07, "prefill_compute_s": 0.3,
               "first_token_s": 0.4, "kv_handoff_s": 0.05, "decode_queue_s": 0.01, "first_decode_step_s": 0.02}
    breakdown = metrics.stage_breakdown([call(timings=timings), call(1, code="CANCELLED", timings=timings)])
    assert breakdown["requests"] == 1
    ttft = breakdown["ttft_split"]
    assert ttft["client_transport_s"]["p50"] == pytest.approx(0.5 - 0.4)
    second = breakdown["second_token_split"]
    assert second["kv_handoff_s"]["mean"] == 0.05 and second["client_second_token_gap_s"]["p50"] == pytest.approx(0.1)
    assert metrics.stage_breakdown([call()]) is None


def test_burst_effect_compares_the_requests_decoding_at_the_burst_with_themselves_without_it():
    def runs(slowdown: float) -> list[metrics.CallRecord]:
        return [call(0, 0.0, (0.1, 0.2 + slowdown), 2, 0.2 + slowdown),  # decoding at 0.15
                call(1, 0.0, (0.1, 0.12), 2, 0.12),                      # done before
                call(2, 0.2, (0.3, 0.4), 2, 0.4),                        # first token after
                call(3, 0.0, (0.11, 0.5 + slowdown), 2, 0.5 + slowdown)]  # decoding at 0.15
    with_burst = runs(0.1) + [call(9, 0.15, (0.3, 0.35), 2, 0.35)]
    effect = metrics.burst_effect(with_burst, runs(0.0), at_s=0.15)
    assert effect["decoding_requests"] == [0, 3]
    assert effect["tpot_without_burst_s"]["p50"] == pytest.approx((0.1 + 0.39) / 2)
    assert effect["p99_ratio"] == pytest.approx(quantile_ratio([0.2, 0.49], [0.1, 0.39]))
    series = metrics.itl_series(with_burst, set(effect["decoding_requests"]))
    assert series == [[0.3, 0.2], [0.6, 0.49]]


def quantile_ratio(with_values, without_values, q=0.99) -> float:
    return quantile(with_values, q) / quantile(without_values, q)


# ---- the workloads ----------------------------------------------------------------------------------

def test_poisson_arrivals_are_seeded_and_at_the_rate():
    times = workload.poisson_arrival_times(4.0, "s", duration_s=500)
    assert times == workload.poisson_arrival_times(4.0, "s", duration_s=500)
    assert times != workload.poisson_arrival_times(4.0, "t", duration_s=500)
    assert 1800 < len(times) < 2200 and times == sorted(times) and times[-1] < 500
    assert len(workload.poisson_arrival_times(1.0, 0, count=7)) == 7
    with pytest.raises(ValueError):
        workload.poisson_arrival_times(1.0, 0)
    added = workload.burst(3.0, 4, prompt_tokens=100, max_tokens=5)
    assert {a.at_s for a in added} == {3.0} and {len(a.spec.prompt_token_ids) for a in added} == {100}
    assert len({a.spec.prompt_token_ids for a in added}) == 4


def test_every_mode_gets_the_same_workload_and_the_floor_a_capped_part_of_it(tmp_path):
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": ms, "input_length": 40, "output_length": 6, "hash_ids": [1]})
                             + "\n" for ms in (0, 500, 1000)))
    args = parse_args(["--rates", "1,2", "--requests-per-rate", "5", "--floor-rates", "1",
                       "--floor-requests-per-rate", "2", "--trace", str(trace), "--rate-scale", "1",
                       "--length-scale", "1", "--burst-at-s", "0.7", "--burst-requests", "2"])
    stack = mode_workloads(MODES["disaggregated"], args)
    assert [w.name for w in stack] == ["poisson-1", "poisson-2", "trace+burst", "trace"]
    assert stack == mode_workloads(MODES["colocated"], args)
    with_burst, without = stack[2].schedule, stack[3].schedule

    def shape(schedule):  # each replay's prompts are its own (salted), their times and lengths the same
        return [(a.at_s, a.spec.name, len(a.spec.prompt_token_ids), a.spec.max_tokens) for a in schedule]

    assert shape(with_burst[:len(without)]) == shape(without)
    assert [a.spec.name for a in with_burst[len(without):]] == ["burst"] * 2
    floor = mode_workloads(MODES["transformers"], args)
    assert [(w.name, w.schedule) for w in floor] == [("poisson-1", stack[0].schedule[:2])]
    curve = tmp_path / "curve.csv"
    curve.write_text("t_seconds,requests_per_second\n0,2\n1,6\n2,0\n")
    with_curve = mode_workloads(MODES["disaggregated"], parse_args(["--rates", "", "--trace", "", "--curve",
                                                                    str(curve), "--curve-seconds", "5"]))
    assert [w.name for w in with_curve] == ["curve"]
    times = [a.at_s for a in with_curve[0].schedule]
    assert len(times) == 8 and sum(t < 1 for t in times) == 2  # 2/s for a second, then 6/s for one
    assert MpsSplit.parse("100,30").service_env() == {"decode": {},
                                                      "prefill": {"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "30"}}


# ---- topologies and the balance over workers ------------------------------------------------------------

def test_topologies_lay_out_the_disaggregated_mode_and_refuse_the_others():
    args = parse_args(["--topologies", "1x1,2x1,1x2", "--trace", ""])
    laid_out = modes_to_run(args)
    assert [m.name for m in laid_out] == ["disaggregated-1P1D", "disaggregated-2P1D", "disaggregated-1P2D"]
    assert [m.topology for m in laid_out] == [Topology(1, 1), Topology(2, 1), Topology(1, 2)]
    assert all(m.services == MODES["disaggregated"].services for m in laid_out)
    assert [m.name for m in modes_to_run(parse_args(["--prefill", "2", "--trace", ""]))] == ["disaggregated-2P1D"]
    assert [m.name for m in modes_to_run(parse_args(["--trace", ""]))] == ["disaggregated", "colocated", "transformers"]
    for refused in (["--topologies", "2x1", "--modes", "disaggregated,colocated"], ["--prefill", "2", "--modes", "mps"],
                    ["--topologies", "2y1"], ["--topologies", "0x1"], ["--topologies", "2x1", "--decode", "2"],
                    ["--topologies", "1x1,1x1"], ["--devices", "prefill=0"], ["--gpu", "--devices", "prefill=a"]):
        with pytest.raises(SystemExit):
            parse_args(refused + ["--trace", ""])


def test_gpu_topologies_all_plan_on_one_gpu_with_the_decodes_mapping_prefill_0():
    """What `--gpu --topologies 1x1,2x1,1x2` asks of the stack on one GPU, planned here without one."""
    args = parse_args(["--gpu", "--topologies", "1x1,2x1,1x2", "--trace", ""])
    for mode in modes_to_run(args):
        settings = stack_settings(args, mode)
        env = {**settings, env_name("stack", "prefill"): str(mode.topology.prefill),
               env_name("stack", "decode"): str(mode.topology.decode)}
        plans = plan_workers(load_config(None, env), allowed_cores=list(range(16)), gpu_count=1)
        assert {plan.device for plan in plans} == {"cuda:0"}, mode.name
        assert len(plans) == mode.topology.prefill + mode.topology.decode
        assert settings["PDSERVE_DECODE_WEIGHTS_FROM"] == "prefill-0"
    assert decodes_share_weights("prefill=0,1 decode=0") and not decodes_share_weights("prefill=0 decode=1")
    assert gpu_stack_settings("m", ("router", "prefill", "decode"), shared_weights=False)[
        "PDSERVE_DECODE_WEIGHTS_FROM"] == ""


def router_page(routed: dict[tuple[str, str], tuple[int, int]]) -> str:
    """A Prometheus page with the router's two counters, as shared/runtime/metrics.py declares them."""
    registry = CollectorRegistry()
    requests = Counter(worker_balance.REQUESTS, "", ["worker_id", "role"], registry=registry)
    tokens = Counter(worker_balance.PROMPT_TOKENS, "", ["worker_id", "role"], registry=registry)
    for labels, (count, prompt_tokens) in routed.items():
        requests.labels(*labels).inc(count)
        tokens.labels(*labels).inc(prompt_tokens)
    return generate_latest(registry).decode()


def test_worker_balance_is_the_counters_difference_with_idle_workers_at_zero():
    before = worker_balance.parse(router_page({("prefill-0", "prefill"): (2, 64), ("decode-0", "decode"): (2, 64)}))
    after = worker_balance.parse(router_page({("prefill-0", "prefill"): (5, 160), ("prefill-1", "prefill"): (1, 32),
                                              ("decode-0", "decode"): (6, 192)}))
    roles = {"prefill-0": "prefill", "prefill-1": "prefill", "decode-0": "decode", "decode-1": "decode"}
    balance = worker_balance.balance(worker_balance.routed_between(before, after, roles))
    assert balance["workers"] == {"decode-0": {"role": "decode", "requests": 4, "prompt_tokens": 128},
                                  "decode-1": {"role": "decode", "requests": 0, "prompt_tokens": 0},
                                  "prefill-0": {"role": "prefill", "requests": 3, "prompt_tokens": 96},
                                  "prefill-1": {"role": "prefill", "requests": 1, "prompt_tokens": 32}}
    assert balance["prefill_prompt_tokens_max_over_mean"] == pytest.approx(96 / 64)
    assert balance["decode_requests_max_over_mean"] == 2.0  # one of two decodes took everything
    total = worker_balance.combined([balance, balance])
    assert total["workers"]["prefill-0"]["prompt_tokens"] == 192 and total["decode_requests_max_over_mean"] == 2.0
    assert worker_balance.max_over_mean([0, 0]) is None
    unread = worker_balance.RouterCounters(f"http://127.0.0.1:{free_port()}/metrics", roles)
    assert "error" in unread.since(unread.read())


# ---- the open-loop client, against a fake server ------------------------------------------------------

HANG, REFUSE = 99, 98  # max_tokens that make the fake server hang past the drain, or refuse


class FakeGeneration(generation_pb2_grpc.GenerationServicer):
    async def Generate(self, request, context):
        if request.max_tokens == HANG:
            await asyncio.sleep(60)
        if request.max_tokens == REFUSE:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "full")
        for token in range(request.max_tokens):
            await asyncio.sleep(0.3)
            last = token == request.max_tokens - 1
            yield generation_pb2.GenerateResponse(token_ids=[token], timings=generation_pb2.StageTimings(
                first_token_s=0.25) if last else None)


async def replay_against_fake(schedule):
    server = grpc.aio.server()
    generation_pb2_grpc.add_GenerationServicer_to_server(FakeGeneration(), server)
    address = f"127.0.0.1:{free_port()}"
    server.add_insecure_port(address)
    await server.start()
    try:
        return await replay(address, schedule, label="fake", timeout_s=30, drain_timeout_s=1.5, channels=2)
    finally:
        await server.stop(0)


def test_open_loop_starts_on_time_and_counts_errors_and_lost_requests():
    def spec(max_tokens: int) -> workload.RequestSpec:
        return workload.RequestSpec("fixed", (1, 2, 3), max_tokens, 0)

    schedule = [workload.Arrival(0.05 * i, spec(3)) for i in range(6)]
    schedule += [workload.Arrival(0.1, spec(HANG)), workload.Arrival(0.0, spec(REFUSE))]
    records = asyncio.run(replay_against_fake(schedule))
    assert [r.index for r in records] == list(range(8))
    assert all(abs(r.started_s - r.scheduled_s) < 0.1 for r in records), [(r.scheduled_s, r.started_s) for r in records]
    assert metrics.counts(records) == {"sent": 8, "ok": 6, "errors": {"RESOURCE_EXHAUSTED": 1}, "answered": 7,
                                       "lost": 1}
    done = records[0]
    assert done.tokens == 3 and done.timings["first_token_s"] == 0.25
    assert 0.25 < done.ttft_s < 0.6 and 0.25 < done.tpot_s < 0.6


# ---- one real run on the CPU ------------------------------------------------------------------------

@pytest.mark.e2e
@pytest.mark.slow
def test_every_mode_end_to_end_with_stage_timings_and_plots(checkpoint, tmp_path):
    modes = ["disaggregated", "colocated", "transformers"]
    missing = {mode: MODES[mode].missing_modules() for mode in modes}
    assert not any(missing.values()), f"serving modes whose service is not in this checkout: {missing}"
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": ms, "input_length": 24, "output_length": 12, "hash_ids": [1]})
                             + "\n" for ms in (0, 300, 600, 900)))
    out = tmp_path / "out"
    command = [sys.executable, "-m", "loadtest.stack.bench_serving", "--modes", ",".join(modes), "--out", str(out),
               "--rates", "1,2", "--requests-per-rate", "3", "--prompt-tokens", "16", "--output-tokens", "4",
               "--floor-requests-per-rate", "2", "--trace", str(trace), "--rate-scale", "1", "--length-scale", "1",
               "--replay-seconds", "2", "--burst-at-s", "0.5", "--burst-requests", "1", "--burst-prompt-tokens", "48",
               "--burst-output-tokens", "2", "--slo-ttft-s", "30", "--slo-tpot-s", "30", "--drain-timeout-s", "60"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads((out / "serving.json").read_text())
    assert json.loads(done.stdout) == report
    assert set(report) >= {"settings", "slo", "definitions", "modes", "comparison", "problems", "wall_s"}
    assert report["problems"] == [] and list(report["modes"]) == modes
    for name, mode in report["modes"].items():
        assert "error" not in mode, mode.get("error")
        rates = {"1": 1.0} if name == "transformers" else {"1": 1.0, "2": 1.0}  # the floor: the lowest rate
        assert mode["attainment_by_rate"] == rates and mode["goodput_rps"] == max(map(float, rates))
        assert report["comparison"][name]["lost"] == 0
        for load in mode["workloads"].values():
            assert_workload_fields(load)
            counts = load["counts"]
            assert counts["sent"] == counts["answered"] == counts["ok"] == len(load["requests"]) and counts["lost"] == 0
    assert set(report["modes"]["transformers"]["workloads"]) == {"poisson-1"}
    assert all(r["timings"] is None for w in report["modes"]["transformers"]["workloads"].values()
               for r in w["requests"])
    for name in modes:
        if name != "transformers":
            mode = report["modes"][name]
            assert set(mode["workloads"]) == {"poisson-1", "poisson-2", "trace+burst", "trace"}
            assert set(mode["burst"]) >= {"decoding_requests", "tpot_with_burst_s", "tpot_without_burst_s", "p99_ratio",
                                          "itl_series"}
    for load in report["modes"]["disaggregated"]["workloads"].values():
        assert load["stages"]["requests"] == len(load["requests"])
        for row in load["requests"]:
            assert_stages_fit(row)
    pytest.importorskip("matplotlib", reason="matplotlib is a dev dependency")
    from loadtest.stack.plot_serving import plot

    pictures = plot(out / "serving.json")
    assert {p.name for p in pictures} >= {"goodput.png", "tpot-over-time.png", "cdf-poisson-1.png", "cdf-trace.png"}
    assert all(p.stat().st_size > 1000 for p in pictures)


def assert_workload_fields(load: dict) -> None:
    assert set(load) >= {"offered_rps", "schedule_s", "counts", "ttft_s", "tpot_s", "itl_s", "e2e_s",
                         "output_tokens_per_s", "requests_per_s", "slo_attainment", "max_start_lag_s", "stages",
                         "cdf", "requests"}
    for key in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        assert set(load[key]) == {"p50", "p90", "p99", "mean", "count"}
    assert load["output_tokens_per_s"] > 0 and load["requests_per_s"] > 0


def assert_stages_fit(row: dict) -> None:
    """Each part is non-negative, the server's first-token stages sum to its TTFT, and that fits inside
    the client's."""
    timings = row["timings"]
    assert timings is not None and all(value >= 0 for value in timings.values()), row
    server_parts = sum(timings[stage] for stage in metrics.TTFT_STAGES)
    assert server_parts == pytest.approx(timings["first_token_s"], abs=1e-6), row
    assert timings["first_token_s"] <= row["ttft_s"] + 1e-3, row
    if row["tokens"] > 1:
        assert all(timings[stage] > 0 for stage in ("kv_handoff_s", "first_decode_step_s")), row


@pytest.mark.e2e
@pytest.mark.slow
def test_two_prefills_one_decode_end_to_end_with_a_balance_that_adds_up(checkpoint, tmp_path):
    out = tmp_path / "out"
    command = [sys.executable, "-m", "loadtest.stack.bench_serving", "--topologies", "2x1", "--out", str(out),
               "--rates", "4", "--requests-per-rate", "6", "--prompt-tokens", "40", "--output-tokens", "3",
               "--trace", "", "--slo-ttft-s", "30", "--slo-tpot-s", "30", "--drain-timeout-s", "60"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads((out / "serving.json").read_text())
    assert report["problems"] == [] and list(report["modes"]) == ["disaggregated-2P1D"]
    assert report["settings"]["topologies"] == ["2P1D"]
    mode = report["modes"]["disaggregated-2P1D"]
    assert mode["topology"] == "2P1D" and report["comparison"]["disaggregated-2P1D"]["topology"] == "2P1D"
    load = mode["workloads"]["poisson-4"]
    assert load["counts"] == {"sent": 6, "ok": 6, "errors": {}, "answered": 6, "lost": 0}
    workers = load["load_balance"]["workers"]
    assert set(workers) == {"prefill-0", "prefill-1", "decode-0"}

    def total(role: str, key: str) -> int:
        return sum(w[key] for w in workers.values() if w["role"] == role)

    # Every request sent went through one prefill and one decode, and only those (not the warm-up).
    assert total("prefill", "requests") == total("decode", "requests") == 6
    sent_tokens = sum(row["prompt_tokens"] for row in load["requests"])
    assert total("decode", "prompt_tokens") == sent_tokens
    assert 0 < total("prefill", "prompt_tokens") <= sent_tokens  # a cached prefix is not computed again
    assert 1.0 <= load["load_balance"]["prefill_prompt_tokens_max_over_mean"] <= 2.0
    assert load["load_balance"]["decode_requests_max_over_mean"] == 1.0
    assert mode["load_balance"]["workers"] == workers  # one workload: the mode's total is that workload's
