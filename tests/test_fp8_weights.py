"""FP8 weights on the CPU: the quantization, the product against float references, a
model quantized at load against the same model stored as an FP8 checkpoint, and the fingerprint."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from shared.kernels.fp8_quant_triton import quantize_rows
from shared.kv.pool import allocate_local_pool
from shared.model.fingerprint import differences, model_fingerprint
from shared.model.fp8_weights import UnsupportedQuantization, is_fp8_checkpoint
from shared.model.from_checkpoint import load_paged_llama
from shared.model.quantization import (
    FP8,
    FP8_MAX,
    Fp8Rows,
    fp8_linear,
    quantize_per_token,
    quantize_weight,
)

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def test_a_weight_quantizes_per_channel_within_e4m3s_rounding():
    weight = torch.randn(64, 256, dtype=torch.float64) * torch.logspace(-3, 1, 64, dtype=torch.float64)[:, None]
    weight[5] = 0  # an all-zero channel stays zero, no NaN
    quantized, scale = quantize_weight(weight)
    assert quantized.dtype == FP8 and scale.shape == (64,) and scale.dtype == torch.float32
    assert torch.equal(quantized.float().abs().amax(dim=1)[torch.arange(64) != 5], torch.full((63,), FP8_MAX))
    back = quantized.double() * scale.double()[:, None]
    # e4m3 keeps 3 mantissa bits: half a step is 2^-4 of the value; subnormals step by 2^-9 of the scale.
    assert ((back - weight).abs() <= weight.abs() * 2 ** -4 + scale.double()[:, None] * 2 ** -9 + 1e-12).all()
    assert not back[5].any()


def test_a_weight_quantized_in_blocks_of_rows_is_the_same_as_whole():
    weight = torch.randn(70, 96, dtype=torch.bfloat16)
    whole = quantize_weight(weight, rows_at_a_time=70)
    for rows in (1, 16, 69):
        quantized, scale = quantize_weight(weight, rows_at_a_time=rows)
        assert torch.equal(quantized.view(torch.uint8), whole[0].view(torch.uint8)) and torch.equal(scale, whole[1])


@pytest.mark.parametrize("rows", [1, 16, 17, 64])
def test_the_product_equals_its_float_reference(rows):
    """Whatever the batch, each row is quantized with its own scale, and the product is that of the
    dequantized operands."""
    torch.manual_seed(0)
    x, weight, bias = torch.randn(rows, 128), torch.randn(96, 128), torch.randn(96)
    quantized, scale = quantize_weight(weight)
    dequantized = quantized.double() * scale.double()[:, None]
    x_fp8, x_scale = quantize_per_token(x)
    x_ref = x_fp8.double() * x_scale.double()
    assert (x_ref - x.double()).abs().max() > 0, "the activations were quantized"
    expected = x_ref @ dequantized.T + bias.double()
    torch.testing.assert_close(fp8_linear(x, quantized, scale, bias).double(), expected, rtol=1e-5, atol=1e-4)


def test_rows_quantized_by_the_kernel_before_give_the_same_product():
    """Fp8Rows (what the GPU prefill's norms and SiLU write) take the path fp8_linear takes after
    quantizing the rows itself, whatever their count, and come back in their model's dtype."""
    torch.manual_seed(0)
    quantized, scale = quantize_weight(torch.randn(96, 128))
    bias = torch.randn(96, dtype=torch.bfloat16)
    for rows in (1, 17, 40):
        x = torch.randn(rows, 128, dtype=torch.bfloat16)
        given = fp8_linear(Fp8Rows(*quantize_per_token(x), torch.bfloat16), quantized, scale, bias)
        assert given.dtype == torch.bfloat16 and torch.equal(given, fp8_linear(x, quantized, scale, bias))
    x = torch.randn(2, 128, dtype=torch.bfloat16)  # the product of the dequantized operands, rounded once
    expected = (F.linear(quantize_per_token(x)[0].float(), quantized.float()) * quantize_per_token(x)[1] * scale)
    torch.testing.assert_close(fp8_linear(Fp8Rows(*quantize_per_token(x), torch.bfloat16), quantized, scale),
                               expected.bfloat16(), rtol=0, atol=0)


def test_bfloat16_activations_come_back_in_bfloat16():
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    quantized, scale = quantize_weight(torch.randn(32, 64))
    assert fp8_linear(x, quantized, scale).dtype == torch.bfloat16
    assert fp8_linear(x.repeat(8, 1), quantized, scale).dtype == torch.bfloat16


def _tiny_checkpoint(folder, **config_fields):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=256, max_position_embeddings=128, **config_fields)
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    return folder


