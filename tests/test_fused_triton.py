"""The fused Triton kernels against the PyTorch expressions of shared/model/llama.py they replace.

Without CUDA the kernels run in Triton's CPU interpreter (fp32, small shapes); with CUDA the same
cases run compiled on the GPU, plus bf16 cases at Llama-3.1-8B size.
"""

import importlib.util
import os
import sys

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    # Must be set before triton is imported: @triton.jit picks the interpreter at decoration time.
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from shared.kernels import fused_triton, kv_quant
from shared.kernels.fp8_quant_triton import FP8, quantize_rows
from tests.triton_cast import cast_like_a_triton_store
from shared.model.elementwise import apply_rope
from shared.kernels.fused_triton import (
    add_rms_norm,
    add_rms_norm_fp8,
    rms_norm,
    rms_norm_fp8,
    rope_in_place,
    rope_rows_per_program,
    rope_write_kv,
    silu_and_mul,
    silu_and_mul_fp8,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
COMPILED_CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
EPS = 1e-5
PAGE_SIZE = 16
FP32_TOL = {"atol": 1e-5, "rtol": 1e-5}
BF16_TOL = {"atol": 2e-2, "rtol": 2e-2}


# --- references, as in PagedLlama (shared/model/llama.py) ---------------------------------------

def ref_rms_norm(x, weight, eps):
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def ref_rope(x, positions, cos_table, sin_table):
    cos, sin = cos_table[positions][:, None, :], sin_table[positions][:, None, :]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def ref_qkv_write(qkv, positions, cos, sin, k_cache, v_cache, pages, offsets, num_heads, num_kv_heads, head_dim):
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = ref_rope(q.view(-1, num_heads, head_dim), positions, cos, sin)
    k = ref_rope(k.view(-1, num_kv_heads, head_dim), positions, cos, sin)
    k_cache[pages.long(), offsets.long()] = k
    v_cache[pages.long(), offsets.long()] = v.view(-1, num_kv_heads, head_dim)
    return q


def ref_qkv_write_quantized(qkv, positions, cos, sin, k_cache, v_cache, k_scale, v_scale, pages, offsets,
                            num_heads, num_kv_heads, head_dim):
    """The same, quantized by shared/kernels/kv_quant.py (its rounded values cast as the kernel casts them)."""
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = ref_rope(q.view(-1, num_heads, head_dim), positions, cos, sin)
    k = ref_rope(k.view(-1, num_kv_heads, head_dim), positions, cos, sin)
    slots = pages.long(), offsets.long()
    for cache, scales, x in ((k_cache, k_scale, k), (v_cache, v_scale, v.view(-1, num_kv_heads, head_dim))):
        y, row_scales = kv_quant.scaled_rows(x, cache.dtype)
        cache[slots] = cast_like_a_triton_store(y, cache.dtype)
        scales[slots] = row_scales
    return q, k


def ref_silu_and_mul(gate_up):
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# --- cases ---------------------------------------------------------------------------------------

def rope_tables(head_dim, max_positions, dtype, device, scaling=0.9):
    """cos/sin as PagedLlama builds them: fp32 angles, both halves equal, scaled, cast to dtype."""
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)
    return (angles.cos() * scaling).to(device, dtype), (angles.sin() * scaling).to(device, dtype)


def rope_case(rows, num_heads, num_kv_heads, head_dim, dtype, device, index_dtype=torch.int64, seed=0):
    """qkv rows with random positions, each row in its own page (shuffled) at an offset >= 1.
    The caches are strided views into a NaN pool that also holds a padding head, so any write
    outside the addressed slots shows up."""
    gen = torch.Generator().manual_seed(seed)
    max_positions = 4096
    num_pages = rows + 4
    width = (num_heads + 2 * num_kv_heads) * head_dim
    qkv = torch.randn(rows, width, generator=gen).to(device, dtype)
    positions = torch.randint(0, max_positions, (rows,), generator=gen)
    pages = torch.randperm(num_pages, generator=gen)[:rows]
    offsets = torch.randint(1, PAGE_SIZE, (rows,), generator=gen)
    pool = torch.full((2, num_pages, PAGE_SIZE, num_kv_heads + 1, head_dim), float("nan"), dtype=dtype, device=device)
    cos, sin = rope_tables(head_dim, max_positions, dtype, device)
    return {"qkv": qkv, "cos": cos, "sin": sin, "positions": positions.to(device), "pool": pool,
            "pages": pages.to(device, index_dtype), "offsets": offsets.to(device, index_dtype)}


