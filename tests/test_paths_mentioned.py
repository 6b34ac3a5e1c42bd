"""Every repository path and `python -m` module that the README, docs/, deploy/, the Makefile, and
the code's docstrings and comments mention exists: this codebase cites its own files heavily, and
a stale citation is the likeliest defect after a file moves."""

import re
from pathlib import Path

from tests.stack import REPO

TOP_FOLDERS = ("services", "shared", "loadtest", "tests", "deploy", "docs", "proto")
# A path starts at a top folder that no `../` or other folder precedes (../shared/ is the material
# beside the checkout, not this repository's shared/).
PATH = re.compile(rf"(?<![\w./-])(?:{'|'.join(TOP_FOLDERS)})/[\w./@-]*[\w/]")
MODULE = re.compile(rf"python3? -m ((?:{'|'.join(TOP_FOLDERS)})(?:\.\w+)+)")
# Paths that name what a run writes, or a pattern, not a file of the repository.
GENERATED = ("docs/results/", "proto/pdserve/v1/generation_pb2")


def cited_files() -> list[Path]:
    files = [REPO / "README.md", REPO / "Makefile", REPO / "pyproject.toml"]
    for folder in ("docs", "deploy"):
        files += [p for p in (REPO / folder).rglob("*") if p.is_file() and p.suffix in (".md", ".service", ".toml", "")]
    for folder in ("services", "shared", "loadtest", "tests"):
        files += (REPO / folder).rglob("*.py")
    return sorted(set(files) - {Path(__file__).resolve()})  # this file's guard cites stale paths on purpose


def exists(mention: str) -> bool:
    """A file or folder, a module without its .py, or a module's attribute (shared/kv/pool.KvPool)."""
    path, _, attribute = mention.partition(".") if "." in Path(mention).name else (mention, "", "")
    candidates = [mention, mention + ".py", path + ".py"] if attribute else [mention, mention + ".py"]
    return any((REPO / c).exists() for c in candidates)


def missing_mentions(text: str) -> list[str]:
    missing = [mention for mention in (m.group(0).split("::")[0] for m in PATH.finditer(text))
               if not mention.startswith(GENERATED) and not exists(mention)]
    for match in MODULE.finditer(text):
        module = REPO / Path(*match.group(1).split("."))
        if not (module.with_suffix(".py").is_file() or (module / "__main__.py").is_file()):
            missing.append(f"python -m {match.group(1)}")
    return missing


def test_every_mentioned_path_and_module_exists():
    missing = [f"{path.relative_to(REPO)}: {mention}" for path in cited_files()
               for mention in missing_mentions(path.read_text())]
    assert missing == []


def test_the_scan_finds_a_stale_mention():
    """Guards the scan: a moved file, a moved module and a test id are read as mentions."""
    text = ("see shared/kv_pool.py, tests/test_layers.py::test_x, shared/kv/pool.KvPool, shared/kv/pages and `python -m services.nowhere`; "
            "../shared/FACTS.md is not ours, docs/results/x.json is written by a run.")
    assert missing_mentions(text) == ["shared/kv_pool.py", "python -m services.nowhere"]
