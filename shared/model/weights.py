"""The tensors the Llama-family forward pass reads (shared/model/llama.py), by layer and by name:
what a model is built from, quantized in, and shared between processes as (weight_share.py)."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from shared.model.loader import UnsupportedModel
from shared.model.mla import MlaWeights
from shared.model.moe import MoeWeights, check_supported
from shared.model.quantization import quantize_weight


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor | None  # None in an MLA layer (mla below)
    qkv_bias: torch.Tensor | None
    o_proj: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor | None  # the dense MLP's; None in a layer of experts
    down: torch.Tensor | None
    # FP8 weights' scales per output channel (shared/model/quantization.py); None in the model's dtype.
    qkv_scale: torch.Tensor | None = None
    o_proj_scale: torch.Tensor | None = None
    gate_up_scale: torch.Tensor | None = None
    down_scale: torch.Tensor | None = None
    # Models with attention_bias (Llama, Qwen3) have one; Qwen2 biases q/k/v alone.
    o_proj_bias: torch.Tensor | None = None
    # Qwen3's RMSNorms [head_dim] over each head's q and k, before RoPE; None for models without.
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    # The experts that replace the dense MLP in a mixture-of-experts layer (shared/model/moe.py).
    moe: MoeWeights | None = None
    # DeepSeek's multi-head latent attention in place of q/k/v (shared/model/mla.py).
    mla: MlaWeights | None = None

    def quantize_fp8(self) -> None:
        """Replaces each linear weight by its FP8 form and scale, freeing the original."""
        if self.moe is not None or self.mla is not None:
            raise UnsupportedModel("FP8 weights for a mixture-of-experts or MLA model are not implemented: "
                                   'serve it with model.quantization = "none"')
        for name in QUANTIZED:
            weight, scale = quantize_weight(getattr(self, name))
            setattr(self, name, weight)
            setattr(self, f"{name}_scale", scale)

    def widen_fp8(self) -> None:
        """FP8 weights to float32, exactly (every e4m3 value is a float32), their scales kept: the
        CPU's products are then the numbers it computed by widening the weight at every call
        (shared/model/quantization.py), which took 35 times the matmul itself."""
        for name in QUANTIZED:
            if getattr(self, f"{name}_scale") is not None:
                setattr(self, name, getattr(self, name).float())

    def named(self) -> dict[str, torch.Tensor]:
        """Every tensor by name, the experts' as moe.<name>, MLA's as mla.<name>."""
        tensors = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in _NESTED}
        for part in _NESTED:
            if getattr(self, part) is not None:
                tensors |= {f"{part}.{name}": t for name, t in getattr(self, part).named().items()}
        return {name: t for name, t in tensors.items() if t is not None}

    @classmethod
    def from_named(cls, tensors: dict[str, torch.Tensor]) -> "LayerWeights":
        def part(prefix: str) -> dict[str, torch.Tensor]:
            return {name.removeprefix(prefix): t for name, t in tensors.items() if name.startswith(prefix)}

        return cls(**{f.name: tensors.get(f.name) for f in fields(cls) if f.name not in _NESTED},
                   moe=MoeWeights.from_named(part("moe.")), mla=MlaWeights.from_named(part("mla.")))


_NESTED = ("moe", "mla")


QUANTIZED = ("qkv", "o_proj", "gate_up", "down")  # a layer's linear weights; embed and lm_head stay


@dataclass
class LlamaWeights:
    """Every tensor the forward pass reads, by name: what a process exports to share its weights."""
    embed: torch.Tensor
    final_norm: torch.Tensor
    lm_head: torch.Tensor
    cos: torch.Tensor  # RoPE tables [max_context, head_dim], attention scaling included
    sin: torch.Tensor
    layers: list[LayerWeights]

    @classmethod
    def from_hf(cls, hf_model, max_context: int) -> "LlamaWeights":
        body = hf_model.model
        dtype = body.embed_tokens.weight.dtype
        rotary = body.rotary_emb
        cos, sin = rope_tables(rotary.inv_freq, getattr(rotary, "attention_scaling", 1.0), max_context, dtype)
        return cls(
            embed=body.embed_tokens.weight.detach(),
            final_norm=body.norm.weight.detach(),
            lm_head=hf_model.lm_head.weight.detach(),
            cos=cos,
            sin=sin,
            layers=[cls._layer(layer, hf_model.config) for layer in body.layers],
        )

    @property
    def quantization(self) -> str:
        return "fp8" if self.layers[0].qkv_scale is not None else "none"

    @staticmethod
    def _layer(layer, config) -> LayerWeights:
        attn, mlp = layer.self_attn, layer.mlp
        latent = hasattr(attn, "kv_a_proj_with_mqa")
        biases = [None] if latent else [attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]
        experts = hasattr(mlp, "experts")
        if experts:
            check_supported(mlp)
        return LayerWeights(
            input_norm=layer.input_layernorm.weight.detach(),
            qkv=None if latent else torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).detach(),
            qkv_bias=torch.cat(biases).detach() if biases[0] is not None else None,
            o_proj=attn.o_proj.weight.detach(),
            post_norm=layer.post_attention_layernorm.weight.detach(),
            gate_up=None if experts else torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach(),
            down=None if experts else mlp.down_proj.weight.detach(),
            o_proj_bias=attn.o_proj.bias.detach() if attn.o_proj.bias is not None else None,
            q_norm=_head_norm(attn, "q_norm"),
            k_norm=_head_norm(attn, "k_norm"),
            moe=MoeWeights.from_hf(mlp) if experts else None,
            mla=MlaWeights.from_hf(attn, config) if latent else None,
        )

    def named(self) -> dict[str, torch.Tensor]:
        tensors = {name: getattr(self, name) for name in ("embed", "final_norm", "lm_head", "cos", "sin")}
        for i, layer in enumerate(self.layers):
            tensors |= {f"layers.{i}.{name}": t for name, t in layer.named().items()}
        return tensors

    @classmethod
    def from_named(cls, tensors: dict[str, torch.Tensor], num_layers: int) -> "LlamaWeights":
        layers = [LayerWeights.from_named({name.removeprefix(f"layers.{i}."): t for name, t in tensors.items()
                                           if name.startswith(f"layers.{i}.")}) for i in range(num_layers)]
        return cls(*(tensors[name] for name in ("embed", "final_norm", "lm_head", "cos", "sin")), layers)


def _head_norm(attn, name: str) -> torch.Tensor | None:
    norm = getattr(attn, name, None)
    return None if norm is None else norm.weight.detach()


def rope_frequencies(config) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [head_dim / 2], attention scaling) as the model type's rotary embedding
    computes them, without importing its modeling code: transformers' ROPE_INIT_FUNCTIONS for a
    scaled RoPE (llama3, yarn, ...), the original RoPE's frequencies for the default."""
    parameters = config.rope_parameters
    if parameters["rope_type"] != "default":
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        return ROPE_INIT_FUNCTIONS[parameters["rope_type"]](config)
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 1.0 / (parameters["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0


def rope_tables(inv_freq: torch.Tensor, attention_scaling: float, max_context: int,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [max_context, head_dim] from a rotary embedding's inverse frequencies, its
    attention scaling included."""
    positions = torch.arange(max_context, dtype=torch.float32, device=inv_freq.device)
    freqs = positions[:, None] * inv_freq.float()[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)
    return (angles.cos() * attention_scaling).to(dtype), (angles.sin() * attention_scaling).to(dtype)
