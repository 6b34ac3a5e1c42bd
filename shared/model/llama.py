"""The Llama-family forward pass (Llama, Mistral, Qwen2, Qwen3, SmolLM, the MoE Mixtral and Qwen3-MoE, and
DeepSeek-V2/V3, whose attention is MLA) over the paged KV pool.

transformers loads the weights; this module runs them, because transformers' caches cannot do
paged continuous batching. Numerics follow transformers' LlamaModel (RMSNorm in fp32, RoPE
tables in fp32 cast to the activation dtype) so greedy tokens match it; q/k/v and gate/up are
fused into one matmul each. Qwen3 adds an RMSNorm over each head's q and k between the projection
and RoPE (LayerWeights.q_norm, k_norm), as Qwen3Attention does. Mixtral and Qwen3-MoE replace the
dense MLP by experts in some or all layers (LayerWeights.moe, shared/model/moe.py). DeepSeek's layers
attend through a latent that the pool keeps in place of K and V (LayerWeights.mla, shared/model/mla.py).
"""

from __future__ import annotations

import array
from collections.abc import Sequence
from typing import Callable

import torch
import torch.nn.functional as F

from shared.control.messages import KvLayout
from shared.kernels import fused_moe_triton, fused_triton, kv_quant
from shared.kv.heads import kv_heads_of
from shared.kv.pool import PagedKvPool, make_layout
from shared.kv.prompt_kv import PromptKv
from shared.model import attention
from shared.model.loader import UnsupportedModel, layer_windows
from shared.model.elementwise import apply_rope, rms_norm, silu_and_mul
from shared.model import layer_kernels
from shared.model.layer_kernels import PYTORCH, Kernels
from shared.model.linear_choice import LinearChooser
from shared.model.mla import Mla, MlaShape, decode_attention, is_mla
from shared.model.moe import Routing, moe_forward
from shared.model.quantization import Fp8Rows, fp8_linear
from shared.model.tensor_parallel import SINGLE, TensorParallel
from shared.model.weights import LayerWeights, LlamaWeights


