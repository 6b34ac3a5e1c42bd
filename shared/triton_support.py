"""Triton where it is installed: the GPU kernels need it, the CPU code path runs without it.

Each kernel module takes `triton` and `tl` from here (None without triton), defines its kernels
only when they are present, and calls require_triton before a launch.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
    import triton.testing  # the GEMV's autotuner times with triton.testing.do_bench
except ImportError as exc:
    triton = tl = None
    _IMPORT_ERROR: ImportError | None = exc
else:
    _IMPORT_ERROR = None


def require_triton(kernel: str) -> None:
    if triton is None:
        raise ImportError(f"{kernel} needs triton (pip install triton)") from _IMPORT_ERROR
