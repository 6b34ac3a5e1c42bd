"""How a benchmark hands over its result: JSON on stdout, and the same into a file when asked."""

from __future__ import annotations

import json
from pathlib import Path


def emit(report: dict, out: str | Path | None) -> None:
    print(json.dumps(report, indent=2))
    save(report, out)


def save(report: dict, out: str | Path | None) -> None:
    """The report so far into the file, if asked: a long run cut short keeps what it measured."""
    if out:
        Path(out).write_text(json.dumps(report, indent=2) + "\n")