def cache_views(pool):
    return pool[0, :, :, 1:], pool[1, :, :, :-1]


def check_rope(rows, num_heads, num_kv_heads, head_dim, dtype, device, tol, index_dtype=torch.int64):
    case = rope_case(rows, num_heads, num_kv_heads, head_dim, dtype, device, index_dtype)
    args = (case["cos"], case["sin"], case["positions"])
    slots = (case["pages"], case["offsets"], num_heads, num_kv_heads, head_dim)
    pool, ref_pool = case["pool"], case["pool"].clone()

    q = rope_write_kv(case["qkv"], *args, *cache_views(pool), *slots)
    ref_q = ref_qkv_write(case["qkv"], case["positions"], case["cos"], case["sin"], *cache_views(ref_pool), *slots)

    assert q.shape == (rows, num_heads, head_dim) and q.dtype == dtype
    torch.testing.assert_close(q, ref_q, **tol)
    written = torch.zeros(pool.shape, dtype=torch.bool, device=device)
    for k_or_v in cache_views(written):
        k_or_v[case["pages"].long(), case["offsets"].long()] = True
    assert pool[~written].isnan().all(), "rope_write_kv wrote outside the addressed slots"
    torch.testing.assert_close(pool[written], ref_pool[written], **tol)


# --- CPU interpreter (or compiled, when CUDA is present), fp32 -----------------------------------

@pytest.mark.parametrize("rows", [1, 3, 5])
@pytest.mark.parametrize("hidden", [64, 128, 96])
def test_rms_norm(rows, hidden):
    gen = torch.Generator().manual_seed(rows * hidden)
    x = (torch.randn(rows, hidden, generator=gen) * 3).to(DEVICE)
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(DEVICE)
    out = rms_norm(x, weight, EPS)
    assert out.shape == x.shape and out.dtype == x.dtype
    torch.testing.assert_close(out, ref_rms_norm(x, weight, EPS), **FP32_TOL)


def test_rms_norm_strided_rows():
    # A row stride wider than the hidden size, as for a slice of a larger activation buffer.
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(3, 200, generator=gen).to(DEVICE)[:, :128]
    weight = torch.randn(128, generator=gen).to(DEVICE)
    torch.testing.assert_close(rms_norm(x, weight, EPS), ref_rms_norm(x, weight, EPS), **FP32_TOL)


@pytest.mark.parametrize("rows", [1, 3, 5])
@pytest.mark.parametrize("hidden", [64, 128])
def test_add_rms_norm(rows, hidden):
    gen = torch.Generator().manual_seed(rows + hidden)
    x = torch.randn(rows, hidden, generator=gen).to(DEVICE)
    residual = (torch.randn(rows, hidden, generator=gen) * 4).to(DEVICE)
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(DEVICE)
    x_before, residual_before = x.clone(), residual.clone()
    normed, summed = add_rms_norm(x, residual, weight, EPS)
    ref_summed = x + residual
    torch.testing.assert_close(summed, ref_summed, **FP32_TOL)
    torch.testing.assert_close(normed, ref_rms_norm(ref_summed, weight, EPS), **FP32_TOL)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before), "inputs must not change"


@pytest.mark.parametrize("rows", [1, 3, 5])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (8, 2), (8, 8), (32, 8)],
                         ids=["kvh2-mha", "kvh2-gqa4", "kvh8-mha", "kvh8-gqa4"])
def test_rope_write_kv(rows, head_dim, num_heads, num_kv_heads):
    check_rope(rows, num_heads, num_kv_heads, head_dim, torch.float32, DEVICE, FP32_TOL)


