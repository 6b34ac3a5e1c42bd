"""Triton where it is installed: the GPU kernels need it, the CPU code path runs without it.

Each kernel module takes `triton` and `tl` from here (None without triton), defines its kernels
only when they are present, and calls require_triton before a launch.

The decode step's kernels also take their launch options from here (pdl_options): programmatic
dependent launch, on GPUs that have it (Hopper, sm_90, and later). A step is some three hundred
small kernels, each depending on the one before; normally the next one is launched only once
the last has drained, and each of these gaps costs about as much as a small kernel's work. With
PDL the next kernel's programs are launched while the last one still runs: each kernel starts
with wait_for_previous_kernel(), which lets its successor launch at once and then waits until
every write of its predecessor is visible. Nothing a kernel does comes before that wait, so the
order of reads and writes on the stream is the same as without PDL.
"""

from __future__ import annotations

import functools
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError as exc:
    triton = tl = None
    _IMPORT_ERROR: ImportError | None = exc
else:
    _IMPORT_ERROR = None

_pdl_allowed = True


def require_triton(kernel: str) -> None:
    if triton is None:
        raise ImportError(f"{kernel} needs triton (pip install triton)") from _IMPORT_ERROR


def compiled(device: torch.device) -> bool:
    """Whether kernels launched on this device are compiled to machine code, so that they may carry
    inline PTX: not in Triton's interpreter (TRITON_INTERPRET=1), which runs the CPU tests."""
    return device.type == "cuda" and os.environ.get("TRITON_INTERPRET", "0") in ("", "0")


def allow_pdl(allowed: bool) -> None:
    """Switches programmatic dependent launch off or on for later launches (benchmarks compare)."""
    global _pdl_allowed
    _pdl_allowed = allowed


@functools.cache
def _has_pdl(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index) >= (9, 0)


_WITH_PDL = {"USE_PDL": True, "launch_pdl": True}
_WITHOUT_PDL = {"USE_PDL": False}


def pdl_options(device: torch.device) -> dict:
    """The launch options of a kernel that starts with wait_for_previous_kernel(USE_PDL); shared
    dicts, to be unpacked and never changed (eager steps call this at every launch)."""
    if _pdl_allowed and device.type == "cuda" and _has_pdl(device.index if device.index is not None else 0):
        return _WITH_PDL
    return _WITHOUT_PDL


wait_for_previous_kernel = None
if triton is not None:

    @triton.jit
    def wait_for_previous_kernel(USE_PDL: tl.constexpr):
        if USE_PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()
