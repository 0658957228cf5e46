"""The fault matrix's runner (tests/e2e/test_fault_matrix.py): real processes, a seeded schedule
of faults at the named seams (ledger/faults.py), a small mixed client workload, a recovery with
the faults off, then the invariants, read from the store, the ledger and the clients' own
records.

One run: the services start with `TOLLGATE_FAULTS` set to the run's schedule, gated until one
request went through; clients stream and not (some leave mid-stream) for `seconds`; a service
that dies (a `die` fault, or a crash) is started again at once, its faults armed once it is up
(a `die` run arms the seams it was not yet killed at: `DieRotation`); then every service is
stopped and started clean, and the run waits until every admitted request is ended and billed
(or the wait runs out). Then:

- each admitted request has exactly one terminal event, one `UsageBilled` and one ledger row;
- every answer a client received complete is billed exactly the count it was shown;
- every request cut short is billed no more than its engine generated, and no less than its
  client was shown minus what the engine generates in `CUT_BOUND_S` (the renewals' 0.1 s, and
  as long again for the renewal's commit: what an edge that dies mid-stream cannot record);
- every terminal event has its bill and ledger row, with the consumers' checkpoints and offsets
  at the head (none moved past an unapplied record and stayed there);
- every read model equals a rebuild from the store;
- a tenant with a daily budget (`BUDGET_USD`, spent within the run by a third of the clients)
  never has more posted against it than its budget;
- dead letters (a `dead_letters` table, where one exists) are counted and reported.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import sqlalchemy as sa

from tests.e2e.conftest import TOLLGATE as TOLLGATE_CLI
from tollgate_llm.domain.projections import PROJECTIONS
from tollgate_llm.domain.requests.events import TERMINAL_TYPES
from tollgate_llm.ledger.engine import create_engine_from_url
from tollgate_llm.ledger.projections import ProjectionRunner
from tollgate_llm.ledger.store import SqlEventStore

TERMINALS = tuple(sorted(TERMINAL_TYPES))
INJECTED = re.compile(r"fault injected: (\S+) (\S+) hit")

# Which process reaches which seam (a `die` rotation kills each process at each of its seams).
EDGE_SEAMS = ("store.append", "store.read", "engine.send", "engine.stream")
WORKER_SEAMS = ("store.append", "store.read", "db.readmodel", "db.checkpoint", "db.status")
KAFKA_WORKER_SEAMS = (*WORKER_SEAMS, "broker.poll", "broker.commit", "db.offsets")
RELAY_SEAMS = ("store.read", "broker.produce", "db.offsets")
CUT_BOUND_S = 0.2
BUDGET_TENANT = "matrix-budgeted"
BUDGET_USD = "0.001"  # 1,000 micro-USD: some 50 of the workload's requests


@dataclass
class Op:
    """One client request as its client saw it."""

    kind: str  # json / stream / leave (a stream the client leaves after a few chunks)
    outcome: str = "unknown"  # ok / failed / left / unknown
    request_id: str | None = None
    status: int = 0
    seen_tokens: int = 0  # the engine count the client was last shown


@dataclass
class Service:
    """One process of the run: its command, its log, and the fault spec of each start."""

    name: str
    args: list[str]
    env: dict[str, str]
    log: Path
    specs: Callable[[int], str]  # start number → TOLLGATE_FAULTS ('' for none)
    wait_url: str | None = None
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0
    deaths: int = 0
    gate: Path | None = None  # the file that arms this start's faults (`{GATE}` in its spec)
    restarting: bool = False

    def start(self, clean: bool = False, wait: bool = True) -> None:
        if isinstance(self.specs, DieRotation):
            self.specs.log = self.log
        self.gate = self.log.parent / f"armed-{self.name}-{self.starts}"
        spec = "" if clean else self.specs(self.starts).replace("{GATE}", str(self.gate))
        with open(self.log, "a") as f:
            f.write(f"\n===== start #{self.starts} faults {spec!r} =====\n")
        self.starts += 1
        env = {**self.env, "TOLLGATE_FAULTS": spec}
        out = open(self.log, "ab")  # noqa: SIM115 - inherited by the process
        self.proc = subprocess.Popen(
            self.args, cwd=Path(__file__).resolve().parents[2], stdout=out,
            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env={**os.environ, **env},
        )  # fmt: skip
        out.close()
        if self.wait_url and wait:
            _wait_ok(self.wait_url, self)

    def stop(self) -> None:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)

    def injected(self) -> Counter[tuple[str, str]]:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return Counter(INJECTED.findall(text))


def _wait_ok(url: str, service: Service, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert service.proc is not None
        if service.proc.poll() is not None:
            return  # died at start (a fault): the supervisor starts it again
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise AssertionError(f"{service.name} not ready: {service.log.read_text()[-2000:]}")


class DieRotation:
    """Each start of a service arms `die` at the nth hit of every one of its seams not yet
    killed at (read from its log): the first reached kills it, so each start covers one more
    seam and a seam the service rarely reaches never stalls the others. Clean once all are."""

    def __init__(self, seed: int, seams: tuple[str, ...], nth: int = 3) -> None:
        self.seed, self.seams, self.nth = seed, seams, nth
        self.log: Path | None = None  # set by the service

    def __call__(self, start: int) -> str:
        done = set()
        if self.log is not None and self.log.exists():
            done = {seam for seam, kind in INJECTED.findall(self.log.read_text(errors="replace"))
                    if kind == "die"}  # fmt: skip
        left = [s for s in self.seams if s not in done]
        if not left:
            return ""
        return ";".join([f"seed={self.seed}", "gate={GATE}",
                         *(f"{s}:die@{self.nth}" for s in left)])  # fmt: skip


def die_rotation(seed: int, seams: tuple[str, ...]) -> DieRotation:
    return DieRotation(seed, seams)


@dataclass
class Run:
    mode: str  # embedded / distributed
    label: str
    seed: int
    services: list[Service]
    base: str
    secret: str
    model: str
    replica_url: str
    db_url: str
    ops: list[Op] = field(default_factory=list)
    budget_secret: str = ""  # a key of BUDGET_TENANT (`budgeted`): a third of the clients use it

    def arm(self) -> None:
        """Open the gates of the services' current starts: their faults arm."""
        for s in self.services:
            if s.gate is not None:
                s.gate.touch()

    def supervise(self, stop: threading.Event) -> None:
        """Start again every service that died while the clients run; its faults arm once it
        is up (its start-up is not faulted)."""

        def restart(s: Service) -> None:
            try:
                s.start()  # an edge: until it answers
                if s.wait_url is None:
                    time.sleep(3.0)  # a worker joins its group, a relay finds its topic
                assert s.gate is not None
                s.gate.touch()
            finally:
                s.restarting = False

        while not stop.is_set():
            for s in self.services:
                dead = s.proc is not None and s.proc.poll() is not None
                if dead and not s.restarting and not stop.is_set():
                    s.deaths += 1
                    s.restarting = True
                    threading.Thread(target=restart, args=(s,), daemon=True).start()
            stop.wait(0.2)

    def warm_up(self, timeout_s: float = 60.0) -> None:
        """One request through the whole pipeline, billed (the broker's group formed)."""
        op = Op("json")
        self._one(op, random.Random(0))
        assert op.outcome == "ok", op
        engine = create_engine_from_url(self.db_url)
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                with engine.connect() as conn:
                    rows = conn.execute(
                        sa.text("SELECT count(*) FROM ledger_entries WHERE request_id = :r"),
                        {"r": op.request_id},
                    ).scalar()
                if rows:
                    return
                time.sleep(0.2)
        finally:
            engine.dispose()
        raise AssertionError(f"the warm-up request {op.request_id} was never billed")

    def budgeted(self, env: dict[str, str]) -> None:
        """BUDGET_TENANT, its daily budget and a key, made with the CLI (no faults armed in
        it); returns once the edge admits with the key."""

        def cli(*args: str) -> str:
            done = subprocess.run(
                [*TOLLGATE_CLI, *args, "--database-url", self.db_url], capture_output=True,
                text=True, timeout=60, env={**os.environ, **env},
            )  # fmt: skip
            assert done.returncode == 0, f"tollgate {args}: {done.stderr}"
            return done.stdout

        cli("tenants", "create", BUDGET_TENANT, "--plan", "enterprise")
        cli("budgets", "set", "--tenant", BUDGET_TENANT, "--period", "day", "--usd", BUDGET_USD)
        self.budget_secret = (
            cli("keys", "issue", "--tenant", BUDGET_TENANT).strip().splitlines()[-1]
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            op = Op("json")
            self._one(op, random.Random(0), self.budget_secret)
            if op.status == 200:
                return
            time.sleep(0.2)
        raise AssertionError(f"the edge never admitted the budgeted tenant's key: {op}")

    def workload(self, seconds: float, clients: int) -> None:
        stop = threading.Event()
        lock = threading.Lock()

        def client(c: int) -> None:
            rng = random.Random(f"{self.seed}:{c}")
            secret = self.budget_secret if c % 3 == 2 and self.budget_secret else self.secret
            while not stop.is_set():
                op = Op(rng.choice(("json", "json", "stream", "stream", "leave")))
                self._one(op, rng, secret)
                with lock:
                    self.ops.append(op)
                if op.outcome in ("unknown", "failed"):
                    time.sleep(0.2)  # a service down: no spinning on refused connections

        threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in range(clients)]
        supervisor = threading.Thread(target=self.supervise, args=(stop,), daemon=True)
        supervisor.start()
        for t in threads:
            t.start()
        time.sleep(seconds)
        stop.set()
        for t in threads:
            t.join(60)
        supervisor.join(10)

    def _one(self, op: Op, rng: random.Random, secret: str = "") -> None:
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": rng.randint(8, 40),
            "messages": [{"role": "user", "content": f"Count to {rng.randint(1, 99)}."}],
        }
        if op.kind != "json":
            body["stream"] = True
            body["stream_options"] = {"include_usage": True, "continuous_usage_stats": True}
        leave_after = rng.randint(1, 6)
        headers = {"Authorization": f"Bearer {secret or self.secret}"}
        try:
            with (
                httpx.Client(timeout=httpx.Timeout(20, connect=3)) as client,
                client.stream(
                    "POST", f"{self.base}/v1/chat/completions", headers=headers, json=body
                ) as r,
            ):
                op.request_id = r.headers.get("x-request-id")
                op.status = r.status_code
                if r.status_code != 200:
                    r.read()
                    op.outcome = "failed"
                    return
                if op.kind == "json":
                    r.read()
                    op.seen_tokens = r.json()["usage"]["completion_tokens"]
                    op.outcome = "ok"
                    return
                chunks = 0
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        op.outcome = "ok" if op.outcome == "unknown" else op.outcome
                        return
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        op.outcome = "failed"
                        continue
                    usage = chunk.get("usage") or {}
                    op.seen_tokens = max(op.seen_tokens, usage.get("completion_tokens") or 0)
                    chunks += 1
                    if op.kind == "leave" and chunks >= leave_after:
                        op.outcome = "left"
                        return
                # the stream ended without [DONE]: cut by the edge or the network
                if op.outcome == "unknown":
                    op.outcome = "failed"
        except (httpx.HTTPError, json.JSONDecodeError, KeyError):
            if op.outcome not in ("left",):
                op.outcome = "unknown"

    def recover(self, timeout_s: float = 90.0) -> None:
        """Every service stopped, then started again with the faults off; wait until every
        admitted request is ended and billed, or `timeout_s`."""
        for s in self.services:
            s.stop()
        for s in self.services:
            s.start(clean=True)
        engine = create_engine_from_url(self.db_url)
        deadline = time.monotonic() + timeout_s
        try:
            while time.monotonic() < deadline:
                with engine.connect() as conn:
                    admitted, billed = conn.execute(sa.text(
                        "SELECT count(*) FILTER (WHERE type = 'RequestAdmitted'), "
                        " (SELECT count(*) FROM ledger_entries) FROM events"
                    )).one()  # fmt: skip
                if admitted == billed:
                    time.sleep(1.0)  # a last pass: nothing more arrives doubled
                    break
                time.sleep(0.5)
        finally:
            engine.dispose()
        for s in self.services:
            s.stop()

    # --- the invariants --------------------------------------------------------------------

    def check(self) -> dict[str, Any]:
        engine = create_engine_from_url(self.db_url)
        try:
            return self._check(engine)
        finally:
            engine.dispose()

    def _check(self, engine: sa.Engine) -> dict[str, Any]:
        with engine.connect() as conn:
            rows = conn.execute(
                sa.text(
                    "SELECT stream_id, "
                    " count(*) FILTER (WHERE type = 'RequestAdmitted'), "
                    " count(*) FILTER (WHERE type IN :terminals), "
                    " count(*) FILTER (WHERE type = 'UsageBilled') "
                    "FROM events WHERE stream_id LIKE 'req_%' GROUP BY stream_id"
                ).bindparams(sa.bindparam("terminals", expanding=True)),
                {"terminals": list(TERMINALS)},
            ).all()
            ledger = {
                r[0]: (int(r[1]), int(r[2]), r[3])
                for r in conn.execute(
                    sa.text(
                        "SELECT request_id, count(*), max(completion_tokens), max(terminal) "
                        "FROM ledger_entries GROUP BY request_id"
                    )
                )
            }
            spent, budget = conn.execute(sa.text(
                "SELECT coalesce(sum(amount_micros), 0), count(*) FROM ledger_entries "
                "WHERE tenant_id = :t"), {"t": BUDGET_TENANT},
            ).one()  # fmt: skip
            dead = 0
            if sa.inspect(conn).has_table("dead_letters"):
                dead = int(conn.execute(sa.text("SELECT count(*) FROM dead_letters")).scalar() or 0)
            types: dict[str, list[str]] = {}
            for sid, typ in conn.execute(sa.text(
                "SELECT stream_id, type FROM events WHERE stream_id LIKE 'req_%' ORDER BY position"
            )):  # fmt: skip
                types.setdefault(sid, []).append(typ)
        admitted = {r[0] for r in rows if r[1]}
        problems: list[str] = []
        lost: list[str] = []
        doubled: list[str] = []
        for rid, n_admitted, n_terminal, n_bills in rows:
            n_rows = ledger.get(rid, (0, 0, None))[0]
            if not n_admitted:
                if n_terminal or n_bills or n_rows:
                    problems.append(f"{rid}: ended or billed, never admitted")
                continue
            if n_terminal > 1 or n_bills > 1 or n_rows > 1:
                doubled.append(f"{rid}: terminals {n_terminal}, bills {n_bills}, rows {n_rows}")
            elif n_terminal == 0 or n_bills == 0 or n_rows == 0:
                lost.append(f"{rid}: terminals {n_terminal}, bills {n_bills}, rows {n_rows}, "
                            f"events {types.get(rid)}")  # fmt: skip
        by_id = {op.request_id: op for op in self.ops if op.request_id}
        seen = billed_seen = cut_billed = cut_generated = 0
        wrong: list[str] = []
        over: list[str] = []
        under: list[str] = []
        worst_s = 0.0  # the largest shortfall below the client's view, in seconds of generation
        for rid, op in by_id.items():
            if rid not in admitted or rid not in ledger:
                if op.outcome == "ok":
                    wrong.append(f"{rid}: answered complete, never admitted or billed")
                continue
            billed = ledger[rid][1]
            if op.outcome == "ok":
                seen += op.seen_tokens
                billed_seen += billed
                if billed != op.seen_tokens:
                    wrong.append(f"{rid}: shown {op.seen_tokens}, billed {billed}")
                continue
            record = self._engine_record(rid)
            if record is not None:
                generated = int(record.get("completion_tokens") or 0)
                cut_billed += billed
                cut_generated += generated
                if billed > generated:
                    over.append(f"{rid}: billed {billed}, the engine generated {generated}")
                short_s = (op.seen_tokens - billed) / _tokens_per_s(record)
                worst_s = max(worst_s, short_s)
                if short_s > CUT_BOUND_S:
                    under.append(f"{rid}: shown {op.seen_tokens}, billed {billed} "
                                 f"({short_s:.3f} s of generation)")  # fmt: skip
        rebuilt = self._rebuild_differs(engine)
        limit = round(float(BUDGET_USD) * 1_000_000)
        refused = sum(op.status == 429 for op in self.ops)
        return {
            "budget": [f"{BUDGET_TENANT}: {spent} micro-USD posted, budget {limit}"]
            if int(spent) > limit
            else [],
            "budget_spent": (int(spent), limit, int(budget), refused),
            "admitted": len(admitted),
            "problems": problems,
            "lost": lost,
            "doubled": doubled,
            "wrong": wrong,
            "over": over,
            "under": under,
            "worst_short_s": worst_s,
            "rebuild_differs": rebuilt,
            "dead_letters": dead,
            "seen": seen,
            "billed_seen": billed_seen,
            "cut_billed": cut_billed,
            "cut_generated": cut_generated,
        }

    def _engine_record(self, rid: str) -> dict[str, Any] | None:
        try:
            r = httpx.get(f"{self.replica_url}/sim/requests/{rid}", timeout=5)
        except httpx.HTTPError:
            return None
        if r.status_code != 200:
            return None  # never reached the engine
        record: dict[str, Any] = r.json()
        return record

    def _rebuild_differs(self, engine: sa.Engine) -> list[str]:
        """The read models whose rows differ from a rebuild from the store."""
        store = SqlEventStore(engine)
        differs = []
        for spec in PROJECTIONS:
            runner = ProjectionRunner(engine, store, spec)
            live = runner.table_digest()
            runner.rebuild()
            if runner.table_digest() != live:
                differs.append(spec.name)
        return differs

    def injected(self) -> Counter[tuple[str, str]]:
        total: Counter[tuple[str, str]] = Counter()
        for s in self.services:
            total += s.injected()
        return total

    @staticmethod
    def lost(result: dict[str, Any]) -> int:
        """Requests never billed, or billed other than their client was shown (each once)."""
        return len({entry.split(":")[0] for entry in (*result["lost"], *result["wrong"])})

    def summary(self, result: dict[str, Any]) -> str:
        injected = self.injected()
        outcomes = Counter(op.outcome for op in self.ops)
        ratio = result["billed_seen"] / result["seen"] if result["seen"] else float("nan")
        cut = result["cut_billed"] / result["cut_generated"] if result["cut_generated"] else 1.0
        cells = ",".join(sorted({f"{s}:{k}" for s, k in injected}))
        deaths = sum(s.deaths for s in self.services)
        return (
            f"fault matrix {self.mode} {self.label} seed {self.seed}: requests {len(self.ops)} "
            f"({dict(outcomes)}), admitted {result['admitted']}, faults injected "
            f"{sum(injected.values())} ({deaths} deaths) / lost {self.lost(result)} / "
            f"doubled {len(result['doubled'])} / "
            f"billed÷seen (answered) {ratio:.3f} / billed÷generated (cut) {cut:.3f}, over the "
            f"engine {len(result['over'])}, under the client's view by more than "
            f"{CUT_BOUND_S} s {len(result['under'])} (worst {result['worst_short_s']:.3f} s) / "
            f"budget {result['budget_spent'][0]} / {result['budget_spent'][1]} micro-USD "
            f"({result['budget_spent'][2]} bills, {result['budget_spent'][3]} × 429) / rebuild "
            f"differs {result['rebuild_differs'] or 0} / dead letters {result['dead_letters']}"
            f" [{cells}]"
        )


def _tokens_per_s(record: dict[str, Any]) -> float:
    """The engine's generation rate for one request, from its own record (first token to
    finish); a request with fewer than two tokens counts as generating one a millisecond."""
    first, last = record.get("first_token_s"), record.get("finished_s")
    tokens = int(record.get("generated_tokens") or record.get("completion_tokens") or 0)
    if first is None or last is None or tokens < 2 or last <= first:
        return 1000.0
    return (tokens - 1) / (last - first)
