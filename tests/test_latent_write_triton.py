"""MLA's latent write in one launch against the PyTorch ops it replaces (shared/model/mla.py's
latents with the PyTorch kernels, then the pool's write_latent), unquantized and quantized, into
pages that hold NaN elsewhere so that a write outside the addressed slots shows. Without CUDA in
Triton's interpreter, in fp32; with CUDA compiled, in bf16 too."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Must be set before triton is imported: @triton.jit picks the interpreter at decoration time.
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from shared.kernels import kv_quant
from shared.kernels.latent_write_triton import norm_rope_write_latent
from shared.model.elementwise import apply_rope, rms_norm
from tests.triton_cast import COMPILED_CUDA, cast_like_a_triton_store

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
RANK, ROPE, PAGE_SIZE, EPS = 64, 16, 16, 1e-6
DTYPES = [torch.float32] + ([torch.bfloat16] if COMPILED_CUDA else [])


def case(rows, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    num_pages, max_positions = rows + 3, 512
    angles = torch.randn(max_positions, ROPE // 2, generator=gen)
    angles = torch.cat([angles, angles], dim=-1)
    return {"x": (torch.randn(rows, RANK + ROPE, generator=gen) * 3).to(DEVICE, dtype),
            "norm": (1 + 0.1 * torch.randn(RANK, generator=gen)).to(DEVICE, dtype),
            "cos": angles.cos().to(DEVICE, dtype), "sin": angles.sin().to(DEVICE, dtype),
            "positions": torch.randint(0, max_positions, (rows,), generator=gen).to(DEVICE),
            "pages": torch.randperm(num_pages, generator=gen)[:rows].to(DEVICE, torch.int32),
            "offsets": torch.randint(0, PAGE_SIZE, (rows,), generator=gen).to(DEVICE),
            "num_pages": num_pages}


def expected_latent(c):
    """What shared/model/mla.py's latents computes with the PyTorch kernels."""
    x = c["x"]
    rotated = apply_rope(x[:, None, RANK:], c["cos"], c["sin"], c["positions"])[:, 0]
    return torch.cat([rms_norm(x[:, :RANK], c["norm"], EPS), rotated], dim=-1)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", [1, 5, 37])
def test_the_latent_lands_in_its_slot_as_the_pytorch_ops_compute_it(rows, dtype):
    c = case(rows, dtype)
    cache = torch.full((c["num_pages"], PAGE_SIZE, 1, RANK + ROPE), float("nan"), dtype=dtype, device=DEVICE)
    norm_rope_write_latent(c["x"], c["norm"], EPS, c["cos"], c["sin"], c["positions"], cache, c["pages"], c["offsets"])
    slots = c["pages"].long(), c["offsets"]
    written = torch.zeros(cache.shape[:2], dtype=torch.bool, device=DEVICE)
    written[slots] = True
    assert cache[~written].isnan().all(), "written outside the addressed slots"
    tolerance = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 0, "rtol": 0}
    torch.testing.assert_close(cache[slots][:, 0], expected_latent(c), **tolerance)


@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn], ids=str)
def test_quantized_pages_get_kv_quants_values_and_one_scale_a_token(kv_dtype):
    c = case(9, torch.float32, seed=1)
    cache = torch.zeros((c["num_pages"], PAGE_SIZE, 1, RANK + ROPE), dtype=kv_dtype, device=DEVICE)
    scales = torch.full(cache.shape[:3], float("nan"), device=DEVICE)
    norm_rope_write_latent(c["x"], c["norm"], EPS, c["cos"], c["sin"], c["positions"], cache, c["pages"],
                           c["offsets"], scales)
    slots = c["pages"].long(), c["offsets"]
    written = torch.zeros(cache.shape[:2], dtype=torch.bool, device=DEVICE)
    written[slots] = True
    assert scales[~written].isnan().all() and (cache[~written].float() == 0).all()
    values, expected_scales = kv_quant.scaled_rows(expected_latent(c), kv_dtype)
    torch.testing.assert_close(scales[slots][:, 0], expected_scales, rtol=1e-6, atol=0)
    expected = kv_quant.dequantize(cast_like_a_triton_store(values, kv_dtype), expected_scales, torch.float32)
    got = kv_quant.dequantize(cache[slots][:, 0], scales[slots][:, 0], torch.float32)
    if COMPILED_CUDA:  # fp32 may differ in its last bit: a value one step of its token's grid away
        step = expected_scales[:, None] * (1.0 if kv_dtype == torch.int8 else 32.0)
        assert torch.all((got - expected).abs() <= step * 1.001)
    else:
        assert torch.equal(got, expected)


def test_what_is_not_a_latent_is_refused():
    c = case(2, torch.float32)
    cache = torch.zeros((c["num_pages"], PAGE_SIZE, 1, RANK + ROPE), device=DEVICE)
    args = (c["cos"], c["sin"], c["positions"])
    with pytest.raises(ValueError, match="not a latent"):
        norm_rope_write_latent(c["x"][:, :-1], c["norm"], EPS, *args, cache, c["pages"], c["offsets"])
    with pytest.raises(ValueError, match="do not rotate"):
        norm_rope_write_latent(c["x"], c["norm"], EPS, c["cos"][:, :8], c["sin"], c["positions"], cache,
                               c["pages"], c["offsets"])
    with pytest.raises(ValueError, match="with scales"):
        norm_rope_write_latent(c["x"], c["norm"], EPS, *args, cache.to(torch.int8), c["pages"], c["offsets"])
