"""loadtest/'s shape, read from its imports (loadtest/README.md): every module in a group, a group
importing only the library and itself, and no entry point imported as a library by another module."""

from __future__ import annotations

import ast

from tests.stack import REPO

GROUPS = ("lib", "engine", "stack", "external")
LOADED_BY_PATH = {"loadtest.external.locustfile"}  # `locust -f` runs it: it has no __main__ block


def modules() -> dict[str, ast.Module]:
    found = {}
    for path in sorted((REPO / "loadtest").rglob("*.py")):
        name = ".".join(path.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
        found[name] = ast.parse(path.read_text(), str(path))
    return found


def group(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def loadtest_imports(tree: ast.Module) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
    return {name for name in names if name.split(".")[0] == "loadtest"}


def entry_points(found: dict[str, ast.Module]) -> set[str]:
    return LOADED_BY_PATH | {name for name, tree in found.items()
                             if any(isinstance(node, ast.If) and "__main__" in ast.unparse(node.test)
                                    for node in tree.body)}


def test_every_module_is_in_a_group():
    assert [name for name in modules() if name != "loadtest" and group(name) not in GROUPS] == []


def test_a_group_imports_only_the_library_and_itself():
    crossing = [f"{name} imports {imported}" for name, tree in modules().items() for imported in loadtest_imports(tree)
                if group(imported) not in ("lib", group(name))]
    assert crossing == []


def test_no_entry_point_is_imported_as_a_library():
    found = modules()
    entries = entry_points(found)
    assert {"loadtest.engine.bench_gpu", "loadtest.stack.bench_serving", "loadtest.external.locustfile"} <= entries
    imported = [f"{name} imports {i}" for name, tree in found.items() for i in loadtest_imports(tree) if i in entries]
    assert imported == []
