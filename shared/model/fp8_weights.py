"""FP8 weights built without a copy in the model's dtype: a 70B-shaped model is 140 GB in bf16, more
than an H200 holds, and 70 GB in FP8. Two sources:

  random presets    each linear weight drawn in the model's dtype on the device and quantized at
                    once, one matrix at a time (model.quantization = "fp8" with random:<preset>);
  FP8 checkpoints   safetensors whose config.json has a quantization_config of the compressed-tensors
                    "float-quantized" format (8-bit float weights, a scale per channel or per tensor)
                    or FBGEMM's fp8 (a scale per channel): the weights are taken as they are stored
                    (shared/model/checkpoint_weights.py reads them).

Either way each layer's q/k/v and gate/up are fused as the unquantized model fuses them, their
scales side by side (a per-tensor scale becomes that tensor's rows' scale).
"""

from __future__ import annotations

import json

import torch

from shared.model.weights import LayerWeights, LlamaWeights, rope_frequencies, rope_tables
from shared.model.quantization import quantize_weight


class UnsupportedQuantization(ValueError):
    pass


def is_fp8_checkpoint(config: dict) -> bool:
    """Whether a config.json says its linear weights are stored in FP8; raises for a quantization
    this project cannot run, rather than reading packed integers as floats."""
    quantization = config.get("quantization_config")
    if not quantization:
        return False
    method = quantization.get("quant_method")
    if method == "fbgemm_fp8":
        return True
    if method == "compressed-tensors":
        groups = quantization.get("config_groups", {}).values()
        weights = [group.get("weights") or {} for group in groups]
        if quantization.get("format") == "float-quantized" and weights and all(
                w.get("type") == "float" and w.get("num_bits") == 8 and w.get("strategy") in ("channel", "tensor")
                for w in weights):
            return True
    raise UnsupportedQuantization(f"quantization_config {json.dumps(quantization)[:200]} is not FP8 weights with "
                                  "a scale per channel or per tensor (compressed-tensors float-quantized, fbgemm_fp8)")


def random_fp8_weights(config, dtype: torch.dtype, device: torch.device | str, seed: int = 0) -> LlamaWeights:
    """A random preset's weights, normal(0, initializer_range) as transformers draws them, the
    linear layers quantized one at a time."""
    generator = torch.Generator(device).manual_seed(seed)
    std = getattr(config, "initializer_range", 0.02)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    hidden, kv = config.hidden_size, config.num_key_value_heads * head_dim

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, device=device, dtype=dtype) * std

    def fp8(*shape: int) -> tuple[torch.Tensor, torch.Tensor]:
        return quantize_weight(normal(*shape))

    def layer() -> LayerWeights:
        tensors = {"qkv": fp8(config.num_attention_heads * head_dim + 2 * kv, hidden),
                   "o_proj": fp8(hidden, config.num_attention_heads * head_dim),
                   "gate_up": fp8(2 * config.intermediate_size, hidden),
                   "down": fp8(config.hidden_size, config.intermediate_size)}
        ones = torch.ones(hidden, device=device, dtype=dtype)
        return LayerWeights(input_norm=ones, post_norm=ones.clone(), qkv_bias=None,
                            **{name: w for name, (w, _) in tensors.items()},
                            **{f"{name}_scale": s for name, (_, s) in tensors.items()})

    cos, sin = rope_tables(*rope_frequencies(config), config.max_position_embeddings, dtype)
    return LlamaWeights(embed=normal(config.vocab_size, hidden), final_norm=torch.ones(hidden, device=device, dtype=dtype),
                        lm_head=normal(config.vocab_size, hidden), cos=cos.to(device), sin=sin.to(device),
                        layers=[layer() for _ in range(config.num_hidden_layers)])
