"""The fused Triton kernels against the PyTorch expressions of shared/model/llama.py they replace.

Without CUDA the kernels run in Triton's CPU interpreter (fp32, small shapes); with CUDA the same
cases run compiled on the GPU, plus bf16 cases at Llama-3.1-8B size. The GEMVs with silu_and_mul or
add_rms_norm as their prologue (shared/model/gemv_triton.py) are checked against these kernels
followed by the plain GEMV or F.linear.
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

from shared.model import fused_triton, gemv_triton
from shared.model.fused_triton import (
    add_rms_norm,
    rms_norm,
    rope_write_kv,
    silu_and_mul,
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


# --- the GEMV with a fused prologue, against the kernel followed by the plain GEMV -----------------

# The multiply-add configs at one row, then tensor-core configs without and with split-K. bf16 only
# through multiply-add: the interpreter's tl.dot multiplies bf16 bit patterns as integers.
MULTIPLY_ADD = [c for c in gemv_triton.CONFIGS if c.kwargs["BLOCK_M"] == 1]
TENSOR_CORE = [c for c in gemv_triton.CONFIGS if c.kwargs["BLOCK_M"] == 16]
PROLOGUE_CASES = ([(c, 1, torch.float32) for c in MULTIPLY_ADD]
                  + [(c, rows, torch.float32) for c in TENSOR_CORE[:1] + TENSOR_CORE[-2:] for rows in (3, 8)]
                  + [(c, 1, torch.bfloat16) for c in MULTIPLY_ADD[:2]])
PROLOGUE_IDS = ["m{BLOCK_M}-n{BLOCK_N}-k{BLOCK_K}-s{SPLIT_K}".format(**c.kwargs) + f"-rows{rows}-{str(dtype)[6:]}"
                for c, rows, dtype in PROLOGUE_CASES]
# One bf16 rounding step of the normalised x, where the rms is summed in another order.
BF16_ULP_TOL = {"atol": 1e-2, "rtol": 2 ** -7}


def norm_gemv_case(rows, hidden, n, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=gen)
    residual = torch.randn(rows, hidden, generator=gen) * 4
    norm_weight = torch.rand(hidden, generator=gen) + 0.5
    weight = torch.randn(n, hidden, generator=gen) / hidden ** 0.5
    return [t.to(device, dtype) for t in (x, residual, norm_weight, weight)]


@pytest.mark.parametrize("config,rows,dtype", PROLOGUE_CASES, ids=PROLOGUE_IDS)
def test_silu_mul_gemv(config, rows, dtype):
    # I = 320: every BLOCK_K leaves a partial block; split 4 leaves splits with nothing to do.
    gen = torch.Generator().manual_seed(rows)
    gate_up = (torch.randn(rows, 2 * 320, generator=gen) * 3).to(DEVICE, dtype)
    weight = (torch.randn(96, 320, generator=gen) / 320 ** 0.5).to(DEVICE, dtype)
    out = gemv_triton.silu_mul_gemv(gate_up, weight, config)
    # The same x blocks, rounded the same way, in the same accumulation order: bit for bit.
    assert torch.equal(out, gemv_triton.gemv(silu_and_mul(gate_up), weight, config))


@pytest.mark.parametrize("config,rows,dtype", PROLOGUE_CASES, ids=PROLOGUE_IDS)
def test_add_rms_norm_gemv(config, rows, dtype):
    x, residual, norm_weight, weight = norm_gemv_case(rows, 256, 96, dtype, DEVICE)
    inputs = [t.clone() for t in (x, residual)]
    out, summed = gemv_triton.add_rms_norm_gemv(x, residual, norm_weight, EPS, weight, config)
    normed, ref_summed = add_rms_norm(x, residual, norm_weight, EPS)
    assert torch.equal(summed, ref_summed)
    tol = FP32_TOL if dtype == torch.float32 else BF16_ULP_TOL
    torch.testing.assert_close(out, gemv_triton.gemv(normed, weight, config), **tol)
    assert all(torch.equal(a, b) for a, b in zip(inputs, (x, residual))), "inputs must not change"


def test_add_rms_norm_gemv_strided_rows():
    # Rows of a wider buffer, as the decode step's activations may be.
    x, residual, norm_weight, weight = norm_gemv_case(3, 384, 96, torch.float32, DEVICE)
    x, residual, norm_weight, weight = x[:, :256], residual[:, 128:], norm_weight[:256], weight[:, :256].contiguous()
    out, summed = gemv_triton.add_rms_norm_gemv(x, residual, norm_weight, EPS, weight, TENSOR_CORE[0])
    normed, ref_summed = add_rms_norm(x, residual, norm_weight, EPS)
    assert torch.equal(summed, ref_summed)
    torch.testing.assert_close(out, F.linear(normed, weight), **FP32_TOL)


def test_prologue_gemv_bad_inputs_raise():
    config = TENSOR_CORE[0]
    x, residual, norm_weight, weight = norm_gemv_case(3, 256, 96, torch.float32, DEVICE)
    with pytest.raises(ValueError):  # gate_up must be twice K wide
        gemv_triton.silu_mul_gemv(torch.randn(3, 256, device=DEVICE), weight, config)
    with pytest.raises(ValueError):
        gemv_triton.add_rms_norm_gemv(x, residual[:2], norm_weight, EPS, weight, config)
    with pytest.raises(ValueError):
        gemv_triton.add_rms_norm_gemv(x, residual, norm_weight[:128], EPS, weight, config)
    with pytest.raises(ValueError):
        gemv_triton.add_rms_norm_gemv(x, residual.half(), norm_weight, EPS, weight, config)


def test_imports_without_triton(monkeypatch):
    # The CPU code path imports this module where triton is not installed.
    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.setitem(sys.modules, "triton.language", None)
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
@pytest.mark.parametrize("rows", [1, 64, 200])
def test_rope_write_kv_bf16_cuda(rows):
    # Every op is correctly rounded at the points PyTorch rounds, so the match is exact.
    check_rope(rows, 32, 8, 128, torch.bfloat16, "cuda", {"atol": 0, "rtol": 0}, index_dtype=torch.int32)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("rows", [1, 64, 257])
def test_silu_and_mul_bf16_cuda(rows):
    gate_up = torch.randn(rows, 2 * 14336, device="cuda", dtype=torch.bfloat16) * 3
    torch.testing.assert_close(silu_and_mul(gate_up), ref_silu_and_mul(gate_up), **BF16_TOL)


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


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("rows", [1, 3, 8, 16])
def test_prologue_gemvs_8b_shapes_bf16_cuda(rows):
    """Autotuned, at Llama-3.1-8B's shapes: down after SiLU*up; qkv, gate_up and lm_head after the
    add + RMSNorm; against the unfused kernels and cuBLAS."""
    gate_up = torch.randn(rows, 2 * 14336, device="cuda", dtype=torch.bfloat16) * 3
    down = torch.randn(4096, 14336, device="cuda", dtype=torch.bfloat16) / 14336 ** 0.5
    torch.testing.assert_close(gemv_triton.silu_mul_gemv(gate_up, down), F.linear(silu_and_mul(gate_up), down),
                               **BF16_TOL)
    for n in (6144, 28672, 128256):
        x, residual, norm_weight, weight = norm_gemv_case(rows, 4096, n, torch.bfloat16, "cuda", seed=n)
        out, summed = gemv_triton.add_rms_norm_gemv(x, residual, norm_weight, EPS, weight)
        normed, ref_summed = add_rms_norm(x, residual, norm_weight, EPS)
        assert torch.equal(summed, ref_summed)
        torch.testing.assert_close(out, F.linear(normed, weight), **BF16_TOL)
