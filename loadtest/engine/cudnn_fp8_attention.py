"""One layer's causal prefill attention through cuDNN's FP8 fused attention (`sdpa_fp8` of the
cudnn-frontend Python package, `cudnn`), where that package is installed: a probe that
loadtest/engine/bench_prefill_attention.py times beside FlashInfer's FP8 kernel. The model never calls it.

cuDNN's per-tensor FP8 attention takes one descale for each input, so q, k and v are quantized to e4m3
with one scale per tensor (its largest magnitude to FP8's 448), not per head as the bench's FlashInfer
ways do. The softmax probabilities go from one matmul to the other in FP8 as well: they are written
scaled by 448 (scale_s; descale_s = 1/448 undoes it), the bound cuDNN's documentation gives for E4M3
without dropout; unscaled, e4m3's smallest step (2^-9) would round every probability below about 1e-3
to zero. The output is bf16, or FP8 scaled by 448 / amax(v) (an attention output is a weighted mean of
the values, never larger than their largest magnitude) and dequantized after.

The causal mask is aligned at the bottom right (query i of T sees the keys up to S - T + i), which
covers a whole prompt (S = T) and a later chunk alike. A graph is built per layout and softmax scale,
on the first call (so the bench's first call includes it), and kept. Every failure, the package's
absence included, is a RuntimeError whose first line says what refused, which the bench reports.
"""

from __future__ import annotations

import functools
import importlib.util
import itertools
from dataclasses import dataclass

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
SCALAR = [1, 1, 1, 1]  # cuDNN's shape for a per-tensor scale
SCALARS = ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")
# Keywords as cudnn-frontend 1.32 spells them, then as older versions do: a version that lacks one
# rejects it (TypeError) when the graph is lowered to the backend, and the next spelling gets a new graph.
STATS_KEYWORDS = ({"generate_stats": False}, {"is_inference": True})


@functools.cache
def installed() -> bool:
    return importlib.util.find_spec("cudnn") is not None


def version() -> str | None:
    """The cudnn-frontend package's version, None where it is not installed."""
    if not installed():
        return None
    try:
        import cudnn
    except Exception as exc:  # installed but not loadable (its libcudnn, say): the report says so
        return f"unimportable: {first_line(exc)}"
    return cudnn.__version__


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[S, H, D] -> (float8_e4m3 [S, H, D], float32 [1, 1, 1, 1]): one scale for the whole tensor, its
    largest value to FP8's largest; the second is the descale, amax / 448, what the FP8 values are
    multiplied by to give x back."""
    descale = (x.abs().amax().float().clamp(min=1e-12) / FP8_MAX).reshape(SCALAR)
    # In x's dtype, as the bench's per-head quantizer: bf16 keeps more bits than e4m3, and a float32 copy
    # of a long context is large.
    return (x * descale.reciprocal().to(x.dtype).reshape(())).to(FP8), descale


@functools.lru_cache(maxsize=1)
def quantized(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
    """The last case's inputs in FP8 with their descales (tensors hash by identity), to time the kernel alone."""
    return tuple(quantize(x) for x in (q, k, v))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, out_fp8: bool = False) -> torch.Tensor:
    """q [T, H, D], k [S, KVH, D], v [S, KVH, Dv] -> [T, H, Dv] in q's dtype, q, k and v quantized in the call."""
    (q8, q_descale), (k8, k_descale), (v8, v_descale) = (quantize(x) for x in (q, k, v))
    return quantized_attention(q8, k8, v8, (q_descale, k_descale, v_descale), scale, q.dtype, out_fp8)


def quantized_attention(q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, descales, scale: float,
                        out_dtype: torch.dtype, out_fp8: bool = False) -> torch.Tensor:
    """The kernel alone, on FP8 q, k and v ([S, H, D] as `attention` takes them) and their three descales."""
    try:
        return run_graph(q8, k8, v8, descales, scale, out_fp8).to(out_dtype)
    except Exception as exc:  # a failing variant is reported by the bench, never stops it
        raise RuntimeError(f"cudnn fp8: {type(exc).__name__}: {first_line(exc)}") from exc


def run_graph(q8, k8, v8, descales, scale: float, out_fp8: bool) -> torch.Tensor:
    """cuDNN's graph for this layout, built if new, run on torch's current stream: [T, H, Dv], bf16 or
    FP8 dequantized to float32."""
    import cudnn

    q_descale, k_descale, v_descale = descales
    length, heads, v_dim = q8.shape[0], q8.shape[1], v8.shape[2]
    out = torch.empty(length, heads, v_dim, device=q8.device, dtype=FP8 if out_fp8 else torch.bfloat16)
    views = {name: heads_first(x) for name, x in (("q", q8), ("k", k8), ("v", v8), ("o", out))}
    plan = graph_plan(tuple((tuple(x.shape), tuple(x.stride()), x.dtype) for x in views.values()), out_fp8, scale,
                      q8.device)
    one, s_scale, s_descale = constants(q8.device)
    buffers = {**views, "descale_q": q_descale, "descale_k": k_descale, "descale_v": v_descale,
               "descale_s": s_descale, "scale_s": s_scale, "scale_o": v_descale.reciprocal() if out_fp8 else one,
               **plan.scratch}
    handle = cudnn_handle()
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream(q8.device).cuda_stream)
    plan.graph.execute({plan.tensors[name]: buffers[name] for name in plan.tensors}, plan.workspace, handle=handle)
    return out.float() * v_descale.reshape(()) if out_fp8 else out


