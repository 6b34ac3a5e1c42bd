"""The long-prompt benchmark end to end on the CPU with the embedded model: two small prompts through
one real stack, in chunks, with int8 pages; its report's fields present and consistent."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest
import torch

from loadtest.lib.generate_client import StreamRecord
from loadtest.lib.model_costs import (
    attention_flops,
    kv_token_bytes,
    linear_flops,
    model_shape,
    prefill_flops,
    weight_bytes_per_step,
)
from loadtest.stack.bench_long_prompt import prompt_report, send_in_turn
from tests.stack import REPO


def test_the_512k_preset_has_the_8b_shape_and_int8_pages_of_67584_bytes_a_token():
    model = model_shape("random:llama-3.1-8b-512k", torch.bfloat16)
    assert model.max_context == 524288 and tuple(model.cos.shape) == (524288, 128)
    assert kv_token_bytes(model, "int8", 16) == 67584
    assert kv_token_bytes(model, "bfloat16", 16) == 131072


def test_the_512k_prompts_bound_is_mostly_causal_attention():
    """The figures of issue 22: 79.4 PFLOP, of which causal attention 72.0 and the linears 7.3."""
    model = model_shape("random:llama-3.1-8b-512k", torch.bfloat16)
    tokens = 524224
    assert prefill_flops(model, tokens) == linear_flops(model, tokens) + attention_flops(model, tokens)
    assert (round(attention_flops(model, tokens) / 1e15, 1), round(linear_flops(model, tokens) / 1e15, 1)) == (72.0, 7.3)


@pytest.mark.e2e
@pytest.mark.slow
def test_chunked_prompts_through_one_stack_report_ttft_beside_their_bound_and_the_decode_beside_its_floor(
        checkpoint, tmp_path):
    out = tmp_path / "long.json"
    command = [sys.executable, "-m", "loadtest.stack.bench_long_prompt", "--device", "cpu", "--tokens", "256,96",
               "--output-tokens", "4", "--chunk-tokens", "128", "--kv-dtype", "int8", "--out", str(out),
               "--start-timeout-s", "180", "--request-timeout-s", "120"]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    report = json.loads(out.read_text())
    assert json.loads(done.stdout) == report
    assert report["kv_dtype"] == "int8" and report["pool_pages"] == 17  # the longest: 260 tokens in pages of 16
    assert report["rates"]["matmul_tflops"] > 0 and report["rates"]["measured"].startswith("cpu")
    assert [(p["tokens"], p["output_tokens"]) for p in report["prompts"]] == [(256, 4), (96, 4)]
    model = model_shape(checkpoint, torch.float32)
    for tokens, prompt in zip((256, 96), report["prompts"]):
        prefill = prompt["prefill"]
        assert prefill["ttft_s"] > 0 and prefill["bound_s"] > 0
        assert prefill["flops"] == prefill_flops(model, tokens)
        assert prefill["ttft_over_bound"] == pytest.approx(prefill["ttft_s"] / prefill["bound_s"])
        assert prefill["linear_bound_s"] + prefill["attention_bound_s"] == pytest.approx(prefill["bound_s"])
        timings = prefill["stage_timings_s"]
        assert 0 < timings["prefill_compute_s"] <= timings["first_token_s"] <= prefill["ttft_s"]
        decode = prompt["decode"]
        assert decode["steps"] == 2 and decode["floor_ms"] > 0 and decode["ms_per_token_p50"] > 0
        assert decode["mean_context"] == tokens + 4 / 2


def test_token_counts_are_a_comma_separated_list():
    from loadtest.stack.bench_long_prompt import parse_args

    assert parse_args(["--device", "cpu", "--tokens", "8192,131072"]).tokens == [8192, 131072]
    with pytest.raises(SystemExit):
        parse_args(["--device", "cpu", "--tokens", "8K"])


def _record(started_s: float, chunk_times_s: list[float]) -> StreamRecord:
    return StreamRecord(started_s=started_s, chunk_times_s=chunk_times_s, token_ids=list(range(len(chunk_times_s))),
                        ended_s=chunk_times_s[-1], code="OK")


def test_the_decode_of_concurrent_requests_is_timed_while_every_one_decodes(checkpoint):
    """Two requests, the second's prefill done while the first decodes: only the gaps after the
    second's first decoded token (at 2.0) and before the first's end (at 2.4) count."""
    model = model_shape(checkpoint, torch.float32)
    first = _record(0.0, [1.0, 1.5, 1.9, 2.1, 2.2, 2.4])
    second = _record(0.0, [1.8, 2.0, 2.2, 2.5, 2.6])
    rates = {"matmul_tflops": 1.0, "copy_bandwidth_gbs": 10.0}
    report = prompt_report([first, second], model, 100, 1000, rates)
    decode = report["decode"]
    assert report["concurrency"] == 2 and report["output_tokens"] == 6
    # first: 2.1->2.2 (its 4th token, context 100 + 4), 2.2->2.4; second: 2.0->2.2 (context 102)
    assert decode["gaps"] == 3 and decode["batch"] == 2
    assert decode["ms_per_token_p50"] == pytest.approx(200.0) and decode["window_s"] == pytest.approx(0.4)
    assert decode["mean_context"] == pytest.approx((104 + 105 + 102) / 3)
    floor_s = (weight_bytes_per_step(model) + 2 * decode["mean_context"] * 1000) / 10e9
    assert decode["floor_ms"] == pytest.approx(floor_s * 1e3)
    prefill = report["prefill"]
    assert prefill["ttft_s"] == [1.0, 1.8] and prefill["last_ttft_s"] == 1.8
    assert prefill["bound_s_all"] == pytest.approx(2 * prefill["bound_s_each"])
    assert prefill["bound_s_each"] == pytest.approx(prefill_flops(model, 100) / 1e12)
    late = _record(0.0, [2.3, 2.5, 2.6])  # its first decoded token after the first request ended
    assert "skipped" in prompt_report([first, late], model, 100, 1000, rates)["decode"]


@pytest.mark.e2e
def test_prompts_sent_at_once_all_come_back_whole(stack):
    """The benchmark's client against the session's stack, one channel for a warm-up and two batches:
    every stream complete, each its own."""
    prompts = [list(range(10, 60)), list(range(70, 130)), list(range(5, 45))]
    batches = asyncio.run(send_in_turn(stack.address, list(range(3, 20)), [prompts, prompts[:1]], 6, 120))
    assert [[record.tokens for record in batch] for batch in batches] == [[6, 6, 6], [6]]
    assert all(record.ok for batch in batches for record in batch)
    assert len({tuple(record.token_ids) for record in batches[0]}) == 3
    assert batches[1][0].token_ids == batches[0][0].token_ids  # the same prompt, greedy
