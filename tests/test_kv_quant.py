"""Quantized KV pages (shared/kernels/kv_quant.py): the round trip, the pool's scale shards and their copies,
kv.dtype in the config, and the fingerprint that keeps workers of different kv.dtype apart."""

from __future__ import annotations

import dataclasses
import uuid

import pytest
import torch

from services.router.control.registration import RegistrationPolicy
from services.router.control.worker_records import WorkerRegistry
from shared.config.loading import load_config
from shared.config.schema import ConfigError
from shared.control.messages import PROTOCOL_VERSION, KvPoolHandle, ModelFingerprint, Register, Role
from shared.kernels import kv_quant
from shared.kv.pool import (
    SHARD_ALIGN_BYTES,
    allocate_local_pool,
    layout_bytes,
    make_layout,
    scale_stride_bytes,
    shard_regions,
)
from shared.kv.transfer.shm import SharedMemoryExport
from shared.model import fingerprint

FORMATS = [torch.int8, torch.float8_e4m3fn]
# Page and scale shards whose sizes are not multiples of 256 bytes, so missing padding would misalign.
SPEC = dict(num_layers=3, num_pages=7, page_size=5, num_kv_heads=3, head_dim=6)


def rows(seed: int = 0) -> torch.Tensor:
    """[tokens, kv heads, head_dim] with rows of very different sizes, a row of zeros and an outlier."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(9, 4, 64, generator=gen) * torch.logspace(-3, 2, 9)[:, None, None]
    x[2, 1] = 0.0
    x[5, 3, 7] = 300.0
    return x


@pytest.mark.parametrize("dtype", FORMATS, ids=str)
def test_round_trip_error_is_bounded_by_each_rows_scale(dtype):
    x = rows()
    values, scales = kv_quant.quantize(x, dtype)
    assert values.dtype == dtype and values.shape == x.shape
    assert scales.dtype == torch.float32 and scales.shape == x.shape[:2]
    back = kv_quant.dequantize(values, scales, torch.float32)
    amax = x.abs().amax(-1, keepdim=True)
    if dtype == torch.int8:  # a uniform grid of amax / 127: at most half a step off
        bound = amax / 127 / 2 * (1 + 1e-5)
    else:  # e4m3 keeps 3 mantissa bits: half an ulp, 1/16 of the value, or half a subnormal step
        bound = torch.maximum(x.abs() / 16, amax / 448 * 2.0 ** -10) * (1 + 1e-5)
    assert torch.all((back - x).abs() <= bound)
    assert torch.equal(back[2, 1], torch.zeros(64)) and scales[2, 1] == 0  # zeros stay zeros
    peak = x.abs().argmax(-1, keepdim=True)  # each row's largest value comes back (nearly) exactly
    torch.testing.assert_close(back.gather(-1, peak), x.gather(-1, peak), rtol=1e-6, atol=0)


def test_int8_rounds_half_up_like_the_triton_write():
    values, scales = kv_quant.quantize(torch.tensor([[127.0, 0.5, -0.5, 1.5, -1.5, 2.5]]), torch.int8)
    assert scales.item() == 1.0 and values.tolist() == [[127, 1, 0, 2, -1, 3]]


def test_config_names_and_storage():
    assert kv_quant.storage_dtype("bfloat16", torch.float32) == torch.float32  # the model's own, unquantized
    assert kv_quant.storage_dtype("bfloat16", torch.bfloat16) == torch.bfloat16
    assert kv_quant.storage_dtype("int8", torch.bfloat16) == torch.int8
    assert kv_quant.storage_dtype("float8_e4m3", torch.float32) == torch.float8_e4m3fn
    assert not kv_quant.is_quantized(torch.bfloat16) and all(kv_quant.is_quantized(d) for d in FORMATS)


@pytest.mark.parametrize("dtype", FORMATS, ids=str)
def test_scale_shards_follow_the_page_shards_aligned(dtype):
    layout = make_layout(**SPEC, dtype=dtype)
    pool, _buffer = allocate_local_pool(layout, "cpu")
    shards = 2 * SPEC["num_layers"]
    scale_bytes = SPEC["num_pages"] * SPEC["page_size"] * SPEC["num_kv_heads"] * 4
    assert scale_bytes % SHARD_ALIGN_BYTES and scale_bytes < scale_stride_bytes(layout) < scale_bytes + 256
    assert layout_bytes(layout) == shards * (layout.shard_stride_bytes + scale_stride_bytes(layout))
    assert pool.scales.shape == (shards, SPEC["num_pages"], SPEC["page_size"], SPEC["num_kv_heads"])
    assert pool.scales.dtype == torch.float32
    starts = [pool.kv[i].data_ptr() for i in range(shards)] + [pool.scales[i].data_ptr() for i in range(shards)]
    assert all(start % SHARD_ALIGN_BYTES == 0 for start in starts)
    assert starts[shards] == starts[0] + shards * layout.shard_stride_bytes  # after every page shard
    for i in range(shards):  # disjoint: each shard keeps what was written to it
        pool.kv[i].fill_(i + 1)
        pool.scales[i].fill_(-i - 1.0)
    assert all(torch.all(pool.kv[i].float() == i + 1) and torch.all(pool.scales[i] == -i - 1.0) for i in range(shards))
    assert pool.key_scale(1).data_ptr() == pool.scales[2].data_ptr()
    assert pool.value_scale(1).data_ptr() == pool.scales[3].data_ptr()


def test_an_unquantized_pool_has_no_scales():
    layout = make_layout(**SPEC, dtype=torch.bfloat16)
    pool, _buffer = allocate_local_pool(layout, "cpu")
    assert pool.scales is None and pool.key_scale(0) is None and scale_stride_bytes(layout) == 0
    assert layout_bytes(layout) == 2 * SPEC["num_layers"] * layout.shard_stride_bytes
    assert len(shard_regions(layout)) == 2 * SPEC["num_layers"]


def random_pool(layout, seed: int):
    pool, buffer = allocate_local_pool(layout, "cpu")
    gen = torch.Generator().manual_seed(seed)
    values, scales = kv_quant.quantize(torch.randn(pool.kv.shape, generator=gen), pool.kv.dtype)
    pool.kv.copy_(values)
    pool.scales.copy_(scales.abs() + 1)  # nonzero, so a scale left behind shows
    return pool, buffer


@pytest.mark.parametrize("dtype", FORMATS, ids=str)
@pytest.mark.parametrize("kind", ["local", "shm"])
def test_copy_pages_from_moves_values_and_scales(dtype, kind):
    src, _src_buffer = random_pool(make_layout(**SPEC, dtype=dtype), seed=1)
    dst_layout = make_layout(**{**SPEC, "num_pages": 5}, dtype=dtype)  # fewer pages: other strides
    export = SharedMemoryExport(dst_layout, f"test-{uuid.uuid4().hex[:8]}") if kind == "shm" else None
    dst, _dst_buffer = (export.pool, None) if export else allocate_local_pool(dst_layout, "cpu")
    try:
        src_pages, dst_pages = [4, 0, 6], [1, 3, 2]
        dst.copy_pages_from(src, torch.tensor(src_pages), torch.tensor(dst_pages))
        assert torch.equal(dst.kv[:, dst_pages].view(torch.uint8), src.kv[:, src_pages].view(torch.uint8))
        assert torch.equal(dst.scales[:, dst_pages], src.scales[:, src_pages])
        assert torch.all(dst.scales[:, [0, 4]] == 0) and torch.all(dst.kv[:, [0, 4]].float() == 0)
    finally:
        if export:
            export.close()


@pytest.mark.parametrize("dtype", [torch.bfloat16, *FORMATS], ids=str)
def test_shard_regions_move_what_copy_pages_from_moves(dtype):
    """A transfer of raw bytes (NIXL) moves page p of each region as offset + p * bytes per page:
    moving the listed pages that way must give the decode's pool what copy_pages_from gives it."""
    layout = make_layout(**SPEC, dtype=dtype)
    if kv_quant.is_quantized(dtype):
        src, src_buffer = random_pool(layout, seed=2)
    else:
        src, src_buffer = allocate_local_pool(layout, "cpu")
        src.kv.copy_(torch.randn(src.kv.shape))
    dst_layout = make_layout(**{**SPEC, "num_pages": 5}, dtype=dtype)
    by_copy, _copy_buffer = allocate_local_pool(dst_layout, "cpu")
    by_regions, regions_buffer = allocate_local_pool(dst_layout, "cpu")
    src_pages, dst_pages = [6, 2], [0, 3]
    by_copy.copy_pages_from(src, torch.tensor(src_pages), torch.tensor(dst_pages))
    src_bytes, dst_bytes = as_bytes(src, src_buffer), as_bytes(by_regions, regions_buffer)
    for (src_at, size), (dst_at, dst_size) in zip(shard_regions(layout), shard_regions(dst_layout), strict=True):
        assert size == dst_size
        for s, d in zip(src_pages, dst_pages):
            dst_bytes[dst_at + d * size: dst_at + (d + 1) * size] = src_bytes[src_at + s * size: src_at + (s + 1) * size]
    assert torch.equal(as_bytes(by_regions, regions_buffer), as_bytes(by_copy, _copy_buffer))


