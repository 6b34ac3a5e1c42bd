"""Tensor parallelism inside the model: which heads and rows each rank holds, and the embedded model
run as three gloo ranks against one process."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from shared.kv.heads import check_tensor_parallel, kv_heads_of
from shared.kv.pages import pages_for
from shared.kv.pool import allocate_local_pool
from shared.model.from_checkpoint import load_paged_llama
from shared.model.tensor_parallel import TensorParallel, shard_weights
from shared.model.weights import LayerWeights, LlamaWeights
from tests.stack import free_port

TP_SIZE = 3  # the embedded model's 9 query and 3 KV heads: one KV head a rank
DECODE_STEPS = 8
KV_DTYPES = ("model", "int8")  # "model": pages in the model's own dtype
# The embedded model's logits reach ~40; measured 5e-5 apart in float32. Over int8 pages a K/V
# value that float32 rounding moves across a quantization step's boundary moves a step: 0.085.
LOGITS_ATOL = {"model": 1e-4, "int8": 0.5}
PROMPT = "Paged attention splits the key-value cache into fixed-size blocks, so that a serving engine can"


def test_kv_heads_split_evenly_or_replicate():
    check_tensor_parallel(3, 9, 3)
    assert [kv_heads_of(rank, 3, 3) for rank in range(3)] == [range(1), range(1, 2), range(2, 3)]
    assert [kv_heads_of(rank, 2, 8) for rank in range(2)] == [range(4), range(4, 8)]
    check_tensor_parallel(16, 32, 8)
    assert [kv_heads_of(rank, 16, 8).start for rank in range(16)] == [rank // 2 for rank in range(16)]
    assert all(len(kv_heads_of(rank, 16, 8)) == 1 for rank in range(16))


@pytest.mark.parametrize("size,heads,kv_heads,message", [
    (2, 9, 3, "tensor_parallel 2 does not divide the model's 9 attention heads"),
    (6, 12, 4, "tensor_parallel 6 and the model's 4 KV heads: neither divides the other"),
    (0, 9, 3, "tensor_parallel 0 must be at least 1"),
])
def test_a_size_the_heads_cannot_split_over_is_refused(size, heads, kv_heads, message):
    with pytest.raises(ValueError, match=message):
        check_tensor_parallel(size, heads, kv_heads)


TOY = SimpleNamespace(num_attention_heads=4, num_key_value_heads=2, head_dim=2, hidden_size=8, intermediate_size=8,
                      vocab_size=10)


def numbered_rows(rows: int, columns: int) -> torch.Tensor:
    return torch.arange(rows, dtype=torch.float32)[:, None].expand(rows, columns).clone()


def numbered_columns(rows: int, columns: int) -> torch.Tensor:
    return numbered_rows(columns, rows).t().contiguous()


def toy_weights() -> LlamaWeights:
    """Each column-parallel weight's rows numbered, each row-parallel weight's columns, so that a
    shard shows which it holds; FP8-style scales numbered alike."""
    qkv_rows, hidden = (4 + 2 + 2) * TOY.head_dim, TOY.hidden_size  # q, k and v heads
    layer = LayerWeights(input_norm=torch.ones(hidden), qkv=numbered_rows(qkv_rows, hidden),
                         qkv_bias=torch.arange(qkv_rows, dtype=torch.float32), o_proj=numbered_columns(hidden, 8),
                         post_norm=torch.ones(hidden), gate_up=numbered_rows(16, hidden),
                         down=numbered_columns(hidden, 8), qkv_scale=torch.arange(qkv_rows, dtype=torch.float32),
                         o_proj_scale=torch.ones(hidden), gate_up_scale=torch.arange(16, dtype=torch.float32),
                         down_scale=torch.ones(hidden))
    return LlamaWeights(embed=torch.zeros(10, hidden), final_norm=torch.ones(hidden), lm_head=numbered_rows(10, hidden),
                        cos=torch.zeros(4, 2), sin=torch.zeros(4, 2), layers=[layer])


@pytest.mark.parametrize("size,rank,qkv,gate_up,columns,vocab", [
    (2, 1, [4, 5, 6, 7, 10, 11, 14, 15], [4, 5, 6, 7, 12, 13, 14, 15], [4, 5, 6, 7], [5, 6, 7, 8, 9]),
    # four ranks over two KV heads: rank 3 holds KV head 1, as rank 2 does; the vocabulary padded to 12
    (4, 3, [6, 7, 10, 11, 14, 15], [6, 7, 14, 15], [6, 7], [9, 0, 0]),
])
def test_a_shard_holds_its_heads_rows_and_columns(size, rank, qkv, gate_up, columns, vocab):
    full = toy_weights()
    shard = shard_weights(full, TOY, TensorParallel(rank, size))
    layer, whole = shard.layers[0], full.layers[0]
    assert layer.qkv[:, 0].tolist() == qkv and layer.qkv_bias.tolist() == qkv and layer.qkv_scale.tolist() == qkv
    assert layer.gate_up[:, 0].tolist() == gate_up and layer.gate_up_scale.tolist() == gate_up
    assert layer.o_proj[0].tolist() == columns and layer.down[0].tolist() == columns
    assert layer.o_proj.is_contiguous() and layer.down.is_contiguous()
    assert layer.o_proj_scale is whole.o_proj_scale and layer.down_scale is whole.down_scale
    assert shard.lm_head[:, 0].tolist() == vocab
    assert shard.embed is full.embed and shard.cos is full.cos
    for name in ("qkv", "o_proj", "gate_up", "down"):
        assert getattr(layer, name).untyped_storage().data_ptr() != getattr(whole, name).untyped_storage().data_ptr()
    assert shard.lm_head.untyped_storage().data_ptr() != full.lm_head.untyped_storage().data_ptr()


def test_loading_a_shard_the_heads_cannot_split_over_is_refused(checkpoint):
    with pytest.raises(ValueError, match="tensor_parallel 2 does not divide the model's 9 attention heads"):
        load_paged_llama(checkpoint, "float32", "cpu", tp=TensorParallel(0, 2))


def test_a_shard_loads_quantized_after_sharding():
    """FP8 scales computed from the shard's own rows and columns: o_proj's per output channel over
    the rank's input columns alone."""
    model = load_paged_llama("random:llama-tiny", "float32", "cpu", "fp8", tp=TensorParallel(1, 2))
    layer = model.layers[0]
    assert (model.num_heads, model.num_kv_heads, model.total_kv_heads) == (4, 1, 2)
    assert layer.qkv.shape == ((4 + 1 + 1) * 64, 512) and layer.qkv_scale is not None  # e4m3 values, held in float32
    assert torch.equal(layer.qkv, layer.qkv.to(torch.float8_e4m3fn).float())
    assert layer.o_proj.shape == (512, 4 * 64) and layer.o_proj_scale.shape == (512,)
    assert layer.gate_up.shape == (1536, 512) and layer.down.shape == (512, 768)
    assert model.lm_head.shape == (16000, 512) and model.kv_layout(4, 16).num_kv_heads == 1


