"""A prompt chunk's causal attention through kernels that also return their log-sum-exp.

A whole prompt (or its first chunk) is one causal call. A chunk after earlier keys (the earlier
chunks, or a cached prefix) is split in two: its queries against the earlier keys with no mask, and
against its own keys with the ordinary causal mask; the two results merge by their log-sum-exps
(shared/kernels/attention_merge.py). On a GPU both calls go to cuDNN's attention, the fastest the
device has for a causal prompt, which runs a chunk after earlier keys slowly when asked for it with
the bottom-right mask that case needs; neither half needs that mask (docs/BENCHMARKS.md, "Prefill
attention").

Grouped KV heads: cuDNN reads the KV heads of a group once for all its query heads where PyTorch
lets it (GQA_NATIVE). Otherwise (GQA_STACKED) the unmasked part stacks each group's query heads
along the sequence (no mask, so positions do not matter) and the causal part repeats its own K/V
heads, which are only a chunk long: a long context's K/V are never repeated.

On the CPU the same split runs through PyTorch's CPU flash kernel, which the tests compare with the
masked attention; the CPU prefill itself keeps the masked SDPA (shared/model/attention.py).
"""

from __future__ import annotations

import torch
from torch.backends.cuda import SDPAParams, can_use_cudnn_attention

from shared.kernels.attention_merge import merge_attention

GQA_NATIVE, GQA_STACKED = "native", "stacked"

def gqa_modes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[str | None, str] | None:
    """How each part of the split runs here: (the unmasked part's GQA mode, None without earlier
    keys; the causal part's), or None where this device's kernels cannot run a part (then the caller
    attends with the masked SDPA). q [T, H, D]; k, v [S, KVH, D], the last T keys the queries' own."""
    length, context = q.shape[0], k.shape[0]
    own = _gqa_mode(q, k[context - length:], v[context - length:], causal=True)
    if context == length or own is None:
        return None if own is None else (None, own)
    earlier = _gqa_mode(q, k[: context - length], v[: context - length], causal=False)
    return None if earlier is None else (earlier, own)


def split_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    modes: tuple[str | None, str]) -> torch.Tensor:
    """q [T, H, D], k/v [S, KVH, D] with S >= T (the last T keys are the queries' own) -> [T, H, D],
    causal from the bottom right; modes from gqa_modes (or forced, to compare them)."""
    length, context = q.shape[0], k.shape[0]
    earlier_mode, own_mode = modes
    if context == length:
        return attend(q, k, v, scale, causal=True, gqa=own_mode, need_lse=False)[0]
    own_out, own_lse = attend(q, k[context - length:], v[context - length:], scale, causal=True, gqa=own_mode)
    earlier_out, earlier_lse = attend(q, k[: context - length], v[: context - length], scale, causal=False,
                                      gqa=earlier_mode)
    return merge_attention(earlier_out, earlier_lse, own_out, own_lse)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool, gqa: str,
           need_lse: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """q [T, H, D] against k, v [S, KVH, D] (causal: from the top left) -> (out [T, H, D] with a
    contiguous last dim, lse [H, T] float32: the log-sum-exp of each query's scaled scores)."""
    if gqa == GQA_STACKED and not causal:
        return _attend_stacked(q, k, v, scale)
    if gqa == GQA_STACKED:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out, lse = _lse_kernel(_bhsd(q), _bhsd(k), _bhsd(v), causal, scale, need_lse)
    return out[0].transpose(0, 1), _heads_by_tokens(lse, q.shape[1], q.shape[0]) if need_lse else None


def _attend_stacked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """Unmasked attention with each KV group's query heads one after another along the sequence:
    row r * T + t of KV head g holds query t of head g * group + r."""
    tokens, heads, head_dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    stacked = q.view(tokens, kv_heads, group, head_dim).permute(2, 0, 1, 3).reshape(group * tokens, kv_heads, head_dim)
    out, lse = _lse_kernel(_bhsd(stacked), _bhsd(k), _bhsd(v), False, scale, True)
    out = out[0].transpose(0, 1).reshape(group, tokens, kv_heads, head_dim).permute(1, 2, 0, 3)
    return out.reshape(tokens, heads, head_dim), _heads_by_tokens(lse, heads, tokens)


def _lse_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
                need_lse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """[1, H, T, D] views of [T, H, D] tensors -> (out [1, H, T, D], laid out as q; lse)."""
    if q.is_cuda:
        out, lse = torch.ops.aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, need_lse, 0.0, causal, False, scale=scale)[:2]
        return out, lse
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, scale=scale)


def _gqa_mode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> str | None:
    if not q.is_cuda:
        return GQA_NATIVE  # the CPU flash kernel groups the heads itself
    q4, k4, v4 = _bhsd(q), _bhsd(k), _bhsd(v)
    if _cudnn_accepts(q4, k4, v4, causal):
        return GQA_NATIVE
    if q.shape[1] != k.shape[1] and _cudnn_accepts(q4[:, : k.shape[1]], k4, v4, causal):
        return GQA_STACKED
    return None


def _cudnn_accepts(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> bool:
    """PyTorch's own checks for its cuDNN attention (dtype, head dim, lengths, layout, cuDNN version)."""
    return can_use_cudnn_attention(SDPAParams(q, k, v, None, 0.0, causal, q.shape[1] != k.shape[1]))


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    """[S, H, D] -> [1, H, S, D], a view: the layout SDPA's kernels take, sequence-major in memory."""
    return x.transpose(0, 1).unsqueeze(0)


def _heads_by_tokens(lse: torch.Tensor, heads: int, tokens: int) -> torch.Tensor:
    """A kernel's log-sum-exp ([1, H, T], or [1, H, T, 1] from cuDNN) as [H, T], a view where it can be."""
    return lse.reshape(heads, tokens)