def linear(x: torch.Tensor | Fp8Rows, weight: torch.Tensor, scale: torch.Tensor | None = None,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, or its FP8 form where the weight has a scale (x quantized already, or not)."""
    return F.linear(x, weight, bias) if scale is None else fp8_linear(x, weight, scale, bias)


class PagedLlama:
    """With tp of more than one rank, weights are the rank's shard (shard_weights) and the head counts
    the rank's own: its KV pool holds only its KV heads."""

    def __init__(self, config, weights: LlamaWeights, device: torch.device | str, tp: TensorParallel = SINGLE):
        self.config = config
        self.device = torch.device(device)
        self.tp = tp
        self.num_heads = config.num_attention_heads // tp.size
        self.total_kv_heads = config.num_key_value_heads
        self.num_kv_heads = len(kv_heads_of(tp.rank, tp.size, self.total_kv_heads))
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.num_layers = config.num_hidden_layers
        self.vocab_size = config.vocab_size
        self.max_context = config.max_position_embeddings
        self.eps = config.rms_norm_eps
        self.scale = self.head_dim ** -0.5
        self.windows = layer_windows(config)  # each layer's sliding window; 0: it sees every earlier token
        _check_head_norms(config, weights)
        self.routing = Routing.of(config, weights.embed.dtype)
        self.weights = weights
        self.embed, self.final_norm, self.lm_head = weights.embed, weights.final_norm, weights.lm_head
        self.cos, self.sin, self.layers = weights.cos, weights.sin, weights.layers
        self.mla: Mla | None = None
        if is_mla(config):  # the pool keeps one latent "head" per token and layer, every rank all of it
            self.mla = Mla(MlaShape.of(config, tp.size), self.eps, self.cos, self.sin)
            self.total_kv_heads = self.num_kv_heads = 1
            self.head_dim, self.scale = self.mla.shape.latent_dim, self.mla.shape.scale
        self.linears = LinearChooser()  # the fused decode's matmuls: cuBLAS or the Triton GEMV, per shape
        # float8_e4m3 pages on a GPU: q and the probabilities in e4m3 too, both attention products on
        # FP8 tensor cores (shared/kernels/paged_attention_triton.py); benchmarks compare it.
        self.fp8_query = False
        # The prefill's fused Triton kernels run on the GPU (tests run them on the CPU, interpreted).
        self.fused_prefill = self.device.type == "cuda"
        # There, the residual adds inside the matmuls where they can be (_output_and_mlp_fused);
        # benchmarks compare it with the adds apart.
        self.adds_in_matmuls = True
        # With FP8 weights, the GPU's norms and SiLU before a product (which quantizes its rows) quantize
        # their output in the same kernel (_quantized_for); benchmarks compare it with the quantization apart.
        self.fp8_rows_fused = True

    @classmethod
    def from_hf(cls, hf_model, device: torch.device | str) -> "PagedLlama":
        config = hf_model.config
        return cls(config, LlamaWeights.from_hf(hf_model, config.max_position_embeddings), device)

    def kv_layout(self, num_pages: int, page_size: int, kv_dtype: str = "bfloat16") -> KvLayout:
        """The layout of a KV pool for this model, its pages in kv_dtype (kv.dtype: "bfloat16",
        the default, keeps them unquantized in the model's own dtype)."""
        return make_layout(self.num_layers, num_pages, page_size, self.num_kv_heads, self.head_dim,
                           kv_quant.storage_dtype(kv_dtype, self.embed.dtype), 1 if self.mla else 2)

    def prefill_variant_rows(self) -> list[int]:
        """The chunk lengths from which the GPU prefill's kernels take another compiled variant (RoPE's
        blocked rows; with experts, their long-run tiles). Lengths within a variant compile nothing
        new: the kernels take them unspecialized (services/prefill/warmup.py)."""
        rows = {fused_triton.ROPE_BLOCKED_FROM_ROWS}
        moe = next((layer.moe for layer in self.layers if layer.moe is not None), None)
        if moe is not None:
            rows.add(fused_moe_triton.long_run_tokens(moe.gate_up.shape[0], self.routing.top_k))
        return sorted(rows)

    def _rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, weight, self.eps)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return apply_rope(x, self.cos, self.sin, positions)

    def _qkv(self, layer: LayerWeights, x: torch.Tensor, positions: torch.Tensor):
        qkv = linear(self._rms_norm(x, layer.input_norm), layer.qkv, layer.qkv_scale, layer.qkv_bias)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q, k = q.view(-1, self.num_heads, self.head_dim), k.view(-1, self.num_kv_heads, self.head_dim)
        if layer.q_norm is not None:
            q, k = self._rms_norm(q, layer.q_norm), self._rms_norm(k, layer.k_norm)
        return self._rope(q, positions), self._rope(k, positions), v.view(-1, self.num_kv_heads, self.head_dim)

    def _norm_heads_in_place(self, layer: LayerWeights, qkv: torch.Tensor) -> None:
        """q_norm and k_norm over the q and k heads of a fused projection, written back into it,
        where rope_write_kv reads them. The Triton RMSNorm takes rows of one stride, which a row's
        heads are not across rows: each part is copied out and back."""
        heads = qkv.view(len(qkv), -1, self.head_dim)
        q_heads, k_heads = heads[:, : self.num_heads], heads[:, self.num_heads: self.num_heads + self.num_kv_heads]
        for part, weight in ((q_heads, layer.q_norm), (k_heads, layer.k_norm)):
            part.copy_(fused_triton.rms_norm(part.reshape(-1, self.head_dim), weight, self.eps).view_as(part))

    def _mlp_block(self, layer: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        hidden = self._rms_norm(x, layer.post_norm)
        if layer.moe is not None:
            return x + self.tp.all_reduce(moe_forward(hidden, layer.moe, self.routing))
        gate_up = linear(hidden, layer.gate_up, layer.gate_up_scale)
        return x + self.tp.all_reduce(linear(silu_and_mul(gate_up), layer.down, layer.down_scale))

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return self._whole_vocab(F.linear(self._rms_norm(x, self.final_norm), self.lm_head)).float()

    def _whole_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Every rank's slice of the logits gathered, the vocabulary's padding (shard_weights) dropped."""
        if self.tp.size == 1:
            return logits
        return self.tp.gather_vocab(logits)[:, : self.vocab_size]

    @torch.inference_mode()
    def prefill(self, token_ids: Sequence[int], pool: PagedKvPool, page_ids: list[int],
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
        pages = _index_tensor(page_ids, self.device)
        positions = torch.arange(start, len(token_ids), device=self.device)
        slots = pages[positions // pool.layout.page_size], positions % pool.layout.page_size
        hidden = self.embed[_index_tensor(token_ids[start:], self.device)]
        staged = self._prompt_kv(len(token_ids), hidden.dtype)
        layer_chunk = self._layer_chunk_fused if self.fused_prefill else self._layer_chunk
        if self.mla is not None:
            layer_chunk = self._mla_layer_chunk
        for i, layer in enumerate(self.layers):
            if start > 0:
                prefix_pages = pages[: -(-start // pool.layout.page_size)]
                if self.mla is not None:
                    self.mla.stage_prefix(layer.mla, pool, i, prefix_pages, start, staged)
                else:
                    staged.load_prefix(pool, i, prefix_pages, start)
            for begin in range(0, len(hidden), chunk):
                rows = slice(begin, begin + chunk)
                layer_chunk(layer, i, hidden[rows], start + begin, positions[rows],
                            (slots[0][rows], slots[1][rows]), pool, staged)
                if after_chunk is not None:
                    after_chunk()
        return self._logits(hidden[-1:])[0]

    def _prompt_kv(self, tokens: int, dtype: torch.dtype) -> PromptKv:
        if self.mla is None:
            return PromptKv(tokens, self.num_kv_heads, self.head_dim, dtype, self.device)
        shape = self.mla.shape  # every head's key and value, expanded from the latent
        return PromptKv(tokens, shape.heads, shape.nope + shape.rope, dtype, self.device, v_dim=shape.v)

    def _mla_layer_chunk(self, layer: LayerWeights, index: int, x: torch.Tensor, begin: int,
                         positions: torch.Tensor, slots: tuple[torch.Tensor, torch.Tensor], pool: PagedKvPool,
                         staged: PromptKv) -> None:
        """An MLA layer over a chunk: its latents to the pages, expanded into keys and values for the
        prompt's attention (shared/model/mla.py); with fused_prefill the GPU's Triton kernels between
        the matmuls, as in _layer_chunk_fused."""
        end, mla = begin + len(x), self.mla
        kernels = layer_kernels.fused() if self.fused_prefill else PYTORCH
        normed = kernels.rms_norm(x, layer.input_norm, self.eps)
        q_nope, q_rope = mla.queries(layer.mla, normed, positions, kernels)
        latent = mla.latents(layer.mla, normed, positions, kernels)
        pool.write_latent(index, *slots, latent)
        staged.write(begin, *mla.expand(layer.mla, latent))
        out = attention.prefill_attention(torch.cat([q_nope, q_rope], dim=-1), staged.k[:end], staged.v[:end],
                                          self.scale)
        if self.fused_prefill:
            self._output_and_mlp_fused(layer, out.reshape(len(x), -1), x)
        else:
            attn = self.tp.all_reduce(linear(out.reshape(len(x), -1), layer.o_proj, layer.o_proj_scale,
                                             layer.o_proj_bias))
            x.copy_(self._mlp_block(layer, x + attn))

    def _layer_chunk(self, layer: LayerWeights, index: int, x: torch.Tensor, begin: int, positions: torch.Tensor,
                     slots: tuple[torch.Tensor, torch.Tensor], pool: PagedKvPool, staged: PromptKv) -> None:
        """Layer `index` over the chunk of positions begin onwards, whose rows of the residual stream
        x it overwrites with its output; the chunk's K/V go to its pages' slots and to staged."""
        end = begin + len(x)
        q, k, v = self._qkv(layer, x, positions)
        pool.write(index, *slots, k, v)
        staged.write(begin, k, v)
        out = attention.prefill_attention(q, staged.k[:end], staged.v[:end], self.scale, self.windows[index])
        attn = self.tp.all_reduce(linear(out.reshape(len(x), -1), layer.o_proj, layer.o_proj_scale, layer.o_proj_bias))
        x.copy_(self._mlp_block(layer, x + attn))

    def _layer_chunk_fused(self, layer: LayerWeights, index: int, x: torch.Tensor, begin: int,
                           positions: torch.Tensor, slots: tuple[torch.Tensor, torch.Tensor], pool: PagedKvPool,
                           staged: PromptKv) -> None:
        """The same with the GPU's fused Triton kernels between the matmuls (RoPE with the KV write,
        SiLU with the gate product, the residual adds in the matmuls: _output_and_mlp_fused): between
        two matmuls one pass over the activations instead of several."""
        end = begin + len(x)
        q, v = self._fused_qkv(layer, x, positions, pool, index, *slots, staged.k[begin:end])
        staged.v[begin:end] = v
        out = attention.prefill_attention(q, staged.k[:end], staged.v[:end], self.scale, self.windows[index])
        self._output_and_mlp_fused(layer, out.reshape(len(x), -1), x)

    def _output_and_mlp_fused(self, layer: LayerWeights, out: torch.Tensor, x: torch.Tensor) -> None:
        """x += o_proj(out), then x += the MLP of its post-attention norm, x overwritten; SiLU with the
        gate product in one Triton kernel. On one rank with unquantized weights both adds happen in
        the matmuls (addmm_: the BLAS adds x as it writes the product, the sum rounded once), so no
        kernel reads and writes the residual stream just to add; otherwise the first add goes with
        the norm (add_rms_norm) and the second is its own kernel. With FP8 weights the norm and SiLU
        write their output quantized for the product that reads it (_quantized_for)."""
        in_matmul = (self.adds_in_matmuls and self.tp.size == 1 and layer.o_proj_scale is None
                     and layer.o_proj_bias is None)
        if in_matmul:
            x.addmm_(out, layer.o_proj.t())
            hidden, residual = fused_triton.rms_norm(x, layer.post_norm, self.eps), x
        else:
            attn = self.tp.all_reduce(linear(out, layer.o_proj, layer.o_proj_scale, layer.o_proj_bias))
            hidden, residual = self._normed_for(attn, x, layer.post_norm, layer.gate_up_scale)
        if layer.moe is not None:
            torch.add(residual, self.tp.all_reduce(moe_forward(hidden, layer.moe, self.routing, layer_kernels.fused())),
                      out=x)
            return
        act = self._silu_for(linear(hidden, layer.gate_up, layer.gate_up_scale), layer.down_scale)
        if in_matmul:
            x.addmm_(act, layer.down.t())
        else:
            torch.add(residual, self.tp.all_reduce(linear(act, layer.down, layer.down_scale)), out=x)

    def _fused_qkv(self, layer: LayerWeights, x: torch.Tensor, positions: torch.Tensor, pool: PagedKvPool,
                   index: int, pages: torch.Tensor, offsets: torch.Tensor, k_out: torch.Tensor):
        """A chunk's q and v as _qkv computes them, its rotated k written to k_out; K and V go to the
        pages (quantized where they are) in the same Triton kernel as the RoPE, as the decode writes them."""
        qkv = linear(self._normed_for(x, None, layer.input_norm, layer.qkv_scale)[0], layer.qkv, layer.qkv_scale,
                     layer.qkv_bias)
        if layer.q_norm is not None:
            self._norm_heads_in_place(layer, qkv)
        q = fused_triton.rope_write_kv(qkv, self.cos, self.sin, positions, pool.key(index), pool.value(index),
                                       pages, offsets, self.num_heads, self.num_kv_heads, self.head_dim,
                                       pool.key_scale(index), pool.value_scale(index), k_out)
        v = qkv[:, (self.num_heads + self.num_kv_heads) * self.head_dim:].view(len(x), self.num_kv_heads, self.head_dim)
        return q, v

    def _quantized_for(self, weight_scale: torch.Tensor | None) -> bool:
        """Whether the GPU's kernel before a product writes its output in FP8 for it (an FP8 weight:
        the product would quantize it)."""
        return self.fp8_rows_fused and weight_scale is not None

    def _normed_for(self, x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                    product_scale: torch.Tensor | None) -> tuple[torch.Tensor | Fp8Rows, torch.Tensor]:
        """(normed, summed): the GPU's RMSNorm of x, or of x + residual (summed: the new residual
        stream, x itself without one), in FP8 where the product that reads it wants (_quantized_for)."""
        if self._quantized_for(product_scale):
            if residual is None:
                return Fp8Rows(*fused_triton.rms_norm_fp8(x, norm_weight, self.eps), x.dtype), x
            quantized, summed = fused_triton.add_rms_norm_fp8(x, residual, norm_weight, self.eps)
            return Fp8Rows(*quantized, x.dtype), summed
        if residual is None:
            return fused_triton.rms_norm(x, norm_weight, self.eps), x
        return fused_triton.add_rms_norm(x, residual, norm_weight, self.eps)

    def _silu_for(self, gate_up: torch.Tensor, product_scale: torch.Tensor | None) -> torch.Tensor | Fp8Rows:
        """The GPU's SiLU with the gate product, in FP8 where the down product wants (_quantized_for)."""
        if self._quantized_for(product_scale):
            return Fp8Rows(*fused_triton.silu_and_mul_fp8(gate_up), gate_up.dtype)
        return fused_triton.silu_and_mul(gate_up)

    @torch.inference_mode()
    def decode(self, token_ids: torch.Tensor, positions: torch.Tensor, page_table: torch.Tensor,
               pool: PagedKvPool) -> torch.Tensor:
        """One step for a batch: token_ids/positions [B], page_table [B, P] -> logits [B, V]."""
        page_size = pool.layout.page_size
        pages = page_table.gather(1, (positions // page_size)[:, None])[:, 0]
        offsets = positions % page_size
        seq_lens = (positions + 1).to(torch.int32)  # once, not in each layer's attention call
        if self.device.type == "cuda":
            return self._decode_fused(token_ids, positions, page_table, pool, pages, offsets, seq_lens)
        if self.mla is not None:
            return self._decode_mla(token_ids, positions, page_table, pool, pages, offsets, seq_lens)
        x = self.embed[token_ids]
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x, positions)
            pool.write(i, pages, offsets, k, v)
            out = attention.paged_decode_attention(q, pool.key(i), pool.value(i), page_table, seq_lens, self.scale,
                                                   pool.key_scale(i), pool.value_scale(i), window=self.windows[i])
            x = x + self.tp.all_reduce(linear(out.reshape(len(token_ids), -1), layer.o_proj, layer.o_proj_scale,
                                              layer.o_proj_bias))
            x = self._mlp_block(layer, x)
        return self._logits(x)

    def _decode_mla(self, token_ids, positions, page_table, pool, pages, offsets, seq_lens) -> torch.Tensor:
        """The CPU's step of MLA layers, in PyTorch (on a GPU _decode_fused runs them)."""
        x = self.embed[token_ids]
        for i, layer in enumerate(self.layers):
            out = self._mla_step(layer, i, self._rms_norm(x, layer.input_norm), positions, pool, pages, offsets,
                                 page_table, seq_lens, PYTORCH)
            x = x + self.tp.all_reduce(linear(out, layer.o_proj, layer.o_proj_scale, layer.o_proj_bias))
            x = self._mlp_block(layer, x)
        return self._logits(x)

    def _mla_step(self, layer: LayerWeights, index: int, normed: torch.Tensor, positions, pool: PagedKvPool,
                  pages, offsets, page_table, seq_lens, kernels: Kernels) -> torch.Tensor:
        """An MLA layer's attention for a step in the absorbed form, before o_proj: every head's query
        in latent space, attention over the latent pages alone, the value up-projection after it
        (shared/model/mla.py) -> [B, heads * v]."""
        mla = self.mla
        q_nope, q_rope = mla.queries(layer.mla, normed, positions, kernels)
        mla.write_latents(layer.mla, normed, positions, pool, index, pages, offsets, kernels)
        out = decode_attention(mla.absorb(layer.mla, q_nope), q_rope, pool, index, page_table, seq_lens, self.scale)
        return mla.unabsorb(layer.mla, out)

    def _decode_fused(self, token_ids, positions, page_table, pool, pages, offsets, seq_lens) -> torch.Tensor:
        """The same step with its elementwise chains fused into Triton kernels (RMSNorm with the
        residual add, RoPE with the KV write, SiLU with the gate product): ten kernels a layer
        instead of about thirty-five, which is most of a small batch's step time. The matmuls go
        through self.linears, which reads each weight with cuBLAS or the Triton GEMV, whichever
        was faster for the shape; MLA layers' attention and the shared experts' too. With FP8 weights
        the norms and SiLU hand their products rows in FP8 (_normed_for)."""
        batch = len(token_ids)
        residual = self.embed[token_ids]
        hidden = self._normed_for(residual, None, self.layers[0].input_norm, self.layers[0].qkv_scale)[0]
        # The norm after each layer: the next layer's input norm, for its qkv product, or the final one.
        norms = [(layer.input_norm, layer.qkv_scale) for layer in self.layers[1:]] + [(self.final_norm, None)]
        kernels = layer_kernels.fused(self.linears.apply)
        for i, layer in enumerate(self.layers):
            if self.mla is not None:
                out = self._mla_step(layer, i, hidden, positions, pool, pages, offsets, page_table, seq_lens, kernels)
            else:
                out = self._attention_step(layer, i, hidden, positions, pool, pages, offsets, page_table,
                                           seq_lens).reshape(batch, -1)
            attn = self.tp.all_reduce(self.linears.apply(out, layer.o_proj, layer.o_proj_bias, layer.o_proj_scale))
            hidden, residual = self._normed_for(attn, residual, layer.post_norm, layer.gate_up_scale)
            if layer.moe is not None:
                mlp = self.tp.all_reduce(moe_forward(hidden, layer.moe, self.routing, kernels))
            else:
                gate_up = self.linears.apply(hidden, layer.gate_up, scale=layer.gate_up_scale)
                mlp = self.tp.all_reduce(self.linears.apply(self._silu_for(gate_up, layer.down_scale), layer.down,
                                                            scale=layer.down_scale))
            hidden, residual = self._normed_for(mlp, residual, *norms[i])
        return self._whole_vocab(self.linears.apply(hidden, self.lm_head)).float()

    def _attention_step(self, layer: LayerWeights, index: int, hidden: torch.Tensor, positions, pool: PagedKvPool,
                        pages, offsets, page_table, seq_lens) -> torch.Tensor:
        """A Llama-family layer's attention for a step, before o_proj: the fused RoPE and KV write,
        then the paged kernel -> [B, heads, head_dim]."""
        qkv = self.linears.apply(hidden, layer.qkv, layer.qkv_bias, layer.qkv_scale)
        if layer.q_norm is not None:
            self._norm_heads_in_place(layer, qkv)
        q = fused_triton.rope_write_kv(qkv, self.cos, self.sin, positions, pool.key(index), pool.value(index), pages,
                                       offsets, self.num_heads, self.num_kv_heads, self.head_dim,
                                       pool.key_scale(index), pool.value_scale(index))
        return attention.paged_decode_attention(q, pool.key(index), pool.value(index), page_table, seq_lens,
                                                self.scale, pool.key_scale(index), pool.value_scale(index),
                                                self.fp8_query, self.windows[index])


def _index_tensor(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """int64 on the device, by way of an array: torch.tensor of a list of 128K ints took 42 ms on a CPU
    machine, this 1 (the prefill's token ids come as an array already: shared/control/wire.py)."""
    return torch.frombuffer(array.array("q", values), dtype=torch.int64).to(device)


def _check_head_norms(config, weights: LlamaWeights) -> None:
    """Qwen3 without its per-head q/k norms would run and answer wrongly: weights built elsewhere than
    from a checkpoint (random_fp8_weights in shared/model/fp8_weights.py) have none."""
    if config.model_type in ("qwen3", "qwen3_moe") and weights.layers[0].q_norm is None:
        raise UnsupportedModel("these qwen3 weights lack the per-head q_norm/k_norm (random FP8 weights are "
                               "drawn without them)")
