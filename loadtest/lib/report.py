"""How a benchmark hands over its result: JSON on stdout, and the same into a file when asked."""

from __future__ import annotations

import json
from pathlib import Path


def emit(report: dict, out: str | Path | None) -> None:
    text = json.dumps(report, indent=2)
    print(text)
    if out:
        Path(out).write_text(text + "\n")