def check_rope_in_place(rows: int, dtype: torch.dtype, device: str) -> None:
    """MLA's two RoPE'd slices where they lie: each head's last 64 of a [rows, 4, 192] projection,
    and the single key head at columns 512-575 of a [rows, 576] one; the rest of each untouched."""
    cos, sin = rope_tables(64, 4096, dtype, device)
    positions = torch.randint(0, 4096, (rows,), generator=torch.Generator().manual_seed(1)).to(device)
    q = torch.randn(rows, 4, 192, generator=torch.Generator().manual_seed(2)).to(device, dtype)
    latent = torch.randn(rows, 576, generator=torch.Generator().manual_seed(3)).to(device, dtype)
    for full, part in ((q, lambda t: t[..., 128:]), (latent, lambda t: t[:, None, 512:])):
        expected = full.clone()
        part(expected).copy_(apply_rope(part(full), cos, sin, positions))
        assert rope_in_place(part(full), cos, sin, positions).data_ptr() == part(full).data_ptr()
        assert torch.equal(full, expected)


def test_rope_in_place():
    check_rope_in_place(5, torch.float32, DEVICE)


def test_rope_in_place_refuses_what_it_cannot_rotate():
    cos, sin = rope_tables(64, 16, torch.float32, DEVICE)
    with pytest.raises(ValueError, match="contiguous last dim"):
        rope_in_place(torch.zeros(2, 1, 128)[..., ::2], cos, sin, torch.zeros(2, dtype=torch.long))
    with pytest.raises(ValueError, match="head dim 32"):
        rope_in_place(torch.zeros(2, 1, 32), cos, sin, torch.zeros(2, dtype=torch.long))


def test_rope_write_kv_over_a_prefill_chunk():
    """A prefill chunk's rows go ROWS a program, the last block partly past the end."""
    rows = 530
    assert rope_rows_per_program(rows) > 1 and rows % rope_rows_per_program(rows)
    check_rope(rows, 4, 2, 64, torch.float32, DEVICE, FP32_TOL)


KV_FORMATS = [torch.int8, torch.float8_e4m3fn]


def check_rope_quantized(rows, num_heads, num_kv_heads, head_dim, dtype, kv_dtype, device, exact):
    """Quantized caches: the pages, scales, q and the k_out copy of the rotated k. exact: the
    interpreter's fp32 arithmetic is PyTorch's; compiled, fp32 may differ in its last bit, so a
    value may land one step of its row's grid away (bf16 q and k stay bit-exact, as unquantized)."""
    case = rope_case(rows, num_heads, num_kv_heads, head_dim, dtype, device)
    num_pages = case["pool"].shape[1]
    caches = torch.zeros((2, num_pages, PAGE_SIZE, num_kv_heads, head_dim), dtype=kv_dtype, device=device)
    scales = torch.full((2, num_pages, PAGE_SIZE, num_kv_heads), float("nan"), device=device)
    ref_caches, ref_scales = caches.clone(), scales.clone()
    args = (case["cos"], case["sin"], case["positions"])
    slots = (case["pages"], case["offsets"], num_heads, num_kv_heads, head_dim)
    k_out = torch.empty((rows, num_kv_heads, head_dim), dtype=dtype, device=device)

    q = rope_write_kv(case["qkv"], *args, caches[0], caches[1], *slots, scales[0], scales[1], k_out)
    ref_q, ref_k = ref_qkv_write_quantized(case["qkv"], case["positions"], case["cos"], case["sin"],
                                           ref_caches[0], ref_caches[1], ref_scales[0], ref_scales[1],
                                           case["pages"], case["offsets"], num_heads, num_kv_heads, head_dim)
    tol = FP32_TOL if dtype == torch.float32 and not exact else {"atol": 0, "rtol": 0}
    torch.testing.assert_close(q, ref_q, **tol)
    torch.testing.assert_close(k_out, ref_k, **tol)
    written = ~ref_scales.isnan()
    assert torch.equal(scales.isnan(), ~written), "rope_write_kv wrote scales outside the addressed slots"
    assert torch.all(caches[~written].float() == 0), "rope_write_kv wrote values outside the addressed slots"
    if exact:
        assert torch.equal(scales[written], ref_scales[written])
        assert torch.equal(caches.view(torch.uint8), ref_caches.view(torch.uint8))
        return
    torch.testing.assert_close(scales[written], ref_scales[written], rtol=1e-6, atol=0)
    got = kv_quant.dequantize(caches[written], scales[written], torch.float32)
    expected = kv_quant.dequantize(ref_caches[written], ref_scales[written], torch.float32)
    step = ref_scales[written][..., None] * (1.0 if kv_dtype == torch.int8 else 32.0)  # e4m3: 448 / 16 at the top
    assert torch.all((got - expected).abs() <= step * 1.001)


