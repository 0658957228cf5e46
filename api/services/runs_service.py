"""Agent runs over HTTP (`POST /v1/runs`, `GET /v1/runs/{id}`, `POST /v1/runs/{id}/end`): parse,
decide through `domain.governance` and the command handler, and render a run with its
consumption as the edge's path view folded it. Runs are the caller's tenant's only: another
tenant's run id is answered 404, exactly like one that does not exist.

A run is billed in one currency (`domain.governance.path_admission`): its cost limit's
(`currency`, default the deployment's setting; `max_cost_usd` is `max_cost` in USD), else its
first call's. Every amount it shows says that currency."""

from __future__ import annotations

import re
import secrets
from decimal import Decimal, InvalidOperation
from typing import Any

import orjson

from tollgate_llm.api.services.auth import Caller
from tollgate_llm.api.services.errors import ApiError
from tollgate_llm.domain.control_plane.decide import decide_control
from tollgate_llm.domain.cost import CURRENCY_CODE
from tollgate_llm.domain.errors import DomainError
from tollgate_llm.domain.governance.budgets import PathView
from tollgate_llm.domain.governance.decide import EndRun, StartRun
from tollgate_llm.domain.governance.state import Hierarchy
from tollgate_llm.domain.runs.state import RUN_ID, Run, RunLimits, run_stream
from tollgate_llm.domain.text import unstorable
from tollgate_llm.ledger.commands import CommandHandler
from tollgate_llm.ledger.control import ControlLog

__all__ = ["RunService"]

MAX_BODY_BYTES = 16 * 1024
_INT_FIELDS = ("max_calls", "max_tool_calls", "max_wall_seconds", "max_in_flight")
_FIELDS = frozenset((*_INT_FIELDS, "id", "project", "max_cost", "currency", "max_cost_usd"))
_MAX_LIMIT = 10**12
_AMOUNT_TEXT = re.compile(r"^[0-9]+(\.[0-9]{1,6})?$")


