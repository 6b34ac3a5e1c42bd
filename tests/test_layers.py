"""The tree's layers, read from the imports themselves (an ast walk, function-level imports included),
so that they cannot drift: see README.md's architecture section."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from tests.stack import REPO

# shared/'s layers, lowest first: a module imports only from its own layer or those below it.
SHARED_LAYERS = ["config", "control", "runtime", "kernels", "kv", "model", "worker"]
TORCH_FREE_LAYERS = {"config", "control", "runtime"}
GPU_MODULES = {"torch", "triton"}
# services/ import shared/ and, apart from these, never each other: the router runs apart from the workers.
SERVICE_IMPORTS_ALLOWED = {"colocated": {"prefill", "decode"}}


def python_files(folder: str) -> list[Path]:
    return sorted((REPO / folder).rglob("*.py"))


def imported_modules(path: Path) -> list[str]:
    """Every module an import statement in the file names, absolute, wherever the statement sits."""
    names = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names += [node.module] + [f"{node.module}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            raise AssertionError(f"{path.relative_to(REPO)}: relative import; this tree imports absolutely")
    return names


def shared_layer(path: Path) -> str:
    """shared/config/schema.py -> config, shared/kv/transfer/nixl.py -> kv."""
    parts = path.relative_to(REPO / "shared").with_suffix("").parts
    return parts[0]


def test_every_shared_module_sits_in_a_known_layer():
    strays = [str(p.relative_to(REPO)) for p in python_files("shared")
              if p != REPO / "shared" / "__init__.py" and shared_layer(p) not in SHARED_LAYERS]
    assert strays == []


def test_shared_layers_import_only_downwards():
    upward = []
    for path in python_files("shared"):
        if path == REPO / "shared" / "__init__.py":
            continue
        rank = SHARED_LAYERS.index(shared_layer(path))
        for name in imported_modules(path):
            parts = name.split(".")
            if parts[0] in ("services", "loadtest", "tests"):
                upward.append(f"{path.relative_to(REPO)} imports {name}")
            elif parts[0] == "shared" and len(parts) > 1 and parts[1] in SHARED_LAYERS:
                if SHARED_LAYERS.index(parts[1]) > rank:
                    upward.append(f"{path.relative_to(REPO)} ({shared_layer(path)}) imports {name}")
    assert upward == []


def test_config_control_and_runtime_import_no_torch():
    found = [f"{p.relative_to(REPO)} imports {name}" for p in python_files("shared")
             if shared_layer(p) in TORCH_FREE_LAYERS
             for name in imported_modules(p) if name.split(".")[0] in GPU_MODULES]
    assert found == []


def test_no_type_checking_back_import_in_shared():
    """An import hidden under TYPE_CHECKING is how a circle between two modules hides."""
    found = [str(p.relative_to(REPO)) for p in python_files("shared")
             if any(isinstance(n, ast.Name) and n.id == "TYPE_CHECKING" or
                    isinstance(n, ast.Attribute) and n.attr == "TYPE_CHECKING"
                    for n in ast.walk(ast.parse(p.read_text())))]
    assert found == []


def test_services_do_not_import_each_other():
    crossing = []
    for path in python_files("services"):
        service = path.relative_to(REPO / "services").parts[0]
        for name in imported_modules(path):
            parts = name.split(".")
            if parts[0] == "services" and len(parts) > 1 and parts[1] != service \
                    and parts[1] not in SERVICE_IMPORTS_ALLOWED.get(service, set()):
                crossing.append(f"{path.relative_to(REPO)} imports {name}")
            if parts[0] in ("loadtest", "tests"):
                crossing.append(f"{path.relative_to(REPO)} imports {name}")
    assert crossing == []


def test_the_checks_above_see_a_violation(tmp_path):
    """Guards the walk itself: an upward import and a torch import hidden in a function are found."""
    module = tmp_path / "m.py"
    module.write_text("def f():\n    import torch\n    from shared.worker.main import WorkerProcess\n")
    assert {"torch", "shared.worker.main", "shared.worker.main.WorkerProcess"} <= set(imported_modules(module))


@pytest.mark.e2e
@pytest.mark.parametrize("module", ["services.router.server", "services.router.__main__"])
def test_the_router_imports_neither_torch_nor_triton(module):
    script = (f"import sys, importlib; importlib.import_module({module!r}); "
              f"print(sorted(m for m in {sorted(GPU_MODULES)!r} if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "[]"
