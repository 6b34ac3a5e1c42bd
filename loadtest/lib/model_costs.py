"""What the served model costs, from its shapes alone: the weight bytes a decode step reads, a
prompt's matmul FLOPs and a token's KV bytes. A benchmark's floor or bound is one of these over a
rate of the device (loadtest/lib/device_rates.py)."""

from __future__ import annotations

import torch

from shared.kv.pool import token_bytes
from shared.model.llama import PagedLlama
from shared.model.loader import load_hf_config

# Read one row per token (the embedding) or per position (the RoPE tables), not whole, by a step.
ROW_GATHERED = ("embed", "cos", "sin")


def model_shape(checkpoint, dtype: torch.dtype, quantization: str = "none") -> PagedLlama:
    """The served model with its weights on the meta device: its shapes, FLOPs and bytes, no memory;
    quantization "fp8": its linear weights in FP8, as model.quantization has them."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(load_hf_config(checkpoint), dtype=dtype)
    model = PagedLlama.from_hf(hf, "meta")
    if quantization == "fp8":
        for layer in model.layers:
            layer.quantize_fp8()
    return model


def weight_bytes_per_step(model: PagedLlama) -> int:
    """Every weight a decode step reads whole: each layer's (biases included), the final norm and
    the lm_head, also where it is tied to the embedding."""
    return sum(t.numel() * t.element_size() for name, t in model.weights.named().items() if name not in ROW_GATHERED)


def prefill_flops(model: PagedLlama, tokens: int) -> float:
    """Matmul FLOPs of a prompt: the linear layers' and the causal attention's."""
    return linear_flops(model, tokens) + attention_flops(model, tokens)


def linear_flops(model: PagedLlama, tokens: int) -> float:
    """2 * params per token for every layer's linears, plus the lm_head for the last position."""
    linear = sum(l.qkv.numel() + l.o_proj.numel() + l.gate_up.numel() + l.down.numel() for l in model.layers)
    return 2 * linear * tokens + 2 * model.lm_head.numel()


def prefill_bound_s(model: PagedLlama, tokens: int, bf16_tflops: float, fp8_tflops: float | None = None) -> dict:
    """A prompt's matmuls at the device's rates: the layers' linears at the rate of their weights'
    type (FP8 weights: fp8_tflops), the lm_head and the causal attention at the bf16 rate."""
    lm_head = 2 * model.lm_head.numel()
    layers_rate = fp8_tflops if model.weights.quantization == "fp8" else bf16_tflops
    linear_s = ((linear_flops(model, tokens) - lm_head) / layers_rate + lm_head / bf16_tflops) / 1e12
    attention_s = attention_flops(model, tokens) / bf16_tflops / 1e12
    return {"bound_s": linear_s + attention_s, "linear_bound_s": linear_s, "attention_bound_s": attention_s}


def attention_flops(model: PagedLlama, tokens: int) -> float:
    """QK^T and PV of causal attention over a prompt, every layer: each query sees half the prompt."""
    return 2 * 2 * model.num_layers * model.num_heads * model.head_dim * tokens * tokens / 2


def kv_token_bytes(model: PagedLlama, kv_dtype: str, page_size: int) -> int:
    """One token's K and V over all layers in pages of kv_dtype, scales included."""
    return token_bytes(model.kv_layout(1, page_size, kv_dtype))
