"""loadtest/engine/bench_prefill.py's own parts on the CPU: its baseline computes what the prefill
computes (so today's row times the same work), and its chunking and kernel kinds."""

from __future__ import annotations

import torch

from loadtest.engine import bench_prefill
from loadtest.lib import kernel_profile
from shared.kv.pool import allocate_local_pool
from shared.model.from_checkpoint import load_paged_llama


def test_the_baseline_prefill_gives_the_prefills_logits_and_pages():
    tiny = load_paged_llama("random:llama-tiny", "float32", "cpu")
    prompt, pages = list(range(3, 60)), [5, 0, 7, 2]
    runs = []
    for prefill in (bench_prefill.todays_prefill, lambda *args: tiny.prefill(*args[1:])):
        pool = allocate_local_pool(tiny.kv_layout(8, bench_prefill.PAGE_SIZE), "cpu")[0]
        runs.append((prefill(tiny, prompt, pool, pages, 20), pool.kv[:, pages]))
    (today, today_kv), (now, now_kv) = runs
    torch.testing.assert_close(today, now, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(today_kv, now_kv, atol=1e-5, rtol=1e-5)


def test_chunks_cover_the_prompt_once():
    assert bench_prefill.chunks_of(100, 32) == [(0, 32), (32, 32), (64, 32), (96, 4)]
    assert bench_prefill.chunks_of(100, 0) == [(0, 100)]


def test_kernel_kinds():
    assert kernel_profile.kernel_kind("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16") == "attention"
    assert kernel_profile.kernel_kind("_merge_kernel") == "attention"
    assert kernel_profile.kernel_kind("nvjet_hsh_256x128_64x4_1x2_h_bz_coopA_NNT") == "matmul"
    assert kernel_profile.kernel_kind("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n") == "matmul"
    assert kernel_profile.kernel_kind("_gemv_kernel") == "matmul"
    assert kernel_profile.kernel_kind("_rope_write_kv_kernel") == "other"
