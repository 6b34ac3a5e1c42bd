"""Megatron-style tensor parallelism: each rank of a group holds a slice of every layer and the
ranks sum their partial outputs twice a layer.

  qkv, gate_up   column-parallel: a rank's rows are its query heads and KV heads (shared/kv/heads.py),
                 its part of the gate rows and of the up rows; attention and SiLU then run on
                 the rank's heads and columns alone, with nothing exchanged;
  o_proj, down   row-parallel: a rank's input columns, so its product is a partial sum of the full
                 output, which all_reduce completes before the residual add (o_proj's bias, where
                 there is one, added by rank 0 alone, so the sum holds it once);
  experts        each expert cut as the dense MLP is: its gate and up rows, its down's input columns, so
                 the rank's weighted sum over its experts' shares is a partial sum of the MLP's output
                 (shared/model/moe.py); DeepSeek's shared experts likewise;
  MLA            a rank's heads' rows of q (or q_b) and kv_b, its heads' columns of o_proj; kv_a, and so
                 the latent the pool keeps, whole on every rank (shared/model/mla.py);
  lm_head        a rank's vocabulary rows, the logits gathered (gather_vocab);
  the rest       embeddings, norms (Qwen3's per-head q/k norms too), the MoE router and RoPE tables,
                 replicated.

Every rank runs the same steps on the same tokens, each over its own KV pool.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from shared.control.dispatch import FatalError
from shared.kv.heads import check_tensor_parallel, kv_heads_of
from shared.model.mla import MlaWeights, is_mla
from shared.model.moe import MoeWeights
from shared.model.weights import LayerWeights, LlamaWeights


class RankLost(FatalError):
    """A collective failed or timed out: a rank died or hangs, so the worker cannot go on; it exits,
    and its ranks restart together (shared/worker/ranks.py)."""

    @classmethod
    def raised_by(cls, collective, *args, rank: int, size: int, **kwargs) -> None:
        try:
            collective(*args, **kwargs)
        except RuntimeError as exc:  # gloo's and NCCL's errors, DistBackendError among them
            raise cls(f"rank {rank} of {size}: a rank broke off ({exc})") from exc


@dataclass(frozen=True)
class TensorParallel:
    rank: int = 0
    size: int = 1
    group: object = None  # a torch.distributed ProcessGroup of `size` ranks; None at size 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums x in place over the group: the row-parallel products' partial sums."""
        if self.size > 1:
            RankLost.raised_by(dist.all_reduce, x, group=self.group, rank=self.rank, size=self.size)
        return x

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """Every rank's [B, V/size] slice of the vocabulary -> [B, V] on every rank."""
        if self.size == 1:
            return logits
        slices = [torch.empty_like(logits) for _ in range(self.size)]
        RankLost.raised_by(dist.all_gather, slices, logits.contiguous(), group=self.group, rank=self.rank,
                           size=self.size)
        return torch.cat(slices, dim=-1)


SINGLE = TensorParallel()


def check_shardable(config, size: int) -> None:
    """ValueError, saying why, for a group size the model's heads or MLP columns cannot be split by."""
    kv_heads = 1 if is_mla(config) else config.num_key_value_heads  # MLA's latent: one head, replicated
    check_tensor_parallel(size, config.num_attention_heads, kv_heads)
    for name in ("intermediate_size", "moe_intermediate_size"):  # the dense MLP's; Qwen3-MoE's experts'
        columns = getattr(config, name, None)
        if columns and columns % size:
            raise ValueError(f"tensor_parallel {size} does not divide the model's {columns} MLP columns ({name})")


def shard_weights(weights: LlamaWeights, config, tp: TensorParallel) -> LlamaWeights:
    """Rank tp.rank's slice of the model, every sliced tensor a copy so the full ones can be freed."""
    check_shardable(config, tp.size)
    if tp.size == 1:
        return weights
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    # o_proj's input columns: the rank's heads' outputs (an MLA head's is v_head_dim wide)
    q_columns = _part(tp, config.num_attention_heads * (config.v_head_dim if is_mla(config) else head_dim))
    kv_heads = kv_heads_of(tp.rank, tp.size, config.num_key_value_heads)
    kv_rows = slice(kv_heads.start * head_dim, kv_heads.stop * head_dim)
    q_size, kv_size = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    qkv_rows = [q_columns, _shift(kv_rows, q_size), _shift(kv_rows, q_size + kv_size)]
    mlp_columns = _part(tp, config.intermediate_size)
    gate_up_rows = [mlp_columns, _shift(mlp_columns, config.intermediate_size)]
    layers = [_shard_layer(layer, qkv_rows, q_columns, gate_up_rows, mlp_columns, tp) for layer in weights.layers]
    if is_mla(config):
        for shard, layer in zip(layers, weights.layers):
            shard.mla = _shard_mla(layer.mla, config, tp)
    return LlamaWeights(embed=weights.embed, final_norm=weights.final_norm, lm_head=_vocab_rows(weights.lm_head, tp),
                        cos=weights.cos, sin=weights.sin, layers=layers)