def _as_fp8_checkpoint(source, target, quantization_config: dict, per_tensor: bool = False):
    """The checkpoint as compressed-tensors or FBGEMM store FP8: each linear weight in e4m3 beside
    its weight_scale ([N, 1] per channel, one number per tensor)."""
    target.mkdir()
    tensors = load_file(str(source / "model.safetensors"))
    for name in [n for n in tensors if n.endswith(".weight") and n.split(".")[-2] in LINEARS]:
        weight = tensors[name].float()
        if per_tensor:
            scale = (weight.abs().amax() / FP8_MAX).reshape(1)
            tensors[name] = (weight / scale).to(FP8)
        else:
            tensors[name], scale = quantize_weight(weight)
            scale = scale[:, None]
        tensors[name.removesuffix("weight") + "weight_scale"] = scale
    save_file(tensors, str(target / "model.safetensors"))
    config = json.loads((source / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config}))
    return target


COMPRESSED_TENSORS = {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
                      "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                          "type": "float", "num_bits": 8, "strategy": "channel", "dynamic": False},
                          "input_activations": {"type": "float", "num_bits": 8, "strategy": "token",
                                                "dynamic": True}}}}


def _prompt_logits(model) -> torch.Tensor:
    pool = allocate_local_pool(model.kv_layout(8, 16), "cpu")[0]
    return model.prefill(list(range(3, 40)), pool, [0, 1, 2])


def test_an_fp8_checkpoint_loads_as_stored_and_equals_quantizing_at_load(tmp_path):
    source = _tiny_checkpoint(tmp_path / "bf16")
    fp8 = _as_fp8_checkpoint(source, tmp_path / "fp8", COMPRESSED_TENSORS)
    at_load = load_paged_llama(source, "float32", "cpu", "fp8")
    stored = load_paged_llama(fp8, "float32", "cpu")  # found from config.json, whatever quantization says
    assert stored.weights.quantization == at_load.weights.quantization == "fp8"
    for ours, theirs in zip(at_load.layers, stored.layers):
        assert torch.equal(ours.qkv.view(torch.uint8), theirs.qkv.view(torch.uint8))
        torch.testing.assert_close(ours.down_scale, theirs.down_scale, rtol=0, atol=0)
    torch.testing.assert_close(_prompt_logits(stored), _prompt_logits(at_load), rtol=0, atol=0)
    unquantized = _prompt_logits(load_paged_llama(source, "float32", "cpu"))
    assert not torch.equal(unquantized, _prompt_logits(at_load)), "the weights were quantized"


def test_per_tensor_and_fbgemm_scales_load_too(tmp_path):
    source = _tiny_checkpoint(tmp_path / "bf16")
    per_tensor = {**COMPRESSED_TENSORS, "config_groups": {"group_0": {
        **COMPRESSED_TENSORS["config_groups"]["group_0"],
        "weights": {"type": "float", "num_bits": 8, "strategy": "tensor", "dynamic": False}}}}
    tensor_scaled = load_paged_llama(_as_fp8_checkpoint(source, tmp_path / "tensor", per_tensor, per_tensor=True),
                                     "float32", "cpu")
    q_rows = tensor_scaled.num_heads * tensor_scaled.head_dim
    qkv_scale = tensor_scaled.layers[0].qkv_scale
    assert qkv_scale.shape == (tensor_scaled.layers[0].qkv.shape[0],)
    assert len(set(qkv_scale[:q_rows].tolist())) == 1 and qkv_scale[0] != qkv_scale[-1]  # q's scale, then v's
    fbgemm = load_paged_llama(_as_fp8_checkpoint(source, tmp_path / "fbgemm", {"quant_method": "fbgemm_fp8"}),
                              "float32", "cpu")
    torch.testing.assert_close(_prompt_logits(fbgemm), _prompt_logits(load_paged_llama(source, "float32", "cpu", "fp8")),
                               rtol=0, atol=0)


def test_a_quantization_that_is_not_fp8_weights_is_refused():
    assert not is_fp8_checkpoint({"model_type": "llama"})
    with pytest.raises(UnsupportedQuantization, match="pack-quantized"):
        is_fp8_checkpoint({"quantization_config": {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                                   "config_groups": {"g": {"weights": {"type": "int", "num_bits": 4}}}}})
    with pytest.raises(UnsupportedQuantization, match="awq"):
        is_fp8_checkpoint({"quantization_config": {"quant_method": "awq", "bits": 4}})


def test_fp8_weights_are_part_of_the_fingerprint():
    plain = model_fingerprint("random:llama-tiny", "bfloat16", "none", 4, 2, 64, 16, "bfloat16")
    fp8 = model_fingerprint("random:llama-tiny", "bfloat16", "fp8", 4, 2, 64, 16, "bfloat16")
    assert differences(plain, fp8) == ["dtype bfloat16 weights=fp8 instead of bfloat16"]


def test_a_random_preset_in_fp8_has_its_shapes():
    """On the CPU the FP8 weights are held widened to float32: e4m3 values, each with its scale."""
    model = load_paged_llama("random:llama-tiny", "float32", "cpu", "fp8")
    layer = model.layers[0]
    assert layer.qkv.shape == ((8 + 2 * 2) * 64, 512) and layer.qkv_scale.shape == (8 * 64 + 2 * 2 * 64,)
    assert layer.qkv.dtype == torch.float32 and torch.equal(layer.qkv, layer.qkv.to(FP8).float())
    assert layer.qkv.abs().max() <= FP8_MAX and layer.qkv.abs().max() > FP8_MAX / 2
    assert layer.down.shape == (512, 1536) and layer.down_scale.shape == (512,)
    assert model.lm_head.dtype == torch.float32
    assert torch.isfinite(_prompt_logits(model)).all()


