"""The Triton GEMV against F.linear, and the per-shape choice between it and cuBLAS.

Without CUDA the kernel runs in Triton's CPU interpreter, one explicit config at a time, on small
shapes. The interpreter's tl.dot multiplies bf16 bit patterns as integers, so there bf16 runs only
through the multiply-add configs; the tensor-core configs are checked in fp32 and fp16 here and in
bf16 on the GPU, where the config the chooser times fastest also runs at the shapes of Llama-3.1-8B,
llama-tiny and SmolLM2-135M, and inside the decode step. float8_e4m3fn weights, with a float32
scale per output channel, run every config with the rows quantized per row (W8A8) against the
float64 product of the quantized operands, here and on the GPU at the shape of Llama-3.1-8B's
o_proj, where fp8_linear's own result is the reference too.
"""

import dataclasses
import importlib.util
import math
import os
import sys

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    # Must be set before triton is imported: @triton.jit picks the interpreter at decoration time.
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from shared.kernels import gemv_triton
from shared.kernels.fp8_quant_triton import quantize_rows
from shared.kernels.gemv_triton import CONFIGS, MAX_ROWS, SUPPORTED_DTYPES, TENSOR_CORE_ROWS, gemv
from shared.model.linear_choice import LinearChooser, fastest_config, prefer_gemv, time_per_call_ms
from shared.model.quantization import fp8_linear

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
COMPILED_CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
H200_SMS = 132
HOPPER_SHARED_MEMORY = 232448  # bytes a program may have on an H100 or H200

