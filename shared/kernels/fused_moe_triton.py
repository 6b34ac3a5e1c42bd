"""A mixture-of-experts MLP in Triton, as vLLM's fused_moe computes it: two grouped GEMMs over
(token, choice) pairs sorted by expert.

    align          sort the T*k pairs by expert, pad each expert's run to a multiple of BLOCK_M:
                   for a decode step's few pairs one Triton program (about fifteen small PyTorch
                   kernels otherwise, a layer's worth of launches on their own)
    gate_up GEMM   one launch: each program takes BLOCK_M sorted pairs of one expert and
                   BLOCK_N columns of that expert's gate_up weight -> [T*k, 2I]
    silu_and_mul   fused_triton's kernel, on the [T*k, 2I] rows as they are -> [T*k, I]
    down GEMM      one launch, the same kernel, each row times its routing weight -> [T*k, H]
    sum over k     a [T, k, H] view summed over k: deterministic, no atomics

Every shape comes from T, k and E, never from the routing: the padded length is bounded by
T*k + min(E, T*k) * (BLOCK_M - 1), and blocks past the last run exit at once. Nothing is read on
the host, so once each config has compiled a call can be captured in a CUDA graph and replayed
with new topk_ids in the same buffers. GEMMs accumulate in fp32 and round to x's dtype where
the PyTorch expression of moe_reference rounds (after each linear, after SiLU).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from shared.kernels.fused_triton import silu_and_mul
from shared.kernels.triton_support import pdl_options, require_triton, tl, triton, wait_for_previous_kernel

SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Decode: runs of a few pairs per expert, so 16-row blocks pad least. The tiles, warps and stages
# were chosen by loadtest/engine/bench_moe_configs.py on an H100: 128-deep K tiles in 4 stages were
# among the six fastest of 24 in 8 of its 12 cases, within 4% of the best there, where the
# 64-deep tiles in 3 stages ran 2-10% slower (docs/BENCHMARKS.md).
SHORT_RUN_CONFIG = {"BLOCK_M": 16, "BLOCK_N": 64, "BLOCK_K": 128, "num_warps": 4, "num_stages": 4}
# Prefill: long runs fill 64-row blocks, and wider tiles read each weight tile for more rows.
LONG_RUN_CONFIG = {"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 4, "num_stages": 3}
# From this many pairs per expert on average, a 64-row block is at least half full.
_LONG_RUN_PAIRS = 32
# Up to this many pairs the alignment is one program (a decode step's: 6 choices x 256 rows at
# most is 1,536); more, a prefill's, go through PyTorch's sort, whose kernels spread over the GPU.
_ONE_PROGRAM_PAIRS = 2048
# The one program's tiles: [rows, experts] comparisons of this many elements (32 a thread at 4 warps).
_ALIGN_TILE = 4096


if triton is not None:

    # num_pairs is the chunk's tokens times k: unspecialized, so that no prompt length compiles the
    # kernels again during a request (services/prefill/warmup.py); only the configs differ.
    @triton.jit(do_not_specialize=["num_pairs"])
    def _grouped_gemm_kernel(
        a_ptr, w_ptr, out_ptr, sorted_pairs_ptr, expert_of_block_ptr, pair_weights_ptr,
        num_pairs, num_experts, N, K, pairs_per_a_row,
        stride_am, stride_we, stride_wn, stride_om,
        MUL_PAIR_WEIGHT: tl.constexpr, DOT_PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, USE_PDL: tl.constexpr,
    ):
        """out[pair, n] = sum_k a[pair // pairs_per_a_row, k] * w[expert, n, k] for the BLOCK_M
        sorted pairs of program (m, n), all of one expert; times pair_weights[pair] if asked."""
        wait_for_previous_kernel(USE_PDL)
        block = tl.program_id(0)
        expert = tl.load(expert_of_block_ptr + block)
        if expert >= num_experts:  # a block past the last expert's run
            return
        pairs = tl.load(sorted_pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
        pair_mask = pairs < num_pairs  # padding holds num_pairs
        a_rows = a_ptr + (pairs // pairs_per_a_row).to(tl.int64)[:, None] * stride_am
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        col_mask = cols < N
        # [BLOCK_K, BLOCK_N] tiles of the expert's [N, K] weight, read along K.
        w_cols = w_ptr + expert.to(tl.int64) * stride_we + cols.to(tl.int64)[None, :] * stride_wn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, K, BLOCK_K):
            ks = k + tl.arange(0, BLOCK_K)
            k_mask = ks < K
            a = tl.load(a_rows + ks[None, :], mask=pair_mask[:, None] & k_mask[None, :], other=0.0)
            w = tl.load(w_cols + ks[:, None], mask=k_mask[:, None] & col_mask[None, :], other=0.0)
            acc = tl.dot(a, w, acc=acc, input_precision=DOT_PRECISION)
        if MUL_PAIR_WEIGHT:
            acc *= tl.load(pair_weights_ptr + pairs, mask=pair_mask, other=0.0)[:, None]
        out = out_ptr + pairs.to(tl.int64)[:, None] * stride_om + cols[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=pair_mask[:, None] & col_mask[None, :])

    @triton.jit(do_not_specialize=["num_pairs"])
    def _align_kernel(ids_ptr, sorted_pairs_ptr, expert_of_block_ptr, num_pairs, num_experts, length,
                      BLOCK_M: tl.constexpr, EXPERTS_PAD: tl.constexpr, ROWS: tl.constexpr, USE_PDL: tl.constexpr):
        """align_pairs_by_expert in one program, ROWS pairs or slots at a time against every expert:
        the runs' lengths, each pair to its run (after the earlier pairs of its expert), the
        padding into every other slot, each block's expert. The pairs and the padding go to
        different slots, so no store waits on another."""
        wait_for_previous_kernel(USE_PDL)
        e = tl.arange(0, EXPERTS_PAD)
        r = tl.arange(0, ROWS)
        counts = tl.zeros([EXPERTS_PAD], tl.int32)
        for start in range(0, num_pairs, ROWS):
            pair = start + r
            # A slot past the pairs reads as EXPERTS_PAD, no expert's.
            expert = tl.load(ids_ptr + pair, mask=pair < num_pairs, other=EXPERTS_PAD)
            counts += tl.sum((expert[:, None] == e[None, :]).to(tl.int32), axis=0)
        padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        ends = tl.cumsum(padded, axis=0)
        starts = ends - padded
        seen = tl.zeros([EXPERTS_PAD], tl.int32)
        for start in range(0, num_pairs, ROWS):
            pair = start + r
            expert = tl.load(ids_ptr + pair, mask=pair < num_pairs, other=EXPERTS_PAD)
            mine = (expert[:, None] == e[None, :]).to(tl.int32)
            earlier = tl.cumsum(mine, axis=0) - mine  # this tile's earlier pairs of the same expert
            place = tl.sum(mine * ((starts + seen)[None, :] + earlier), axis=1)
            tl.store(sorted_pairs_ptr + place, pair.to(tl.int64), mask=pair < num_pairs)
            seen += tl.sum(mine, axis=0)
        filled_ends = starts + counts
        real = e < num_experts
        for start in range(0, length, ROWS):
            slot = start + r
            run = (slot[:, None] >= starts[None, :]) & (slot[:, None] < ends[None, :]) & real[None, :]
            holds_pair = tl.sum((run & (slot[:, None] < filled_ends[None, :])).to(tl.int32), axis=1) > 0
            tl.store(sorted_pairs_ptr + slot, tl.full([ROWS], 0, tl.int64) + num_pairs,
                     mask=(slot < length) & ~holds_pair)
        for start in range(0, length // BLOCK_M, ROWS):
            block = start + r
            # A block's expert: the runs that end at or before its first slot (searchsorted, right).
            first = block * BLOCK_M
            expert_of = tl.sum(((ends[None, :] <= first[:, None]) & real[None, :]).to(tl.int32), axis=1)
            tl.store(expert_of_block_ptr + block, expert_of.to(tl.int64), mask=first < length)


def block_config(num_pairs: int, num_experts: int) -> dict:
    """The tile sizes for T*k = num_pairs routed pairs over num_experts experts."""
    return LONG_RUN_CONFIG if num_pairs >= _LONG_RUN_PAIRS * num_experts else SHORT_RUN_CONFIG


def long_run_tokens(num_experts: int, top_k: int) -> int:
    """The fewest tokens whose pairs take LONG_RUN_CONFIG."""
    return -(-_LONG_RUN_PAIRS * num_experts // top_k)


def padded_length(num_pairs: int, num_experts: int, block_m: int) -> int:
    """A bound on the padded runs' total whatever the routing: only a chosen expert pads, by less
    than a block."""
    return triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m) * block_m


def align_pairs_by_expert(topk_ids: torch.Tensor, num_experts: int,
                          block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's moe_align_block_size in torch ops, none of which syncs with the host.

    Pair p is (token p // k, choice p % k). Returns sorted_pairs int64 [padded_length]: the pairs
    of expert 0, then of expert 1, ..., each run padded with num_pairs to a multiple of block_m,
    then num_pairs to the end; and expert_of_block int64 [padded_length // block_m]: each block's
    expert, num_experts for blocks past the last run.
    """
    experts = topk_ids.reshape(-1).long()
    num_pairs = experts.numel()
    length = padded_length(num_pairs, num_experts, block_m)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=experts.device)
    counts.scatter_add_(0, experts, torch.ones_like(experts))
    padded_counts = (counts + block_m - 1) // block_m * block_m
    padded_ends = padded_counts.cumsum(0)
    # The j-th pair in expert order moves right by the padding of every expert before its own.
    padding_before = (padded_counts - counts).cumsum(0) - (padded_counts - counts)
    sorted_experts, order = torch.sort(experts, stable=True)
    places = torch.arange(num_pairs, device=experts.device) + padding_before[sorted_experts]
    sorted_pairs = torch.full((length,), num_pairs, dtype=torch.int64, device=experts.device)
    sorted_pairs.scatter_(0, places, order)
    block_starts = torch.arange(0, length, block_m, device=experts.device)
    expert_of_block = torch.searchsorted(padded_ends, block_starts, right=True)
    return sorted_pairs, expert_of_block


