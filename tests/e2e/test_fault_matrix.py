"""The fault matrix (issue 26): every seam (ledger/faults.py) × every fault kind, on both modes,
with real processes and a mixed client workload; then a recovery with the faults off and the
invariants of tests/faults/matrix.py, read from the store, the ledger and the clients' records.

Embedded: `tollgate serve --no-fold-worker` on SQLite and `tollgate worker`. Distributed:
`tollgate api`, `tollgate relay` and a Kafka `tollgate worker` on PostgreSQL and the development
broker. One replica (the simulator, its own process: its per-request counts are the engine's).

A run arms one fault kind at every seam its mode reaches (`@n` hits for coverage, `@p` for
volume) or, for `die`, kills each service at each of its seams in turn (every death started
again at once). The fast tier runs each (mode, kind) once; the long tier runs them over seeds
until ≥ 100,000 requests and ≥ 200 faults. Each run prints one summary line and, on a failure,
the seed and the environment that reproduce it.

The safeguard-off twin: the edge that never sends a dropped batch again (tests/faults/
edge_child.py) under `store.append` faults must be found losing what its clients were shown.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy as sa

from tests.e2e.conftest import MODEL, TOLLGATE, free_port, poll, start_replica
from tests.faults.matrix import (
    EDGE_SEAMS,
    KAFKA_WORKER_SEAMS,
    RELAY_SEAMS,
    WORKER_SEAMS,
    Run,
    Service,
    die_rotation,
)
from tests.faults.tier import LONG, pick
from tollgate_llm.ledger import faults
from tollgate_llm.ledger.engine import create_engine_from_url

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ARTIFACTS = Path("/tmp/tollgate-fault-matrix")
FAST = {"speed": 20, "step_base_ms": 10}
SECONDS = pick(10, 60)
DIE_SECONDS = pick(75, 120)  # each death costs a start (~5-10 s here) of the service
HANG_SECONDS = pick(20, 60)  # each hang stops its caller 5 s
CLIENTS = pick(6, 16)
SEEDS = range(1, pick(2, 9))  # the long tier: 8 seeds of every cell
EMBEDDED_SEAMS = tuple(dict.fromkeys((*EDGE_SEAMS, *WORKER_SEAMS)))
DISTRIBUTED_SEAMS = tuple(dict.fromkeys((*EDGE_SEAMS, *KAFKA_WORKER_SEAMS, *RELAY_SEAMS)))
KINDS = tuple(faults.KINDS)
# A hang lasts longer than the lease TTL the workers run with: past the caller's timeout.
LEASE_TTL_S, HANG_S = 4, 5
RESTARTS_FAULTED = 3  # a service that died this often runs clean (no crash loop)


# What every run injected, by mode: the last test checks every seam × kind was covered.
COVERED: dict[str, Counter[tuple[str, str]]] = {"embedded": Counter(), "distributed": Counter()}


RARE = ("db.status", "db.offsets", "broker.commit")  # a hit a second or a batch


def schedule(seed: int, kind: str, seams: tuple[str, ...]) -> str:
    """Every seam armed with `kind` at its 3rd and 12th hits (the rare ones, whose next hits
    a hang elsewhere delays, at their 1st), the busiest at random too."""
    arms = [f"{s}:{kind}@{n}" for s in seams for n in ((1, 12) if s in RARE else (3, 12))]
    if kind != "hang":  # a hang per hit at random would leave little time for anything else
        arms += [f"store.append:{kind}@p=0.01", f"engine.stream:{kind}@p=0.002"]
        arms += [f"{s}:{kind}@p=0.1" for s in ("broker.poll", "broker.commit") if s in seams]
    return ";".join([f"seed={seed}", f"hang={HANG_S}", "gate={GATE}", *arms])


def _secret(data_dir: Path) -> str:
    return json.loads((data_dir / "demo-keys.json").read_text())["demo-enterprise"]


def _embedded(tmp: Path, seed: int, kind: str, edge_cli: list[str], spec: str = "") -> Run:
    replica = start_replica(tmp, MODEL, seed=seed, **FAST)
    data = tmp / "data"
    data.mkdir()
    db_url = f"sqlite:///{data / 'tollgate.db'}"
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {"TOLLGATE_DATA_DIR": str(data)}

    def specs(seams: tuple[str, ...]) -> Any:
        if kind == "die":
            return die_rotation(seed, seams)
        armed = spec or schedule(seed, kind, seams)
        return lambda start: armed if start < RESTARTS_FAULTED else ""

    worker = Service(
        "worker", [*TOLLGATE, "worker", "--database-url", db_url, "--lease-ttl", str(LEASE_TTL_S)],
        env, tmp / "worker.log", specs(WORKER_SEAMS),
    )  # fmt: skip
    edge = Service(
        "edge",
        [*edge_cli, "serve", "--no-fold-worker", "--port", str(port),
         "--replica", f"{MODEL}={replica.url}"],
        env, tmp / "edge.log", specs(EDGE_SEAMS), wait_url=f"{base}/healthz",
    )  # fmt: skip
    run = Run("embedded", kind, seed, [worker, edge], base, "", MODEL, replica.url, db_url)
    run.replica = replica  # type: ignore[attr-defined]
    try:
        worker.start()  # it migrates the database, then the edge seeds it
        poll("the worker to migrate the database", (data / "tollgate.db").exists, timeout=30)
        edge.start()
        poll("the demo keys", (data / "demo-keys.json").exists, timeout=30)
        run.secret = _secret(data)
        run.warm_up()
        run.budgeted(env)
    except BaseException:
        _stop(run)
        raise
    run.arm()
    return run


def _distributed(
    tmp: Path, seed: int, kind: str, request: pytest.FixtureRequest,
    worker_cli: list[str] = TOLLGATE, spec: str = "",
) -> Run:
    postgres_url = request.getfixturevalue("postgres_url")
    broker = request.getfixturevalue("kafka_broker")
    replica = start_replica(tmp, MODEL, seed=seed, **FAST)
    data = tmp / "data"
    env = {
        "TOLLGATE_DATA_DIR": str(data),
        "TOLLGATE_KAFKA_BOOTSTRAP": broker.bootstrap,
        "TOLLGATE_KAFKA_TOPIC": request.getfixturevalue("kafka_topic"),
    }
    port = free_port()
    base = f"http://127.0.0.1:{port}"

    def specs(seams: tuple[str, ...]) -> Any:
        if kind == "die":
            return die_rotation(seed, seams)
        armed = spec or schedule(seed, kind, seams)
        return lambda start: armed if start < RESTARTS_FAULTED else ""

    edge = Service(
        "edge",
        [*TOLLGATE, "api", "--port", str(port), "--database-url", postgres_url,
         "--replica", f"{MODEL}={replica.url}"],
        env, tmp / "edge.log", specs(EDGE_SEAMS), wait_url=f"{base}/healthz",
    )  # fmt: skip
    relay = Service("relay", [*TOLLGATE, "relay", "--database-url", postgres_url], env,
                    tmp / "relay.log", specs(RELAY_SEAMS))  # fmt: skip
    worker = Service(
        "worker",
        [*worker_cli, "worker", "--database-url", postgres_url, "--lease-ttl", str(LEASE_TTL_S)],
        env, tmp / "worker.log", specs(KAFKA_WORKER_SEAMS),
    )  # fmt: skip
    run = Run("distributed", kind, seed, [edge, relay, worker], base, "", MODEL, replica.url,
              postgres_url)  # fmt: skip
    run.replica = replica  # type: ignore[attr-defined]
    # The edge migrates and seeds, the relay makes the topic, the worker joins its group, one
    # request goes through; then the faults arm (their gate file).
    try:
        for s in run.services:
            s.start()
        poll("the demo keys", (data / "demo-keys.json").exists, timeout=30)
        run.secret = _secret(data)
        run.warm_up()
        run.budgeted(env)
    except BaseException:
        _stop(run)
        raise
    run.arm()
    return run


def _stop(run: Run) -> None:
    for s in run.services:
        s.stop()
    run.replica.stop()  # type: ignore[attr-defined]


def _reproduce(run: Run) -> str:
    specs = {s.name: re.findall(r"===== start #\d+ faults '(.+)' =====", s.log.read_text())
             for s in run.services}  # fmt: skip
    return (
        f"reproduce: TOLLGATE_FAULTS per service and start {specs}; "
        f"`./dev test tests/e2e/test_fault_matrix.py -s -k '{run.mode} and {run.label} and "
        f"seed{run.seed}'`"
    )


def _execute(run: Run) -> dict[str, Any]:
    try:
        seconds = {"die": DIE_SECONDS, "hang": HANG_SECONDS}.get(run.label, SECONDS)
        run.workload(seconds, CLIENTS)
        run.recover()
        result = run.check()
    finally:
        _stop(run)
        # The logs outlive pytest's temporary directories (kept three runs deep).
        keep = ARTIFACTS / f"{run.mode}-{run.label}-seed{run.seed}"
        shutil.rmtree(keep, ignore_errors=True)
        shutil.copytree(run.services[0].log.parent, keep, ignore=shutil.ignore_patterns("*.db*"))
    COVERED[run.mode] += run.injected()
    print(run.summary(result))
    return result


def _verdict(run: Run, result: dict[str, Any]) -> list[str]:
    broken = []
    for name in ("problems", "lost", "doubled", "wrong", "over", "under", "budget"):
        if result[name]:
            broken.append(f"{name} {len(result[name])}: {result[name][:5]}")
    if result["rebuild_differs"]:
        broken.append(f"read models not equal to a rebuild: {result['rebuild_differs']}")
    if result["dead_letters"]:
        broken.append(f"{result['dead_letters']} dead letters")
    # A fault other than `die` is weather a service must live through, not exit on.
    died = {s.name: s.deaths for s in run.services if s.deaths}
    if run.label != "die" and died:
        broken.append(f"services exited on a fault they must survive: {died}")
    return broken


CELLS = [
    pytest.param(mode, kind, seed, id=f"{mode}-{kind}-seed{seed}",
                 marks=[pytest.mark.postgres, pytest.mark.kafka] if mode == "distributed" else [])
    for seed in SEEDS for mode in ("embedded", "distributed") for kind in KINDS
]  # fmt: skip


@pytest.mark.parametrize(("mode", "kind", "seed"), CELLS)
def test_fault_matrix_cell(
    mode: str, kind: str, seed: int, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    if mode == "embedded":
        run = _embedded(tmp_path, seed, kind, TOLLGATE)
    else:
        run = _distributed(tmp_path, seed, kind, request)
    result = _execute(run)
    assert len(run.ops) > 0 and result["admitted"] > 0, run.summary(result)
    broken = _verdict(run, result)
    assert not broken, f"{run.summary(result)}\n{_reproduce(run)}\n" + "\n".join(broken)


def test_every_seam_and_kind_was_injected() -> None:
    """After the cells above (pytest runs a file in order): every seam × kind of each mode
    that ran was injected at least once."""
    missing = []
    for mode, seams in (("embedded", EMBEDDED_SEAMS), ("distributed", DISTRIBUTED_SEAMS)):
        covered = COVERED[mode]
        if not covered:
            continue  # that mode's cells were not selected
        never = [f"{mode} {s}:{k}" for s in seams for k in KINDS if not covered[s, k]]
        print(f"fault matrix {mode}: {sum(covered.values())} faults over {len(covered)} "
              f"seam × kind cells; never injected: {never}")  # fmt: skip
        missing += never
    assert not missing, missing


def test_safeguard_off_twin_finds_the_loss(tmp_path: Path) -> None:
    """Finding 3's twin: the edge that never sends a batch again once the store dropped it and
    sends an answer's end before its terminal event commits, under store.append faults: the
    matrix's checks must find answers billed other than shown, or never billed."""
    cli = [sys.executable, "-m", "tests.faults.edge_child"]
    spec = "seed=7;gate={GATE};store.append:drop@p=0.05;store.append:drop@3"
    run = _embedded(tmp_path, 7, "twin", cli, spec)
    result = _execute(run)
    broken = _verdict(run, result)
    print(f"safeguard off: {len(broken)} kinds of violation found: {broken}")
    assert broken, "the unsafe edge lost nothing: a blind matrix"


