"""The Llama-family forward pass (Llama, Mistral, Qwen2, SmolLM) over the paged KV pool.

transformers loads the weights; this module runs them, because transformers' caches cannot do
paged continuous batching. Numerics follow transformers' LlamaModel (RMSNorm in fp32, RoPE
tables in fp32 cast to the activation dtype) so greedy tokens match it; q/k/v and gate/up are
fused into one matmul each.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from shared.kv_pool import PagedKvPool
from shared.model import attention, presets


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o_proj: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


class PagedLlama:
    def __init__(self, hf_model, device: torch.device | str):
        config = hf_model.config
        self.config = config
        self.device = torch.device(device)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.num_layers = config.num_hidden_layers
        self.vocab_size = config.vocab_size
        self.max_context = config.max_position_embeddings
        self.eps = config.rms_norm_eps
        self.scale = self.head_dim ** -0.5
        body = hf_model.model
        self.embed = body.embed_tokens.weight
        self.final_norm = body.norm.weight
        self.lm_head = hf_model.lm_head.weight
        self.layers = [self._layer(layer) for layer in body.layers]
        rotary = body.rotary_emb
        positions = torch.arange(self.max_context, dtype=torch.float32, device=rotary.inv_freq.device)
        freqs = positions[:, None] * rotary.inv_freq.float()[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        scaling = getattr(rotary, "attention_scaling", 1.0)
        self.cos = (angles.cos() * scaling).to(self.embed.dtype)
        self.sin = (angles.sin() * scaling).to(self.embed.dtype)

    @staticmethod
    def _layer(layer) -> LayerWeights:
        attn, mlp = layer.self_attn, layer.mlp
        biases = [attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]
        return LayerWeights(
            input_norm=layer.input_layernorm.weight,
            qkv=torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]),
            qkv_bias=torch.cat(biases) if biases[0] is not None else None,
            o_proj=attn.o_proj.weight,
            post_norm=layer.post_attention_layernorm.weight,
            gate_up=torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
            down=mlp.down_proj.weight,
        )

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * h.to(x.dtype)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        cos, sin = self.cos[positions][:, None, :], self.sin[positions][:, None, :]
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos + rotated * sin

    def _qkv(self, layer: LayerWeights, x: torch.Tensor, positions: torch.Tensor):
        qkv = F.linear(self._rms_norm(x, layer.input_norm), layer.qkv, layer.qkv_bias)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = self._rope(q.view(-1, self.num_heads, self.head_dim), positions)
        k = self._rope(k.view(-1, self.num_kv_heads, self.head_dim), positions)
        return q, k, v.view(-1, self.num_kv_heads, self.head_dim)

    def _mlp_block(self, layer: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(self._rms_norm(x, layer.post_norm), layer.gate_up).chunk(2, dim=-1)
        return x + F.linear(F.silu(gate) * up, layer.down)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self._rms_norm(x, self.final_norm), self.lm_head).float()

    @staticmethod
    def _write_kv(pool: PagedKvPool, layer_index: int, pages: torch.Tensor, offsets: torch.Tensor,
                  k: torch.Tensor, v: torch.Tensor) -> None:
        pool.key(layer_index)[pages, offsets] = k
        pool.value(layer_index)[pages, offsets] = v

    @torch.inference_mode()
    def prefill(self, token_ids: list[int], pool: PagedKvPool, page_ids: list[int],
                chunk_tokens: int = 0) -> torch.Tensor:
        """Runs one prompt, writes its KV into page_ids, returns the last position's logits [V].

        With chunk_tokens > 0 the prompt goes through in chunks of that many tokens, so
        activation memory stays bounded for long prompts; each chunk attends to the earlier
        chunks' K/V read back from the pages.
        """
        chunk = chunk_tokens if chunk_tokens > 0 else len(token_ids)
        ids = torch.tensor(token_ids, device=self.device)
        pages = torch.tensor(page_ids, device=self.device)
        for start in range(0, len(token_ids), chunk):
            x = self._prefill_chunk(ids[start:start + chunk], start, pool, pages)
        return self._logits(x[-1:])[0]

    def _prefill_chunk(self, ids: torch.Tensor, start: int, pool: PagedKvPool, pages: torch.Tensor) -> torch.Tensor:
        page_size = pool.layout.page_size
        end = start + len(ids)
        positions = torch.arange(start, end, device=self.device)
        chunk_pages, offsets = pages[positions // page_size], positions % page_size
        x = self.embed[ids]
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x, positions)
            self._write_kv(pool, i, chunk_pages, offsets, k, v)
            if start > 0:  # earlier chunks: read back this request's pages up to the chunk's end
                used = pages[: -(-end // page_size)]
                k = pool.key(i)[used].flatten(0, 1)[:end]
                v = pool.value(i)[used].flatten(0, 1)[:end]
            out = attention.prefill_attention(q, k, v, self.scale)
            x = x + F.linear(out.reshape(len(ids), -1), layer.o_proj)
            x = self._mlp_block(layer, x)
        return x

    @torch.inference_mode()
    def decode(self, token_ids: torch.Tensor, positions: torch.Tensor, page_table: torch.Tensor,
               pool: PagedKvPool) -> torch.Tensor:
        """One step for a batch: token_ids/positions [B], page_table [B, P] -> logits [B, V]."""
        page_size = pool.layout.page_size
        pages = page_table.gather(1, (positions // page_size)[:, None])[:, 0]
        offsets = positions % page_size
        seq_lens = positions + 1
        x = self.embed[token_ids]
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x, positions)
            self._write_kv(pool, i, pages, offsets, k, v)
            out = attention.paged_decode_attention(q, pool.key(i), pool.value(i), page_table, seq_lens, self.scale)
            x = x + F.linear(out.reshape(len(token_ids), -1), layer.o_proj)
            x = self._mlp_block(layer, x)
        return self._logits(x)


def load_paged_llama(checkpoint: Path | str, dtype: str, device: str) -> PagedLlama:
    """From a checkpoint folder, or a `random:<preset>` model built on the device."""
    if presets.is_random(str(checkpoint)):
        return PagedLlama(presets.random_hf_model(str(checkpoint), getattr(torch, dtype), device), device)
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=getattr(torch, dtype), device_map=device)
    return PagedLlama(hf_model.eval(), device)
