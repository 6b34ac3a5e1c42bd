"""Two partial attentions of the same queries merged into one, by their log-sum-exps.

A prefill chunk after earlier keys attends to them and to its own keys in two calls
(shared/model/split_attention.py). Each call returns its output o_i and, per query and head,
lse_i = log sum exp(score) over the keys it saw. Over both key sets, each part's softmax weights
shrink by exp(lse_i - lse) with lse = log(exp(lse_a) + exp(lse_b)), so

    out = o_b + sigmoid(lse_a - lse_b) * (o_a - o_b)

which never exponentiates a large number (PyTorch's context-parallel attention merges the same way).
On a GPU one Triton pass reads both outputs, computes in fp32 and rounds once; on the CPU the
PyTorch expression below does the same.
"""

from __future__ import annotations

import torch

from shared.kernels.triton_support import require_triton, tl, triton

# Elements of one program's [heads, head_dim] tile: all 32 heads of 128 for the 8B shape.
_TILE = 4096

if triton is not None:

    # The log-sum-exps' head strides are the chunk's length: specialized, a length that is not a
    # multiple of 16 would compile the kernel again during a request, holding the GIL for a second.
    @triton.jit(do_not_specialize=["stride_lah", "stride_lbh"])
    def _merge_kernel(
        a_ptr, b_ptr, lse_a_ptr, lse_b_ptr, out_ptr, heads, head_dim,
        stride_at, stride_ah, stride_bt, stride_bh,
        stride_lah, stride_lat, stride_lbh, stride_lbt, stride_ot, stride_oh,
        BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        # Program (t, j): token t, heads j * BLOCK_H onwards, every dim of each.
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        h_mask = h < heads
        mask = h_mask[:, None] & (d[None, :] < head_dim)
        lse_a = tl.load(lse_a_ptr + h * stride_lah + t * stride_lat, mask=h_mask, other=0.0)
        lse_b = tl.load(lse_b_ptr + h * stride_lbh + t * stride_lbt, mask=h_mask, other=0.0)
        weight = tl.sigmoid(lse_a.to(tl.float32) - lse_b.to(tl.float32))
        a = tl.load(a_ptr + t * stride_at + h[:, None] * stride_ah + d[None, :], mask=mask, other=0.0)
        b = tl.load(b_ptr + t * stride_bt + h[:, None] * stride_bh + d[None, :], mask=mask, other=0.0)
        b = b.to(tl.float32)
        out = b + weight[:, None] * (a.to(tl.float32) - b)
        tl.store(out_ptr + t * stride_ot + h[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=mask)


def merge_attention(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                    lse_b: torch.Tensor) -> torch.Tensor:
    """out_a/out_b [T, H, D] with a contiguous last dim, lse_a/lse_b [H, T] float32 (any strides)
    -> [T, H, D] contiguous, in out_a's dtype: the attention over both parts' keys."""
    _check(out_a, lse_a, out_b, lse_b)
    if out_a.is_cuda:
        return merge_triton(out_a, lse_a, out_b, lse_b)
    return merge_reference(out_a, lse_a, out_b, lse_b)


def merge_reference(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                    lse_b: torch.Tensor) -> torch.Tensor:
    weight = torch.sigmoid(lse_a.float() - lse_b.float()).transpose(0, 1).unsqueeze(-1)
    b = out_b.float()
    return (b + weight * (out_a.float() - b)).to(out_a.dtype).contiguous()


def merge_triton(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor,
                 lse_b: torch.Tensor) -> torch.Tensor:
    """The same in one Triton launch (under TRITON_INTERPRET=1 also on CPU tensors)."""
    require_triton("merge_attention")
    tokens, heads, head_dim = out_a.shape
    out = torch.empty((tokens, heads, head_dim), dtype=out_a.dtype, device=out_a.device)
    if tokens == 0:
        return out
    block_d = triton.next_power_of_2(head_dim)
    block_h = min(triton.next_power_of_2(heads), max(1, _TILE // block_d))
    _merge_kernel[(tokens, triton.cdiv(heads, block_h))](
        out_a, out_b, lse_a, lse_b, out, heads, head_dim,
        out_a.stride(0), out_a.stride(1), out_b.stride(0), out_b.stride(1),
        lse_a.stride(0), lse_a.stride(1), lse_b.stride(0), lse_b.stride(1), out.stride(0), out.stride(1),
        BLOCK_H=block_h, BLOCK_D=block_d, num_warps=4,
    )
    return out


def _check(out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor) -> None:
    if out_a.dim() != 3 or out_b.shape != out_a.shape or out_b.dtype != out_a.dtype:
        raise ValueError(f"outputs {tuple(out_a.shape)} {out_a.dtype} and {tuple(out_b.shape)} {out_b.dtype} "
                         "must both be [T, H, D] of one dtype")
    if out_a.stride(-1) != 1 or out_b.stride(-1) != 1:
        raise ValueError("outputs need a contiguous last dim")
    expected = (out_a.shape[1], out_a.shape[0])
    for name, lse in (("lse_a", lse_a), ("lse_b", lse_b)):
        if lse.shape != expected or lse.dtype != torch.float32:
            raise ValueError(f"{name} must be float32 {expected} (heads, tokens), got {tuple(lse.shape)} {lse.dtype}")
