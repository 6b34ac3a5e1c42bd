"""A dense checkpoint's weights read straight from its safetensors files, as serving engines read
them: Llama, Mistral, Qwen2 and Qwen3 in transformers' layout (model.layers.N.self_attn.q_proj.weight,
...), q/k/v and gate/up fused as LlamaWeights holds them. Each linear weight comes as stored: in the
model's dtype, or in FP8 with its scale where the checkpoint stores FP8 (shared/model/fp8_weights.py
says which formats).

Read without transformers' model classes and from_pretrained, a worker of the embedded model starts
on 6.3 s of CPU instead of 7.6-7.9 (the modeling code imports torch._dynamo; docs/BENCHMARKS.md).
Mixture-of-experts and MLA checkpoints, whose tensors transformers converts as it loads them, still
come through from_pretrained (shared/model/from_checkpoint.py)."""

from __future__ import annotations

import json
from contextlib import ExitStack
from pathlib import Path

import torch

from shared.model.loader import UnsupportedModel
from shared.model.quantization import FP8, quantize_weight
from shared.model.weights import LayerWeights, LlamaWeights, rope_frequencies, rope_tables

DIRECT_MODEL_TYPES = {"llama", "mistral", "qwen2", "qwen3"}

# Stored beside the weights by some checkpoints, recomputed from the config here.
_RECOMPUTED = ("rotary_emb.inv_freq",)


class CheckpointTensors:
    """The tensors of a folder's safetensors files by name, each read to the device when asked for;
    which were read, so that none the model needs is left over."""

    def __init__(self, folder: Path, device: torch.device | str):
        from safetensors import safe_open

        self._stack = ExitStack()
        self._files = {}
        for path in _weight_files(folder):
            handle = self._stack.enter_context(safe_open(str(path), "pt", device=str(device)))
            self._files |= {name: handle for name in handle.keys()}
        self.read: set[str] = set()

    def __enter__(self) -> "CheckpointTensors":
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def __contains__(self, name: str) -> bool:
        return name in self._files

    def get(self, name: str) -> torch.Tensor:
        if name not in self._files:
            raise UnsupportedModel(f"the checkpoint has no tensor {name}")
        self.read.add(name)
        return self._files[name].get_tensor(name)

    def unread_weights(self) -> list[str]:
        return sorted(name for name in self._files.keys() - self.read
                      if name.endswith((".weight", ".bias")) and not name.endswith(_RECOMPUTED))


