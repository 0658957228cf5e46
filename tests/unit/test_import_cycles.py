"""No import cycle among the product packages and bench: a cycle makes import order matter, and
each one found so far hid code that belonged in a module of its own. An import inside a function
or under `if TYPE_CHECKING:` counts too: it is how a cycle was hidden, not how one is broken."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = (
    "api", "cli", "domain", "engine_adapter", "ledger", "loadgen", "predictor", "streams",
    "bench",
)  # fmt: skip


# The installed product is one package: its folders are imported as `tollgate_llm.<folder>`.
PRODUCT = ("api", "cli", "domain", "engine_adapter", "ledger", "loadgen", "migrations", "predictor",
           "streams")  # fmt: skip


def _module(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    return f"tollgate_llm.{name}" if parts[0] in PRODUCT else name


def _imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    return [n for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))]


def import_graph(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> dict[str, set[str]]:
    """module -> the project modules it imports at module level."""
    paths = [p for pkg in packages for p in sorted((root / pkg).rglob("*.py"))]
    modules = {_module(p, root): p for p in paths}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in _imports(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                candidates = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                # `from a.b import c` imports the module a.b.c when there is one, else a.b.
                candidates = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                    for alias in node.names
                ]
            for candidate in candidates:
                # Every package on the way (a, a.b) runs its __init__, except the importer's
                # own packages, which are already running.
                parts = candidate.split(".")
                for i in range(1, len(parts) + 1):
                    prefix = ".".join(parts[:i])
                    if prefix in modules and prefix != name and not name.startswith(prefix + "."):
                        targets.add(prefix)
        graph[name] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def test_the_graph_reaches_the_packages() -> None:
    graph = import_graph()
    assert len(graph) > 100
    assert "tollgate_llm.ledger.store" in graph["tollgate_llm.streams.worker"] or any(
        m.startswith("tollgate_llm.ledger.store") for m in graph["tollgate_llm.streams.worker"]
    )


def test_no_import_cycles() -> None:
    assert cycles(import_graph()) == []


def test_every_import_names_the_one_package() -> None:
    """The folders are sub-packages of `tollgate_llm` once installed: an import of `domain` or
    `api.x` works only in a checkout (by accident of the working directory) and would import a
    second copy of the module beside `tollgate_llm.domain`."""
    bare = []
    for pkg in (*PACKAGES, "tests"):
        for path in sorted((ROOT / pkg).rglob("*.py")):
            for node in _imports(ast.parse(path.read_text(), filename=str(path))):
                names = (
                    [a.name for a in node.names] if isinstance(node, ast.Import)
                    else [node.module or ""] if not node.level else []
                )  # fmt: skip
                bare += [
                    f"{path.relative_to(ROOT)}:{node.lineno} {n}"
                    for n in names if n.split(".")[0] in PRODUCT
                ]  # fmt: skip
    assert bare == []


def test_a_cycle_is_found(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg import b\n")
    (pkg / "b.py").write_text("from pkg.c import thing\n")
    (pkg / "c.py").write_text("import pkg.a\nthing = 1\n")
    (pkg / "d.py").write_text("def late():\n    from pkg import a\n")
    assert cycles(import_graph(tmp_path, ("pkg",))) == [["pkg.a", "pkg.b", "pkg.c"]]