@pytest.mark.parametrize("kv_dtype", KV_FORMATS, ids=str)
@pytest.mark.parametrize("rows,num_heads,num_kv_heads,head_dim",
                         [(1, 2, 2, 64), (5, 8, 2, 64), (3, 8, 2, 128), (530, 2, 1, 64)])
def test_rope_write_kv_quantized(kv_dtype, rows, num_heads, num_kv_heads, head_dim):
    check_rope_quantized(rows, num_heads, num_kv_heads, head_dim, torch.float32, kv_dtype, DEVICE,
                         exact=not COMPILED_CUDA)


def test_rope_write_kv_refuses_scales_that_do_not_fit():
    case = rope_case(3, 4, 2, 64, torch.float32, DEVICE)
    caches = torch.zeros((2, case["pool"].shape[1], PAGE_SIZE, 2, 64), dtype=torch.int8, device=DEVICE)
    scales = torch.zeros((2, case["pool"].shape[1], PAGE_SIZE, 2), device=DEVICE)
    args = (case["qkv"], case["cos"], case["sin"], case["positions"])
    slots = (case["pages"], case["offsets"], 4, 2, 64)
    with pytest.raises(ValueError, match="needs k_scale"):
        rope_write_kv(*args, caches[0], caches[1], *slots)
    with pytest.raises(ValueError, match="needs v_scale"):
        rope_write_kv(*args, caches[0], caches[1], *slots, scales[0], scales[1, :, :, :1])
    with pytest.raises(ValueError, match="unquantized"):
        rope_write_kv(*args, *cache_views(case["pool"]), *slots, scales[0], scales[1])


def test_rope_write_kv_int32_slots():
    check_rope(5, 8, 2, 64, torch.float32, DEVICE, FP32_TOL, index_dtype=torch.int32)


@pytest.mark.parametrize("rows", [1, 3, 5])
@pytest.mark.parametrize("inter", [64, 1500])  # 1500: two blocks, the second partial
def test_silu_and_mul(rows, inter):
    gen = torch.Generator().manual_seed(rows + inter)
    gate_up = (torch.randn(rows, 2 * inter, generator=gen) * 3).to(DEVICE)
    out = silu_and_mul(gate_up)
    assert out.shape == (rows, inter) and out.dtype == gate_up.dtype
    torch.testing.assert_close(out, ref_silu_and_mul(gate_up), **FP32_TOL)


def assert_quantized_alike(fused, unfused, reference):
    """A kernel's FP8 output (values, scale) equal to quantize_rows of its unquantized twin's output,
    and within a step of e4m3 of the float reference quantized with that scale (cast as a Triton
    store casts, see tests/triton_cast.py)."""
    (values, scale), (want_values, want_scale) = fused, unfused
    assert values.dtype == FP8 and scale.dtype == torch.float32 and scale.shape == (len(values), 1)
    assert torch.equal(scale, want_scale) and torch.equal(values.view(torch.uint8), want_values.view(torch.uint8))
    # rtol: bf16's rounding of the row's largest value, which the kernel and the reference may round apart
    torch.testing.assert_close(scale, reference.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12 * 448) / 448,
                               rtol=2 ** -7, atol=0)
    got = values.float().cpu()
    want = cast_like_a_triton_store((reference.float() / scale).clamp(-448, 448), FP8).float().cpu()
    assert ((got - want).abs() <= want.abs() * 2 ** -3 + 2 ** -9).all()


