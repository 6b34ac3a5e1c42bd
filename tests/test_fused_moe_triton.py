"""The Triton mixture-of-experts MLP against its PyTorch reference, and the alignment it runs on.

Without CUDA the kernels run in Triton's CPU interpreter on tiny shapes, in fp32 and fp16: the
interpreter's tl.dot multiplies bf16 bit patterns as integers, so bf16 is checked on the GPU,
where a CUDA graph of the whole call is also replayed with new routing in the same buffers.
"""

import importlib.util
import os
import sys

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

if not torch.cuda.is_available():
    # Must be set before triton is imported: @triton.jit picks the interpreter at decoration time.
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from loadtest.engine import bench_moe_configs
from shared.kernels import fused_moe_triton
from shared.kernels.fused_moe_triton import (
    LONG_RUN_CONFIG,
    SHORT_RUN_CONFIG,
    align_pairs_by_expert,
    align_pairs_in_one_program,
    block_config,
    fused_moe,
    grouped_gemm,
    moe_reference,
    padded_length,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
COMPILED_CUDA = torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1"
TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.float16: {"atol": 2e-3, "rtol": 2e-3},
       torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2}}
EXPERTS, CHOICES, HIDDEN, INTER = 8, 2, 64, 32
EVERY_TOKENS_EXPERT = 3
# Experts 2, 4, 6 and 7 are chosen by no token.
SECOND_CHOICES = torch.tensor([0, 1, 5])


def weights(experts, hidden, inter, dtype, device, seed=0):
    """gate_up and down scaled so every activation is about N(0, 1)."""
    gen = torch.Generator(device).manual_seed(seed)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen, device=device) / hidden ** 0.5
    down = torch.randn(experts, hidden, inter, generator=gen, device=device) / inter ** 0.5
    return gate_up.to(dtype), down.to(dtype)


