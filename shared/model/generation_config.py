"""The model's own sampling defaults, from its checkpoint's generation_config.json, as vLLM takes them.

A request that leaves temperature, top_p or top_k unset gets the value the model's authors set in
generation_config.json; a key the file leaves out, or a checkpoint without the file (the embedded
GGUF's conversion has none), falls back to OpenAI's defaults: temperature 1.0, top_p 1.0, top_k 0
(off). Read as JSON, without transformers, since the router reads it (shared/model/loader.py says why).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from shared.model import presets
from shared.model.loader import UnsupportedModel

FILE = "generation_config.json"


@dataclass(frozen=True)
class SamplingDefaults:
    temperature: float = 1.0  # 0 is greedy
    top_p: float = 1.0
    top_k: int = 0            # 0 is off


# Each key a request may leave unset: its type, whether a value from the file is usable, and what it must be.
_RULES = {
    "temperature": (float, lambda v: isinstance(v, (int, float)) and math.isfinite(v) and v >= 0, "a number >= 0"),
    "top_p": (float, lambda v: isinstance(v, (int, float)) and 0 < v <= 1, "a number in (0, 1]"),
    "top_k": (int, lambda v: isinstance(v, int) and v >= 0, "an integer >= 0"),
}


def sampling_defaults(checkpoint: Path | str) -> SamplingDefaults:
    """UnsupportedModel for a file that is not JSON or sets a value no request could."""
    path = Path(checkpoint) / FILE
    if presets.is_random(str(checkpoint)) or not path.exists():
        return SamplingDefaults()
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UnsupportedModel(f"cannot read {path}: {exc}") from None
    if not isinstance(table, dict):
        raise UnsupportedModel(f"{path} is not a JSON object")
    given = {key: table[key] for key in _RULES if table.get(key) is not None}
    for key, value in given.items():
        _, usable, expected = _RULES[key]
        if isinstance(value, bool) or not usable(value):
            raise UnsupportedModel(f"{path}: {key} must be {expected}, got {value!r}")
    return SamplingDefaults(**{key: _RULES[key][0](value) for key, value in given.items()})
