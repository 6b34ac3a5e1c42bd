"""The settings the stack benchmarks start a stack with: where the model cache is, and the stack's
sizes on one GPU."""

from __future__ import annotations

import os

MODEL_CACHE_DIR = os.environ.get("PDSERVE_MODEL_CACHE_DIR", "~/.cache/pdserve")


def gpu_stack_settings(model: str, services: tuple[str, ...], shared_weights: bool = True) -> dict[str, str]:
    """The stack's settings on one GPU, sized for the 8B model on an H200. A decode process of its
    own maps the prefill's weights (if shared_weights) and spins when idle."""
    separate_decode = "decode" in services
    return {"PDSERVE_MODEL_PATH": model, "PDSERVE_MODEL_DEVICE": "cuda:0", "PDSERVE_MODEL_DTYPE": "bfloat16",
            "PDSERVE_KV_PREFILL_PAGES": "6144", "PDSERVE_KV_DECODE_PAGES": "8192",
            "PDSERVE_PREFILL_CHUNK_TOKENS": "8192", "PDSERVE_DECODE_MAX_BATCH_SIZE": "128",
            "PDSERVE_DECODE_CUDA_GRAPH_BATCH_SIZES": "1,2,4,8,16,32,64,128",
            "PDSERVE_DECODE_IDLE_SPIN_S": "1.0" if separate_decode else "0",
            "PDSERVE_DECODE_WEIGHTS_FROM": "prefill-0" if shared_weights and separate_decode else ""}