def routing(tokens, device, seed=0):
    """Every token chooses EVERY_TOKENS_EXPERT and one of SECOND_CHOICES, in either order; the
    weights are a softmax, as a router's are."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.full((tokens,), EVERY_TOKENS_EXPERT),
                       SECOND_CHOICES[torch.randint(len(SECOND_CHOICES), (tokens,), generator=gen)]], dim=1)
    swapped = torch.rand(tokens, generator=gen) < 0.5
    ids[swapped] = ids[swapped].flip(1)
    topk_weights = torch.randn(tokens, CHOICES, generator=gen).softmax(dim=1)
    return topk_weights.to(device), ids.to(device)


def inputs(tokens, dtype, device=DEVICE, seed=0):
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(seed)).to(dtype).to(device)
    return (x, *weights(EXPERTS, HIDDEN, INTER, dtype, device, seed), *routing(tokens, device, seed))


def check(args, dtype):
    out = fused_moe(*args)
    assert out.dtype == dtype and out.shape == args[0].shape
    torch.testing.assert_close(out, moe_reference(*args), **TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("tokens", [1, 5, 33])
def test_equals_reference(tokens, dtype):
    check(inputs(tokens, dtype), dtype)


def test_long_runs_take_64_row_blocks():
    # 64 tokens over two experts: runs of 64 pairs, several blocks each, wider tiles.
    tokens, experts = 64, 2
    assert block_config(tokens * CHOICES, experts) == LONG_RUN_CONFIG
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    gate_up, down = weights(experts, HIDDEN, INTER, torch.float32, DEVICE, seed=1)
    topk_ids = torch.tensor([[0, 1], [1, 0]], device=DEVICE).repeat(tokens // 2, 1)
    topk_weights = torch.rand(tokens, CHOICES, device=DEVICE)
    check((x, gate_up, down, topk_weights, topk_ids), torch.float32)


def test_int32_ids_and_no_tokens():
    x, gate_up, down, topk_weights, topk_ids = inputs(5, torch.float32)
    check((x, gate_up, down, topk_weights, topk_ids.int()), torch.float32)
    empty = fused_moe(x[:0], gate_up, down, topk_weights[:0], topk_ids[:0])
    assert empty.shape == (0, HIDDEN)


def test_block_config_by_average_run():
    assert block_config(1 * 8, 128) == SHORT_RUN_CONFIG, "decode, Qwen3-30B-A3B: runs of one pair"
    assert block_config(512 * 8, 128) == LONG_RUN_CONFIG, "prefill: runs of 32 pairs on average"


def test_alignment_pads_each_run_to_whole_blocks():
    topk_ids = torch.tensor([[3, 0], [3, 5], [1, 3], [3, 0]])
    num_pairs, block_m = topk_ids.numel(), 4
    sorted_pairs, expert_of_block = align_pairs_by_expert(topk_ids, EXPERTS, block_m)
    assert sorted_pairs.shape == (padded_length(num_pairs, EXPERTS, block_m),) == (32,)
    pad = num_pairs
    runs = [1, 7, pad, pad] + [4, pad, pad, pad] + [0, 2, 5, 6] + [3, pad, pad, pad]  # experts 0, 1, 3, 5
    assert sorted_pairs.tolist() == runs + [pad] * 16
    assert expert_of_block.tolist() == [0, 1, 3, 5] + [EXPERTS] * 4


@pytest.mark.parametrize("experts,choices,tokens,block_m", [
    (8, 2, 4, 4), (8, 2, 33, 16), (64, 6, 1, 16), (64, 6, 64, 16), (128, 8, 7, 16), (256, 8, 3, 16),
    (2, 2, 64, 64), (64, 6, 341, 64),
], ids=lambda v: str(v))
@pytest.mark.parametrize("id_dtype", [torch.int64, torch.int32], ids=["int64", "int32"])
def test_one_program_aligns_as_the_pytorch_ops_do(experts, choices, tokens, block_m, id_dtype):
    """Random routings (each token's choices distinct, as top-k's are) from one token to more
    pairs than a tile, over 2 to 256 experts: the same sorted pairs and block experts."""
    gen = torch.Generator().manual_seed(experts * 1000 + tokens)
    topk_ids = torch.rand(tokens, experts, generator=gen).topk(choices, dim=1).indices.to(id_dtype).to(DEVICE)
    expected = align_pairs_by_expert(topk_ids, experts, block_m)
    got = align_pairs_in_one_program(topk_ids, experts, block_m)
    for want, have in zip(expected, got):
        assert have.dtype == want.dtype == torch.int64
        assert have.tolist() == want.tolist()


def test_alignment_reads_nothing_on_the_host():
    """Under fake tensors, which hold no data, a host read (.item(), nonzero, a shape from the
    routing) raises: what passes here can be captured in a CUDA graph."""
    with FakeTensorMode():
        sorted_pairs, expert_of_block = align_pairs_by_expert(torch.randint(EXPERTS, (33, CHOICES)), EXPERTS, 16)
    assert sorted_pairs.shape == (padded_length(33 * CHOICES, EXPERTS, 16),)
    assert expert_of_block.shape == (sorted_pairs.shape[0] // 16,)


def test_reference_runs_without_triton(monkeypatch):
    # The CPU code path imports this module where triton is not installed.
    monkeypatch.setitem(sys.modules, "triton", None)
    monkeypatch.setitem(sys.modules, "triton.language", None)
    monkeypatch.delitem(sys.modules, "shared.kernels.triton_support")  # imported again, without triton
    spec = importlib.util.spec_from_file_location("fused_moe_no_triton", fused_moe_triton.__file__)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    args = inputs(5, torch.float32, "cpu")
    torch.testing.assert_close(module.moe_reference(*args), moe_reference(*args))
    with pytest.raises(ImportError, match="needs triton"):
        module.fused_moe(*args)


def test_bad_inputs_raise():
    x, gate_up, down, topk_weights, topk_ids = inputs(5, torch.float32)
    with pytest.raises(ValueError, match="one of"):
        fused_moe(x.double(), gate_up, down, topk_weights, topk_ids)
    with pytest.raises(ValueError, match="do not match"):
        fused_moe(x, gate_up[:, :-1], down, topk_weights, topk_ids)
    with pytest.raises(ValueError, match="contiguous last dim"):
        fused_moe(x, gate_up.transpose(1, 2).contiguous().transpose(1, 2), down, topk_weights, topk_ids)
    with pytest.raises(ValueError, match="is not int"):
        fused_moe(x, gate_up, down, topk_weights, topk_ids.float())
    with pytest.raises(ValueError, match="is not float32"):
        fused_moe(x, gate_up, down, topk_weights.half(), topk_ids)


# --- compiled on CUDA: bf16, a model's shapes, a CUDA graph ---------------------------------------

needs_cuda = pytest.mark.skipif(not COMPILED_CUDA, reason="needs CUDA with compiled (not interpreted) Triton")


def random_routing(tokens, experts, choices, device, seed):
    """Distinct experts per token, drawn at random, and softmax weights."""
    gen = torch.Generator(device).manual_seed(seed)
    topk_ids = torch.rand(tokens, experts, generator=gen, device=device).topk(choices, dim=1).indices
    return torch.randn(tokens, choices, generator=gen, device=device).softmax(dim=1), topk_ids


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("tokens", [1, 5, 33])
def test_equals_reference_bf16_cuda(tokens):
    check(inputs(tokens, torch.bfloat16), torch.bfloat16)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("tokens", [1, 16, 512])
def test_qwen3_30b_a3b_shapes_bf16_cuda(tokens):
    experts, choices, hidden, inter = 128, 8, 2048, 768
    gate_up, down = weights(experts, hidden, inter, torch.bfloat16, "cuda")
    x = torch.randn(tokens, hidden, device="cuda").bfloat16()
    check((x, gate_up, down, *random_routing(tokens, experts, choices, "cuda", seed=tokens)), torch.bfloat16)


@pytest.mark.gpu
@needs_cuda
def test_cuda_graph_replays_new_routing_cuda():
    tokens = 8
    x, gate_up, down, topk_weights, topk_ids = inputs(tokens, torch.bfloat16, "cuda")
    fused_moe(x, gate_up, down, topk_weights, topk_ids)  # compiles, which must happen outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_moe(x, gate_up, down, topk_weights, topk_ids)
    new_weights, new_ids = random_routing(tokens, EXPERTS, CHOICES, "cuda", seed=1)
    assert not torch.equal(new_ids, topk_ids)
    topk_weights.copy_(new_weights)
    topk_ids.copy_(new_ids)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.testing.assert_close(out, moe_reference(x, gate_up, down, topk_weights, topk_ids), **TOL[torch.bfloat16])


SWEPT_TILES = bench_moe_configs.grid([4], [3, 4, 5] if COMPILED_CUDA else [3])


@pytest.mark.parametrize("config", SWEPT_TILES, ids=lambda c: "n{BLOCK_N}k{BLOCK_K}s{num_stages}".format(**c))
def test_every_config_the_sweep_tries_computes_each_pairs_product(config):
    """Whatever loadtest/engine/bench_moe_configs.py ships, both GEMMs stay exact: widths that are
    not multiples of the tiles (K 160 and 96, N 192 and 160), a routing weight on the down's rows."""
    experts, choices, tokens, hidden, inter = 8, 2, 5, 160, 96
    dtype = torch.bfloat16 if COMPILED_CUDA else torch.float32
    gen = torch.Generator().manual_seed(2)
    gate_up, down = weights(experts, hidden, inter, dtype, DEVICE, seed=2)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype).to(DEVICE)
    h = torch.randn(tokens * choices, inter, generator=gen).to(dtype).to(DEVICE)
    ids = torch.rand(tokens, experts, generator=gen).topk(choices, dim=1).indices.to(DEVICE)
    pair_weights = torch.rand(tokens * choices, generator=gen).to(DEVICE)
    sorted_pairs, expert_of_block = align_pairs_by_expert(ids, experts, config["BLOCK_M"])
    expert, token = ids.reshape(-1), torch.arange(tokens, device=DEVICE).repeat_interleave(choices)
    gate_up_out = torch.empty(tokens * choices, 2 * inter, dtype=dtype, device=DEVICE)
    grouped_gemm(x, gate_up, gate_up_out, sorted_pairs, expert_of_block, choices, config)
    expected = torch.einsum("pk,pnk->pn", x[token].float(), gate_up[expert].float())
    torch.testing.assert_close(gate_up_out.float(), expected, **TOL[dtype])
    down_out = torch.empty(tokens * choices, hidden, dtype=dtype, device=DEVICE)
    grouped_gemm(h, down, down_out, sorted_pairs, expert_of_block, 1, config, pair_weights=pair_weights)
    expected = torch.einsum("pk,pnk->pn", h.float(), down[expert].float()) * pair_weights[:, None]
    torch.testing.assert_close(down_out.float(), expected, **TOL[dtype])
