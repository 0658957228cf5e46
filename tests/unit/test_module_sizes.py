"""No class over 300 lines and no function over 60 in the chat request's path (issue 28): past
those sizes a unit has always been mixing concerns, and a reader following the request loses it.

The path is computed, not listed, so a module the chat service starts to import is measured from
that day: the chat service (`api/services/edge.py`, and `api/http/chat*.py` once the chat route
has a module of its own) with every project module they import, transitively (`domain/`,
`ledger/`, the store, `streams/status.py`); the ASGI entry (`api/http/app.py`) and the body
reader (`api/http/body_limits.py`), whose own imports are not followed: they serve every route,
and what they import for the others (pages, billing, batches, runs) is not the chat path; plus
all of `engine_adapter/`, whose fleet, replica client and estimators are injected behind the ports
the edge calls and whose simulator is the engine answering in development and in the tests.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests.unit.test_import_cycles import _module, import_graph

ROOT = Path(__file__).resolve().parents[2]
CLASS_LINES_MAX = 300
FUNCTION_LINES_MAX = 60
PACKAGES = ("api", "domain", "engine_adapter", "ledger", "streams")
FOLLOWED = ("tollgate_llm.api.services.edge",)
MEASURED_ONLY = ("tollgate_llm.api.http.app", "tollgate_llm.api.http.body_limits")

# Units still over the bounds, each with why and its size when listed (in brackets). Drop an
# entry when its unit is cut: a stale one fails. None is left: every class on the request path
# is under CLASS_LINES_MAX and every function under FUNCTION_LINES_MAX.
ALLOWED: dict[str, str] = {}


def request_path(root: Path = ROOT) -> list[Path]:
    """The files the chat request runs through, as the module docstring defines them."""
    graph = import_graph(root, PACKAGES)
    chat_routes = [_module(p, root) for p in sorted((root / "api" / "http").glob("chat*.py"))]
    seen: set[str] = set()
    todo = [m for m in (*FOLLOWED, *chat_routes) if m in graph]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(graph[module])
    seen.update(m for m in graph if m.startswith("tollgate_llm.engine_adapter"))
    seen.update(m for m in MEASURED_ONLY if m in graph)
    files = (p for package in PACKAGES for p in (root / package).rglob("*.py"))
    return sorted(p for p in files if _module(p, root) in seen)


def oversized(source: str) -> list[tuple[str, int]]:
    """(qualified name, lines) of every class over CLASS_LINES_MAX and function over
    FUNCTION_LINES_MAX, nested ones included; a unit's lines run from its `def`/`class` line to
    its last line (docstring and comments in, decorators out)."""
    found: list[tuple[str, int]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = (child.end_lineno or child.lineno) - child.lineno + 1
                limit = CLASS_LINES_MAX if isinstance(child, ast.ClassDef) else FUNCTION_LINES_MAX
                if lines > limit:
                    found.append((prefix + child.name, lines))
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return found


def _measured() -> dict[str, int]:
    sizes: dict[str, int] = {}
    for path in request_path():
        rel = path.relative_to(ROOT).as_posix()
        for name, lines in oversized(path.read_text()):
            sizes[f"{rel}::{name}"] = lines
    return sizes


def test_the_path_reaches_every_layer() -> None:
    files = {p.relative_to(ROOT).as_posix() for p in request_path()}
    for expected in (
        "api/http/app.py",
        "api/services/edge.py",
        "api/services/admission.py",
        "domain/requests/decide.py",
        "ledger/commands.py",
        "ledger/store/sql.py",
        "engine_adapter/fleet.py",
        "engine_adapter/simulator/server.py",
    ):
        assert expected in files
    assert "api/http/web.py" not in files  # pages are not the chat path


def test_no_oversized_unit_in_the_request_path() -> None:
    # Split what is listed by concern; the limits are CLASS_LINES_MAX and FUNCTION_LINES_MAX.
    over = [f"{name}: {lines}" for name, lines in _measured().items() if name not in ALLOWED]
    assert over == []


def test_the_allow_list_holds_only_units_still_oversized() -> None:
    measured = _measured()
    assert [name for name in ALLOWED if name not in measured] == []


def test_a_unit_one_line_over_is_found() -> None:
    body = "        x = 1\n" * (FUNCTION_LINES_MAX - 1)  # with its `def` line: exactly the limit
    source = f"class A:\n    def fits(self):\n{body}\n    def over(self):\n{body}        x = 2\n"
    assert oversized(source) == [("A.over", FUNCTION_LINES_MAX + 1)]