def heads_first(x: torch.Tensor) -> torch.Tensor:
    """[S, H, D] viewed as cuDNN's [B=1, H, S, D], no copy: strides [S*H*D, D, H*D, 1], the batch's the whole
    tensor's, as cuDNN's own samples lay out BSHD (x.permute(1, 0, 2).unsqueeze(0) would give it H*D)."""
    return x.unsqueeze(0).permute(0, 2, 1, 3)


@dataclass(frozen=True)
class Plan:
    graph: object  # cudnn.pygraph, built
    tensors: dict  # name -> the graph's tensor, for every buffer an execute binds
    scratch: dict  # name -> buffer of the outputs nobody reads (the amaxes)
    workspace: torch.Tensor


@functools.cache  # one per layout, out_fp8, softmax scale and device: a failed build is not kept
def graph_plan(layouts: tuple, out_fp8: bool, scale: float, device: torch.device) -> Plan:
    """The graph for q, k, v and o of these (shape, stride, dtype), the first keyword spelling the installed
    version takes."""
    import cudnn

    masks = ({"diagonal_alignment": cudnn.diagonal_alignment.BOTTOM_RIGHT, "right_bound": 0},  # "preferred"
             {"use_causal_mask_bottom_right": True})  # deprecated, what older versions take
    rejected = None
    for stats, mask in itertools.product(STATS_KEYWORDS, masks):
        try:
            return build(cudnn, layouts, out_fp8, scale, device, {**stats, **mask})
        except TypeError as exc:  # a keyword this version does not take
            rejected = rejected or exc
    raise rejected


def build(cudnn, layouts: tuple, out_fp8: bool, scale: float, device: torch.device, keywords: dict) -> Plan:
    """One sdpa_fp8 graph, planned and built: q, k, v FP8 and six float32 scalars in, O bf16 or FP8 out, with
    `keywords` the stats and bottom-right mask in one version's spelling."""
    fp8, f32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
    graph = cudnn.pygraph(io_data_type=fp8, intermediate_data_type=f32, compute_data_type=f32, handle=cudnn_handle())
    (q_dim, q_stride, _), (k_dim, k_stride, _), (v_dim, v_stride, _), (o_dim, o_stride, _) = layouts
    inputs = {name: graph.tensor(name=name, dim=list(dim), stride=list(stride), data_type=fp8)
              for name, dim, stride in (("q", q_dim, q_stride), ("k", k_dim, k_stride), ("v", v_dim, v_stride))}
    scalars = {name: graph.tensor(name=name, dim=SCALAR, stride=SCALAR, data_type=f32) for name in SCALARS}
    o, _, amax_s, amax_o = graph.sdpa_fp8(**inputs, **scalars, attn_scale=scale, name="sdpa_fp8", **keywords)
    o.set_output(True).set_dim(list(o_dim)).set_stride(list(o_stride))
    o.set_data_type(fp8 if out_fp8 else cudnn.data_type.BFLOAT16)
    tensors = {**inputs, **scalars, "o": o}
    # Older versions need both amaxes as outputs; 1.32 calls amax_s deprecated (its docstring: leave it
    # virtual) but takes it. Output last, so a version that refuses any of it leaves it virtual.
    amax_o.set_dim(SCALAR).set_stride(SCALAR).set_data_type(f32).set_output(True)
    tensors["amax_o"] = amax_o
    try:
        amax_s.set_dim(SCALAR).set_stride(SCALAR).set_data_type(f32).set_output(True)
        tensors["amax_s"] = amax_s
    except Exception:
        pass
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()
    scratch = {name: torch.empty(SCALAR, device=device, dtype=torch.float32) for name in ("amax_o", "amax_s")
               if name in tensors}
    workspace = torch.empty(max(graph.get_workspace_size(), 1), device=device, dtype=torch.uint8)
    return Plan(graph, tensors, scratch, workspace)


@functools.cache
def cudnn_handle():
    """One cuDNN handle for the process, on the device current at the first call; execute sets its stream."""
    import cudnn

    return cudnn.create_handle()


@functools.cache
def constants(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """1 (scale_o for a bf16 output), 448 (scale_s) and 1/448 (descale_s), float32 [1, 1, 1, 1] on the device."""
    return tuple(torch.full(SCALAR, value, device=device, dtype=torch.float32) for value in (1.0, FP8_MAX, 1 / FP8_MAX))


def first_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[0] if lines else repr(exc)