@pytest.mark.gpu
def test_the_triton_row_quantization_equals_pytorchs():
    """The GPU's one-pass kernel against the PyTorch steps: the scales to float32 rounding (the
    GPU divides otherwise, in the last bit), the values to one e4m3 step. Not on the CPU: Triton's
    interpreter rounds float32 to e4m3 wrongly where the rounding carries into the exponent (124.3
    gave 64, not 128)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    torch.manual_seed(0)
    x = (torch.randn(5, 4096) * torch.tensor([1e-3, 1.0, 30.0, 0.0, 5.0])[:, None]).cuda().bfloat16()
    ours, our_scale = quantize_rows(x)
    theirs, their_scale = quantize_per_token(x.cpu())
    torch.testing.assert_close(our_scale.cpu(), their_scale, rtol=1e-6, atol=0)
    ours, theirs = ours.float().cpu(), theirs.float()
    assert ((ours - theirs).abs() <= theirs.abs() * 2 ** -3 + 2 ** -9).all()
    assert (ours == theirs).float().mean() > 0.99


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 8, 64, 8192])
def test_the_gpus_products_equal_the_cpus(rows):
    """The GPU's product, the FP8 GEMV or torch._scaled_mm as the decode's chooser picks (a prefill's
    8192 rows: torch._scaled_mm), against the CPU's float computation of the same quantized
    operands, at bf16's rounding."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from shared.model.linear_choice import LinearChooser

    torch.manual_seed(0)
    x, weight = torch.randn(rows, 4096, dtype=torch.bfloat16), torch.randn(1024, 4096)
    quantized, scale = quantize_weight(weight)
    x_fp8, x_scale = quantize_per_token(x.cuda())  # the GPU's own quantization (tested above)
    expected = F.linear(x_fp8.float().cpu() * x_scale.cpu(), quantized.float() * scale[:, None])
    got = LinearChooser().apply(x.cuda(), quantized.cuda(), scale=scale.cuda())
    torch.testing.assert_close(got.float().cpu(), expected, rtol=2e-2, atol=2e-2 * float(expected.abs().mean()))


@pytest.mark.slow
def test_the_kernels_before_the_products_quantize_as_the_products_would(tmp_path, monkeypatch):
    """The GPU's fused prefill and decode step (on the CPU, Triton interpreted) with FP8 weights: the
    norms and SiLU writing their output in FP8
    (PagedLlama.fp8_rows_fused) give the logits and pages that quantizing it in a kernel of its own
    gives, bit for bit. Both ways quantize with the GPU's kernel, quantize_rows, on the CPU too: the
    interpreter's FP8 cast is not PyTorch's (tests/triton_cast.py). The RoPE runs blocks of rows a
    program: interpreted one row a program, it took two thirds of this test (test_fused_triton.py
    checks both)."""
    from shared.kernels import fused_triton
    from shared.model import quantization

    monkeypatch.setattr(fused_triton, "ROPE_BLOCKED_FROM_ROWS", 1)
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    monkeypatch.setattr(quantization, "quantize_per_token", lambda x: quantize_rows(x.contiguous()))
    model = load_paged_llama(_tiny_checkpoint(tmp_path / "bf16"), "bfloat16" if cuda else "float32", device, "fp8")
    model.fused_prefill = True
    calls = {"rms_norm_fp8": 0, "add_rms_norm_fp8": 0, "silu_and_mul_fp8": 0}
    for name in calls:
        def counted(*args, _kernel=getattr(fused_triton, name), _name=name):
            calls[_name] += 1
            return _kernel(*args)
        monkeypatch.setattr(fused_triton, name, counted)
    batch = 3
    page_table = torch.arange(3, 3 + batch, device=device)[:, None]  # a page each, after the prompt's 3
    positions = torch.arange(batch, device=device) % 16
    runs = {}
    for fused in (True, False):
        model.fp8_rows_fused = fused
        pool = allocate_local_pool(model.kv_layout(3 + batch, 16), device)[0]
        prompt = model.prefill(list(range(3, 37)), pool, list(range(3)), chunk_tokens=17)  # chunks of 17
        step = model._decode_fused(torch.arange(5, 5 + batch, device=device), positions, page_table, pool,
                                   page_table[:, 0], positions, (positions + 1).to(torch.int32))
        runs[fused] = prompt, step, pool.kv.clone()
    # prefill: 2 layers x 2 chunks each; the step: the first layer's input norm, both post norms, the
    # second layer's input norm (the final one stays unquantized, for the lm_head), both SiLUs
    assert calls == {"rms_norm_fp8": 4 + 1, "add_rms_norm_fp8": 4 + 3, "silu_and_mul_fp8": 4 + 2}
    for fused, apart in zip(runs[True], runs[False]):
        assert torch.equal(fused, apart)
