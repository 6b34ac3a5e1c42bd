"""What the served model costs, from its shapes alone: the weight bytes a decode step reads, a
prompt's matmul FLOPs and a token's KV bytes. A benchmark's floor or bound is one of these over a
rate of the device (loadtest/lib/device_rates.py).

A mixture-of-experts layer (LayerWeights.moe) costs its router and the experts its tokens are routed
to: top_k of them per token in FLOPs; in bytes, those a step's batch touches, which grow with the
batch towards all of them (experts_read). Shared experts (DeepSeek's) are a dense MLP every token
reads. An MLA layer (LayerWeights.mla) costs its projections, kv_b once per token (the prefill
expands each latent once; the decode absorbs it into the query and applies it after attention),
and attention of (qk_nope + qk_rope) wide scores and v wide values per head."""

from __future__ import annotations

import torch

from shared.kv.pool import token_bytes
from shared.model.llama import PagedLlama
from shared.model.loader import load_hf_config
from shared.model.weights import LayerWeights

# Read one row per token (the embedding) or per position (the RoPE tables), not whole, by a step.
ROW_GATHERED = ("embed", "cos", "sin")


def model_shape(checkpoint, dtype: torch.dtype, quantization: str = "none") -> PagedLlama:
    """The served model with its weights on the meta device: its shapes, FLOPs and bytes, no memory;
    quantization "fp8": its linear weights in FP8, as model.quantization has them (refused for a
    mixture-of-experts model, by LayerWeights.quantize_fp8, as the served model refuses it)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        hf = AutoModelForCausalLM.from_config(load_hf_config(checkpoint), dtype=dtype)
    model = PagedLlama.from_hf(hf, "meta")
    if quantization == "fp8":
        for layer in model.layers:
            layer.quantize_fp8()
    return model


def weight_bytes_per_step(model: PagedLlama, batch: int = 1) -> int:
    """The weight bytes a decode step of `batch` tokens reads: each dense layer's whole (biases
    included), the final norm and the lm_head, also where it is tied to the embedding; of a layer of
    experts, its router and the experts_read(model, batch) experts the batch is routed to."""
    share = experts_read(model, batch) / num_experts(model) if model.routing is not None else 1
    return round(sum(_bytes(t) * (share if _is_expert(name) else 1)
                     for name, t in model.weights.named().items() if name not in ROW_GATHERED))


def experts_read(model: PagedLlama, batch: int) -> float:
    """The experts of a layer that a step of `batch` tokens reads, in expectation, assuming uniform
    routing (each token picks top_k of the E experts, every k-subset alike, tokens independently): an
    expert is missed by all of them with probability (1 - k/E) ** batch, so E * (1 - (1 - k/E) ** batch)
    are read. A skewed router reads fewer (1 - (1 - p) ** batch is concave in an expert's share p): an
    upper estimate."""
    experts, k = num_experts(model), model.routing.top_k
    return experts * (1 - (1 - k / experts) ** batch)


def num_experts(model: PagedLlama) -> int:
    """E of a mixture-of-experts model: the rows of its routers."""
    return next(len(layer.moe.router) for layer in model.layers if layer.moe is not None)


def prefill_flops(model: PagedLlama, tokens: int) -> float:
    """Matmul FLOPs of a prompt: the linear layers' and the causal attention's."""
    return linear_flops(model, tokens) + attention_flops(model, tokens)


def linear_flops(model: PagedLlama, tokens: int) -> float:
    """2 * params per token for every layer's linears (of a layer of experts: the router and the top_k
    experts each token is routed to), plus the lm_head for the last position."""
    return 2 * sum(_linear_params_per_token(model, l) for l in model.layers) * tokens + 2 * model.lm_head.numel()


def _linear_params_per_token(model: PagedLlama, layer: LayerWeights) -> int:
    if layer.mla is not None:
        attention = sum(t.numel() for name, t in layer.mla.named().items() if not name.endswith(("norm", "bias")))
        attention += layer.o_proj.numel()
    else:
        attention = layer.qkv.numel() + layer.o_proj.numel()
    if layer.moe is None:
        return attention + layer.gate_up.numel() + layer.down.numel()
    experts = layer.moe.gate_up.numel() + layer.moe.down.numel()
    shared = sum(t.numel() for t in (layer.moe.shared_gate_up, layer.moe.shared_down) if t is not None)
    return attention + layer.moe.router.numel() + shared + experts // len(layer.moe.router) * model.routing.top_k


def _is_expert(name: str) -> bool:
    """A routed expert's weights (layers.<i>.moe.gate_up, .down), not what every token reads: the
    router, its correction bias, the shared experts."""
    return name.endswith((".moe.gate_up", ".moe.down"))


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


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
    if model.mla is not None:
        shape = model.mla.shape
        per_pair = shape.heads * (shape.nope + shape.rope + shape.v)
    else:
        per_pair = 2 * model.num_heads * model.head_dim
    return 2 * model.num_layers * per_pair * tokens * tokens / 2


def kv_token_bytes(model: PagedLlama, kv_dtype: str, page_size: int) -> int:
    """One token's K and V over all layers in pages of kv_dtype, scales included."""
    return token_bytes(model.kv_layout(1, page_size, kv_dtype))
