"""Fixtures that start the real services as processes and the transformers reference model."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

# Triton kernels run under the interpreter on a machine without CUDA. It must be chosen before
# anything imports triton, and product modules (shared.kv.pool) import it.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # CI's `make test` runs its test processes beside the stacks' workers on two cores. A test
    # process's second OpenMP thread then mostly spins at barriers: a quantized decode test
    # (test_model.py) took 54 s with two threads and 24 s with one beside three busy processes, and
    # 11-12 s either way on an idle machine. A test that needs another count sets it itself
    # (test_kv_quant_e2e.py).
    torch.set_num_threads(1)

from tests.stack import ServiceStack  # noqa: E402

CACHE_DIR = os.environ.get("PDSERVE_MODEL_CACHE_DIR", "~/.cache/pdserve")
# The session stack's workers run with their wall clocks 10 minutes off the router's, each its own
# way (tests/clock_skew/sitecustomize.py): what holds there holds across hosts.
CLOCK_SKEW = Path(__file__).parent / "clock_skew"
SKEWED_CLOCKS = {role: {"PYTHONPATH": os.pathsep.join(filter(None, [str(CLOCK_SKEW), os.environ.get("PYTHONPATH")])),
                        "CLOCK_SKEW_S": skew} for role, skew in (("prefill", "600"), ("decode", "-600"))}
# Its decode also launches each step before reading the last one back (decode.overlap_steps, what
# "auto" does on a GPU): the tests on the session stack check that path, the other stacks the plain one.
SESSION_STACK_ENV = {**SKEWED_CLOCKS, "decode": {**SKEWED_CLOCKS["decode"], "PDSERVE_DECODE_OVERLAP_STEPS": "on"}}


@pytest.fixture(autouse=True)
def processes_only_in_e2e_tests(request, monkeypatch):
    """`make test-fast` runs the tests not marked e2e and promises that none starts a process: a
    test that starts one must carry the marker, or it fails here. Checked where Triton interprets
    (no CUDA, as in CI): on a GPU, any test that launches a Triton kernel compiles it, and the
    compiler starts processes of its own (ldconfig, ptxas)."""
    if torch.cuda.is_available():
        return
    if request.node.get_closest_marker("e2e") is None:
        def refuse(self, args, *_, **__):
            raise AssertionError(f"this test starts a process ({args!r}): mark it pytest.mark.e2e")
        monkeypatch.setattr(subprocess.Popen, "__init__", refuse)


@pytest.fixture(scope="session")
def checkpoint():
    from shared.model.loader import resolve_checkpoint

    return resolve_checkpoint("embedded", CACHE_DIR)  # converts the GGUF once, before services race for it


@pytest.fixture(scope="session")
def tokenizer(checkpoint):
    """transformers' own tokenizer: the reference the router's (shared/model/tokenizer.py) must match."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(checkpoint))


@pytest.fixture(scope="session")
def reference_model(checkpoint):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def stack(checkpoint, tmp_path_factory):
    """Router, prefill and decode as real processes on a free port, the workers' clocks skewed
    (SKEWED_CLOCKS), the decode's steps overlapped (SESSION_STACK_ENV); torn down with SIGTERM.

    At teardown it checks what every test owes: both pools have every page free again, each
    service exits 0, and no shared-memory segment is left behind.
    """
    with ServiceStack(tmp_path_factory.mktemp("stack"), CACHE_DIR, service_env=SESSION_STACK_ENV) as services:
        yield services
        services.stop_drained()