def as_bytes(pool, buffer: torch.Tensor) -> torch.Tensor:
    """The pool's bytes, from its aligned start, as a view of its buffer."""
    offset = pool.kv.data_ptr() - buffer.data_ptr()
    return buffer[offset: offset + layout_bytes(pool.layout)]


def test_kv_dtype_in_the_config():
    assert load_config(None, environ={}).kv.dtype == "bfloat16"
    for name in ("float8_e4m3", "int8", "bfloat16"):
        assert load_config(None, environ={"PDSERVE_KV_DTYPE": name}).kv.dtype == name
    assert set(kv_quant.KV_DTYPES) == {"bfloat16", "float8_e4m3", "int8"}
    with pytest.raises(ConfigError, match=r"kv.dtype \(from PDSERVE_KV_DTYPE\): 'fp8' must be bfloat16, "):
        load_config(None, environ={"PDSERVE_KV_DTYPE": "fp8"})


def test_workers_of_another_kv_dtype_are_refused():
    def fp(kv_dtype: str) -> ModelFingerprint:
        return fingerprint.model_fingerprint("random:llama-tiny", "bfloat16", "none", 4, 2, 64, 16, kv_dtype)

    int8, bf16 = fp("int8"), fp("bfloat16")
    assert int8.kv_layout != bf16.kv_layout and "kv_dtype=int8" in int8.kv_layout
    assert fingerprint.differences(bf16, int8) == [f"kv_layout {int8.kv_layout} instead of {bf16.kv_layout}"]
    policy = RegistrationPolicy(16, dataclasses.astuple(int8)[:3], None)
    registry = WorkerRegistry()
    layout = make_layout(**SPEC, dtype=torch.int8)
    prefill = Register("prefill-0", Role.PREFILL, PROTOCOL_VERSION, "a", 1, 8, 16, 0, 0,
                       KvPoolHandle("shm", b"segment", layout, 0), int8)
    assert policy.refusal(prefill, None, registry) == ""
    registry.register(b"prefill", None, prefill)
    decode = Register("decode-0", Role.DECODE, PROTOCOL_VERSION, "b", 2, 8, 16, 4, 0, None, bf16)
    assert "kv_dtype=bfloat16 instead of" in policy.refusal(decode, None, registry)
    assert policy.refusal(dataclasses.replace(decode, fingerprint=int8), None, registry) == ""


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", FORMATS, ids=str)
def test_copy_pages_on_the_gpu_moves_values_and_scales(dtype):
    src, _src_buffer = random_pool(make_layout(**SPEC, dtype=dtype), seed=3)
    on_gpu, _gpu_buffer = allocate_local_pool(make_layout(**SPEC, dtype=dtype), "cuda")
    back, _back_buffer = allocate_local_pool(make_layout(**{**SPEC, "num_pages": 5}, dtype=dtype), "cuda")
    on_gpu.kv_bits.copy_(src.kv_bits)
    on_gpu.scales.copy_(src.scales)
    back.copy_pages_from(on_gpu, torch.tensor([4, 0, 6], device="cuda"), torch.tensor([1, 3, 2], device="cuda"))
    assert torch.equal(back.kv_bits[:, [1, 3, 2]].cpu(), src.kv_bits[:, [4, 0, 6]])
    assert torch.equal(back.scales[:, [1, 3, 2]].cpu(), src.scales[:, [4, 0, 6]])
    assert torch.all(back.scales[:, [0, 4]] == 0)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kv_dtype", ["int8", "float8_e4m3"])
