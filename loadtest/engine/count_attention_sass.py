"""The decode attention's machine code for an H100/H200 (sm_90), counted on any machine (JSON on stdout).

    python -m loadtest.engine.count_attention_sass [--out FILE]

The kernel is bound by the instructions it issues per byte of K/V (shared/kernels/paged_attention_triton.py):
an H200 SM must take in about 16 bytes a cycle to keep up with HBM and issues at most 4 warp
instructions a cycle. This compiles the split kernel ahead of time for sm_90 with the ptxas that
Triton bundles (no GPU needed), as the JIT would for the 8B shape (group of 4, head_dim 128, pages
of 16, strides divisible by 16), disassembles it with Triton's cuobjdump, and reports per mode,
kv.dtype and tiling (the small batches' and the large ones'): the registers, the spilled bytes,
each loop's instructions per iteration, and the warp instructions per K/V byte of the main loop
(the tile's bytes over its instructions times its warps). The same for the MLA latent kernel
(shared/kernels/mla_decode_triton.py) at DeepSeek-V2-Lite's shape, per page format, and for its
separate merge (split_merge_triton.merge_splits). The figures are the compiler's, not timings: the
same Triton version as the GPU's must be installed for them to describe what runs there.
"""

from __future__ import annotations

import argparse
import re
import subprocess
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget

from loadtest.lib.report import emit
from shared.kernels.decode_tiling import DEFAULT_TILING, LARGE_BATCH_TILING, Tiling
from shared.kernels.mla_decode_triton import _MERGE_COLUMNS, _PRODUCTS, _mla_split_kernel
from shared.kernels.mla_decode_triton import default_tiling as latent_tiling
from shared.kernels.paged_attention_triton import MODES, _paged_decode_split_kernel
from shared.kernels.split_merge_triton import _SPLITS_PER_LOAD, _merge_kernel

POINTERS = ("q_ptr", "k_ptr", "v_ptr", "k_scale_ptr", "v_scale_ptr", "page_table_ptr", "seq_lens_ptr", "m_ptr",
            "l_ptr", "acc_ptr", "out_ptr", "counters_ptr")
# Integer arguments the JIT sees divisible by 16 at the 8B shape (and so specialises on).
DIVISIBLE = ("stride_qb", "stride_qh", "stride_p", "stride_t", "stride_h", "stride_sp", "stride_pt", "stride_ob",
             "stride_oh", "num_heads")
CASES = [("native", "bf16"), ("int8_query", "i8"), ("fp16", "fp8e4nv"), ("fp8_query", "fp8e4nv")]
ELEMENT_BYTES = {"bf16": 2, "i8": 1, "fp8e4nv": 1}
# The latent kernel's, at DeepSeek-V2-Lite's shape (16 heads, a latent of 512 and a RoPE key of 64).
LATENT_POINTERS = ("q_latent_ptr", "q_rope_ptr", "cache_ptr", "scale_ptr", "page_table_ptr", "seq_lens_ptr", "m_ptr",
                   "l_ptr", "acc_ptr", "out_ptr", "counters_ptr")
LATENT_DIVISIBLE = ("stride_lb", "stride_lh", "stride_rb", "stride_rh", "stride_p", "stride_t", "stride_pt",
                    "stride_ob", "stride_oh", "num_heads")
LATENT_HEADS, LATENT_RANK, LATENT_ROPE = 16, 512, 64


def compile_sass(kernel, types: dict[str, str], constants: dict, divisible: tuple[str, ...], num_warps: int,
                 num_stages: int, cubin: Path) -> tuple[str, str]:
    """The kernel compiled for sm_90 as the JIT would (the arguments in `divisible` known to be
    multiples of 16): its machine code and its resource usage."""
    types = {name: ("constexpr" if name in constants else kind) for name, kind in types.items()}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names) if name in divisible}
    source = triton.compiler.ASTSource(fn=kernel, signature=types, constexprs=constants, attrs=attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages})
    cubin.write_bytes(compiled.asm["cubin"])
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    sass = subprocess.run([cuobjdump, "-sass", cubin], capture_output=True, text=True, check=True).stdout
    usage = subprocess.run([cuobjdump, "-res-usage", cubin], capture_output=True, text=True, check=True).stdout
    return sass, usage


