"""Dense checkpoints read straight from their safetensors files (shared/model/checkpoint_weights.py)
hold every tensor that transformers' from_pretrained gives the same model, RoPE tables included;
a checkpoint with tensors the model would not read, or without one it needs, is refused. Each is a
tiny random checkpoint written with transformers."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

from shared.model.checkpoint_weights import checkpoint_weights
from shared.model.loader import UnsupportedModel
from shared.model.weights import LlamaWeights, rope_frequencies

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=300, max_position_embeddings=128)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}

CONFIGS = {
    "llama-tied": LlamaConfig(**TINY, tie_word_embeddings=True),
    "llama-biases-llama3-rope": LlamaConfig(**TINY, attention_bias=True, rope_parameters=LLAMA3_ROPE),
    "mistral": MistralConfig(**TINY, sliding_window=32, head_dim=32),
    "qwen2": Qwen2Config(**TINY),
    "qwen3": Qwen3Config(**TINY, head_dim=24),
    "llama-yarn": LlamaConfig(**TINY, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                                        "original_max_position_embeddings": 32}),
}


def _write(folder, config):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    model.save_pretrained(folder)
    return model


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_files_give_what_from_pretrained_gives(name, tmp_path):
    config = CONFIGS[name]
    _write(tmp_path, config)
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    expected = LlamaWeights.from_hf(reference, config.max_position_embeddings).named()
    got = checkpoint_weights(tmp_path, reference.config, torch.float32, "cpu").named()
    assert got.keys() == expected.keys()
    for tensor_name, tensor in expected.items():
        assert torch.equal(got[tensor_name], tensor), tensor_name
    assert ("layers.0.qkv_bias" in got) == (name in ("llama-biases-llama3-rope", "qwen2"))
    assert ("layers.0.q_norm" in got) == (name == "qwen3")


@pytest.mark.parametrize("name", list(CONFIGS))
def test_rope_frequencies_are_the_rotary_modules(name):
    """Without the modeling code: each model type's own rotary embedding computes the same."""
    model = AutoModelForCausalLM.from_config(CONFIGS[name])
    rotary = model.model.rotary_emb
    inv_freq, scaling = rope_frequencies(model.config)
    assert torch.equal(inv_freq, rotary.inv_freq)
    assert scaling == rotary.attention_scaling


def test_the_checkpoints_weights_in_bfloat16(tmp_path):
    _write(tmp_path, CONFIGS["qwen2"])
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16).eval()
    expected = LlamaWeights.from_hf(reference, TINY["max_position_embeddings"]).named()
    got = checkpoint_weights(tmp_path, reference.config, torch.bfloat16, "cpu").named()
    assert all(got[n].dtype == torch.bfloat16 and torch.equal(got[n], t) for n, t in expected.items())


def test_tensors_the_model_would_not_read_are_refused(tmp_path):
    """Llama's MLP biases: the forward pass has none, so dropping them would answer wrongly."""
    model = _write(tmp_path, LlamaConfig(**TINY, mlp_bias=True))
    with pytest.raises(UnsupportedModel, match="does not read: model.layers.0.mlp.down_proj.bias"):
        checkpoint_weights(tmp_path, model.config, torch.float32, "cpu")


def test_a_missing_tensor_is_named(tmp_path):
    model = _write(tmp_path, CONFIGS["qwen3"])
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UnsupportedModel, match="no tensor model.layers.1.self_attn.k_norm.weight"):
        checkpoint_weights(tmp_path, model.config, torch.float32, "cpu")


def test_weights_split_over_files_are_read_from_each_the_index_names(tmp_path):
    """A sharded checkpoint (transformers writes model-0000N-of-0000M.safetensors past max_shard_size),
    beside a file of Mistral's own format, which the index does not name."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(CONFIGS["mistral"]).eval()
    model.save_pretrained(tmp_path, max_shard_size="50KB")
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    save_file({"layers.0.attention.wq.weight": torch.ones(2, 2)}, tmp_path / "consolidated.safetensors")  # another format's
    expected = LlamaWeights.from_hf(model, TINY["max_position_embeddings"]).named()
    got = checkpoint_weights(tmp_path, model.config, torch.float32, "cpu").named()
    assert all(torch.equal(got[n], t) for n, t in expected.items())


def test_an_fp8_tensor_outside_the_linear_layers_is_refused(tmp_path):
    """An lm_head stored in FP8 (a checkpoint that did not `ignore` it) would read back without its scale."""
    model = _write(tmp_path, CONFIGS["llama-biases-llama3-rope"])
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["lm_head.weight"] = tensors["lm_head.weight"].to(torch.float8_e4m3fn)
    save_file(tensors, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(UnsupportedModel, match="lm_head.weight is stored in FP8"):
        checkpoint_weights(tmp_path, model.config, torch.float32, "cpu", fp8_stored=True)
