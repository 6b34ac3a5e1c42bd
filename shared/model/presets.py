"""Random-weight models of real shapes, so the GPU can be measured without downloading weights.

`model.path = "random:llama-3.1-8b"` builds Llama-3.1-8B's architecture (32 layers, 32 query and
8 KV heads of 128, 14336 MLP, 128256 vocab) with random weights in the configured dtype, straight
on the device (with model.quantization fp8, each linear weight quantized as it is drawn:
shared/model/fp8_weights.py). Speed depends on shapes, not on the values of the weights.

A preset is a config.json's fields; "model_type" names its architecture where it is not Llama's
(written into the preset only there, so the Llama presets' fields, which the fingerprint hashes,
stay as they were).
"""

from __future__ import annotations

import copy

PREFIX = "random:"

LLAMA_3_1_8B = dict(
    hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=131072,
    rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False, bos_token_id=128000,
    eos_token_id=128009,
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192},
)

# DeepSeek-V2-Lite's published shape: 27 layers of MLA (16 heads, a latent of 512 plus a RoPE key
# of 64), the first with a dense MLP, the others 64 experts of 1408, 6 routed per token plus 2
# shared; 15.7B parameters, 2.4B of them active per token. YaRN over 4096 original positions.
DEEPSEEK_V2_LITE = dict(
    model_type="deepseek_v2", hidden_size=2048, intermediate_size=10944, moe_intermediate_size=1408,
    num_hidden_layers=27, num_attention_heads=16, num_key_value_heads=16, kv_lora_rank=512, q_lora_rank=None,
    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=64, num_experts_per_tok=6,
    n_shared_experts=2, first_k_dense_replace=1, topk_method="greedy", n_group=1, topk_group=1,
    routed_scaling_factor=1.0, norm_topk_prob=False, vocab_size=102400, max_position_embeddings=163840,
    rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=100000,
    eos_token_id=100001,
    rope_scaling={"type": "yarn", "rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                  "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 0.707, "mscale_all_dim": 0.707},
)

PRESETS = {
    "llama-3.1-8b": LLAMA_3_1_8B,
    # Llama-3.1-70B's shape: 140 GB in bf16, more than one H200; 70 GB with model.quantization fp8.
    "llama-3.1-70b": {**LLAMA_3_1_8B, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                      "num_attention_heads": 64},
    # The same shape with a 512K context, for one 512K-token prompt (loadtest/stack/bench_long_prompt.py).
    # RoPE keeps Llama 3.1's scaling, stretched 64 times instead of 8 over the 8192 original
    # positions, so that every position up to 524288 lies within the scaled range.
    "llama-3.1-8b-512k": {**LLAMA_3_1_8B, "max_position_embeddings": 524288,
                          "rope_scaling": {**LLAMA_3_1_8B["rope_scaling"], "factor": 64.0}},
    # Qwen3-30B-A3B's published shape: 48 layers of 128 experts of 768, 8 routed per token, no shared
    # expert; 30.5B parameters, 3.3B of them active per token. FP8 is refused for experts.
    "qwen3-30b-a3b": dict(
        model_type="qwen3_moe", hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128, num_experts=128,
        num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
        vocab_size=151936, max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
        tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645,
    ),
    "deepseek-v2-lite": DEEPSEEK_V2_LITE,
    # The same with a 512K context: YaRN stretched 128 times over the 4096 original positions.
    "deepseek-v2-lite-512k": {**DEEPSEEK_V2_LITE, "max_position_embeddings": 524288,
                              "rope_scaling": {**DEEPSEEK_V2_LITE["rope_scaling"], "factor": 128.0}},
    # A small model of the Llama family for quick GPU tests.
    "llama-tiny": dict(
        hidden_size=512, intermediate_size=1536, num_hidden_layers=4, num_attention_heads=8,
        num_key_value_heads=2, head_dim=64, vocab_size=32000, max_position_embeddings=65536,
        rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
    ),
}


def is_random(path: str) -> bool:
    return path.startswith(PREFIX)


def preset_name(path: str) -> str:
    name = path.removeprefix(PREFIX)
    if name not in PRESETS:
        raise ValueError(f"unknown random model {name!r}; presets: {sorted(PRESETS)}")
    return name


def preset_fields(path: str) -> dict:
    """The preset's config fields, a deep copy: transformers' config writes into nested dicts
    (rope_scaling), and the preset's own must stay as the fingerprint hashed them."""
    return copy.deepcopy(PRESETS[preset_name(path)])


def preset_config(path: str):
    from transformers import AutoConfig

    fields = preset_fields(path)
    return AutoConfig.for_model(fields.pop("model_type", "llama"), **fields)


def random_hf_model(path: str, dtype, device: str, seed: int = 0):
    """dtype: a torch.dtype. torch is imported here, not at the top: the router reads presets too."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(preset_config(path), dtype=dtype)
    return model.eval()
