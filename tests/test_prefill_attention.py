"""The prefill's attention: the split of a chunk after earlier keys and its log-sum-exp merge on the
CPU against the masked attention, the Triton merge against its PyTorch expression, and on a GPU each
way (FlashInfer's Hopper kernel where installed, SDPA's pick for a whole prompt and the cuDNN split
where keys precede the chunk, the masked SDPA) against SDPA's math backend."""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported: kernels run interpreted

from shared.kernels import attention_merge, flashinfer_prefill
from shared.model import attention, split_attention

HEADS, KV_HEADS = 8, 2
BF16_ATOL = 1e-2  # the outputs are averages of values near 1: a few bf16 ulps
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def qkv(queries: int, keys: int, heads: int = HEADS, kv_heads: int = KV_HEADS, head_dim: int = 16,
        dtype: torch.dtype = torch.float32, device: str = "cpu", seed: int = 0, v_dim: int | None = None):
    generator = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(queries, heads, head_dim, generator=generator, device=device).to(dtype)
    k, v = (torch.randn(keys, kv_heads, dim, generator=generator, device=device).to(dtype)
            for dim in (head_dim, v_dim or head_dim))
    return q, k, v


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Softmax attention in float64, query t seeing keys up to S - T + t: the definition itself."""
    length, context = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    k, v = (x.double().repeat_interleave(group, dim=1) for x in (k, v))
    scores = torch.einsum("thd,shd->hts", q.double(), k) * scale
    seen = torch.arange(context)[None, :] <= torch.arange(length)[:, None] + context - length
    weights = scores.masked_fill(~seen.to(q.device), float("-inf")).softmax(-1)
    return torch.einsum("hts,shd->thd", weights, v)


@pytest.mark.parametrize("queries, keys", [(7, 7), (7, 19), (1, 12), (16, 17), (5, 40)])
@pytest.mark.parametrize("modes", [("native", "native"), ("stacked", "stacked")])
def test_the_split_and_merge_equal_the_masked_attention_on_the_cpu(queries, keys, modes):
    """Through PyTorch's CPU flash kernel, which also returns the log-sum-exp: the unmasked part over
    the earlier keys (GQA native, or query heads stacked along the sequence) merged with the causal
    part over the chunk's own keys, against the masked SDPA and the definition."""
    q, k, v = qkv(queries, keys)
    split = split_attention.split_attention(q, k, v, 0.3, modes)
    torch.testing.assert_close(split, attention.masked_attention(q, k, v, 0.3), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(split.double(), reference(q, k, v, 0.3), atol=1e-5, rtol=1e-5)


def test_the_split_in_bfloat16_stays_within_its_rounding():
    q, k, v = qkv(33, 97, dtype=torch.bfloat16)
    exact = reference(q, k, v, 0.25)
    split = split_attention.split_attention(q, k, v, 0.25, ("stacked", "native"))
    masked = attention.masked_attention(q, k, v, 0.25)
    assert (split.double() - exact).abs().max() <= max(2 * (masked.double() - exact).abs().max(), BF16_ATOL / 4)


def test_the_cpu_prefill_keeps_the_masked_attention(monkeypatch):
    """On the CPU prefill_attention never splits: its output is the masked SDPA's, bit for bit."""
    monkeypatch.setattr(split_attention, "split_attention", lambda *args: pytest.fail("split on the CPU"))
    q, k, v = qkv(9, 30)
    assert torch.equal(attention.prefill_attention(q, k, v, 0.3), attention.masked_attention(q, k, v, 0.3))


def test_a_flashinfer_kernel_that_does_not_build_is_not_asked_for_again(monkeypatch, capsys):
    """FlashInfer (absent here, so stood in for) builds its kernel at first use: where the build
    fails (no nvcc, say) the prefill logs it once and attends without FlashInfer from then on."""
    import types

    asked = []

    def failing_build(*args):
        asked.append(args)
        raise RuntimeError("Ninja build failed.\nnvcc: not found")

    prefill = types.SimpleNamespace(get_single_prefill_module=failing_build)
    monkeypatch.setitem(sys.modules, "flashinfer", types.SimpleNamespace(prefill=prefill))
    monkeypatch.setitem(sys.modules, "flashinfer.prefill", prefill)
    flashinfer_prefill.builds.cache_clear()
    try:
        assert not flashinfer_prefill.builds(torch.bfloat16, 128)
        assert not flashinfer_prefill.builds(torch.bfloat16, 128)
        assert asked == [("fa3", torch.bfloat16, torch.bfloat16, torch.bfloat16, 128, 128, 0, False, False, False)]
        captured = capsys.readouterr()
        assert (captured.out + captured.err).count("does not build here") == 1
        prefill.get_single_prefill_module = lambda *args: object()
        assert flashinfer_prefill.builds(torch.float16, 64)
    finally:
        flashinfer_prefill.builds.cache_clear()


@pytest.mark.skipif(torch.cuda.is_available(), reason="Triton interprets CPU tensors only without CUDA; "
                    "test_the_merge_kernel_on_the_gpu compiles it")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_interpreted_merge_kernel_equals_its_expression(dtype):
    """Strided inputs, as the kernels hand them over: outputs [T, H, D] of any token and head
    strides, log-sum-exps [H, T] either way round; 12 heads of 24, a partial tile of each."""
    tokens, heads, dim = 5, 12, 24
    out_a = torch.randn(heads, tokens, dim).transpose(0, 1).to(dtype)
    out_b = torch.randn(tokens, heads, dim).to(dtype)
    lse_a, lse_b = torch.randn(tokens, heads).t() * 4, torch.randn(heads, tokens) * 4
    merged = attention_merge.merge_triton(out_a, lse_a, out_b, lse_b)
    expected = attention_merge.merge_reference(out_a, lse_a, out_b, lse_b)
    assert merged.is_contiguous()
    # float32: rounding; bfloat16: one ulp of each output (2^-7 of it), which randn's draws above 4
    # in magnitude made larger than the fixed 2^-6 this test had (about one run in ten failed)
    tolerance = dict(atol=1e-5, rtol=0) if dtype == torch.float32 else dict(atol=2 ** -9, rtol=2 ** -7)
    torch.testing.assert_close(merged, expected, **tolerance)


def test_the_merge_of_a_part_with_itself_is_that_part():
    out = torch.randn(4, 3, 8)
    lse = torch.randn(3, 4)
    torch.testing.assert_close(attention_merge.merge_attention(out, lse, out, lse), out)


def test_the_merge_refuses_what_does_not_fit():
    out, lse = torch.randn(4, 3, 8), torch.randn(3, 4)
    with pytest.raises(ValueError, match="heads, tokens"):
        attention_merge.merge_attention(out, lse.t(), out, lse)
    with pytest.raises(ValueError, match="one dtype"):
        attention_merge.merge_attention(out, lse, out.double(), lse)
    with pytest.raises(ValueError, match="float32"):
        attention_merge.merge_attention(out, lse, out, lse.double())


# --- on the GPU -------------------------------------------------------------------------------

EIGHT_B = dict(heads=32, kv_heads=8, head_dim=128, dtype=torch.bfloat16, device="cuda")
# DeepSeek-V2-Lite's prefill attention: keys of 192 (128 from the latent, 64 RoPE), values of 128.
MLA = dict(heads=16, kv_heads=16, head_dim=192, v_dim=128, dtype=torch.bfloat16, device="cuda")
# (queries, keys): a whole prompt; chunks after earlier keys, none of the lengths a power of two;
# a single query and a single earlier key, which cuDNN refuses (the masked SDPA takes them).
GPU_CASES = [(1000, 1000), (777, 2277), (512, 4608), (1, 300), (300, 301)]


@pytest.fixture
def held_to(request):
    attention.hold_prefill_to(request.param)
    yield request.param
    attention.hold_prefill_to(None)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("queries, keys", GPU_CASES)
@pytest.mark.parametrize("shape", [EIGHT_B, MLA], ids=["8b", "mla"])
@pytest.mark.parametrize("held_to", [None, *attention.PREFILL_WAYS], indirect=True)
def test_the_gpu_prefill_attention_equals_the_math_backend(queries, keys, shape, held_to):
    """Each way and the chosen one (None) on the 8B's and MLA's heads against SDPA's math backend in
    float32 on the same bf16 inputs, within bf16 rounding: FlashInfer's kernel, SDPA's pick for a
    whole prompt and the cuDNN split after earlier keys (the masked SDPA where cuDNN refuses a part),
    the masked SDPA."""
    q, k, v = qkv(queries, keys, **shape)
    if held_to == "cudnn" and queries > 1 and keys - queries > 1:
        assert split_attention.gqa_modes(q, k, v) is not None, "cuDNN refused a case it should take"
    if held_to == "flashinfer" and not flashinfer_prefill.accepts(q, k, v):
        pytest.skip("FlashInfer's Hopper kernel is not installed here, or does not take these heads")
    out = attention.prefill_attention(q, k, v, shape["head_dim"] ** -0.5)
    torch.testing.assert_close(out.float(), math_backend(q, k, v), atol=BF16_ATOL, rtol=0)


@pytest.mark.gpu
@needs_cuda
def test_the_gpu_split_with_stacked_query_heads_equals_the_math_backend():
    q, k, v = qkv(777, 2277, **EIGHT_B)
    split = split_attention.split_attention(q, k, v, 128 ** -0.5, ("stacked", "stacked"))
    torch.testing.assert_close(split.float(), math_backend(q, k, v), atol=BF16_ATOL, rtol=0)


@pytest.mark.gpu
@needs_cuda
def test_the_merge_kernel_on_the_gpu():
    tokens, heads, dim = 3000, 32, 128
    out_a = torch.randn(tokens, heads, dim, device="cuda", dtype=torch.bfloat16)
    out_b = torch.randn(heads, tokens, dim, device="cuda", dtype=torch.bfloat16).transpose(0, 1)
    lse_a, lse_b = (torch.randn(heads, tokens, device="cuda") * 4 for _ in range(2))
    merged = attention_merge.merge_attention(out_a, lse_a, out_b, lse_b)
    expected = attention_merge.merge_reference(out_a, lse_a, out_b, lse_b)
    torch.testing.assert_close(merged, expected, atol=2 ** -5, rtol=0)  # one bf16 ulp below 8


@pytest.mark.gpu
@needs_cuda
def test_the_gpu_prefill_in_chunks_after_a_cached_prefix_follows_the_cpu_path():
    """The whole GPU prefill (fused Triton layers, cuDNN whole and split) of a bf16 model, in chunks
    after a cached prefix, against the float32 CPU path on the same weights: within bf16's reach."""
    from shared.kv.pool import allocate_local_pool
    from shared.model.llama import PagedLlama
    from shared.model.presets import random_hf_model

    hf = random_hf_model("random:llama-tiny", torch.float32, "cpu")
    prompt, pages = list(range(5, 305)), list(range(19))
    logits = {}
    for device, dtype in (("cpu", torch.float32), ("cuda", torch.bfloat16)):
        model = PagedLlama.from_hf(hf.to(device, dtype), device)
        pool = allocate_local_pool(model.kv_layout(20, 16), device)[0]
        model.prefill(prompt[:64] + [1], pool, pages[:5])
        logits[device] = model.prefill(prompt, pool, pages, chunk_tokens=96, start=64).float().cpu()
    assert (logits["cuda"] - logits["cpu"]).abs().max() <= 0.05 * logits["cpu"].abs().max()


def math_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """SDPA's math backend in float32, the bottom-right causal mask spelled out, scaled by the head dim."""
    length, context = q.shape[0], k.shape[0]
    seen = torch.arange(context, device=q.device)[None, :] <= torch.arange(length, device=q.device)[:, None] + (
        context - length)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        out = F.scaled_dot_product_attention(*(x.float().transpose(0, 1)[None] for x in (q, k, v)), attn_mask=seen,
                                             scale=q.shape[-1] ** -0.5, enable_gqa=True)
    return out[0].transpose(0, 1)
