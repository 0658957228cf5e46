"""Fault injection at named seams, for the fault tests (RELIABILITY.md, "Fault matrix").

Every call from the edges, the relay, the workers and the batch runner to the event store, the
projections' database, the broker and the engine goes through a named seam (SEAMS): a decorator
on the adapter's method, `@faults.seam("store.append")`. With

    TOLLGATE_FAULTS="seed=42;store.append:after@p=0.05;engine.stream:drop@3;hang=2"

the process injects, at each armed seam, one fault kind (KINDS) on the hits its trigger picks:
`@n` the n-th hit (once), `@p=x` each hit with probability x, drawn from a generator seeded by
`seed`, the seam and the kind (so a run is reproduced by its seed, thread interleavings aside).
`hang=s` is how long a `hang` lasts (default 5 s); `delay=s` arms the seams only s seconds after
the process starts, `gate=PATH` only once the file PATH exists (a test's warm-up done): before,
calls neither fault nor count. Each injection writes one line to stderr, `fault injected: <seam>
<kind> hit <n> pid <pid>`, which the tests count.

The older crash points (POINTS, armed by `TOLLGATE_FAULT_POINTS="billing.after_append@3"`) sit
between an effect and the checkpoint that covers it; they take the one kind `die`, under either
variable.

Unset — always, outside those tests — a seam costs one truth test of an empty dict per call. An
unknown seam, kind or trigger refuses to start rather than never firing.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, TypeVar

ENV: Final = "TOLLGATE_FAULT_POINTS"
FAULTS_ENV: Final = "TOLLGATE_FAULTS"

POINTS: Final[dict[str, str]] = {
    "fold.after_read": "the fold worker read a batch of events and applied none of it",
    "billing.after_append": "bills committed, the billing checkpoint not yet saved",
    "projections.before_commit": "read-model rows and checkpoints written, not yet committed",
    "projections.after_commit": "read-model rows and checkpoints committed, positions not moved",
    "sweeper.after_expire": "a lease expired and refunded, the sweeper's own book not updated",
    "kafka.after_bills": "a Kafka worker's bills committed, its rows and offsets not yet",
    "kafka.before_commit": "a Kafka worker's rows and offsets written, not yet committed",
    # Only the test's unsafe consumer (its checkpoint moved before the write) reaches this one.
    "billing.after_checkpoint": "the billing checkpoint saved before its bills were appended",
}

# name → (what crosses it, the family whose realistic error it raises by default)
SEAMS: Final[dict[str, tuple[str, str]]] = {
    "store.append": ("an append of event batches to the event store (edges, bills, sweeper, "
                     "batch runner)", "store"),
    "store.read": ("a read of the event store: a stream, a tail by position, the relay's "
                   "committed outbox rows", "db"),
    "db.read": ("a support or finance read of the read models: the request list "
                "(`GET /v1/requests`, `tollgate requests list`)", "db"),
    "db.readmodel": ("read-model rows written in a fold's transaction (request_log, "
                     "usage_hourly, ledger_entries)", "db"),
    "db.checkpoint": ("a fold's checkpoint saved (on its own or in the caller's "
                      "transaction)", "db"),
    "db.offsets": ("a Kafka consumer's partition offsets, or the relay's published place, "
                   "saved", "db"),
    "db.status": ("a worker's or the batch runner's worker_status row written (heartbeat, "
                  "errors, dead letters)", "db"),
    "broker.produce": ("the relay publishes a batch of events and waits for the broker's "
                       "acknowledgements", "broker"),
    "broker.poll": ("a Kafka worker consumes a batch of records from the topic", "broker"),
    "broker.commit": ("a Kafka worker commits its offsets (in PostgreSQL, in the effect's "
                      "transaction)", "broker"),
    "engine.send": ("the edge or the batch runner sends a chat request to a replica", "engine"),
    "engine.stream": ("bytes of a replica's streamed answer arrive at the edge", "engine"),
    "engine.lora": ("the edge loads a tenant's LoRA adapter on the replica a request for it "
                    "was placed on (`POST /v1/load_lora_adapter`), before the chat is sent",
                    "engine"),
}  # fmt: skip

KINDS: Final[dict[str, str]] = {
    "before": "raises the seam's realistic error before its effect",
    "after": "the effect happens (commits), then the caller sees the error: the unknown outcome",
    "hang": "sleeps `hang` seconds (past the caller's timeout), then goes on",
    "drop": "the connection drops mid-way: invalidated (database) or aborted (socket), then "
    "the error",
    "die": "SIGKILL of the process at that point",
}


@dataclass
class _Arm:
    kind: str
    nth: int = 0  # fire on the nth hit only (0: use probability)
    probability: float = 0.0
    rng: random.Random | None = None


@dataclass
class Plan:
    seed: int
    hang_s: float
    arms: dict[str, list[_Arm]]
    delay_s: float = 0.0
    gate: str = ""


def parse_faults(spec: str) -> Plan:
    """`seed=N;seam:kind@n;seam:kind@p=x;hang=s` → a Plan; ValueError naming what is unknown."""
    seed, hang_s, delay_s, gate = 0, 5.0, 0.0, ""
    items: list[tuple[str, str, str]] = []
    for item in filter(None, (part.strip() for part in spec.split(";"))):
        if item.startswith("seed="):
            seed = _number(item, int)
            continue
        if item.startswith("hang="):
            hang_s = _number(item, float)
            continue
        if item.startswith("gate="):
            gate = item.partition("=")[2]
            continue
        if item.startswith("delay="):
            delay_s = _number(item, float)
            continue
        target, _, trigger = item.partition("@")
        name, _, kind = target.partition(":")
        if name not in SEAMS and name not in POINTS:
            known = ", ".join([*SEAMS, *POINTS])
            raise ValueError(f"{FAULTS_ENV}: unknown seam {name!r} (known: {known})")
        if kind not in KINDS or (name in POINTS and kind != "die"):
            kinds = "die" if name in POINTS else ", ".join(KINDS)
            raise ValueError(f"{FAULTS_ENV}: {item!r}: unknown fault kind {kind!r} ({kinds})")
        items.append((name, kind, trigger or "1"))
    arms: dict[str, list[_Arm]] = {}
    for name, kind, trigger in items:
        if trigger.startswith("p="):
            p = _number(trigger, float)
            if not 0 < p <= 1:
                raise ValueError(f"{FAULTS_ENV}: {name}:{kind}: p must be in (0, 1]")
            rng = random.Random(f"{seed}:{name}:{kind}")
            arms.setdefault(name, []).append(_Arm(kind, probability=p, rng=rng))
        elif trigger.isdigit() and int(trigger) >= 1:
            arms.setdefault(name, []).append(_Arm(kind, nth=int(trigger)))
        else:
            raise ValueError(f"{FAULTS_ENV}: {name}:{kind}@{trigger}: @n (n ≥ 1) or @p=x")
    return Plan(seed, hang_s, arms, delay_s, gate)


def _number(item: str, kind: type[int] | type[float]) -> Any:
    try:
        return kind(item.partition("=")[2])
    except ValueError:
        raise ValueError(f"{FAULTS_ENV}: {item!r}: not a number") from None


def parse(spec: str) -> dict[str, int]:
    """The older crash points: `name@n,...` → {name: n}; ValueError naming an unknown point."""
    armed: dict[str, int] = {}
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, count = item.partition("@")
        if name not in POINTS:
            raise ValueError(f"{ENV}: unknown fault point {name!r} (known: {', '.join(POINTS)})")
        if count and (not count.isdigit() or int(count) < 1):
            raise ValueError(f"{ENV}: {item!r}: the count after @ must be a positive integer")
        armed[name] = int(count or 1)
    return armed


# The one environment read below the command line that is not a setting (api/config.py): a
# test-only fault hook, armed at import in every process a test starts (children included),
# before any settings exist, and never part of a deployment's configuration.
_armed: dict[str, int] = parse(os.environ.get(ENV, ""))
_plan: dict[str, list[_Arm]] = {}
_hang_s = 5.0
_armed_from = 0.0  # time.monotonic() from which the seams fire
_gate = ""  # a file whose existence arms the seams ('' once it exists)
_gate_checked = 0.0
_hits: dict[str, int] = {}
_point_hits: dict[str, int] = {}
_lock = threading.Lock()


def arm(spec: str) -> None:
    """Arm the seams of `spec` in this process (the environment's spec is armed at import)."""
    global _hang_s, _armed_from, _gate
    plan = parse_faults(spec)
    _gate = plan.gate
    _plan.clear()
    _plan.update(plan.arms)
    _hang_s = plan.hang_s
    _armed_from = time.monotonic() + plan.delay_s
    _hits.clear()


arm(os.environ.get(FAULTS_ENV, ""))


def _report(name: str, kind: str, hits: int, details: str = "") -> None:
    sys.stderr.write(f"fault injected: {name} {kind} hit {hits} pid {os.getpid()} {details}\n")
    sys.stderr.flush()


def _kill() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def point(name: str, **context: object) -> None:
    """Reach crash point `name`: SIGKILL this process if it is armed and this is its n-th hit.
    `context` is written to stderr first (the test reads, e.g., the position it died at)."""
    if not _armed and not _plan:
        return
    details = " ".join(f"{k}={v}" for k, v in context.items())
    if _plan and _choose(name) == "die":
        _report(name, "die", _hits[name], details)
        _kill()
    wanted = _armed.get(name)
    if wanted is None:
        return
    hits = _point_hits[name] = _point_hits.get(name, 0) + 1
    if hits < wanted:
        return
    sys.stderr.write(f"fault point {name} hit {hits}: SIGKILL pid {os.getpid()} {details}\n")
    sys.stderr.flush()
    _kill()


def _choose(name: str) -> str | None:
    """Count a hit of `name`; the kind to inject on it, if any."""
    arms = _plan.get(name)
    if arms is None or time.monotonic() < _armed_from or (_gate and not _gate_open()):
        return None
    with _lock:
        hits = _hits[name] = _hits.get(name, 0) + 1
        for a in arms:
            if a.nth == hits or (a.rng is not None and a.rng.random() < a.probability):
                return a.kind
    return None


def _gate_open() -> bool:
    """Whether the gate file exists (looked for at most every 0.1 s)."""
    global _gate, _gate_checked
    now = time.monotonic()
    if now - _gate_checked < 0.1:
        return False
    _gate_checked = now
    if os.path.exists(_gate):
        _gate = ""
        return True
    return False


# --- the realistic errors, by family -----------------------------------------------------------


def db_error(message: str = "server closed the connection unexpectedly") -> Exception:
    import sqlalchemy as sa

    return sa.exc.OperationalError("(fault injected)", None, ConnectionError(message))


def store_error() -> Exception:
    from tollgate_llm.ledger.errors import StoreUnavailable

    return StoreUnavailable("event store unavailable: server closed the connection (fault)")


def broker_error() -> Exception:
    import confluent_kafka as ck

    return ck.KafkaException(ck.KafkaError(ck.KafkaError._TRANSPORT, "broker connection reset"))


def engine_error() -> Exception:
    return ConnectionResetError(104, "Connection reset by peer (fault injected)")


_DEFAULT_ERRORS: Final[dict[str, Callable[[], Exception]]] = {
    "store": store_error,
    "db": db_error,
    "broker": broker_error,
    "engine": engine_error,
}

F = TypeVar("F", bound=Callable[..., Any])


def seam(name: str, error: Callable[[], Exception] | None = None) -> Callable[[F], F]:
    """Decorate an adapter method as seam `name`; `error` makes its realistic exception (by
    default its family's). In a process started without TOLLGATE_FAULTS (production) the
    method is returned as it is: no cost at all. With it (even empty), a wrapper whose cost,
    unarmed, is one truth test of an empty dict."""
    if name not in SEAMS:
        raise ValueError(f"unknown seam {name!r}")
    make_error = error or _DEFAULT_ERRORS[SEAMS[name][1]]

    def wrap(fn: F) -> F:
        if not _plan and FAULTS_ENV not in os.environ:
            return fn
        fn = getattr(fn, "__wrapped__", fn)  # wrapped again by a test: once only
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def awrapper(*args: Any, **kwargs: Any) -> Any:
                if not _plan:
                    return await fn(*args, **kwargs)
                kind = _choose(name)
                if kind is None:
                    return await fn(*args, **kwargs)
                _report(name, kind, _hits[name])
                if kind == "hang":
                    await asyncio.sleep(_hang_s)
                    return await fn(*args, **kwargs)
                _before(kind, make_error, args)
                await fn(*args, **kwargs)
                raise make_error()

            return awrapper  # type: ignore[return-value]

        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if not _plan:
                return fn(*args, **kwargs)
            kind = _choose(name)
            if kind is None:
                return fn(*args, **kwargs)
            _report(name, kind, _hits[name])
            if kind == "hang":
                _hang(args)
                return fn(*args, **kwargs)
            _before(kind, make_error, args)
            result = fn(*args, **kwargs)
            conn = _connection(args, kwargs)
            if conn is not None and conn.in_transaction():
                _fail_at_commit(conn, make_error)  # the caller's transaction commits, then fails
                return result
            raise make_error()

        return wrapper  # type: ignore[return-value]

    return wrap


def _before(kind: str, make_error: Callable[[], Exception], args: tuple[Any, ...]) -> None:
    """The kinds that act before the effect; returns for `after`."""
    if kind == "die":
        _kill()
    if kind == "before":
        raise make_error()
    if kind == "drop":
        _drop(args)
        raise make_error()


def _connection(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    import sqlalchemy as sa

    for value in (*args, *kwargs.values()):
        if isinstance(value, sa.Connection):
            return value
    return None


def _drop(args: tuple[Any, ...]) -> None:
    """Drop what the call talks through: a SQLAlchemy connection among its arguments (or every
    pooled connection of its object's engine), or its object's socket."""
    import sqlalchemy as sa

    conn = _connection(args, {})
    if conn is not None:
        conn.invalidate()
        return
    owner = args[0] if args else None
    engine = getattr(owner, "engine", None) or getattr(owner, "_engine", None)
    if isinstance(engine, sa.Engine):
        engine.pool.dispose()
        return
    transport = getattr(owner, "_transport", None)
    if transport is not None:
        transport.abort()


def _hang(args: tuple[Any, ...]) -> None:
    """Block this thread `hang` seconds; on an event loop (a socket's callback), stop reading
    the socket that long instead, as a silent peer would, rather than freeze the loop."""
    transport = getattr(args[0], "_transport", None) if args else None
    if transport is not None and hasattr(transport, "pause_reading"):
        loop = asyncio.get_running_loop()
        if transport.is_reading():
            transport.pause_reading()

            def resume() -> None:
                if not transport.is_closing() and not transport.is_reading():
                    transport.resume_reading()

            loop.call_later(_hang_s, resume)
        return
    time.sleep(_hang_s)


def _fail_at_commit(conn: Any, make_error: Callable[[], Exception]) -> None:
    """When `conn`'s transaction commits, commit it through the driver, then raise: the caller
    sees an error for a transaction that committed."""
    import sqlalchemy as sa

    def commit_then_fail(c: Any) -> None:
        sa.event.remove(conn, "commit", commit_then_fail)
        c.connection.dbapi_connection.commit()
        raise make_error()

    sa.event.listen(conn, "commit", commit_then_fail)