if LONG:  # ~2 min with its own broker and workers: the long tier; the fast tier keeps the
    # integration twin (tests/integration/test_pg_restart.py, safeguard off) of the same rewind

    @pytest.mark.postgres
    @pytest.mark.kafka
    def test_safeguard_off_twin_finds_a_kafka_worker_moving_past(
        tmp_path: Path, request: pytest.FixtureRequest
    ) -> None:
        """Finding 1's twin: Kafka workers that do not owe a rewind after a failed poll, under
        broker.poll:after faults: the checks must find terminal events never billed."""
        cli = [sys.executable, "-m", "tests.faults.worker_child"]
        spec = "seed=11;gate={GATE};broker.poll:after@p=0.2;broker.poll:after@3"
        run = _distributed(tmp_path, 11, "twin", request, cli, spec)
        result = _execute(run)
        broken = _verdict(run, result)
        print(f"safeguard off (kafka rewind): {len(broken)} kinds of violation found: {broken}")
        assert broken, "the unsafe worker lost nothing: a blind matrix"


# --- the read rows: a support or finance read that meets a failing store ---------------------

# The request list's reads, in order, and the `db.read` hit each reaches: a plain page is one
# hit (the rows), a page `after` a cursor two (the cursor's row, then the rows). The faults sit
# on hits 2 (before), 3 (after, on the cursor's read), 5 (drop) and 7 (hang, on the rows of a
# page after a cursor); `die` at a read is the edge dying, the edge-crash rows' case.
READS = (("plain", 200), ("plain", 503), ("after", 503), ("plain", 200), ("plain", 503),
         ("after", 200), ("plain", 200), ("after", 200))  # fmt: skip
