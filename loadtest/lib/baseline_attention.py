"""An earlier version of the decode attention kernel, run beside today's in one benchmark run.

The earlier module is a file written out of git before the run, for instance
`git show 38a1faa:shared/kernels/paged_attention_triton.py > .baseline_attention.py` (an untracked
file travels to the GPU machine with the tree). load() imports it under a name of its own; its
paged_decode_attention takes the same leading arguments as today's. in_the_model() puts it in place
of today's for the decode step of shared/model/attention.py, so a whole graphed step is timed with it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import types
from collections.abc import Iterator
from pathlib import Path

from shared.model import attention


def load(path: str | Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("baseline_paged_attention_triton", Path(path))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there while the file runs
    spec.loader.exec_module(module)
    return module


def call(module: types.ModuleType, *args, fp8_query: bool = False, tiling=None, **kwargs):
    """The earlier kernel on today's arguments; it has no FP8-query mode and no tiling choice."""
    if fp8_query or tiling is not None:
        raise ValueError("the baseline kernel has no fp8_query or tiling")
    return module.paged_decode_attention(*args, **kwargs)


@contextlib.contextmanager
def in_the_model(module: types.ModuleType) -> Iterator[None]:
    """The model's decode attention runs the earlier kernel inside the block."""
    current = attention.paged_attention_triton
    attention.paged_attention_triton = types.SimpleNamespace(
        paged_decode_attention=lambda *args, **kwargs: call(module, *args, **kwargs))
    try:
        yield
    finally:
        attention.paged_attention_triton = current
