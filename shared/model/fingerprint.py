"""A model's fingerprint: what must be equal for a prefill's KV to be usable by a decode.

The router computes the checkpoint's part (config, weights, tokenizer) from its own copy and
refuses a worker whose fingerprint differs from it or, in dtype and KV layout, from the workers
already serving. Weights are identified by each file's name, size, first and last MiB: enough to
tell two checkpoints apart without reading gigabytes at every start.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from shared.control.messages import ModelFingerprint
from shared.model import presets
from shared.model.loader import config_dict

SAMPLE_BYTES = 1 << 20
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "tokenizer.model", "vocab.json", "merges.txt")


def checkpoint_fingerprint(checkpoint: Path | str) -> tuple[str, str, str]:
    """(config_sha, weights_sha, tokenizer_sha) of a checkpoint folder or a random preset. The
    config is hashed as its file says it (loader.config_dict), so the router needs no transformers."""
    config_sha = _sha(json.dumps(config_dict(checkpoint), sort_keys=True).encode())
    if presets.is_random(str(checkpoint)):  # random weights are seeded: the preset's name is their identity
        return config_sha, _sha(str(checkpoint).encode()), _sha(str(checkpoint).encode())
    folder = Path(checkpoint)
    weights = hashlib.sha256()
    for path in sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin")):
        size = path.stat().st_size
        weights.update(f"{path.name}:{size}".encode())
        with path.open("rb") as f:
            weights.update(f.read(SAMPLE_BYTES))
            f.seek(max(0, size - SAMPLE_BYTES))
            weights.update(f.read(SAMPLE_BYTES))
    tokenizer = hashlib.sha256()
    for name in TOKENIZER_FILES:
        if (folder / name).is_file():
            tokenizer.update(name.encode() + (folder / name).read_bytes())
    return config_sha, weights.hexdigest(), tokenizer.hexdigest()


def model_fingerprint(checkpoint: Path | str, dtype: str, quantization: str, num_layers: int, num_kv_heads: int,
                      head_dim: int, page_size: int, kv_dtype: str) -> ModelFingerprint:
    """dtype: the activations'; quantization: the weights' ("none", "fp8"), part of the dtype field,
    since workers of different weights compute different KV; kv_dtype: the KV cache's format (kv.dtype)."""
    kv_layout = (f"layers={num_layers} kv_heads={num_kv_heads} head_dim={head_dim} page_size={page_size} "
                 f"kv_dtype={kv_dtype}")
    weights = "" if quantization == "none" else f" weights={quantization}"
    return ModelFingerprint(*checkpoint_fingerprint(checkpoint), dtype + weights, kv_layout)


def differences(ours: ModelFingerprint, theirs: ModelFingerprint) -> list[str]:
    """The fields that differ, for a refusal that says what is wrong: hashes by their first 16
    digits, dtype and KV layout whole (two layouts differ in their ends, e.g. kv_dtype)."""
    shown = {"config_sha": 16, "weights_sha": 16, "tokenizer_sha": 16, "dtype": None, "kv_layout": None}
    return [f"{name} {getattr(theirs, name)[:length]} instead of {getattr(ours, name)[:length]}"
            for name, length in shown.items() if getattr(ours, name) != getattr(theirs, name)]


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