def align_pairs_in_one_program(topk_ids: torch.Tensor, num_experts: int,
                               block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """align_pairs_by_expert's result from one Triton program, for topk_ids on a GPU (or in
    Triton's interpreter): the same tensors, element for element."""
    require_triton("align_pairs_in_one_program")
    ids = topk_ids.reshape(-1)
    num_pairs = ids.numel()
    length = padded_length(num_pairs, num_experts, block_m)
    sorted_pairs = torch.empty(length, dtype=torch.int64, device=ids.device)
    expert_of_block = torch.empty(length // block_m, dtype=torch.int64, device=ids.device)
    experts_pad = triton.next_power_of_2(num_experts)
    _align_kernel[(1,)](ids, sorted_pairs, expert_of_block, num_pairs, num_experts, length,
                        BLOCK_M=block_m, EXPERTS_PAD=experts_pad, ROWS=max(16, _ALIGN_TILE // experts_pad),
                        **pdl_options(ids.device))
    return sorted_pairs, expert_of_block


def _align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    if topk_ids.numel() <= _ONE_PROGRAM_PAIRS:
        return align_pairs_in_one_program(topk_ids, num_experts, block_m)
    return align_pairs_by_expert(topk_ids, num_experts, block_m)


def grouped_gemm(a: torch.Tensor, weights: torch.Tensor, out: torch.Tensor, sorted_pairs: torch.Tensor,
                 expert_of_block: torch.Tensor, pairs_per_a_row: int, config: dict,
                 pair_weights: torch.Tensor | None = None) -> None:
    """out[pair] = a[pair // pairs_per_a_row] @ weights[expert of pair].T (times pair_weights[pair]
    if given) for the pairs as align_pairs_by_expert sorts them into config's BLOCK_M blocks; config:
    the tile sizes, num_warps and num_stages (SHORT_RUN_CONFIG's keys)."""
    num_experts, n, k = weights.shape
    grid = (expert_of_block.numel(), triton.cdiv(n, config["BLOCK_N"]))
    # tf32 would round fp32 inputs to 10 mantissa bits; for 16-bit inputs the precision is moot.
    precision = "ieee" if a.dtype == torch.float32 else "tf32"
    _grouped_gemm_kernel[grid](
        a, weights, out, sorted_pairs, expert_of_block, pair_weights,
        out.shape[0], num_experts, n, k, pairs_per_a_row,
        a.stride(0), weights.stride(0), weights.stride(1), out.stride(0),
        MUL_PAIR_WEIGHT=pair_weights is not None, DOT_PRECISION=precision, **config, **pdl_options(a.device),
    )


def _check(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor,
           topk_ids: torch.Tensor) -> None:
    if x.dtype not in SUPPORTED_DTYPES or gate_up.dtype != x.dtype or down.dtype != x.dtype:
        raise ValueError(f"x {x.dtype}, gate_up {gate_up.dtype}, down {down.dtype}: one of {SUPPORTED_DTYPES}")
    if x.dim() != 2 or gate_up.dim() != 3 or down.dim() != 3:
        raise ValueError(f"x {tuple(x.shape)}, gate_up {tuple(gate_up.shape)}, down {tuple(down.shape)} "
                         "are not [T, H], [E, 2I, H], [E, H, I]")
    experts, hidden, inter = down.shape
    if x.shape[1] != hidden or gate_up.shape != (experts, 2 * inter, hidden):
        raise ValueError(f"x {tuple(x.shape)}, gate_up {tuple(gate_up.shape)} do not match down "
                         f"{tuple(down.shape)} = [E, H, I]")
    if x.stride(1) != 1 or gate_up.stride(2) != 1 or down.stride(2) != 1:
        raise ValueError("x, gate_up and down need a contiguous last dim")
    if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0] or topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} {topk_ids.dtype} is not int [T={x.shape[0]}, k]")
    if topk_weights.shape != topk_ids.shape or topk_weights.dtype != torch.float32:
        raise ValueError(f"topk_weights {tuple(topk_weights.shape)} {topk_weights.dtype} is not float32 "
                         f"{tuple(topk_ids.shape)}")


def fused_moe(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    """x [T, H]; gate_up [E, 2*I, H] (each expert's gate rows then up rows, as nn.Linear weights);
    down [E, H, I]; topk_weights [T, k] float32; topk_ids [T, k] int (expert of each choice) ->
    [T, H] in x's dtype: sum over the k choices of weight * down_e(silu(gate_e x) * up_e x).
    A config's first call compiles it, so it must not come in a CUDA-graph capture."""
    require_triton("fused_moe")
    _check(x, gate_up, down, topk_weights, topk_ids)
    tokens, choices = topk_ids.shape
    experts, hidden, inter = down.shape
    if tokens == 0:
        return torch.zeros_like(x)
    num_pairs = tokens * choices
    config = block_config(num_pairs, experts)
    sorted_pairs, expert_of_block = _align(topk_ids, experts, config["BLOCK_M"])
    gate_up_out = torch.empty((num_pairs, 2 * inter), dtype=x.dtype, device=x.device)
    grouped_gemm(x, gate_up, gate_up_out, sorted_pairs, expert_of_block, choices, config)
    down_out = torch.empty((num_pairs, hidden), dtype=x.dtype, device=x.device)
    grouped_gemm(silu_and_mul(gate_up_out), down, down_out, sorted_pairs, expert_of_block, 1, config,
                  pair_weights=topk_weights.reshape(-1).contiguous())
    return down_out.view(tokens, choices, hidden).sum(dim=1)


def moe_reference(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor) -> torch.Tensor:
    """fused_moe in plain PyTorch, one expert at a time: the CPU path and the tests' oracle. It
    reads the routing on the host, so it cannot be captured in a CUDA graph."""
    tokens, choices = topk_ids.shape
    token_of_pair = torch.arange(tokens, device=x.device).repeat_interleave(choices)
    experts, pair_weights = topk_ids.reshape(-1), topk_weights.reshape(-1)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for expert in range(gate_up.shape[0]):
        pairs = (experts == expert).nonzero().squeeze(1)
        if pairs.numel() == 0:
            continue
        rows = token_of_pair[pairs]
        gate, up = F.linear(x[rows], gate_up[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, down[expert])
        out.index_add_(0, rows, y.float() * pair_weights[pairs, None])
    return out.to(x.dtype)
