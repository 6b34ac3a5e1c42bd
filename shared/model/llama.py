"""The Llama-family forward pass (Llama, Mistral, Qwen2, SmolLM) over the paged KV pool.

transformers loads the weights; this module runs them, because transformers' caches cannot do
paged continuous batching. Numerics follow transformers' LlamaModel (RMSNorm in fp32, RoPE
tables in fp32 cast to the activation dtype) so greedy tokens match it; q/k/v and gate/up are
fused into one matmul each.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from shared.control.messages import KvLayout
from shared.kernels import fused_triton, kv_quant
from shared.kv.pool import PagedKvPool, make_layout
from shared.kv.prompt_kv import PromptKv
from shared.model import attention, presets
from shared.model.linear_choice import LinearChooser


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o_proj: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


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
        rotary = body.rotary_emb
        positions = torch.arange(max_context, dtype=torch.float32, device=rotary.inv_freq.device)
        freqs = positions[:, None] * rotary.inv_freq.float()[None, :]
        angles = torch.cat((freqs, freqs), dim=-1)
        scaling = getattr(rotary, "attention_scaling", 1.0)
        dtype = body.embed_tokens.weight.dtype
        return cls(
            embed=body.embed_tokens.weight.detach(),
            final_norm=body.norm.weight.detach(),
            lm_head=hf_model.lm_head.weight.detach(),
            cos=(angles.cos() * scaling).to(dtype),
            sin=(angles.sin() * scaling).to(dtype),
            layers=[cls._layer(layer) for layer in body.layers],
        )

    @staticmethod
    def _layer(layer) -> LayerWeights:
        attn, mlp = layer.self_attn, layer.mlp
        biases = [attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]
        return LayerWeights(
            input_norm=layer.input_layernorm.weight.detach(),
            qkv=torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).detach(),
            qkv_bias=torch.cat(biases).detach() if biases[0] is not None else None,
            o_proj=attn.o_proj.weight.detach(),
            post_norm=layer.post_attention_layernorm.weight.detach(),
            gate_up=torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach(),
            down=mlp.down_proj.weight.detach(),
        )

    def named(self) -> dict[str, torch.Tensor]:
        tensors = {name: getattr(self, name) for name in ("embed", "final_norm", "lm_head", "cos", "sin")}
        for i, layer in enumerate(self.layers):
            for f in fields(LayerWeights):
                if getattr(layer, f.name) is not None:
                    tensors[f"layers.{i}.{f.name}"] = getattr(layer, f.name)
        return tensors

    @classmethod
    def from_named(cls, tensors: dict[str, torch.Tensor], num_layers: int) -> "LlamaWeights":
        layers = [LayerWeights(**{f.name: tensors.get(f"layers.{i}.{f.name}") for f in fields(LayerWeights)})
                  for i in range(num_layers)]
        return cls(*(tensors[name] for name in ("embed", "final_norm", "lm_head", "cos", "sin")), layers)


class PagedLlama:
    def __init__(self, config, weights: LlamaWeights, device: torch.device | str):
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
        self.weights = weights
        self.embed, self.final_norm, self.lm_head = weights.embed, weights.final_norm, weights.lm_head
        self.cos, self.sin, self.layers = weights.cos, weights.sin, weights.layers
        self.linears = LinearChooser()  # the fused decode's matmuls: cuBLAS or the Triton GEMV, per shape
        # float8_e4m3 pages on a GPU: q and the probabilities in e4m3 too, both attention products on
        # FP8 tensor cores (shared/kernels/paged_attention_triton.py); benchmarks compare it.
        self.fp8_query = False
        # The prefill's fused Triton kernels run on the GPU (tests run them on the CPU, interpreted).
        self.fused_prefill = self.device.type == "cuda"

    @classmethod
    def from_hf(cls, hf_model, device: torch.device | str) -> "PagedLlama":
        config = hf_model.config
        return cls(config, LlamaWeights.from_hf(hf_model, config.max_position_embeddings), device)

    def kv_layout(self, num_pages: int, page_size: int, kv_dtype: str = "bfloat16") -> KvLayout:
        """The layout of a KV pool for this model, its pages in kv_dtype (kv.dtype: "bfloat16",
        the default, keeps them unquantized in the model's own dtype)."""
        return make_layout(self.num_layers, num_pages, page_size, self.num_kv_heads, self.head_dim,
                           kv_quant.storage_dtype(kv_dtype, self.embed.dtype))

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

    @torch.inference_mode()
    def prefill(self, token_ids: list[int], pool: PagedKvPool, page_ids: list[int],
                chunk_tokens: int = 0, after_chunk: Callable[[], None] | None = None, start: int = 0) -> torch.Tensor:
        """Runs one prompt, writes its KV into page_ids, returns the last position's logits [V].

        The prompt runs layer by layer, each layer over it in chunks of chunk_tokens (0: all at
        once), so activation memory stays bounded for long prompts: beside one chunk's activations
        only the residual stream of every position and one layer's K/V of the prompt
        (shared/kv/prompt_kv.py) are kept, and a chunk's attention reads the earlier chunks' K/V
        there, in place. after_chunk runs once each chunk of a layer is issued (the worker's
        liveness: a long prompt is progress, chunk by chunk). start: the KV of the first `start`
        tokens is already in the pages (a cached prefix), so only the rest is computed, attending to
        it as a later chunk does; at least the last token is computed, for its logits. With
        quantized pages (kv.dtype int8 or float8_e4m3) the prompt attends to its own K/V as computed
        and to a cached prefix's as the pages hold them, dequantized, as the decode does.
        """
        if not 0 <= start < len(token_ids):
            raise ValueError(f"start {start} must leave at least one of the {len(token_ids)} tokens to compute")
        chunk = chunk_tokens if chunk_tokens > 0 else len(token_ids) - start
        pages = torch.tensor(page_ids, device=self.device)
        positions = torch.arange(start, len(token_ids), device=self.device)
        slots = pages[positions // pool.layout.page_size], positions % pool.layout.page_size
        hidden = self.embed[torch.tensor(token_ids[start:], device=self.device)]
        staged = PromptKv(len(token_ids), self.num_kv_heads, self.head_dim, hidden.dtype, self.device)
        layer_chunk = self._layer_chunk_fused if self.fused_prefill else self._layer_chunk
        for i, layer in enumerate(self.layers):
            if start > 0:
                staged.load_prefix(pool, i, pages[: -(-start // pool.layout.page_size)], start)
            for begin in range(0, len(hidden), chunk):
                rows = slice(begin, begin + chunk)
                layer_chunk(layer, i, hidden[rows], start + begin, positions[rows],
                            (slots[0][rows], slots[1][rows]), pool, staged)
                if after_chunk is not None:
                    after_chunk()
        return self._logits(hidden[-1:])[0]

    def _layer_chunk(self, layer: LayerWeights, index: int, x: torch.Tensor, begin: int, positions: torch.Tensor,
                     slots: tuple[torch.Tensor, torch.Tensor], pool: PagedKvPool, staged: PromptKv) -> None:
        """Layer `index` over the chunk of positions begin onwards, whose rows of the residual stream
        x it overwrites with its output; the chunk's K/V go to its pages' slots and to staged."""
        end = begin + len(x)
        q, k, v = self._qkv(layer, x, positions)
        pool.write(index, *slots, k, v)
        staged.write(begin, k, v)
        out = attention.prefill_attention(q, staged.k[:end], staged.v[:end], self.scale)
        x.copy_(self._mlp_block(layer, x + F.linear(out.reshape(len(x), -1), layer.o_proj)))

    def _layer_chunk_fused(self, layer: LayerWeights, index: int, x: torch.Tensor, begin: int,
                           positions: torch.Tensor, slots: tuple[torch.Tensor, torch.Tensor], pool: PagedKvPool,
                           staged: PromptKv) -> None:
        """The same with the GPU's fused Triton kernels between the matmuls, as the decode step has
        them (RMSNorm with the residual add, RoPE with the KV write, SiLU with the gate product):
        between two matmuls one pass over the activations instead of several."""
        end = begin + len(x)
        q, v = self._fused_qkv(layer, x, positions, pool, index, *slots, staged.k[begin:end])
        staged.v[begin:end] = v
        out = attention.prefill_attention(q, staged.k[:end], staged.v[:end], self.scale)
        attn = F.linear(out.reshape(len(x), -1), layer.o_proj)
        hidden, residual = fused_triton.add_rms_norm(attn, x, layer.post_norm, self.eps)
        mlp = F.linear(fused_triton.silu_and_mul(F.linear(hidden, layer.gate_up)), layer.down)
        torch.add(residual, mlp, out=x)

    def _fused_qkv(self, layer: LayerWeights, x: torch.Tensor, positions: torch.Tensor, pool: PagedKvPool,
                   index: int, pages: torch.Tensor, offsets: torch.Tensor, k_out: torch.Tensor):
        """A chunk's q and v as _qkv computes them, its rotated k written to k_out; K and V go to the
        pages (quantized where they are) in the same Triton kernel as the RoPE, as the decode writes them."""
        qkv = F.linear(fused_triton.rms_norm(x, layer.input_norm, self.eps), layer.qkv, layer.qkv_bias)
        q = fused_triton.rope_write_kv(qkv, self.cos, self.sin, positions, pool.key(index), pool.value(index),
                                       pages, offsets, self.num_heads, self.num_kv_heads, self.head_dim,
                                       pool.key_scale(index), pool.value_scale(index), k_out)
        v = qkv[:, (self.num_heads + self.num_kv_heads) * self.head_dim:].view(len(x), self.num_kv_heads, self.head_dim)
        return q, v

    @torch.inference_mode()
    def decode(self, token_ids: torch.Tensor, positions: torch.Tensor, page_table: torch.Tensor,
               pool: PagedKvPool) -> torch.Tensor:
        """One step for a batch: token_ids/positions [B], page_table [B, P] -> logits [B, V]."""
        page_size = pool.layout.page_size
        pages = page_table.gather(1, (positions // page_size)[:, None])[:, 0]
        offsets = positions % page_size
        seq_lens = positions + 1
        if self.device.type == "cuda":
            return self._decode_fused(token_ids, positions, page_table, pool, pages, offsets, seq_lens)
        x = self.embed[token_ids]
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x, positions)
            pool.write(i, pages, offsets, k, v)
            out = attention.paged_decode_attention(q, pool.key(i), pool.value(i), page_table, seq_lens, self.scale,
                                                   pool.key_scale(i), pool.value_scale(i))
            x = x + F.linear(out.reshape(len(token_ids), -1), layer.o_proj)
            x = self._mlp_block(layer, x)
        return self._logits(x)

    def _decode_fused(self, token_ids, positions, page_table, pool, pages, offsets, seq_lens) -> torch.Tensor:
        """The same step with its elementwise chains fused into Triton kernels (RMSNorm with the
        residual add, RoPE with the KV write, SiLU with the gate product): ten kernels a layer
        instead of about thirty-five, which is most of a small batch's step time. The matmuls go
        through self.linears, which reads each weight with cuBLAS or the Triton GEMV, whichever
        was faster for the shape."""
        batch = len(token_ids)
        residual = self.embed[token_ids]
        hidden = fused_triton.rms_norm(residual, self.layers[0].input_norm, self.eps)
        norms = [layer.input_norm for layer in self.layers[1:]] + [self.final_norm]
        for i, layer in enumerate(self.layers):
            qkv = self.linears.apply(hidden, layer.qkv, layer.qkv_bias)
            q = fused_triton.rope_write_kv(qkv, self.cos, self.sin, positions, pool.key(i), pool.value(i), pages,
                                           offsets, self.num_heads, self.num_kv_heads, self.head_dim,
                                           pool.key_scale(i), pool.value_scale(i))
            out = attention.paged_decode_attention(q, pool.key(i), pool.value(i), page_table, seq_lens, self.scale,
                                                   pool.key_scale(i), pool.value_scale(i), self.fp8_query)
            attn = self.linears.apply(out.reshape(batch, -1), layer.o_proj)
            hidden, residual = fused_triton.add_rms_norm(attn, residual, layer.post_norm, self.eps)
            gate_up = self.linears.apply(hidden, layer.gate_up)
            mlp = self.linears.apply(fused_triton.silu_and_mul(gate_up), layer.down)
            hidden, residual = fused_triton.add_rms_norm(mlp, residual, norms[i], self.eps)
        return self.linears.apply(hidden, self.lm_head).float()


def load_paged_llama(checkpoint: Path | str, dtype: str, device: str) -> PagedLlama:
    """From a checkpoint folder, or a `random:<preset>` model built on the device."""
    if presets.is_random(str(checkpoint)):
        return PagedLlama.from_hf(presets.random_hf_model(str(checkpoint), getattr(torch, dtype), device), device)
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=getattr(torch, dtype), device_map=device)
    return PagedLlama.from_hf(hf_model.eval(), device)
