"""The FP8 benchmark's closing comparison (loadtest/engine/bench_fp8_weights.py), on constructed rows:
each FP8 step against bf16 weights with bf16 pages, whatever pages the FP8 row had."""

import pytest

from loadtest.engine.bench_fp8_weights import fp8_against_bf16


def rows(step_ms: dict[tuple[str, int], float]) -> list[dict]:
    return [{"kv_dtype": kv, "batch": batch, "step_ms_p50": ms, "tokens_per_s": batch / (ms / 1e3)}
            for (kv, batch), ms in step_ms.items()]


def test_every_fp8_row_is_compared_with_bf16_weights_and_bf16_pages():
    bf16 = {"decode": rows({("bfloat16", 1): 4.0, ("bfloat16", 64): 8.0, ("int8", 1): 3.9, ("int8", 64): 6.0}),
            "prefill": {"ms_p50": 200.0}}
    fp8 = {"decode": rows({("bfloat16", 1): 3.0, ("bfloat16", 64): 6.4, ("int8", 1): 2.9, ("int8", 64): 4.0}),
           "prefill": {"ms_p50": 130.0}}
    comparison = fp8_against_bf16(fp8, bf16, ["bfloat16", "int8"], [1, 64])
    assert comparison == pytest.approx({
        "batch_1_step": 0.75, "batch_64_step": 0.8, "largest_batch_tokens_per_s": 1.25,
        "batch_1_step_int8_pages": 2.9 / 4.0, "batch_64_step_int8_pages": 0.5,
        "largest_batch_tokens_per_s_int8_pages": 2.0, "prefill": 0.65})


def test_without_bf16_pages_the_first_kv_dtype_is_the_baseline():
    bf16 = {"decode": rows({("int8", 1): 4.0})}
    fp8 = {"decode": rows({("int8", 1): 3.0})}
    assert fp8_against_bf16(fp8, bf16, ["int8"], [1]) == pytest.approx(
        {"batch_1_step": 0.75, "largest_batch_tokens_per_s": 4.0 / 3.0})