def _shard_layer(layer: LayerWeights, qkv_rows: list[slice], q_columns: slice, gate_up_rows: list[slice],
                 mlp_columns: slice, tp: TensorParallel) -> LayerWeights:
    """Column-parallel weights (and their biases and scales, per output row) cut by rows; row-parallel
    ones by input columns, their scales per output channel whole."""
    return LayerWeights(
        input_norm=layer.input_norm, post_norm=layer.post_norm,
        qkv=_rows(layer.qkv, qkv_rows), qkv_bias=_rows(layer.qkv_bias, qkv_rows),
        qkv_scale=_rows(layer.qkv_scale, qkv_rows),
        o_proj=layer.o_proj[:, q_columns].contiguous(), o_proj_scale=layer.o_proj_scale,
        o_proj_bias=layer.o_proj_bias if tp.rank == 0 else None, q_norm=layer.q_norm, k_norm=layer.k_norm,
        gate_up=_rows(layer.gate_up, gate_up_rows), gate_up_scale=_rows(layer.gate_up_scale, gate_up_rows),
        down=None if layer.down is None else layer.down[:, mlp_columns].contiguous(), down_scale=layer.down_scale,
        moe=None if layer.moe is None else _shard_experts(layer.moe, tp),
    )


def _shard_experts(moe: MoeWeights, tp: TensorParallel) -> MoeWeights:
    intermediate = moe.down.shape[2]
    columns = _part(tp, intermediate)
    gate_up = torch.cat([moe.gate_up[:, columns], moe.gate_up[:, _shift(columns, intermediate)]], dim=1)
    shared_gate_up = shared_down = None
    if moe.shared_gate_up is not None:
        shared = moe.shared_down.shape[1]
        shared_columns = _part(tp, shared)
        shared_gate_up = _rows(moe.shared_gate_up, [shared_columns, _shift(shared_columns, shared)])
        shared_down = moe.shared_down[:, shared_columns].contiguous()
    return MoeWeights(router=moe.router, gate_up=gate_up, down=moe.down[:, :, columns].contiguous(),
                      correction_bias=moe.correction_bias, shared_gate_up=shared_gate_up, shared_down=shared_down)


def _shard_mla(mla: MlaWeights, config, tp: TensorParallel) -> MlaWeights:
    """The rank's heads' rows of the query projection and of kv_b; the rest whole."""
    q_rows = [_part(tp, config.num_attention_heads * (config.qk_nope_head_dim + config.qk_rope_head_dim))]
    kv_b_rows = [_part(tp, config.num_attention_heads * (config.qk_nope_head_dim + config.v_head_dim))]
    return MlaWeights(kv_a=mla.kv_a, kv_a_norm=mla.kv_a_norm, kv_b=_rows(mla.kv_b, kv_b_rows),
                      q=_rows(mla.q, q_rows), q_a=mla.q_a, q_a_norm=mla.q_a_norm, q_b=_rows(mla.q_b, q_rows),
                      q_a_bias=mla.q_a_bias, kv_a_bias=mla.kv_a_bias)


def _vocab_rows(lm_head: torch.Tensor, tp: TensorParallel) -> torch.Tensor:
    """The rank's rows of the vocabulary, padded with zero rows to an equal share (the padding's
    logits are gathered, then trimmed by the model)."""
    per_rank = -(-len(lm_head) // tp.size)
    rows = lm_head[tp.rank * per_rank: (tp.rank + 1) * per_rank]
    return torch.cat([rows, rows.new_zeros(per_rank - len(rows), rows.shape[1])])


def _part(tp: TensorParallel, total: int) -> slice:
    share = total // tp.size
    return slice(tp.rank * share, (tp.rank + 1) * share)


def _shift(rows: slice, by: int) -> slice:
    return slice(rows.start + by, rows.stop + by)


def _rows(tensor: torch.Tensor | None, rows: list[slice]) -> torch.Tensor | None:
    return None if tensor is None else torch.cat([tensor[r] for r in rows])