class RunService:
    def __init__(
        self, control_log: ControlLog, commands: CommandHandler, paths: PathView, *,
        currency: str,
    ) -> None:  # fmt: skip
        self.control_log = control_log
        self.commands = commands
        self.paths = paths
        self.currency = currency  # the deployment's: a cost limit's unless the body names one

    @property
    def _tree(self) -> Hierarchy:
        return self.control_log.view.hierarchy

    def start(self, caller: Caller, raw: bytes) -> dict[str, Any]:
        body = _object(raw)
        unknown = sorted(set(body) - _FIELDS)
        if unknown:
            raise ApiError(400, f"unknown field {unknown[0]!r}", param=unknown[0],
                           code="invalid_value")  # fmt: skip
        run_id = body.get("id")
        if run_id is None:
            run_id = "run_" + secrets.token_hex(12)
        if not isinstance(run_id, str) or not RUN_ID.fullmatch(run_id):
            raise ApiError(400, f"'id' must match {RUN_ID.pattern}", param="id",
                           code="invalid_value")  # fmt: skip
        project = body.get("project")
        if project is None:
            project = self._tree.project_of_key(caller.tenant_id, caller.key_id)
        elif isinstance(project, str) and unstorable(project) is not None:
            raise ApiError(400, f"'project' {unstorable(project)}", param="project",
                           code="invalid_value")  # fmt: skip
        elif not isinstance(project, str) or self._tree.project(caller.tenant_id, project) is None:
            raise ApiError(404, f"no project {project!r}", param="project", code="not_found")
        # Seconds become milliseconds in the domain: bounded here so that a refusal names the
        # field the client sent (issue 27 item 8), not `max_wall_ms`.
        most = {name: _MAX_LIMIT for name in _INT_FIELDS} | {"max_wall_seconds": _MAX_LIMIT // 1000}
        ints = {name: _limit(body, name, most[name]) for name in _INT_FIELDS}
        wall_s = ints["max_wall_seconds"]
        max_cost, currency = self._cost(body)
        limits = RunLimits(
            ints["max_calls"], ints["max_tool_calls"], None if wall_s is None else wall_s * 1000,
            max_cost, ints["max_in_flight"], currency,
        )  # fmt: skip
        self._execute(caller, StartRun(caller.tenant_id, run_id, project, limits))
        return self.show(caller, run_id)

    def end(self, caller: Caller, run_id: str) -> dict[str, Any]:
        self._known(caller, run_id)
        self._execute(caller, EndRun(caller.tenant_id, run_id))
        return self.show(caller, run_id)

    def show(self, caller: Caller, run_id: str) -> dict[str, Any]:
        run = self._known(caller, run_id)
        usage = self.paths.runs.usage(caller.tenant_id, run_id)
        limits = run.limits
        status = "ended" if run.ended_at else ("exhausted" if usage.exhausted else "active")
        billed_in = limits.currency if limits.max_cost_micros is not None else (
            usage.currency or self.currency
        )  # fmt: skip
        usd = billed_in == "USD"
        return {
            "id": run.run_id,
            "object": "run",
            "project": run.project_id,
            "status": status,
            "started_at": run.started_at.isoformat().replace("+00:00", "Z"),
            "ended_at": run.ended_at.isoformat().replace("+00:00", "Z") if run.ended_at else None,
            "implicit": run.implicit,
            "limits": {
                "max_calls": limits.max_calls,
                "max_tool_calls": limits.max_tool_calls,
                "max_wall_seconds": None if limits.max_wall_ms is None
                else limits.max_wall_ms / 1000,
                "max_cost": _amount(limits.max_cost_micros),
                "currency": limits.currency,
                "max_cost_usd": _amount(limits.max_cost_micros) if limits.currency == "USD"
                else None,
                "max_in_flight": limits.max_in_flight,
            },
            "usage": {
                "calls": usage.calls,
                "in_flight": usage.in_flight,
                "tool_calls": usage.tool_calls,
                "currency": billed_in,
                "cost": _amount(usage.posted_micros),
                "reserved": _amount(usage.reserved_micros),
                "cost_usd": _amount(usage.posted_micros) if usd else None,
                "reserved_usd": _amount(usage.reserved_micros) if usd else None,
            },
            "exhausted": usage.exhausted,
        }  # fmt: skip

    def _cost(self, body: dict[str, Any]) -> tuple[int | None, str]:
        """The cost limit a body gives, in micro-units, and its currency."""
        currency = body.get("currency")
        if currency is not None and (
            not isinstance(currency, str) or not CURRENCY_CODE.fullmatch(currency)
        ):
            raise ApiError(400, f"'currency' must be an ISO 4217 code ({CURRENCY_CODE.pattern})",
                           param="currency", code="invalid_value")  # fmt: skip
        if body.get("max_cost_usd") is None:
            return _micros(body.get("max_cost"), "max_cost"), currency or self.currency
        if body.get("max_cost") is not None or currency not in (None, "USD"):
            raise ApiError(400, "'max_cost_usd' is max_cost in USD: give max_cost and currency "
                           "instead", param="max_cost_usd", code="invalid_value")  # fmt: skip
        return _micros(body.get("max_cost_usd"), "max_cost_usd"), "USD"

    def _known(self, caller: Caller, run_id: str) -> Run:
        run = self._tree.run(caller.tenant_id, run_id)
        if run is not None:
            return run
        started = self.paths.runs.started(caller.tenant_id, run_id)
        if started is None:
            raise ApiError(404, f"no run {run_id!r}", param="run_id", code="not_found")
        return self._tree.in_force(started)

    def _execute(self, caller: Caller, command: StartRun | EndRun) -> None:
        stream = run_stream(caller.tenant_id, command.run_id)
        view = self.control_log.view
        try:
            handled = self.commands.handle(
                stream, lambda v: decide_control(v, command), self.control_log.loader(stream),
                tenant_id=caller.tenant_id,
            )  # fmt: skip
        except DomainError as exc:
            status = 409 if exc.rule == "duplicate_run" else 400
            raise ApiError(status, exc.message, param=exc.field, code=exc.rule) from None
        for record in handled.records:
            view.apply(record)


def _object(raw: bytes) -> dict[str, Any]:
    if len(raw) > MAX_BODY_BYTES:
        raise ApiError(413, f"the body is over {MAX_BODY_BYTES} bytes", code="body_too_large")
    if not raw.strip():
        return {}
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise ApiError(400, "the body is not JSON", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body is a JSON object", code="invalid_value")
    return body


def _limit(body: dict[str, Any], name: str, most: int) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= most:
        raise ApiError(400, f"'{name}' must be an integer from 0 to {most}", param=name,
                       code="invalid_value")  # fmt: skip
    return value


def _micros(value: Any, name: str) -> int | None:
    """A decimal amount of the currency (a string or a number) as micro-units."""
    if value is None:
        return None
    amount = None
    if isinstance(value, str) and _AMOUNT_TEXT.fullmatch(value) or (
        isinstance(value, (int, float)) and not isinstance(value, bool)
    ):
        try:
            amount = Decimal(str(value))
        except InvalidOperation:
            amount = None
    if amount is None or isinstance(value, bool) or not amount.is_finite() or amount < 0:
        raise ApiError(400, f"'{name}' must be a non-negative amount", param=name,
                       code="invalid_value")  # fmt: skip
    micros = amount * 1_000_000
    if micros != micros.to_integral_value() or micros > _MAX_LIMIT:
        raise ApiError(400, f"'{name}' is finer than a micro-unit or too large", param=name,
                       code="invalid_value")  # fmt: skip
    return int(micros)


def _amount(micros: int | None) -> str | None:
    if micros is None:
        return None
    return str(Decimal(micros) / 1_000_000)