def test_gpu_prefill_and_decode_on_quantized_pages_equal_the_cpu_path(kv_dtype):
    """The GPU's fused RoPE/quantizing write and Triton attention against the CPU's PyTorch path,
    on the same weights: a whole prompt, one in chunks (which reads its first chunk back), a step."""
    from shared.model.llama import PagedLlama
    from shared.model.presets import random_hf_model

    hf = random_hf_model("random:llama-tiny", torch.float32, "cuda:0")
    models = {"cuda:0": PagedLlama.from_hf(hf, "cuda:0"), "cpu": PagedLlama.from_hf(hf.cpu(), "cpu")}
    logits = {}
    for device, model in models.items():
        layout = model.kv_layout(16, 16, kv_dtype)
        pool = allocate_local_pool(layout, device)[0]
        whole = model.prefill(list(range(5, 45)), pool, [3, 7, 1])
        chunked = model.prefill(list(range(60, 93)), pool, [9, 2, 4], chunk_tokens=16)
        step = model.decode(torch.tensor([11, 12], device=device), torch.tensor([40, 33], device=device),
                            torch.tensor([[3, 7, 1], [9, 2, 4]], device=device), pool)
        logits[device] = [whole.cpu(), chunked.cpu(), step.cpu()]
    for gpu, cpu in zip(logits["cuda:0"], logits["cpu"]):
        torch.testing.assert_close(gpu, cpu, atol=2e-3, rtol=2e-3)