def _weight_files(folder: Path) -> list[Path]:
    """The files transformers reads: those model.safetensors.index.json maps the tensors to, else
    model.safetensors. A folder may hold another format's files beside them (Mistral's
    consolidated.safetensors, under other names)."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        return sorted({folder / name for name in json.loads(index.read_text())["weight_map"].values()})
    if (folder / "model.safetensors").exists():
        return [folder / "model.safetensors"]
    raise UnsupportedModel(f"{folder} has neither model.safetensors nor model.safetensors.index.json")


def checkpoint_weights(folder: Path, config, dtype: torch.dtype, device: torch.device | str,
                       fp8_stored: bool = False) -> LlamaWeights:
    """fp8_stored: the checkpoint stores its linear weights in FP8 (is_fp8_checkpoint); a projection it
    left unquantized is quantized here, so every layer holds one kind. Tensors the forward pass would
    not read (an MLP's biases, say) are refused rather than dropped."""
    if config.model_type not in DIRECT_MODEL_TYPES:
        raise UnsupportedModel(f"model type {config.model_type!r} is read through transformers, not from its files")
    with CheckpointTensors(folder, device) as stored:
        reader = _Reader(stored, config, dtype, fp8_stored)
        layers = [reader.layer(f"model.layers.{i}") for i in range(config.num_hidden_layers)]
        embed, lm_head = reader.embeddings(config.tie_word_embeddings)
        final_norm = reader.plain("model.norm.weight")
        left = stored.unread_weights()
    if left:
        raise UnsupportedModel(f"the checkpoint has tensors this model does not read: {', '.join(left[:6])}")
    cos, sin = rope_tables(*rope_frequencies(config), config.max_position_embeddings, dtype)
    return LlamaWeights(embed=embed, final_norm=final_norm, lm_head=lm_head, cos=cos.to(device),
                        sin=sin.to(device), layers=layers)


class _Reader:
    """What each layer holds follows from the config, as transformers builds the model's modules:
    biases on q/k/v with attention_bias and always in Qwen2, on o_proj with attention_bias, and
    per-head q/k norms in Qwen3."""

    def __init__(self, stored: CheckpointTensors, config, dtype: torch.dtype, fp8_stored: bool):
        self.stored, self.dtype, self.fp8_stored = stored, dtype, fp8_stored
        self.output_bias = bool(getattr(config, "attention_bias", False))
        self.qkv_bias = self.output_bias or config.model_type == "qwen2"
        self.head_norms = config.model_type == "qwen3"

    def plain(self, name: str) -> torch.Tensor:
        tensor = self.stored.get(name)
        if tensor.dtype == FP8:  # its scale would be dropped: an FP8 lm_head, say
            raise UnsupportedModel(f"{name} is stored in FP8: only the layers' linear weights are read in FP8")
        return tensor.to(self.dtype)

    def optional(self, name: str, present: bool) -> torch.Tensor | None:
        return self.plain(name) if present else None

    def embeddings(self, tied: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(embed, lm_head); tied, one tensor for both, under whichever name the file kept."""
        embed_name, head_name = "model.embed_tokens.weight", "lm_head.weight"
        if not tied:
            return self.plain(embed_name), self.plain(head_name)
        embed = self.plain(embed_name if embed_name in self.stored else head_name)
        if head_name in self.stored:
            self.stored.read.add(head_name)
        return embed, embed

    def layer(self, prefix: str) -> LayerWeights:
        attention, mlp = f"{prefix}.self_attn", f"{prefix}.mlp"
        fused = {"qkv": self.projections(attention, ("q_proj", "k_proj", "v_proj")),
                 "o_proj": self.projections(attention, ("o_proj",)),
                 "gate_up": self.projections(mlp, ("gate_proj", "up_proj")),
                 "down": self.projections(mlp, ("down_proj",))}
        biases = [self.plain(f"{attention}.{name}.bias") for name in ("q_proj", "k_proj", "v_proj") if self.qkv_bias]
        return LayerWeights(
            input_norm=self.plain(f"{prefix}.input_layernorm.weight"),
            post_norm=self.plain(f"{prefix}.post_attention_layernorm.weight"),
            qkv_bias=torch.cat(biases) if biases else None,
            o_proj_bias=self.optional(f"{attention}.o_proj.bias", self.output_bias),
            q_norm=self.optional(f"{attention}.q_norm.weight", self.head_norms),
            k_norm=self.optional(f"{attention}.k_norm.weight", self.head_norms),
            **{name: weight for name, (weight, _) in fused.items()},
            **{f"{name}_scale": scale for name, (_, scale) in fused.items()})

    def projections(self, prefix: str, names: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The weights of names fused by rows, and in FP8 their scales per row (None unquantized)."""
        if not self.fp8_stored:
            return torch.cat([self.plain(f"{prefix}.{name}.weight") for name in names]), None
        weights, scales = [], []
        for name in names:
            weight = self.stored.get(f"{prefix}.{name}.weight")
            if weight.dtype != FP8:  # a projection the checkpoint left unquantized
                weight, scale = quantize_weight(weight.to(self.dtype))
            else:
                scale = self.stored.get(f"{prefix}.{name}.weight_scale").float().flatten()
                scale = scale.expand(weight.shape[0]) if scale.numel() == 1 else scale
            weights.append(weight)
            scales.append(scale)
        return torch.cat(weights), torch.cat(scales).contiguous()
