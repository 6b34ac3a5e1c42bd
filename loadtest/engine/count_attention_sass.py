"""The decode attention's machine code for an H100/H200 (sm_90), counted on any machine (JSON on stdout).

    python -m loadtest.engine.count_attention_sass [--out FILE]

The kernel is bound by the instructions it issues per byte of K/V (shared/kernels/paged_attention_triton.py):
an H200 SM must take in about 16 bytes a cycle to keep up with HBM and issues at most 4 warp
instructions a cycle. This compiles the split kernel ahead of time for sm_90 with the ptxas that
Triton bundles (no GPU needed), as the JIT would for the 8B shape (group of 4, head_dim 128, pages
of 16, strides divisible by 16), disassembles it with Triton's cuobjdump, and reports per mode,
kv.dtype and tiling (the small batches' and the large ones'): the registers, the spilled bytes,
each loop's instructions per iteration, and the warp instructions per K/V byte of the main loop
(the tile's bytes over its instructions times its warps). The figures are the compiler's, not timings: the same Triton version as the
GPU's must be installed for them to describe what runs there.
"""

from __future__ import annotations

import argparse
import re
import subprocess
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget

from loadtest.lib.report import emit
from shared.kernels.paged_attention_triton import (
    DEFAULT_TILING,
    LARGE_BATCH_TILING,
    MODES,
    Tiling,
    _paged_decode_split_kernel,
)

KERNEL = _paged_decode_split_kernel
POINTERS = ("q_ptr", "k_ptr", "v_ptr", "k_scale_ptr", "v_scale_ptr", "page_table_ptr", "seq_lens_ptr", "m_ptr",
            "l_ptr", "acc_ptr", "out_ptr", "counters_ptr")
# Integer arguments the JIT sees divisible by 16 at the 8B shape (and so specialises on).
DIVISIBLE = ("stride_qb", "stride_qh", "stride_p", "stride_t", "stride_h", "stride_sp", "stride_pt", "stride_ob",
             "stride_oh", "num_heads")
CASES = [("native", "bf16"), ("fp16", "i8"), ("fp16", "fp8e4nv"), ("fp8_query", "fp8e4nv")]
ELEMENT_BYTES = {"bf16": 2, "i8": 1, "fp8e4nv": 1}


def signature(kv_type: str) -> dict[str, str]:
    types = {name: "i32" for name in KERNEL.arg_names}
    types.update({name: "*fp32" for name in POINTERS}, q_ptr="*bf16", k_ptr=f"*{kv_type}", v_ptr=f"*{kv_type}",
                 page_table_ptr="*i32", seq_lens_ptr="*i32", out_ptr="*bf16", counters_ptr="*i32", qk_scale="fp32",
                 stride_p="i64")
    return types


def compile_sass(mode: str, kv_type: str, tiling: Tiling, workdir: Path) -> tuple[str, str]:
    constants = {"GROUP": 4, "GROUP_PAD": 64 if mode == "fp8_query" else 16, "HEAD_DIM": 128, "PAGE_SIZE": 16,
                 "BLOCK_N": tiling.block_n, "MODE": MODES[mode], "DOT_PRECISION": "tf32",
                 "SPLIT": True, "INLINE_PTX": True, "USE_PDL": True}
    types = {name: ("constexpr" if name in constants else kind) for name, kind in signature(kv_type).items()}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(KERNEL.arg_names)
             if name in POINTERS or name in DIVISIBLE}
    source = triton.compiler.ASTSource(fn=KERNEL, signature=types, constexprs=constants, attrs=attrs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                              options={"num_warps": tiling.num_warps, "num_stages": tiling.num_stages})
    cubin = workdir / f"{mode}_{kv_type}_{tiling.block_n}x{tiling.num_warps}.cubin"
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


def count(mode: str, kv_type: str, tiling: Tiling, workdir: Path) -> dict:
    sass, usage = compile_sass(mode, kv_type, tiling, workdir)
    loops = loop_sizes(sass)
    main_loop = max(loops)
    tile_bytes = 2 * tiling.block_n * 128 * ELEMENT_BYTES[kv_type]
    return {"mode": mode, "kv": kv_type, "tiling": vars(tiling),
            "registers": int(re.search(r"REG:(\d+)", usage).group(1)),
            "stack_bytes": int(re.search(r"STACK:(\d+)", usage).group(1)),
            "loop_instructions": loops, "warp_instructions_per_kv_byte": main_loop * tiling.num_warps / tile_bytes}


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m loadtest.engine.count_attention_sass")
    parser.add_argument("--workdir", default="/tmp/pdserve_attention_sass")
    parser.add_argument("--out")
    args = parser.parse_args()
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    rows = [count(mode, kv_type, tiling, workdir) for mode, kv_type in CASES
            for tiling in dict.fromkeys((DEFAULT_TILING[mode], LARGE_BATCH_TILING[mode]))]
    emit({"triton": triton.__version__, "target": "sm_90", "kernels": rows}, args.out)


if __name__ == "__main__":
    main()