MULTIPLY_ADD = [c for c in CONFIGS if c.kwargs["BLOCK_M"] == 1]
WIDE = [c for c in CONFIGS if c.kwargs["BLOCK_M"] > TENSOR_CORE_ROWS]  # 17 to 64 rows
TENSOR_CORES = [c for c in CONFIGS if c.kwargs["BLOCK_M"] == TENSOR_CORE_ROWS]
SPLIT = [c for c in CONFIGS if c.kwargs["SPLIT_K"] > 1 and c.kwargs["BLOCK_M"] <= TENSOR_CORE_ROWS]
# Multiply-add configs take one row, tensor-core configs up to 16; the wide ones below.
CONFIG_ROWS = [(c, rows) for c in CONFIGS for rows in (1, 3, 8) if rows <= c.kwargs["BLOCK_M"] <= TENSOR_CORE_ROWS]
# Each wide config at the fewest rows it is timed for and at its full block.
WIDE_ROWS = [(c, rows) for c in WIDE for rows in (c.kwargs["BLOCK_M"] // 2 + 1, c.kwargs["BLOCK_M"])]


def config_id(config) -> str:
    return "m{BLOCK_M}-n{BLOCK_N}-k{BLOCK_K}-s{SPLIT_K}".format(**config.kwargs)


def operands(rows, n, k, dtype, device, seed=0):
    """x and weight scaled so every output is about N(0, 1), whatever K; drawn on the device (the
    8B lm_head is half a billion numbers)."""
    gen = torch.Generator(device).manual_seed(seed)
    x = torch.randn(rows, k, generator=gen, device=device) / k ** 0.5
    return x.to(dtype), torch.randn(n, k, generator=gen, device=device).to(dtype)


def fp8_operands(rows, n, k, dtype, device, seed=0):
    """operands() with the weight quantized to float8_e4m3fn, one float32 scale per output channel:
    x, the fp8 weight, its scale, and the dequantized weight in float64 (exact)."""
    x, weight = operands(rows, n, k, torch.float32, device, seed)
    scale = weight.abs().amax(dim=1) / 448.0  # e4m3's largest value
    quantized = (weight / scale[:, None]).to(torch.float8_e4m3fn)
    return x.to(dtype), quantized, scale, quantized.double() * scale.double()[:, None]


def check(out, x, weight, tol):
    assert out.shape == (x.shape[0], weight.shape[0]) and out.dtype == x.dtype
    torch.testing.assert_close(out.float(), F.linear(x.float(), weight.float()), **tol)


def check_fp8(out, x, dequantized, tol):
    """Against the float64 product of the rows quantized as the kernel quantizes them (quantize_rows, as
    fp8_linear does on a GPU) with the dequantized weight: only the kernel's rounding is left. (The
    interpreter's float8 cast rounds 124.3 to 64, not 128, where torch's gives 128: so the kernel's own
    quantization is the reference, not torch's.)"""
    assert out.shape == (x.shape[0], dequantized.shape[0]) and out.dtype == x.dtype
    x_fp8, x_scale = quantize_rows(x)
    torch.testing.assert_close(out.double(), (x_fp8.double() * x_scale.double()) @ dequantized.T, **tol)


FP32_TOL = {"atol": 1e-5, "rtol": 1e-5}
FP16_TOL = {"atol": 2e-3, "rtol": 2e-3}
BF16_TOL = {"atol": 2e-2, "rtol": 2e-2}
TOL = {torch.float32: FP32_TOL, torch.float16: FP16_TOL, torch.bfloat16: BF16_TOL}
# Hopper's FP8 MMA adds its products at less than fp32's precision (about 14 bits) between the GEMV's
# promotions to fp32 (every 128 of K): on the GPU an FP8 product matches the float64 one to fp16's
# tolerance. (Without the promotions an H100 put fp32 outputs of about 1 up to 0.015 off.)
FP8_TOL = {torch.float32: FP16_TOL if COMPILED_CUDA else FP32_TOL, torch.float16: FP16_TOL,
           torch.bfloat16: BF16_TOL}


# --- CPU interpreter (or compiled, when CUDA is present), explicit configs -----------------------

@pytest.mark.parametrize("config,rows", CONFIG_ROWS, ids=[f"{config_id(c)}-rows{r}" for c, r in CONFIG_ROWS])
@pytest.mark.parametrize("n,k", [(96, 256), (100, 200)], ids=["even", "partial-blocks"])
def test_every_config_fp32(config, rows, n, k):
    x, weight = operands(rows, n, k, torch.float32, DEVICE)
    check(gemv(x, weight, config), x, weight, FP32_TOL)


@pytest.mark.parametrize("config", [MULTIPLY_ADD[0], TENSOR_CORES[-1]], ids=config_id)
def test_fp16(config):
    x, weight = operands(1, 96, 256, torch.float16, DEVICE)
    check(gemv(x, weight, config), x, weight, FP16_TOL)


@pytest.mark.parametrize("config", MULTIPLY_ADD, ids=config_id)
def test_bf16_multiply_add(config):
    x, weight = operands(1, 100, 576, torch.bfloat16, DEVICE)
    check(gemv(x, weight, config), x, weight, BF16_TOL)


@pytest.mark.parametrize("config", SPLIT, ids=config_id)
def test_split_k_at_16_rows(config):
    # K = 448: the last split gets a partial block (split 2) or nothing at all (split 4).
    x, weight = operands(TENSOR_CORE_ROWS, 64, 448, torch.float32, DEVICE)
    check(gemv(x, weight, config), x, weight, FP32_TOL)


@pytest.mark.parametrize("config,rows", WIDE_ROWS, ids=[f"{config_id(c)}-rows{r}" for c, r in WIDE_ROWS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_wide_configs_unquantized(config, rows, dtype):
    """17 to 64 rows of a weight in x's dtype: the weight's rows as the MMA's M side, x's rows as
    its N side, K = 448 leaving the last split a partial block; N = 100 leaving a partial row block."""
    x, weight = operands(rows, 100, 448, dtype, DEVICE)
    check(gemv(x, weight, config), x, weight, TOL[dtype])


def fp8_rows(config) -> tuple[int, ...]:
    """Rows to test a config at: one for multiply-add; 1, 3 and 16 for the narrow tensor-core block;
    the fewest a wide block takes and its full block."""
    block = config.kwargs["BLOCK_M"]
    return (1,) if block == 1 else (1, 3, block) if block == TENSOR_CORE_ROWS else (TENSOR_CORE_ROWS + 1, block)


FP8_CONFIG_ROWS = [(c, rows) for c in CONFIGS for rows in fp8_rows(c)]
FP8_SHAPES = {"even": (96, 256), "partial-rows": (51, 256)}  # 51: no BLOCK_N divides it


@pytest.mark.parametrize("config,rows", FP8_CONFIG_ROWS, ids=[f"{config_id(c)}-rows{r}" for c, r in FP8_CONFIG_ROWS])
@pytest.mark.parametrize("n,k", FP8_SHAPES.values(), ids=FP8_SHAPES.keys())
def test_every_config_fp8_weight_quantizes_the_rows(config, rows, n, k):
    """An FP8 weight's rows are quantized per row (W8A8) at every batch size."""
    x, weight, scale, dequantized = fp8_operands(rows, n, k, torch.float32, DEVICE)
    check_fp8(gemv(x, weight, config, weight_scale=scale), x, dequantized, FP8_TOL[torch.float32])


@pytest.mark.parametrize("config,dtype", [(MULTIPLY_ADD[0], torch.bfloat16), (TENSOR_CORES[0], torch.float16)],
                         ids=["multiply-add-bf16", "tensor-cores-fp16"])
def test_fp8_weight_16_bit_rows(config, dtype):
    x, weight, scale, dequantized = fp8_operands(1, *FP8_SHAPES["partial-rows"], dtype, DEVICE)
    check_fp8(gemv(x, weight, config, weight_scale=scale), x, dequantized, FP8_TOL[dtype])


QUANTIZED_BEFORE_ROWS = [(c, 1 if c.kwargs["BLOCK_M"] == 1 else c.kwargs["BLOCK_M"] - 3) for c in CONFIGS]


@pytest.mark.parametrize("config,rows", QUANTIZED_BEFORE_ROWS,
                         ids=[f"{config_id(c)}-rows{r}" for c, r in QUANTIZED_BEFORE_ROWS])
def test_rows_quantized_before_give_what_the_kernels_own_quantization_gives(config, rows):
    """Rows the decode's norm or SiLU quantized already (x in FP8 with its scales) take the product as
    they are: the same result as the rows quantized in gemv, bit for bit, in the dtype asked."""
    x, weight, scale, _ = fp8_operands(rows, *FP8_SHAPES["partial-rows"], torch.float32, DEVICE)
    x_fp8, x_scale = quantize_rows(x)
    out = gemv(x_fp8, weight, config, weight_scale=scale, x_scale=x_scale, out_dtype=torch.float32)
    assert out.dtype == torch.float32 and torch.equal(out, gemv(x, weight, config, weight_scale=scale))
    with pytest.raises(ValueError, match="x_scale and an out_dtype"):
        gemv(x_fp8, weight, config, weight_scale=scale)


def test_wide_configs_take_up_to_64_rows():
    x, weight, scale, dequantized = fp8_operands(MAX_ROWS + 1, 96, 256, torch.float32, DEVICE)
    with pytest.raises(ValueError, match="at most 64 rows"):
        gemv(x, weight, WIDE[-1], weight_scale=scale)
    with pytest.raises(ValueError, match="at most 64 rows"):
        gemv(x, dequantized.float(), WIDE[-1])
    with pytest.raises(ValueError, match="takes at most 32 rows"):
        gemv(x[:MAX_ROWS], dequantized.float(), WIDE[0])


def test_bad_fp8_inputs_raise():
    x, weight, scale, dequantized = fp8_operands(1, 96, 256, torch.bfloat16, DEVICE)
    config = MULTIPLY_ADD[0]
    with pytest.raises(ValueError, match="needs its weight_scale"):
        gemv(x, weight, config)
    with pytest.raises(ValueError, match="goes with a torch.float8_e4m3fn weight"):
        gemv(x, dequantized.bfloat16(), config, weight_scale=scale)
    with pytest.raises(ValueError, match="come with their x_scale"):
        gemv(x.to(torch.float8_e4m3fn), weight, config, weight_scale=scale)
    for bad_scale in (scale[:95], scale[None], scale.double(), scale.bfloat16(), scale.repeat_interleave(2)[::2]):
        with pytest.raises(ValueError, match=r"must be float32 \[96\], contiguous"):
            gemv(x, weight, config, weight_scale=bad_scale)


def test_strided_rows_of_x():
    # A row stride wider than K, as for a slice of a larger activation buffer.
    x, weight = operands(3, 96, 384, torch.float32, DEVICE)
    x = x[:, :256]
    weight = weight[:, :256].contiguous()
    check(gemv(x, weight, TENSOR_CORES[0]), x, weight, FP32_TOL)


def test_usable_configs_at_8b_shapes():
    def usable(rows, n, k):
        return gemv_triton.usable_configs(rows, n, k, H200_SMS, HOPPER_SHARED_MEMORY)

    o_proj_one_row = usable(1, 4096, 4096)
    assert any(c.kwargs["BLOCK_M"] == 1 for c in o_proj_one_row)
    assert any(c.kwargs["SPLIT_K"] > 1 for c in o_proj_one_row), "N = 4096 leaves SMs idle without split-K"
    assert all(c.kwargs["BLOCK_M"] == 16 for c in usable(8, 4096, 14336))
    assert all(c.kwargs["SPLIT_K"] == 1 for c in usable(1, 28672, 4096)), "gate_up has rows enough"
    for rows in range(1, TENSOR_CORE_ROWS + 1):
        for n, k in [(96, 64), (576, 576), (128256, 4096)]:
            assert usable(rows, n, k), f"no config for {rows}x{k} @ {n}x{k}"
            assert all(c.kwargs["BLOCK_M"] <= TENSOR_CORE_ROWS for c in usable(rows, n, k))
    for rows in range(TENSOR_CORE_ROWS + 1, MAX_ROWS + 1):  # the narrowest wide block that holds them
        for n, k in [(4096, 4096), (6144, 4096), (4096, 14336), (128256, 4096)]:
            assert {c.kwargs["BLOCK_M"] for c in usable(rows, n, k)} == {32 if rows <= 32 else 64}


def test_usable_configs_fit_shared_memory():
    # A program allowed 100 KB: configs whose pipelined tiles need more are not timed, in fp32 more
    # of them than in bf16.
    def usable(weight_bytes, x_bytes):
        return gemv_triton.usable_configs(TENSOR_CORE_ROWS, 4096, 14336, H200_SMS, 100_000, weight_bytes, x_bytes)

    def needs(config, element_bytes):
        meta = config.kwargs
        return config.num_stages * meta["BLOCK_K"] * (meta["BLOCK_N"] + meta["BLOCK_M"]) * element_bytes

    every = gemv_triton.usable_configs(TENSOR_CORE_ROWS, 4096, 14336, H200_SMS, HOPPER_SHARED_MEMORY)
    for element_bytes in (2, 4):
        kept = {id(c) for c in usable(element_bytes, element_bytes)}
        assert kept == {id(c) for c in every if needs(c, element_bytes) <= 100_000}
    assert len(usable(4, 4)) < len(usable(2, 2)) < len(every)


def test_tile_element_bytes_count_rows_as_the_kernel_reads_them():
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    weight = torch.zeros(32, 64, dtype=torch.bfloat16)
    assert gemv_triton.tile_element_bytes(x, weight, None) == (2, 2)
    fp8_weight, scale = weight.to(gemv_triton.FP8_DTYPE), torch.ones(32)
    # bf16 rows go through quantize_rows before the kernel, as rows quantized already do not
    assert gemv_triton.tile_element_bytes(x, fp8_weight, scale) == (1, 1)
    assert gemv_triton.tile_element_bytes(x.to(gemv_triton.FP8_DTYPE), fp8_weight, scale) == (1, 1)
    assert gemv_triton.tile_element_bytes(x.float(), weight.float(), None) == (4, 4)


def test_bad_inputs_raise():
    x, weight = operands(3, 96, 256, torch.float32, DEVICE)
    with pytest.raises(ValueError):
        gemv(x, weight[:, :128].contiguous(), TENSOR_CORES[0])
    with pytest.raises(ValueError, match="at most 64 rows"):
        gemv(torch.zeros(MAX_ROWS + 1, 256, device=DEVICE), weight, WIDE[-1])
    with pytest.raises(ValueError, match="takes at most 16 rows"):
        gemv(torch.zeros(TENSOR_CORE_ROWS + 1, 256, device=DEVICE), weight, TENSOR_CORES[0])
    with pytest.raises(ValueError):
        gemv(x, weight.half(), TENSOR_CORES[0])
    with pytest.raises(ValueError):
        gemv(x, weight.t().contiguous().t(), TENSOR_CORES[0])
    with pytest.raises(ValueError, match="at most 1 rows"):
        gemv(x, weight, MULTIPLY_ADD[0])


def test_chooser_on_cpu_is_f_linear():
    chooser = LinearChooser()
    x, weight = operands(2, 96, 256, torch.float32, "cpu")
    bias = torch.randn(96)
    assert not gemv_triton.supports(x, weight)
    assert torch.equal(chooser.apply(x, weight), F.linear(x, weight))
    assert torch.equal(chooser.apply(x, weight, bias), F.linear(x, weight, bias))
    assert chooser.choices == {}
    with pytest.raises(ValueError):
        LinearChooser("fastest")


def test_gemv_must_beat_cublas_by_the_margin_unless_forced():
    assert prefer_gemv(cublas_ms=0.030, gemv_ms=0.028, mode="auto")
    assert not prefer_gemv(cublas_ms=0.030, gemv_ms=0.0295, mode="auto"), "within the 3% margin: cuBLAS"
    assert not prefer_gemv(cublas_ms=0.030, gemv_ms=0.035, mode="auto")
    assert prefer_gemv(cublas_ms=0.030, gemv_ms=0.035, mode="gemv")
    assert not prefer_gemv(cublas_ms=0.030, gemv_ms=0.010, mode="cublas")


def test_a_split_k_config_must_beat_the_best_single_kernel_by_the_margin():
    single = [c for c in CONFIGS if c.kwargs["SPLIT_K"] == 1][:2]
    split = SPLIT[:1]
    configs = single + split
    assert fastest_config(configs, [0.0105, 0.0102, 0.0101]) == 1, "1% faster split: the single kernel"
    assert fastest_config(configs, [0.0105, 0.0102, 0.0095]) == 2, "7% faster split: the split"
    assert fastest_config(configs, [0.0090, 0.0102, 0.0095]) == 0
    assert fastest_config(split, [0.02]) == 0, "only split configs: the fastest of them"


def test_imports_without_triton(monkeypatch):
    # The CPU code path imports this module where triton is not installed.
    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.setitem(sys.modules, "triton.language", None)
    monkeypatch.delitem(sys.modules, "shared.kernels.triton_support")  # imported again, without triton
    spec = importlib.util.spec_from_file_location("gemv_triton_no_triton", gemv_triton.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    x, weight = operands(1, 96, 256, torch.float32, "cpu")
    assert not module.supports(x, weight)
    with pytest.raises(ImportError, match="needs triton"):
        module.gemv(x, weight, None)


# --- compiled on CUDA: the chooser's configs, model shapes, CUDA graphs, the decode step ---------

needs_cuda = pytest.mark.skipif(not COMPILED_CUDA, reason="needs CUDA with compiled (not interpreted) Triton")

LLAMA_8B = {"qkv": (6144, 4096), "o_proj": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
            "lm_head": (128256, 4096)}
SMALL_MODELS = {"tiny-qkv": (768, 512), "tiny-o_proj": (512, 512), "tiny-gate_up": (3072, 512),
                "tiny-down": (512, 1536), "tiny-lm_head": (32000, 512),
                "smol-qkv": (960, 576), "smol-o_proj": (576, 576), "smol-gate_up": (3072, 576),
                "smol-down": (576, 1536), "smol-lm_head": (49152, 576)}


def fastest_gemv(x, weight):
    """The GEMV with the config LinearChooser times fastest for this shape."""
    chooser = LinearChooser("gemv")
    out = chooser.apply(x, weight)
    (choice,) = chooser.choices.values()
    assert choice.use_gemv and choice.gemv_config in CONFIGS
    return out


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("rows", [1, 3, 8, 16, 17, 32, 64])
@pytest.mark.parametrize("shape", LLAMA_8B.values(), ids=LLAMA_8B.keys())
def test_8b_shapes_bf16_cuda(shape, rows):
    x, weight = operands(rows, *shape, torch.bfloat16, "cuda")
    check(fastest_gemv(x, weight), x, weight, BF16_TOL)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("rows", [1, 8])
@pytest.mark.parametrize("shape", SMALL_MODELS.values(), ids=SMALL_MODELS.keys())
def test_small_model_shapes_bf16_cuda(shape, rows):
    # fp32 at the llama-tiny shapes: test_decode_chooses_per_shape_and_keeps_the_logits.
    x, weight = operands(rows, *shape, torch.bfloat16, "cuda")
    check(fastest_gemv(x, weight), x, weight, BF16_TOL)


# Those whose tiles fit a Hopper SM in bf16 (the rest are for one-byte weights; the chooser never times them here).
BF16_ON_HOPPER = [c for c in CONFIGS if gemv_triton.fits_shared_memory(c, HOPPER_SHARED_MEMORY, 2, 2)]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("config", BF16_ON_HOPPER, ids=config_id)
def test_every_config_bf16_cuda(config):
    rows = {1: 1, TENSOR_CORE_ROWS: 5}.get(config.kwargs["BLOCK_M"], config.kwargs["BLOCK_M"] - 3)
    x, weight = operands(rows, 4096, 14336, torch.bfloat16, "cuda")
    check(gemv(x, weight, config), x, weight, BF16_TOL)


# bf16 rows at each config's rows to test; fp32 and fp16 at the first of them.
FP8_CUDA_CASES = [(c, rows, dtype) for c in CONFIGS for rows in fp8_rows(c) for dtype in SUPPORTED_DTYPES
                  if dtype == torch.bfloat16 or rows == fp8_rows(c)[0]]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("config,rows,dtype", FP8_CUDA_CASES,
                         ids=[f"{config_id(c)}-rows{r}-{str(d)[6:]}" for c, r, d in FP8_CUDA_CASES])
def test_every_config_fp8_weight_at_the_8b_shape_cuda(config, rows, dtype):
    """The product of the quantized operands for rows in each dtype; for bf16 rows (the model's) also
    fp8_linear's result, torch._scaled_mm's, which the chooser may take instead."""
    x, weight, scale, dequantized = fp8_operands(rows, *LLAMA_8B["o_proj"], dtype, "cuda")
    assert gemv_triton.supports(x, weight, scale)
    out = gemv(x, weight, config, weight_scale=scale)
    check_fp8(out, x, dequantized, FP8_TOL[dtype])
    if dtype == torch.bfloat16:
        torch.testing.assert_close(out, fp8_linear(x, weight, scale), **BF16_TOL)


@pytest.mark.gpu
@needs_cuda
def test_a_candidate_too_big_for_the_device_is_timed_infinite_cuda():
    from triton.runtime.errors import OutOfResources

    def too_big(weight):
        raise OutOfResources(262144, 232448, "shared memory")

    x, weight = operands(8, *LLAMA_8B["o_proj"], torch.bfloat16, "cuda")
    times = time_per_call_ms({"fits": lambda w: F.linear(x, w), "too_big": too_big}, weight)
    assert times["too_big"] == math.inf and math.isfinite(times["fits"])


@pytest.mark.gpu
@needs_cuda
def test_supports_fp8_weight_with_its_scale_cuda():
    x, weight, scale, dequantized = fp8_operands(1, 96, 256, torch.bfloat16, "cuda")
    assert gemv_triton.supports(x, weight, scale)
    assert not gemv_triton.supports(x, weight)
    assert not gemv_triton.supports(x, dequantized.bfloat16(), scale)
    for bad_scale in (scale[:95], scale.double(), scale.repeat_interleave(2)[::2], scale.cpu()):
        assert not gemv_triton.supports(x, weight, bad_scale)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("rows", [8, 48])
def test_cuda_graph_replay_cuda(rows):
    x, weight = operands(rows, *LLAMA_8B["o_proj"], torch.bfloat16, "cuda")
    down_x, down = operands(rows, *LLAMA_8B["down"], torch.bfloat16, "cuda")
    chooser = LinearChooser("gemv")
    for a, b in ((x, weight), (down_x, down)):
        chooser.apply(a, b)  # times and compiles, which must happen outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = chooser.apply(x, weight), chooser.apply(down_x, down)
    x.copy_(torch.randn_like(x))
    down_x.copy_(torch.randn_like(down_x))
    graph.replay()
    for got, want in zip(outs, (chooser.apply(x, weight), chooser.apply(down_x, down))):
        assert torch.equal(got, want)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_decode_chooses_per_shape_and_keeps_the_logits(dtype):
    """Graph warm-up makes one choice per (batch, weight shape); the graphed step with those
    choices, and an eager step forced onto the GEMV, give cuBLAS's logits."""
    from services.decode.cuda_graphs import GraphedDecode
    from shared.kv.pages import PageAllocator
    from shared.kv.pool import allocate_local_pool
    from shared.model.llama import PagedLlama
    from shared.model.presets import random_hf_model
    from tests.decode_inputs import prefilled_step_inputs

    hf = random_hf_model("random:llama-tiny", dtype, "cuda:0")
    chosen, forced, cublas = (PagedLlama.from_hf(hf, "cuda:0") for _ in range(3))
    forced.linears, cublas.linears = LinearChooser("gemv"), LinearChooser("cublas")
    layout = chosen.kv_layout(256, 16)
    pool, _ = allocate_local_pool(layout, "cuda:0")
    allocator = PageAllocator(layout.num_pages)
    graphs = GraphedDecode(chosen, pool, allocator.allocate(1)[0], 64, [1, 4, 8])

    weights = [chosen.layers[0].qkv, chosen.layers[0].o_proj, chosen.layers[0].gate_up, chosen.layers[0].down,
               chosen.lm_head]
    assert set(chosen.linears.choices) == {(rows, *w.shape, dtype) for rows in (1, 4, 8) for w in weights}

    inputs = prefilled_step_inputs(cublas, pool, allocator, [5, 40, 17])
    kv_before = pool.kv.clone()
    logits = {}
    for name, step in (("graphed", lambda: graphs.step(inputs)),
                       ("gemv", lambda: forced.decode(inputs.token_ids, inputs.positions, inputs.page_table, pool)),
                       ("cublas", lambda: cublas.decode(inputs.token_ids, inputs.positions, inputs.page_table, pool))):
        pool.kv.copy_(kv_before)
        logits[name] = step().clone()
    scale = logits["cublas"].abs().max().item()
    tol = {"atol": 1e-3, "rtol": 1e-3} if dtype == torch.float32 else {"atol": 3e-2 * scale, "rtol": 3e-2}
    torch.testing.assert_close(logits["graphed"], logits["cublas"], **tol)
    torch.testing.assert_close(logits["gemv"], logits["cublas"], **tol)


@pytest.mark.gpu
@needs_cuda
def test_rows_put_on_the_gemv_take_it_where_cublas_was_chosen():
    x, weight = operands(4, *SMALL_MODELS["smol-o_proj"], torch.bfloat16, "cuda")
    chooser = LinearChooser()
    chooser.apply(x, weight)
    (key,) = chooser.choices
    chooser.choices[key] = dataclasses.replace(chooser.choices[key], use_gemv=False)  # as if cuBLAS had won
    assert chooser.uses_cublas(4) and not chooser.uses_cublas(1)
    assert torch.equal(chooser.apply(x, weight), F.linear(x, weight))
    chooser.gemv_rows.add(4)
    assert torch.equal(chooser.apply(x, weight), gemv(x, weight, chooser.choices[key].gemv_config))


@pytest.mark.gpu
@needs_cuda
def test_a_bucket_with_cublas_matmuls_keeps_its_faster_capture():
    """Where some matmul of a bucket chose cuBLAS, the bucket is captured both ways and timed; the
    faster capture is kept, and either gives the eager step's logits."""
    from services.decode.cuda_graphs import GraphedDecode
    from shared.kv.pages import PageAllocator
    from shared.kv.pool import allocate_local_pool
    from shared.model.llama import PagedLlama
    from shared.model.presets import random_hf_model
    from tests.decode_inputs import prefilled_step_inputs

    model = PagedLlama.from_hf(random_hf_model("random:llama-tiny", torch.float32, "cuda:0"), "cuda:0")
    layout = model.kv_layout(256, 16)
    pool, _ = allocate_local_pool(layout, "cuda:0")
    allocator = PageAllocator(layout.num_pages)
    scratch = allocator.allocate(1)[0]
    inputs = prefilled_step_inputs(model, pool, allocator, [5, 40, 17, 9])
    kv_before = pool.kv.clone()
    eager = model.decode(inputs.token_ids, inputs.positions, inputs.page_table, pool).clone()
    for key, choice in model.linears.choices.items():  # as if cuBLAS had won every shape of 4 rows
        model.linears.choices[key] = dataclasses.replace(choice, use_gemv=False)

    graphs = GraphedDecode(model, pool, scratch, 64, [4])
    timings = graphs.matmul_timings[4]
    assert timings["per_shape_ms"] > 0 and timings["all_gemv_ms"] > 0
    assert (4 in model.linears.gemv_rows) == (timings["all_gemv_ms"] < timings["per_shape_ms"])
    pool.kv.copy_(kv_before)
    torch.testing.assert_close(graphs.step(inputs), eager, atol=1e-3, rtol=1e-3)
