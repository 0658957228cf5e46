"""The lists that must be the same everywhere are written once, in domain/: the terminal events
(`domain.requests.events.TERMINAL_EVENTS` and the names and statuses derived from it) and the
read models (`domain.projections.PROJECTIONS`). Two hand-kept copies of the terminal set once
drifted and
lost preempted requests; these tests fail when a consumer keeps its own copy again, or when a
dispatch table or a union that names terminal events leaves one out."""

from __future__ import annotations

import ast
import dataclasses
import typing
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from tests import builders as b
from tollgate_llm.domain.envelope import Event
from tollgate_llm.domain.errors import DomainError
from tollgate_llm.domain.projections import PROJECTIONS, PROJECTIONS_BY_NAME
from tollgate_llm.domain.requests.events import (
    TERMINAL_EVENTS,
    TERMINAL_STATUS_OF,
    TERMINAL_TYPES,
    RequestAdmitted,
    RequestRouted,
    TerminalEvent,
    is_terminal,
)
from tollgate_llm.domain.requests.evolve import evolve, fold
from tollgate_llm.domain.requests.state import RequestState
from tollgate_llm.domain.types import TERMINAL_STATUSES

ROOT = Path(__file__).resolve().parents[2]
# Every folder of Python the project runs or tests: the product packages, bench and the tests.
SCANNED = (
    "api", "cli", "domain", "engine_adapter", "ledger", "loadgen", "predictor", "streams",
    "bench", "tests",
)  # fmt: skip
# Where the terminal events are named: their stream's events, and the registry of every event.
DEFINITIONS = (Path("domain/requests/events.py"), Path("domain/registry.py"))
HERE = Path(__file__).resolve().relative_to(ROOT)  # its samples are copies on purpose
TERMINAL_NAMES = frozenset(cls.__name__ for cls in TERMINAL_EVENTS)


def _example(cls: type[Event]) -> Event:
    """An instance of `cls` for request `b.RID` built from its field types alone, so a terminal
    event added later needs no builder before this test can see it."""
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]
        if field.default is not dataclasses.MISSING or not field.init:
            continue
        kind = hints[field.name]
        if field.name == "request_id":
            values[field.name] = b.RID
        elif kind is bool:
            values[field.name] = False
        elif kind is int:
            values[field.name] = 1
        elif kind is datetime:
            values[field.name] = datetime(2026, 1, 1, tzinfo=UTC)
        elif typing.get_origin(kind) is tuple:
            values[field.name] = ()
        else:
            values[field.name] = "x"
    return cls(**values)


def _streaming() -> RequestState:
    """A request admitted and routed: every terminal event can end it."""
    return fold(b.stream(b.admitted(), b.routed()))


def _event_classes() -> list[type[Event]]:
    """Every event class there is, found from the base class (not from any list)."""
    found: list[type[Event]] = []
    pending = list(Event.__subclasses__())
    while pending:
        cls = pending.pop()
        found.append(cls)
        pending += cls.__subclasses__()
    return [cls for cls in found if dataclasses.is_dataclass(cls) and hasattr(cls, "EVENT_TYPE")]


def test_every_event_that_ends_a_request_stream_is_a_terminal_event_and_nothing_else_is() -> None:
    ending = []
    for cls in _event_classes():
        fields = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        if cls in (RequestAdmitted, RequestRouted) or "request_id" not in fields:
            continue
        try:
            state = evolve(_streaming(), b.record(_example(cls), version=3))
        except DomainError:  # an event that cannot follow a routing ends nothing
            continue
        if state.terminal is not None:
            ending.append(cls)
            assert state.terminal == cls.EVENT_TYPE
            assert state.status == TERMINAL_STATUS_OF[cls]
    assert len(ending) >= 5
    assert set(ending) == set(TERMINAL_EVENTS)


def test_the_terminal_names_and_statuses_are_derived_from_the_one_list() -> None:
    assert {cls.EVENT_TYPE for cls in TERMINAL_EVENTS} == TERMINAL_TYPES
    assert tuple(TERMINAL_STATUS_OF) == TERMINAL_EVENTS
    assert set(TERMINAL_STATUS_OF.values()) == TERMINAL_STATUSES
    assert set(typing.get_args(TerminalEvent)) == set(TERMINAL_EVENTS)
    assert all(is_terminal(_example(cls)) for cls in TERMINAL_EVENTS)
    assert not is_terminal(b.admitted())


def test_the_projection_registry_is_one_list_named_by_table() -> None:
    assert tuple(PROJECTIONS_BY_NAME.values()) == PROJECTIONS
    assert all(name == spec.name for name, spec in PROJECTIONS_BY_NAME.items())


