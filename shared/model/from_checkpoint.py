"""A PagedLlama from a checkpoint folder or a `random:<preset>`: unquantized, quantized to FP8 at load,
or stored in FP8; whole, or one tensor-parallel rank's shard."""

from __future__ import annotations

from pathlib import Path

import torch

from shared.model import presets
from shared.model.checkpoint_weights import DIRECT_MODEL_TYPES, checkpoint_weights
from shared.model.fp8_weights import is_fp8_checkpoint, random_fp8_weights
from shared.model.llama import PagedLlama
from shared.model.loader import UnsupportedModel, config_dict
from shared.model.moe import MOE_MODEL_TYPES
from shared.model.tensor_parallel import SINGLE, TensorParallel, check_shardable, shard_weights
from shared.model.weights import LlamaWeights


def load_paged_llama(checkpoint: Path | str, dtype: str, device: str, quantization: str = "none",
                     tp: TensorParallel = SINGLE) -> PagedLlama:
    """From a checkpoint folder, or a `random:<preset>` model built on the device. quantization
    "fp8" (model.quantization) quantizes the linear layers' weights (shared/model/quantization.py);
    a checkpoint stored in FP8 loads as it is stored, whatever quantization says. With tp of more
    than one rank, the rank's shard of it (_load_shard). On the CPU, FP8 weights are held widened
    to float32 (LayerWeights.widen_fp8): the same numbers, without a conversion at every product."""
    _refuse_fp8_experts(checkpoint, quantization)
    model = _load(checkpoint, getattr(torch, dtype), device, quantization, tp)
    if model.device.type == "cpu":
        for layer in model.layers:
            layer.widen_fp8()
    return model


def _load(checkpoint: Path | str, torch_dtype: torch.dtype, device: str, quantization: str,
          tp: TensorParallel) -> PagedLlama:
    if tp.size > 1:
        return _load_shard(checkpoint, torch_dtype, device, quantization, tp)
    if presets.is_random(str(checkpoint)):
        if quantization == "fp8":
            config = presets.preset_config(str(checkpoint))
            return PagedLlama(config, random_fp8_weights(config, torch_dtype, device), device)
        return PagedLlama.from_hf(presets.random_hf_model(str(checkpoint), torch_dtype, device), device)
    config = _config(checkpoint)
    model = PagedLlama(config, _stored_weights(checkpoint, config, torch_dtype, device), device)
    if quantization == "fp8" and model.weights.quantization == "none":
        for layer in model.layers:
            layer.quantize_fp8()
    return model


def _refuse_fp8_experts(checkpoint: Path | str, quantization: str) -> None:
    """FP8 is not implemented for experts: refused before gigabytes are loaded, or an FP8 checkpoint's
    expert tensors read as if it were dense."""
    fields = config_dict(checkpoint)
    if fields.get("model_type") in MOE_MODEL_TYPES and (quantization == "fp8" or is_fp8_checkpoint(fields)):
        raise UnsupportedModel("FP8 weights for a mixture-of-experts model are not implemented: serve an "
                               'unquantized checkpoint with model.quantization = "none"')


def _load_shard(checkpoint: Path | str, dtype: torch.dtype, device: str, quantization: str,
               tp: TensorParallel) -> PagedLlama:
    """Rank tp.rank's shard: the whole model loaded on the CPU (random presets too, so that every rank
    draws the same weights from the seed), sharded, the shard moved to the device and only then
    quantized, so the device never holds more than the shard."""
    config = _config(checkpoint)
    check_shardable(config, tp.size)
    shard = shard_weights(_weights_on_cpu(checkpoint, config, dtype), config, tp)
    shard = LlamaWeights.from_named({name: t.to(device) for name, t in shard.named().items()}, len(shard.layers))
    if quantization == "fp8" and shard.quantization == "none":
        for layer in shard.layers:
            layer.quantize_fp8()
    return PagedLlama(config, shard, device, tp=tp)


def _config(checkpoint: Path | str):
    if presets.is_random(str(checkpoint)):
        return presets.preset_config(str(checkpoint))
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(checkpoint))


def _weights_on_cpu(checkpoint: Path | str, config, dtype: torch.dtype) -> LlamaWeights:
    if presets.is_random(str(checkpoint)):
        return LlamaWeights.from_hf(presets.random_hf_model(str(checkpoint), dtype, "cpu"),
                                    config.max_position_embeddings)
    return _stored_weights(checkpoint, config, dtype, "cpu")


def _stored_weights(checkpoint: Path | str, config, dtype: torch.dtype, device: str) -> LlamaWeights:
    """A checkpoint folder's weights on the device: read from its files for the dense model types,
    through transformers' from_pretrained for those whose tensors it converts (experts, MLA)."""
    if config.model_type in DIRECT_MODEL_TYPES:
        return checkpoint_weights(Path(checkpoint), config, dtype, device, is_fp8_checkpoint(config_dict(checkpoint)))
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=dtype, device_map=device)
    return LlamaWeights.from_hf(hf_model.eval(), config.max_position_embeddings)
