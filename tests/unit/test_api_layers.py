"""Inside api/, the HTTP layer sits above the services: api/http/ may import api/services/, never
the other way round, and a service imports neither the composition root (runtime.py), which
builds it, nor the process start (serve.py)."""

from __future__ import annotations

import ast
from pathlib import Path

API = Path(__file__).resolve().parents[2] / "api"
# What a service may never import: the layer above it and the modules that wire or start it.
ABOVE_SERVICES = {
    ("tollgate_llm", "api", "http"), ("tollgate_llm", "api", "runtime"),
    ("tollgate_llm", "api", "serve"),
}  # fmt: skip


def _imported(source: str, package: tuple[str, ...]) -> set[tuple[str, ...]]:
    """Every module a source imports, as name parts; `from tollgate_llm.api import x` counts as
    `tollgate_llm.api.x` and a
    relative import is resolved against `package`."""
    modules: set[tuple[str, ...]] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            modules.update(tuple(alias.name.split(".")) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else ()
            module = base + tuple(node.module.split(".") if node.module else ())
            modules.add(module)
            modules.update(module + (alias.name,) for alias in node.names)
    return modules


def _above(modules: set[tuple[str, ...]]) -> set[str]:
    return {".".join(m) for m in modules for top in ABOVE_SERVICES if m[: len(top)] == top}


def test_the_check_sees_every_form_of_import() -> None:
    package = ("tollgate_llm", "api", "services")
    assert _above(_imported("from tollgate_llm.api.http.app import create_app", package))
    assert _above(_imported("import tollgate_llm.api.http.web", package))
    assert _above(_imported("from tollgate_llm.api import http", package))
    assert _above(_imported("from ..http import schemas", package))
    assert _above(_imported("from tollgate_llm.api import runtime", package))
    assert not _above(_imported("from tollgate_llm.api.services.errors import ApiError", package))
    assert not _above(_imported("from tollgate_llm.api import metrics, ports", package))
    assert not _above(_imported("import http.client", package))


def test_services_import_nothing_of_the_http_layer_or_the_wiring() -> None:
    paths = sorted((API / "services").glob("*.py"))
    assert len(paths) > 10
    for path in paths:
        above = _above(_imported(path.read_text(), ("tollgate_llm", "api", "services")))
        assert not above, f"api/services/{path.name} imports {sorted(above)}"