def _sources() -> list[Path]:
    found = []
    for folder in SCANNED:
        found += sorted((ROOT / folder).rglob("*.py"))
    return [p for p in found if ".venv" not in p.parts]


def _named(node: ast.AST) -> str | None:
    """The terminal event a node names: the class (`RequestCompleted`, `events.LeaseExpired`)
    or its type string."""
    if isinstance(node, ast.Name) and node.id in TERMINAL_NAMES:
        return node.id
    if isinstance(node, ast.Attribute) and node.attr in TERMINAL_NAMES:
        return node.attr
    if isinstance(node, ast.Constant) and node.value in TERMINAL_TYPES:
        return str(node.value)
    return None


def _union_members(node: ast.AST) -> list[ast.AST]:
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        return _union_members(node.left) + _union_members(node.right)
    return [node]


def _findings(text: str, where: str) -> list[str]:
    tree = ast.parse(text, filename=where)
    # `A | B | C` nests: only the outermost union is read whole.
    inner = {
        id(side)
        for node in ast.walk(tree)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr)
        for side in (node.left, node.right)
    }
    found: list[str] = []
    for node in ast.walk(tree):
        if id(node) in inner:
            continue
        line = f"{where}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            names = {n for n in map(_named, node.elts) if n}
            if len(names) >= 2:
                found.append(f"{line}: a hand-written list of terminal events {sorted(names)}")
        elif isinstance(node, ast.Dict):
            names = {n for n in map(_named, [k for k in node.keys if k is not None]) if n}
            if len(names) < 2:
                continue
            if all(isinstance(v, ast.Constant) for v in node.values):
                found.append(f"{line}: a hand-written map of terminal events {sorted(names)}")
            elif names != TERMINAL_NAMES:
                found.append(f"{line}: a dispatch table missing {sorted(TERMINAL_NAMES - names)}")
        elif isinstance(node, ast.Match):
            patterns = [c.pattern for c in node.cases]
            classes = [p.cls for p in patterns if isinstance(p, ast.MatchClass)]
            names = {n for n in map(_named, classes) if n}
            if len(names) >= 2 and names != TERMINAL_NAMES:
                found.append(f"{line}: a match missing {sorted(TERMINAL_NAMES - names)}")
        elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
            names = {n for n in map(_named, _union_members(node)) if n}
            if len(names) >= 2 and names != TERMINAL_NAMES:
                found.append(f"{line}: a union missing {sorted(TERMINAL_NAMES - names)}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names = {t for t in TERMINAL_TYPES if f"'{t}'" in node.value}
            if len(names) >= 2:
                found.append(f"{line}: terminal types written into SQL {sorted(names)}")
    return found


def test_no_consumer_keeps_its_own_copy_of_the_terminal_events() -> None:
    """Lists, status maps and SQL name the terminal events through `TERMINAL_EVENTS`,
    `TERMINAL_TYPES` or `TERMINAL_STATUS_OF`; a dispatch table or a type union that names them
    one by one, or a `match` on them, names every one (a new terminal event fails here until
    each has it)."""
    sources = [p for p in _sources() if p.relative_to(ROOT) not in (*DEFINITIONS, HERE)]
    assert len(sources) > 100  # the scan reached the packages
    findings = [f for p in sources for f in _findings(p.read_text(), str(p.relative_to(ROOT)))]
    assert findings == []


@pytest.mark.parametrize(
    ("source", "finding"),
    [
        ("X = (RequestCompleted, LeaseExpired)", "a hand-written list"),
        ('X = {"RequestFailed", "RequestPreempted"}', "a hand-written list"),
        ('X = {RequestCompleted: "completed", RequestFailed: "failed"}', "a hand-written map"),
        ("X = {RequestCompleted: f, RequestFailed: f}", "a dispatch table missing"),
        ("x: RequestCompleted | RequestCancelled", "a union missing"),
        ("match e:\n case RequestCompleted(): pass\n case LeaseExpired(): pass", "a match missing"),
        ("q = \"type IN ('RequestCompleted','LeaseExpired')\"", "terminal types written into SQL"),
    ],
)
def test_the_scan_finds_each_kind_of_copy(source: str, finding: str) -> None:
    found = _findings(source, "sample.py")
    assert len(found) == 1 and finding in found[0]


def test_the_scan_passes_the_one_list_and_a_complete_dispatch_table() -> None:
    source = (
        "X = {RequestAdmitted: f, **{kind: g for kind in TERMINAL_EVENTS}}\n"
        "Y = {RequestCompleted: g, RequestCancelled: g, RequestFailed: g, LeaseExpired: g,"
        " RequestPreempted: g}\n"
    )
    assert _findings(source, "sample.py") == []