def loop_sizes(sass: str) -> list[int]:
    """Instructions between each backward branch and its target: one iteration of each loop."""
    lines = [(int(at, 16), text) for at, text in re.findall(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", sass)]
    sizes = []
    for at, text in lines:
        branch = re.search(r"BRA\s+0x([0-9a-f]+)", text)
        if branch and int(branch.group(1), 16) < at:
            sizes.append(sum(1 for where, _ in lines if int(branch.group(1), 16) <= where <= at))
    return sizes


def summary(sass: str, usage: str, num_warps: int, loop_bytes: int) -> dict:
    """Registers, spills, each loop's instructions per iteration, and the main loop's warp
    instructions per byte it reads (loop_bytes: a tile's)."""
    loops = loop_sizes(sass)
    return {"registers": int(re.search(r"REG:(\d+)", usage).group(1)),
            "stack_bytes": int(re.search(r"STACK:(\d+)", usage).group(1)),
            "loop_instructions": loops, "warp_instructions_per_kv_byte": max(loops) * num_warps / loop_bytes}


def count(mode: str, kv_type: str, tiling: Tiling, workdir: Path) -> dict:
    kernel = _paged_decode_split_kernel
    types = {name: "i32" for name in kernel.arg_names}
    types.update({name: "*fp32" for name in POINTERS}, q_ptr="*bf16", k_ptr=f"*{kv_type}", v_ptr=f"*{kv_type}",
                 page_table_ptr="*i32", seq_lens_ptr="*i32", out_ptr="*bf16", counters_ptr="*i32", qk_scale="fp32",
                 stride_p="i64")
    constants = {"GROUP": 4, "GROUP_PAD": 64 if mode == "fp8_query" else 16, "HEAD_DIM": 128, "PAGE_SIZE": 16,
                 "BLOCK_N": tiling.block_n, "MODE": MODES[mode], "DOT_PRECISION": "tf32",
                 "SPLIT": True, "MERGE_HERE": True, "INLINE_PTX": tiling.convert_on_load, "USE_PDL": True}
    sass, usage = compile_sass(kernel, types, constants, POINTERS + DIVISIBLE, tiling.num_warps, tiling.num_stages,
                               workdir / f"{mode}_{kv_type}_{tiling.block_n}x{tiling.num_warps}.cubin")
    tile_bytes = 2 * tiling.block_n * 128 * ELEMENT_BYTES[kv_type]
    return {"mode": mode, "kv": kv_type, "tiling": vars(tiling), **summary(sass, usage, tiling.num_warps, tile_bytes)}


def count_latent(kv_type: str, workdir: Path) -> dict:
    kernel, tiling = _mla_split_kernel, latent_tiling(LATENT_HEADS)
    types = {name: "i32" for name in kernel.arg_names}
    types.update({name: "*fp32" for name in LATENT_POINTERS}, q_latent_ptr="*bf16", q_rope_ptr="*bf16",
                 cache_ptr=f"*{kv_type}", page_table_ptr="*i32", seq_lens_ptr="*i32", out_ptr="*bf16",
                 counters_ptr="*i32", qk_scale="fp32", stride_p="i64")
    constants = {"RANK": LATENT_RANK, "ROPE": LATENT_ROPE, "PAGE_SIZE": 16, "BLOCK_H": tiling.block_h,
                 "BLOCK_N": tiling.block_n, "QUANTIZED": kv_type != "bf16",
                 "PRODUCTS": _PRODUCTS["native" if kv_type == "bf16" else "fp16"], "DOT_PRECISION": "tf32",
                 "INLINE_PTX": True, "SPLIT": True, "MERGE_COLUMNS": _MERGE_COLUMNS, "MERGE_HERE": True,
                 "USE_PDL": True}
    sass, usage = compile_sass(kernel, types, constants, LATENT_POINTERS + LATENT_DIVISIBLE, tiling.num_warps,
                               tiling.num_stages, workdir / f"latent_{kv_type}.cubin")
    tile_bytes = tiling.block_n * (LATENT_RANK + LATENT_ROPE) * ELEMENT_BYTES[kv_type]
    return {"heads": LATENT_HEADS, "kv": kv_type, "tiling": vars(tiling),
            **summary(sass, usage, tiling.num_warps, tile_bytes)}


def count_merge(workdir: Path) -> dict:
    """The latent kernel's separate merge (shared/kernels/split_merge_triton.merge_splits) at
    DeepSeek-V2-Lite's latent width, launched with 4 warps as merge_splits launches it."""
    kernel = _merge_kernel
    types = {name: "i32" for name in kernel.arg_names}
    types.update(m_ptr="*fp32", l_ptr="*fp32", acc_ptr="*fp32", out_ptr="*bf16", seq_lens_ptr="*i32")
    constants = {"WIDTH": LATENT_RANK, "CHUNK": _MERGE_COLUMNS, "BLOCK_N": latent_tiling(LATENT_HEADS).block_n,
                 "SPLITS_PER_LOAD": _SPLITS_PER_LOAD, "USE_PDL": True}
    sass, usage = compile_sass(kernel, types, constants, ("m_ptr", "l_ptr", "acc_ptr", "out_ptr", "seq_lens_ptr",
                                                          "stride_ob", "stride_oh", "num_heads"),
                               4, 3, workdir / "latent_merge.cubin")
    loops = loop_sizes(sass)
    return {"registers": int(re.search(r"REG:(\d+)", usage).group(1)),
            "stack_bytes": int(re.search(r"STACK:(\d+)", usage).group(1)), "loop_instructions": loops}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m loadtest.engine.count_attention_sass")
    parser.add_argument("--workdir", default="/tmp/pdserve_attention_sass")
    parser.add_argument("--out")
    args = parser.parse_args()
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    rows = [count(mode, kv_type, tiling, workdir) for mode, kv_type in CASES
            for tiling in dict.fromkeys((DEFAULT_TILING[mode], LARGE_BATCH_TILING[mode]))]
    latent = [count_latent(kv_type, workdir) for kv_type in ELEMENT_BYTES]
    emit({"triton": triton.__version__, "target": "sm_90", "kernels": rows, "latent_kernels": latent,
          "latent_merge_kernel": count_merge(workdir)}, args.out)


if __name__ == "__main__":
    main()
