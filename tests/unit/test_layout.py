"""The house's rules, read from the code: imports point one way (no circle among the modules of soma_edge,
coordinator, worker, export and bench, counting imports inside functions and under `if TYPE_CHECKING:`), no
private name crosses a module, the roles never import each other, and no product or bench file passes 600
lines. The import graph is read with `ast`, so nothing is imported to check it."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("soma_edge", "coordinator", "worker", "export", "bench")
ROLES = ("coordinator", "worker", "export")
MAX_LINES = 600


def _modules() -> dict[str, Path]:
    """Every module of the five packages by its dotted name (a package by its own name, for __init__.py)."""
    out = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


MODULES = _modules()


@dataclass(frozen=True)
class Use:
    """One module's use of another: the target module, and the name taken from it (None: the module)."""

    source: str
    target: str
    name: str | None
    line: int


def _resolve(source: str, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    base = source.split(".")
    if not MODULES[source].name == "__init__.py":
        base = base[:-1]
    base = base[: len(base) - node.level + 1]
    return ".".join(base + ([node.module] if node.module else []))


def _uses(source: str, tree: ast.AST) -> list[Use]:
    """Every import of one of our modules, wherever it stands (module level, a function, TYPE_CHECKING), and
    every attribute read off a module imported whole (`spsa._private`)."""
    out, aliases = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name in MODULES:
                    out.append(Use(source, a.name, None, node.lineno))
                    aliases[a.asname or a.name] = a.name
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(source, node)
            for a in node.names:
                whole = f"{base}.{a.name}"
                if whole in MODULES:  # `from soma_edge import spsa`: the module
                    out.append(Use(source, whole, None, node.lineno))
                    aliases[a.asname or a.name] = whole
                elif base in MODULES:
                    out.append(Use(source, base, a.name, node.lineno))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in aliases:
            out.append(Use(source, aliases[node.value.id], node.attr, node.lineno))
    return out


def _all_uses() -> list[Use]:
    return [u for name, path in MODULES.items() for u in _uses(name, ast.parse(path.read_text(), str(path)))]


USES = _all_uses()


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in edges.get(v, ()):
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle_anywhere():
    edges: dict[str, set[str]] = {}
    for u in USES:
        if u.target != u.source:
            edges.setdefault(u.source, set()).add(u.target)
    circles = _cycles(edges)
    said = [" <-> ".join(c) for c in circles]
    assert not circles, "import circles (counting imports in functions and under TYPE_CHECKING): " + "; ".join(said)


def test_no_private_name_leaves_its_module():
    crossing = sorted(
        f"{u.source}:{u.line} takes {u.target}.{u.name}"
        for u in USES
        if u.name and u.name.startswith("_") and not u.name.startswith("__") and u.target != u.source
    )
    assert not crossing, "private names used outside their module:\n" + "\n".join(crossing)


def test_the_roles_never_import_each_other():
    crossing = sorted(
        f"{u.source}:{u.line} imports {u.target}"
        for u in USES
        if u.source.split(".")[0] in ROLES
        and u.target.split(".")[0] in ROLES
        and u.source.split(".")[0] != u.target.split(".")[0]
    )
    assert not crossing, "\n".join(crossing)


def test_no_product_or_bench_file_passes_600_lines():
    long = sorted(
        f"{path.relative_to(ROOT)}: {n} lines"
        for path in MODULES.values()
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    )
    assert not long, "files over 600 lines:\n" + "\n".join(long)


def test_the_checks_see_what_they_must(tmp_path):
    """The reader is not blind: a circle through a function-level import, a TYPE_CHECKING import and a
    private name taken by `from` and by attribute are all seen in a made-up pair of modules."""
    a = ast.parse(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from soma_edge.b import B\n"
        "def f():\n    from soma_edge import b\n    return b._hidden\n"
    )
    b = ast.parse("from soma_edge.a import _secret\n")
    MODULES.update({"soma_edge.a": tmp_path / "a.py", "soma_edge.b": tmp_path / "b.py"})
    try:
        uses = _uses("soma_edge.a", a) + _uses("soma_edge.b", b)
    finally:
        del MODULES["soma_edge.a"], MODULES["soma_edge.b"]
    edges: dict[str, set[str]] = {}
    for u in uses:
        edges.setdefault(u.source, set()).add(u.target)
    assert _cycles(edges) == [["soma_edge.a", "soma_edge.b"]]
    assert {(u.target, u.name) for u in uses if u.name and u.name.startswith("_")} == {
        ("soma_edge.b", "_hidden"),
        ("soma_edge.a", "_secret"),
    }


# The core's layers, lowest first: a module imports from its own package or from packages of lower layers
# only (docs/ARCHITECTURE.md draws them). "basics" are the modules at soma_edge's top level.
LAYERS = {"basics": 0, "corpus": 1, "spsa": 1, "processes": 1, "expert": 2, "engine": 3, "wire": 3, "rundir": 4}
ENTRY_POINTS = {"soma_edge.flower_commands"}  # a stable `python -m` path, handing on to processes/


def _layer_of(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in LAYERS) else "basics"


def test_the_core_imports_only_downward():
    assert {p.name for p in (ROOT / "soma_edge").iterdir() if (p / "__init__.py").exists()} == set(LAYERS) - {
        "basics"
    }, "a package of soma_edge/ without its layer here"
    upward = sorted(
        f"{u.source}:{u.line} ({_layer_of(u.source)}) imports {u.target} ({_layer_of(u.target)})"
        for u in USES
        if u.source.startswith("soma_edge.")
        and u.target.startswith("soma_edge.")
        and u.source not in ENTRY_POINTS
        and _layer_of(u.source) != _layer_of(u.target)
        and LAYERS[_layer_of(u.target)] >= LAYERS[_layer_of(u.source)]
    )
    assert not upward, "imports that do not point down the core's layers:\n" + "\n".join(upward)


def test_the_core_is_a_few_packages():
    top = [p.name for p in (ROOT / "soma_edge").glob("*.py") if p.name != "__init__.py"]
    assert len(top) <= 8, f"soma_edge/ has {len(top)} modules at its top level: {sorted(top)}"
    for pkg in (ROOT / "soma_edge").iterdir():
        if (pkg / "__init__.py").exists():
            mods = [p for p in pkg.glob("*.py") if p.name not in ("__init__.py", "__main__.py")]
            assert len(mods) <= 10, f"{pkg.name}/ holds {len(mods)} modules"
            assert ast.get_docstring(ast.parse((pkg / "__init__.py").read_text())), f"{pkg.name}/ has no docstring"