@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("hidden", [64, 96])
def test_norms_quantized_as_their_output_would_be(rows, hidden):
    gen = torch.Generator().manual_seed(rows * hidden)
    x = (torch.randn(rows, hidden, generator=gen) * 3).to(DEVICE)
    residual = (torch.randn(rows, hidden, generator=gen) * 4).to(DEVICE)
    x[0, :8] *= 100  # one row with a few large values: a scale that most of it is small against
    weight = (torch.rand(hidden, generator=gen) + 0.5).to(DEVICE)
    assert_quantized_alike(rms_norm_fp8(x, weight, EPS), quantize_rows(rms_norm(x, weight, EPS)),
                           ref_rms_norm(x, weight, EPS))
    quantized, summed = add_rms_norm_fp8(x, residual, weight, EPS)
    normed, want_summed = add_rms_norm(x, residual, weight, EPS)
    assert torch.equal(summed, want_summed)
    assert_quantized_alike(quantized, quantize_rows(normed), ref_rms_norm(x + residual, weight, EPS))


# 4500: the row in one pass, its block partly masked; 20000: past the one-pass width, in blocks
# read twice, the last partial.
@pytest.mark.parametrize("inter", [64, 4500, 20000])
def test_silu_and_mul_quantized_as_its_output_would_be(inter):
    gen = torch.Generator().manual_seed(inter)
    gate_up = (torch.randn(3, 2 * inter, generator=gen) * 3).to(DEVICE)
    gate_up[1] = 0  # a row of zeros: the least scale, zeros, no NaN
    quantized = silu_and_mul_fp8(gate_up)
    assert_quantized_alike(quantized, quantize_rows(silu_and_mul(gate_up)), ref_silu_and_mul(gate_up))
    assert (quantized[0][1].float() == 0).all()


def test_a_quantized_norm_needs_its_weight_in_the_activations_dtype():
    x = torch.randn(2, 64, device=DEVICE)
    with pytest.raises(ValueError, match="weight in x's dtype"):
        rms_norm_fp8(x, torch.ones(64, device=DEVICE, dtype=torch.float16), EPS)


def test_bad_shapes_raise():
    x = torch.randn(3, 64, device=DEVICE)
    with pytest.raises(ValueError):
        rms_norm(x, torch.ones(32, device=DEVICE), EPS)
    with pytest.raises(ValueError):
        silu_and_mul(torch.randn(3, 7, device=DEVICE))
    case = rope_case(3, 4, 2, 64, torch.float32, DEVICE)
    with pytest.raises(ValueError):  # qkv width does not match 4 q + 2x2 kv heads
        rope_write_kv(case["qkv"], case["cos"], case["sin"], case["positions"], *cache_views(case["pool"]),
                      case["pages"], case["offsets"], 4, 1, 64)


