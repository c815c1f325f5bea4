"""The product code's size limits (issue "house"): no class over 250 lines, no function over 80, and no
import inside a function except of a heavy or optional package, with a comment saying why it waits."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("soma_edge", "coordinator", "worker", "export")
MAX_CLASS, MAX_FUNCTION = 250, 80
# Imported where used, so that a command or a process that never needs them never pays for them.
# The expert's graph builders and the engine's modules that make them count as onnx: they build (or run what
# builds) onnx graphs, and the deploy path must run without onnx.
# pydoc_data is an optional part of the standard library that only the stdlib corpus reads.
HEAVY = {
    "torch",
    "onnx",
    "onnxruntime",
    "flwr",
    "matplotlib",
    "tensorboardX",
    "cryptography",
    "soma_edge.expert.builder",
    "soma_edge.expert.graph",
    "soma_edge.expert.population_graph",
    "soma_edge.expert.update_graph",
    "soma_edge.engine.evaluator",
    "soma_edge.engine.population",
    "soma_edge.engine.resident",
    "soma_edge.engine.capture",
}
HEAVY |= {"pydoc_data"}
FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)


def _modules() -> list[tuple[str, ast.Module, list[str]]]:
    out = []
    for pkg in PACKAGES:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            text = f.read_text()
            out.append((str(f.relative_to(ROOT)), ast.parse(text), text.splitlines()))
    return out


MODULES = _modules()


def test_no_class_or_function_over_its_limit():
    over = []
    for name, tree, _ in MODULES:
        for n in ast.walk(tree):
            limit = MAX_CLASS if isinstance(n, ast.ClassDef) else MAX_FUNCTION if isinstance(n, FUNCTIONS) else None
            if limit and n.end_lineno - n.lineno + 1 > limit:
                over.append(f"{name}:{n.lineno} {n.name}: {n.end_lineno - n.lineno + 1} lines (limit {limit})")
    assert not over, "\n".join(over)


def _imported(node: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(node, ast.ImportFrom):
        return [
            f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in HEAVY else node.module or "" for a in node.names
        ]
    return [a.name for a in node.names]


def test_imports_inside_functions_are_heavy_packages_with_a_reason():
    bad = []
    for name, tree, lines in MODULES:
        for fn in ast.walk(tree):
            if not isinstance(fn, FUNCTIONS):
                continue
            for n in ast.walk(fn):
                if not isinstance(n, (ast.Import, ast.ImportFrom)):
                    continue
                where = f"{name}:{n.lineno} {ast.unparse(n)}"
                if not all(_heavy(mod) for mod in _imported(n)):
                    bad.append(f"{where}: not a heavy or optional package; import it at the top")
                elif not _explained(lines, n):
                    bad.append(f"{where}: say why it waits, in a comment on it or on the imports above it")
    assert not bad, "\n".join(sorted(set(bad)))


def _heavy(module: str) -> bool:
    return module.split(".")[0] in HEAVY or any(module == h or module.startswith(h + ".") for h in HEAVY)


def _explained(lines: list[str], n: ast.stmt) -> bool:
    """A comment on the import itself, on the line above it, or on the run of imports right above it."""
    if any("#" in lines[i] for i in range(max(n.lineno - 2, 0), n.end_lineno)):
        return True
    i = n.lineno - 2
    while i >= 0 and (not lines[i].strip() or lines[i].strip().startswith(("import ", "from ", "#", "try:"))):
        if "#" in lines[i]:
            return True
        i -= 1
    return False


@pytest.mark.parametrize("pkg", PACKAGES)
def test_the_limits_see_every_package(pkg):
    assert any(name.startswith(pkg + "/") for name, _, _ in MODULES)