READ_SPEC = "seed=5;hang=3;db.read:before@2;db.read:after@3;db.read:drop@5;db.read:hang@7"
READ_INJECTED = {("db.read", "before"): 1, ("db.read", "after"): 1, ("db.read", "drop"): 1,
                 ("db.read", "hang"): 1}  # fmt: skip


@pytest.mark.parametrize(
    "database", ["sqlite", pytest.param("postgresql", marks=pytest.mark.postgres)]
)
def test_fault_matrix_read_row_request_list(
    database: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    """`GET /v1/requests` (support's list of a tenant's requests) while its read of the request
    log fails with each kind: a failed read is a whole 503 (`Retry-After`, an OpenAI error body
    saying the store is unavailable), never a 500 nor a page cut short; a read that hangs
    answers the whole page once the store does; the next read is whole again; and nothing else
    is touched: the edge stays up, a chat served while the read hangs and the chats after are
    answered and billed, and the list shows them."""
    replica = start_replica(tmp_path, MODEL, seed=5, **FAST)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    args = [*TOLLGATE, "serve", "--port", str(port), "--replica", f"{MODEL}={replica.url}"]
    db_url = f"sqlite:///{tmp_path / 'data' / 'tollgate.db'}"
    if database == "postgresql":
        db_url = request.getfixturevalue("postgres_url")
        args += ["--database-url", db_url]
    edge = Service("edge", args, {"TOLLGATE_DATA_DIR": str(tmp_path / "data")},
                   tmp_path / "edge.log", lambda start: READ_SPEC if start == 0 else "",
                   wait_url=f"{base}/readyz")  # fmt: skip
    try:
        edge.start()
        keys = json.loads((tmp_path / "data" / "demo-keys.json").read_text())
        support, listed, other = ({"Authorization": f"Bearer {keys[k]}"}
                                  for k in ("support", "demo-enterprise", "demo-free"))
        with httpx.Client(base_url=base, timeout=30) as client:

            def chat(headers: dict[str, str]) -> str:
                r = client.post("/v1/chat/completions", headers=headers,
                                json={"model": MODEL, "max_tokens": 4,
                                      "messages": [{"role": "user", "content": "Hi."}]})
                assert r.status_code == 200, r.text
                return str(r.headers["x-request-id"])

            def page(kind: str) -> httpx.Response:
                params = {"tenant": "demo-enterprise", "limit": "2"}
                if kind == "after":
                    params["after"] = sent[-2]  # the second newest: the page holds the rest
                return client.get("/v1/requests", headers=support, params=params)

            sent = [chat(listed) for _ in range(5)]  # oldest first
            expected = {"plain": sent[::-1][:2], "after": sent[::-1][2:4]}
            # Waited for in the database itself: every read of the list counts as a hit.
            poll("the request log to hold the chats", lambda: logged(db_url) == len(sent))
            answers: list[tuple[str, int, httpx.Response]] = []
            served_meanwhile: list[str] = []
            def read(kind: str, wanted: int) -> None:
                answers.append((kind, wanted, page(kind)))

            for n, (kind, wanted) in enumerate(READS):
                if n != 5:
                    read(kind, wanted)
                    continue
                # The read that hangs, in its own thread; another tenant's chat meanwhile.
                hung = threading.Thread(target=read, args=(kind, wanted))
                hung.start()
                served_meanwhile.append(chat(other))
                hung.join(60)
                assert not hung.is_alive(), "the hung read never answered"
            after_faults = chat(listed)
            poll("the request log to hold it", lambda: logged(db_url) == len(sent) + 1)
            last = page("plain")
    finally:
        edge.stop()
        replica.stop()
    assert edge.deaths == 0 and edge.proc is not None and edge.proc.returncode in (0, -15)
    assert edge.injected() == READ_INJECTED
    for i, (kind, wanted, r) in enumerate(answers):
        body = r.json()  # a whole JSON body: a page cut short would not parse
        assert r.status_code == wanted, (i, kind, r.status_code, body)
        if wanted == 503:
            assert int(r.headers["retry-after"]) >= 1, (i, r.headers)
            assert body["error"]["code"] == "store_unavailable" and body["error"]["message"]
            assert body["error"]["type"] == "server_error"
        else:
            assert [row["request_id"] for row in body["data"]] == expected[kind], (i, body)
            assert body["has_more"] is True and body["last_id"] == expected[kind][-1]
    assert len(served_meanwhile) == 1
    assert [row["request_id"] for row in last.json()["data"]] == [after_faults, sent[-1]]


def logged(db_url: str, tenant: str = "demo-enterprise") -> int:
    """A tenant's rows in the request log (the fold worker writes them shortly after each
    request)."""
    engine = create_engine_from_url(db_url)
    try:
        with engine.connect() as conn:
            count = conn.execute(
                sa.text("SELECT count(*) FROM request_log WHERE tenant_id = :t"), {"t": tenant}
            ).scalar()
            return int(count or 0)
    finally:
        engine.dispose()


# --- the LoRA load row: a request for an adapter whose load on its replica fails --------------

# Each request below is for an adapter its replica does not hold yet: one `engine.lora` hit
# each, the first four faulted. `die` at a load is the edge dying with requests in flight: the
# edge-crash rows' case. `drop` has no socket of its own to abort there (the load goes through
# aiohttp's pool): it fails before the effect, as `before` does.
LORA_SPEC = ("seed=9;hang=2;engine.lora:before@1;engine.lora:after@2;engine.lora:drop@3;"
             "engine.lora:hang@4")  # fmt: skip
LORA_INJECTED = {("engine.lora", kind): 1 for kind in ("before", "after", "drop", "hang")}
LORA_FIRST = (503, 503, 503, 200, 200)  # the answers to the first request of each adapter


def test_fault_matrix_lora_row(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tenant's adapters, each asked for once, the first loads faulted with each kind: a
    failed load (`before`, `after`: loaded but answered as failed, `drop`) is the client's 503
    `replica_unavailable` with `Retry-After`, its request ended `RequestFailed` and billed
    nothing; a load that hangs is served, late, and billed once; nothing is half-written, so
    each adapter is served on its next request (the one loaded behind the router's back
    included); the edge never exits; one terminal, one refund, one bill each."""
    from tests.e2e.conftest import TERMINALS, Server, short_body
    from tests.vllm.tiny_adapter import build

    replica = start_replica(tmp_path, MODEL, seed=9, enable_lora=True, max_loras=8, **FAST)
    monkeypatch.setenv(faults.FAULTS_ENV, LORA_SPEC)  # the edge's (the CLI never loads one)
    server = Server(tmp_path, [replica])
    try:
        server.start()
        tenant = server.new_tenant("lora")
        names = [f"a{i}" for i in range(len(LORA_FIRST))]
        for name in names:
            server.cli("adapters", "register", "--tenant", tenant.name, "--name", name,
                       "--base", MODEL, "--path", str(build(tmp_path / name)))  # fmt: skip
        headers = {"Authorization": f"Bearer {tenant.secret}"}
        with httpx.Client(base_url=server.base, timeout=30) as client:

            def chat(model: str) -> httpx.Response:
                return client.post("/v1/chat/completions", headers=headers,
                                   json=short_body(model))  # fmt: skip

            poll("the edge to follow the registrations",
                 lambda: {m["id"] for m in client.get("/v1/models", headers=headers).json()[
                     "data"]} >= set(names))  # fmt: skip
            first = [chat(name) for name in names]
            again = [chat(name) for name in names]
        alive = server.proc is not None and server.proc.poll() is None
        server.wait_all_billed()
        server.assert_lifecycle()
    finally:
        server.stop()
        replica.stop()
    assert alive, "the edge exited on a fault it must survive"
    injected = Counter(re.findall(r"fault injected: (\S+) (\S+) hit", server.log.read_text()))
    assert injected == LORA_INJECTED, injected
    assert [r.status_code for r in first] == list(LORA_FIRST), [r.text for r in first]
    assert [r.status_code for r in again] == [200] * len(names), [r.text for r in again]
    for name, r in zip(names * 2, first + again, strict=True):
        rid = r.headers["x-request-id"]
        [terminal] = [t for t in server.event_types(rid) if t in TERMINALS]
        bill = server.ledger(rid)
        assert bill is not None, rid
        if r.status_code == 503:
            error = r.json()["error"]
            assert error["code"] == "replica_unavailable" and int(r.headers["retry-after"]) >= 1
            assert terminal == "RequestFailed", server.event_types(rid)
            assert (bill["amount_micros"], bill["completion_tokens"]) == (0, 0), dict(bill)
        else:
            assert r.json()["model"] == name
            assert terminal == "RequestCompleted", server.event_types(rid)
            assert bill["completion_tokens"] == r.json()["usage"]["completion_tokens"] > 0