def test_imports_without_triton(monkeypatch):
    # The CPU code path imports this module where triton is not installed.
    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.setitem(sys.modules, "triton.language", None)
    monkeypatch.delitem(sys.modules, "shared.kernels.triton_support")  # imported again, without triton
    spec = importlib.util.spec_from_file_location("fused_triton_no_triton", fused_triton.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(ImportError, match="needs triton"):
        module.rms_norm(torch.randn(1, 64), torch.ones(64), EPS)


# --- compiled on CUDA, bf16 at Llama-3.1-8B size -------------------------------------------------

needs_cuda = pytest.mark.skipif(not COMPILED_CUDA, reason="needs CUDA with compiled (not interpreted) Triton")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("rows", [1, 64, 257])
def test_norms_bf16_cuda(rows):
    x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn_like(x) * 4
    weight = torch.rand(4096, device="cuda", dtype=torch.bfloat16) + 0.5
    torch.testing.assert_close(rms_norm(x, weight, EPS), ref_rms_norm(x, weight, EPS), **BF16_TOL)
    normed, summed = add_rms_norm(x, residual, weight, EPS)
    assert torch.equal(summed, x + residual)
    torch.testing.assert_close(normed, ref_rms_norm(x + residual, weight, EPS), **BF16_TOL)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("rows", [1, 64, 200, 8200])
def test_rope_write_kv_bf16_cuda(rows):
    # Every op is correctly rounded at the points PyTorch rounds, so the match is exact.
    check_rope(rows, 32, 8, 128, torch.bfloat16, "cuda", {"atol": 0, "rtol": 0}, index_dtype=torch.int32)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("rows", [1, 64, 300])
def test_rope_in_place_bf16_cuda(rows):
    check_rope_in_place(rows, torch.bfloat16, "cuda")  # rounded where PyTorch rounds: bitwise equal


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kv_dtype", KV_FORMATS, ids=str)
@pytest.mark.parametrize("rows", [1, 64, 200, 8200])
def test_rope_write_kv_quantized_bf16_cuda(kv_dtype, rows):
    check_rope_quantized(rows, 32, 8, 128, torch.bfloat16, kv_dtype, "cuda", exact=False)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("rows", [1, 64, 257])
def test_silu_and_mul_bf16_cuda(rows):
    gate_up = torch.randn(rows, 2 * 14336, device="cuda", dtype=torch.bfloat16) * 3
    torch.testing.assert_close(silu_and_mul(gate_up), ref_silu_and_mul(gate_up), **BF16_TOL)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("rows", [17, 8192])
def test_quantized_norms_and_silu_bf16_cuda(rows):
    """At the 8B's sizes (a 70B's intermediate too), compiled: bit for bit quantize_rows of the unfused output."""
    x = torch.randn(rows, 4096, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn_like(x) * 4
    weight = torch.rand(4096, device="cuda", dtype=torch.bfloat16) + 0.5
    assert_quantized_alike(rms_norm_fp8(x, weight, EPS), quantize_rows(rms_norm(x, weight, EPS)),
                           ref_rms_norm(x, weight, EPS))
    quantized, summed = add_rms_norm_fp8(x, residual, weight, EPS)
    normed, want_summed = add_rms_norm(x, residual, weight, EPS)
    assert torch.equal(summed, want_summed)
    assert_quantized_alike(quantized, quantize_rows(normed), ref_rms_norm(want_summed, weight, EPS))
    for inter in (14336, 28672):  # the 8B's row in one pass, the 70B's in two
        gate_up = torch.randn(rows, 2 * inter, device="cuda", dtype=torch.bfloat16) * 3
        assert_quantized_alike(silu_and_mul_fp8(gate_up), quantize_rows(silu_and_mul(gate_up)),
                               ref_silu_and_mul(gate_up))


@pytest.mark.gpu
@needs_cuda
def test_cuda_graph_capture():
    # All four functions captured together and replayed on new inputs written in place.
    rows, hidden, heads, kv_heads, dim, inter = 8, 4096, 32, 8, 128, 14336
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    residual = torch.randn_like(x)
    weight = torch.rand(hidden, device="cuda", dtype=torch.bfloat16) + 0.5
    gate_up = torch.randn(rows, 2 * inter, device="cuda", dtype=torch.bfloat16)
    case = rope_case(rows, heads, kv_heads, dim, torch.bfloat16, "cuda", torch.int32)
    k_cache, v_cache = cache_views(case["pool"])

    def step():
        normed, summed = add_rms_norm(x, residual, weight, EPS)
        q = rope_write_kv(case["qkv"], case["cos"], case["sin"], case["positions"], k_cache, v_cache,
                          case["pages"], case["offsets"], heads, kv_heads, dim)
        return rms_norm(summed, weight, EPS), normed, q, silu_and_mul(gate_up)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    x.copy_(torch.randn_like(x))
    case["qkv"].copy_(torch.randn_like(case["qkv"]))
    gate_up.copy_(torch.randn_like(gate_up))
    graph.replay()
    expected = step()
    for got, want in zip(outs, expected):
        assert torch.equal(got, want)