def greedy_run(model, prompt: list[int], kv_dtype: str) -> torch.Tensor:
    """The prefill's logits, then each greedy decode step's: [1 + DECODE_STEPS, V]."""
    kv_args = () if kv_dtype == "model" else (kv_dtype,)
    pages = list(range(pages_for(len(prompt) + DECODE_STEPS, 16)))
    pool = allocate_local_pool(model.kv_layout(len(pages), 16, *kv_args), "cpu")[0]
    logits = [model.prefill(prompt, pool, pages)]
    for step in range(DECODE_STEPS):
        token, position = logits[-1].argmax()[None], torch.tensor([len(prompt) + step])
        logits.append(model.decode(token, position, torch.tensor([pages]), pool)[0])
    return torch.stack(logits)


def run_rank(rank: int, checkpoint: str, port: int, prompt: list[int], out: str, size: int = TP_SIZE) -> None:
    """One rank of the group, in its own process: its shard over its own pools, every run's logits
    saved, and its head counts (query heads, KV heads, the model's KV heads) as "heads"."""
    torch.set_num_threads(1)  # the ranks share the CI machine's two cores
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=timedelta(seconds=120))
    try:
        model = load_paged_llama(checkpoint, "float32", "cpu", tp=TensorParallel(rank, size, dist.group.WORLD))
        runs = {kv: greedy_run(model, prompt, kv) for kv in KV_DTYPES}
        torch.save(runs | {"heads": (model.num_heads, model.num_kv_heads, model.total_kv_heads)},
                   Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.e2e
@pytest.mark.slow
def test_three_ranks_generate_what_one_process_does(checkpoint, tokenizer, tmp_path):
    """The embedded model sharded over three gloo ranks: every rank's logits, prefill and decode,
    are one process's within float32 rounding (the partial sums add in another order), and its
    greedy tokens the same, with pages in the model's dtype and in int8."""
    prompt = tokenizer(PROMPT * 2)["input_ids"][:40]
    mp.spawn(run_rank, args=(str(checkpoint), free_port(), prompt, str(tmp_path)), nprocs=TP_SIZE)
    single = load_paged_llama(checkpoint, "float32", "cpu")
    for kv in KV_DTYPES:
        expected = greedy_run(single, prompt, kv)
        for rank in range(TP_SIZE):
            saved = torch.load(tmp_path / f"rank{rank}.pt")
            assert saved["heads"] == (3, 1, 3)
            logits = saved[kv]
            assert torch.equal(logits.argmax(-1), expected.argmax(-1)), (kv, rank)
            torch.testing.assert_close(logits, expected, atol=LOGITS_ATOL[kv], rtol=1e-4)
