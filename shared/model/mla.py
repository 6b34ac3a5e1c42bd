"""DeepSeek's multi-head latent attention (MLA, DeepSeek-V2 and V3) over a pool of latents.

Per token and layer the pool keeps one vector (shared/kv/pool.py, one shard per layer): c, the
compressed KV latent (kv_lora_rank values, after kv_a_layernorm), then k_rope, the RoPE key that
every head shares (qk_rope_head_dim values, rotated). A head's key is [W_uk c, k_rope] and its value
W_uv c, W_uk and W_uv being that head's rows of kv_b_proj.

The prefill computes attention from the latent: each prompt token's c expanded once into every
head's key and value (PromptKv), then causal attention as any model's. The decode uses the absorbed
form: q_nope W_uk is one query in latent space per head, so the scores are q_latent . c + q_rope .
k_rope over the pages as they are, all heads reading the same latent, and W_uv goes after attention.
A step reads the latent pages alone: 576 values a token and layer for DeepSeek-V3, not 128 heads of K
and V (shared/kernels/mla_decode_triton.py on a GPU).

RoPE: DeepSeek rotates interleaved pairs (x0, x1), (x2, x3), ... (V2 always, V3 with rope_interleave);
the rows of q and kv_a that make the rotated dims are reordered once at load (evens, then odds), so
that the rotate-half RoPE of the other models gives the same products in another order of dims.
YaRN's scaling is in the RoPE tables (transformers' rotary module); its mscale also multiplies the
softmax scale (softmax_scale). Under tensor parallelism a rank holds its heads' rows of q and kv_b
and its columns of o_proj; kv_a and the latent are replicated on every rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

from shared.kernels import mla_decode_triton
from shared.kv.pool import PagedKvPool
from shared.kv.prompt_kv import PromptKv
from shared.model.layer_kernels import PYTORCH, Kernels

MLA_MODEL_TYPES = {"deepseek_v2", "deepseek_v3"}


@dataclass
class MlaWeights:
    kv_a: torch.Tensor              # [kv_lora_rank + rope, hidden]: c, then k_rope
    kv_a_norm: torch.Tensor         # [kv_lora_rank]
    kv_b: torch.Tensor              # [heads * (nope + v), kv_lora_rank]: per head W_uk rows, then W_uv rows
    q: torch.Tensor | None = None   # [heads * (nope + rope), hidden], without q_lora_rank (V2-Lite)
    q_a: torch.Tensor | None = None  # [q_lora_rank, hidden]
    q_a_norm: torch.Tensor | None = None
    q_b: torch.Tensor | None = None  # [heads * (nope + rope), q_lora_rank]
    q_a_bias: torch.Tensor | None = None  # attention_bias
    kv_a_bias: torch.Tensor | None = None

    @classmethod
    def from_hf(cls, attn, config) -> "MlaWeights":
        """From transformers' DeepseekV2Attention or DeepseekV3Attention, the RoPE rows de-interleaved."""
        def weight(module):
            return None if module is None else module.weight.detach()

        def bias(module):
            return None if module is None or module.bias is None else module.bias.detach()

        shape = MlaShape.of(config)
        interleaved = config.model_type == "deepseek_v2" or getattr(config, "rope_interleave", True)
        q_out = attn.q_proj if attn.q_lora_rank is None else attn.q_b_proj
        q_rows = weight(q_out)
        kv_a = weight(attn.kv_a_proj_with_mqa)
        kv_a_bias = bias(attn.kv_a_proj_with_mqa)
        if interleaved:
            q_rows = _deinterleave_query_rows(q_rows, shape)
            kv_a, kv_a_bias = (None if t is None else _deinterleave_tail(t, shape.rope) for t in (kv_a, kv_a_bias))
        return cls(kv_a=kv_a, kv_a_norm=weight(attn.kv_a_layernorm), kv_b=weight(attn.kv_b_proj),
                   q=q_rows if attn.q_lora_rank is None else None, q_a=weight(attn.q_a_proj),
                   q_a_norm=weight(attn.q_a_layernorm), q_b=q_rows if attn.q_lora_rank is not None else None,
                   q_a_bias=bias(attn.q_a_proj), kv_a_bias=kv_a_bias)

    def named(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    @classmethod
    def from_named(cls, tensors: dict[str, torch.Tensor]) -> "MlaWeights | None":
        """None where the names are absent: a layer of another attention."""
        if "kv_a" not in tensors:
            return None
        return cls(**{f.name: tensors.get(f.name) for f in fields(cls)})


def _deinterleave_tail(rows: torch.Tensor, rope: int) -> torch.Tensor:
    """The last `rope` rows reordered evens then odds."""
    order = torch.cat([torch.arange(rows.shape[0] - rope), rows.shape[0] - rope + _evens_then_odds(rope)])
    return rows[order.to(rows.device)].contiguous()


def _deinterleave_query_rows(rows: torch.Tensor, shape: "MlaShape") -> torch.Tensor:
    per_head = rows.view(-1, shape.nope + shape.rope, *rows.shape[1:])
    head_order = torch.cat([torch.arange(shape.nope), shape.nope + _evens_then_odds(shape.rope)])
    return per_head[:, head_order.to(rows.device)].reshape(rows.shape).contiguous()


def _evens_then_odds(n: int) -> torch.Tensor:
    return torch.cat([torch.arange(0, n, 2), torch.arange(1, n, 2)])


@dataclass(frozen=True)
class MlaShape:
    heads: int  # this rank's
    nope: int   # qk_nope_head_dim
    rope: int   # qk_rope_head_dim
    v: int      # v_head_dim
    rank: int   # kv_lora_rank
    scale: float

    @classmethod
    def of(cls, config, tp_size: int = 1) -> "MlaShape":
        return cls(config.num_attention_heads // tp_size, config.qk_nope_head_dim, config.qk_rope_head_dim,
                   config.v_head_dim, config.kv_lora_rank, softmax_scale(config))

    @property
    def latent_dim(self) -> int:
        """The values a token keeps per layer: c, then k_rope."""
        return self.rank + self.rope


def is_mla(config) -> bool:
    return getattr(config, "model_type", None) in MLA_MODEL_TYPES


def softmax_scale(config) -> float:
    """1/sqrt(qk head dim), times YaRN's mscale(factor, mscale_all_dim) squared, as DeepSeek's
    reference (and transformers' yarn_apply_mscale) scale the scores."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    factor, mscale_all_dim = rope.get("factor", 1.0), rope.get("mscale_all_dim", 0)
    if rope.get("rope_type", rope.get("type", "default")) != "default" and mscale_all_dim and factor > 1:
        mscale = 0.1 * mscale_all_dim * math.log(factor) + 1.0
        scale *= mscale * mscale
    return scale


class Mla:
    """One model's MLA: its shape, norms' epsilon and RoPE tables; the layers' weights come per call."""

    def __init__(self, shape: MlaShape, eps: float, cos: torch.Tensor, sin: torch.Tensor):
        self.shape, self.eps, self.cos, self.sin = shape, eps, cos, sin

    def queries(self, w: MlaWeights, x: torch.Tensor, positions: torch.Tensor,
                kernels: Kernels = PYTORCH) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] (input_layernorm's output) -> q_nope [T, H, nope], rotated q_rope [T, H, rope]."""
        s, linear = self.shape, kernels.linear
        if w.q is not None:
            q = linear(x, w.q)
        else:
            q = linear(kernels.rms_norm(linear(x, w.q_a, w.q_a_bias), w.q_a_norm, self.eps), w.q_b)
        q_nope, q_rope = q.view(len(x), s.heads, s.nope + s.rope).split([s.nope, s.rope], dim=-1)
        return q_nope, kernels.rope(q_rope, self.cos, self.sin, positions)

    def latents(self, w: MlaWeights, x: torch.Tensor, positions: torch.Tensor,
                kernels: Kernels = PYTORCH) -> torch.Tensor:
        """x [T, hidden] -> what the pool keeps [T, 1, kv_lora_rank + rope]: normed c, rotated k_rope."""
        c, k_rope = kernels.linear(x, w.kv_a, w.kv_a_bias).split([self.shape.rank, self.shape.rope], dim=-1)
        k_rope = kernels.rope(k_rope[:, None], self.cos, self.sin, positions)[:, 0]
        return torch.cat([kernels.rms_norm(c, w.kv_a_norm, self.eps), k_rope], dim=-1)[:, None]

    def write_latents(self, w: MlaWeights, x: torch.Tensor, positions: torch.Tensor, pool: PagedKvPool, layer: int,
                      pages: torch.Tensor, offsets: torch.Tensor, kernels: Kernels = PYTORCH) -> None:
        """x [T, hidden] -> each token's latent (as `latents` computes it) into its slot of layer's pages."""
        if kernels.write_latent is None:
            pool.write_latent(layer, pages, offsets, self.latents(w, x, positions, kernels))
            return
        kernels.write_latent(kernels.linear(x, w.kv_a, w.kv_a_bias), w.kv_a_norm, self.eps, self.cos, self.sin,
                             positions, pool.latent(layer), pages, offsets, pool.latent_scale(layer))

    def expand(self, w: MlaWeights, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latents [S, 1, rank + rope] -> every head's keys [S, H, nope + rope] and values [S, H, v]."""
        s = self.shape
        c, k_rope = latent[:, 0].split([s.rank, s.rope], dim=-1)
        k_nope, v = F.linear(c, w.kv_b).view(len(latent), s.heads, s.nope + s.v).split([s.nope, s.v], dim=-1)
        return torch.cat([k_nope, k_rope[:, None].expand(-1, s.heads, -1)], dim=-1), v

    def stage_prefix(self, w: MlaWeights, pool: PagedKvPool, layer: int, pages: torch.Tensor, count: int,
                     staged: PromptKv) -> None:
        """A cached prefix's first `count` latents of `layer`, read from its pages, expanded into staged."""
        staged.write(0, *self.expand(w, pool.read_tokens(layer, pages, count, staged.k.dtype)))

    def absorb(self, w: MlaWeights, q_nope: torch.Tensor) -> torch.Tensor:
        """q_nope [B, H, nope] -> the same queries in latent space [B, H, rank]: q_nope W_uk per head."""
        return torch.einsum("bhn,hnr->bhr", q_nope, self._up(w)[:, : self.shape.nope])

    def unabsorb(self, w: MlaWeights, out: torch.Tensor) -> torch.Tensor:
        """Attention's output in latent space [B, H, rank] -> every head's value output [B, H * v]."""
        return torch.einsum("bhr,hvr->bhv", out, self._up(w)[:, self.shape.nope:]).flatten(1)

    def _up(self, w: MlaWeights) -> torch.Tensor:
        s = self.shape
        return w.kv_b.view(s.heads, s.nope + s.v, s.rank)


def decode_attention(q_latent: torch.Tensor, q_rope: torch.Tensor, pool: PagedKvPool, layer: int,
                     page_table: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """The absorbed attention of one step over the latent pages -> [B, H, rank]: the Triton kernel on
    a GPU, which reads the pages in place; its PyTorch reference on the CPU."""
    kernel = mla_decode_triton.mla_decode_attention if q_latent.is_cuda else mla_decode_triton.mla_decode_reference
    return kernel(q_latent, q_rope, pool.latent(layer), pool.latent_scale(layer), page_table.to(torch.int32),
                  seq_lens.to(torch.int32), scale)
