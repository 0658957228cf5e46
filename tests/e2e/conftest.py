"""End-to-end fixtures: simulated vLLM replicas and `tollgate serve` as real subprocesses, spoken
to over real HTTP; results read straight from the SQLite file the server writes.

Every process started here is stopped here (terminate, then kill), whatever the test did.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from tollgate_llm.domain.requests.events import TERMINAL_TYPES

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
TOLLGATE = (
    [str(BIN / "tollgate")]
    if (BIN / "tollgate").exists()
    else [sys.executable, "-m", "tollgate_llm.cli"]
)

MODEL = "llama-3.1-8b-2026-05"  # fast replicas
SLOW_MODEL = "llama-3.1-70b-2026-05"  # one slow replica: long streams that stay in flight
TERMINALS = tuple(sorted(TERMINAL_TYPES))

_LIVE: list[subprocess.Popen[bytes]] = []
_LIVE_LOCK = threading.Lock()


def _stop_process(proc: subprocess.Popen[bytes], grace: float = 5.0) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait(5)
    with _LIVE_LOCK:
        if proc in _LIVE:
            _LIVE.remove(proc)


@atexit.register
def _stop_all() -> None:  # a last resort if a fixture's teardown never ran
    for proc in list(_LIVE):
        _stop_process(proc, 2.0)


def spawn(
    args: list[str], log: Path, env: dict[str, str] | None = None, stderr: Path | None = None
) -> subprocess.Popen[bytes]:
    """Start a process, its stdout appended to `log`, its stderr too unless `stderr` names a
    file of its own (a process's log, apart from what it prints)."""
    out = open(log, "ab")  # noqa: SIM115 - closed with the process (inherited by it)
    err = open(stderr, "ab") if stderr is not None else None  # noqa: SIM115 - the same
    proc = subprocess.Popen(
        args, cwd=REPO, stdout=out, stderr=err or subprocess.STDOUT, stdin=subprocess.DEVNULL,
        env={**os.environ, **(env or {})},
    )
    out.close()
    if err is not None:
        err.close()
    with _LIVE_LOCK:
        _LIVE.append(proc)
    return proc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_http(url: str, proc: subprocess.Popen[bytes], log: Path, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    last: object = None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"{proc.args} exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            r = httpx.get(url, timeout=2)
            if r.status_code == 200:
                return
            last = (r.status_code, r.text[:300])
        except httpx.HTTPError as exc:
            last = exc
        time.sleep(0.1)
    pytest.fail(f"{url} not ready after {timeout}s (last: {last}):\n{log.read_text()[-3000:]}")


def poll(
    what: str,
    fn: Callable[[], Any],
    timeout: float = 15.0,
    every: float = 0.1,
    detail: Callable[[], str] | None = None,
) -> Any:
    """Call fn until it returns something truthy; fail with `what` after `timeout` seconds (and
    what `detail` tells then, e.g. the end of an engine's log)."""
    deadline = time.monotonic() + timeout
    value = None
    while time.monotonic() < deadline:
        value = fn()
        if value:
            return value
        time.sleep(every)
    told = f"\n{detail()}" if detail is not None else ""
    pytest.fail(f"timed out after {timeout}s waiting for {what} (last value: {value!r}){told}")


# --- replicas --------------------------------------------------------------------------------


@dataclass
class Replica:
    model: str
    port: int
    proc: subprocess.Popen[bytes]
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def record(self, request_id: str) -> dict[str, Any] | None:
        r = httpx.get(f"{self.url}/sim/requests/{request_id}", timeout=5)
        return r.json() if r.status_code == 200 else None

    def stats(self) -> dict[str, Any]:
        return httpx.get(f"{self.url}/sim/stats", timeout=5).json()

    def metric(self, name: str) -> float:
        """Sum of a gauge/counter over all label sets, from the replica's /metrics."""
        total = 0.0
        for line in httpx.get(f"{self.url}/metrics", timeout=5).text.splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def stop(self) -> None:
        _stop_process(self.proc)


def start_replica(tmp: Path, model: str, seed: int, **config: Any) -> Replica:
    port = free_port()
    log = tmp / f"replica-{port}.log"
    args = [sys.executable, "-m", "tollgate_llm.engine_adapter.simulator", "--port", str(port),
            "--model", model, "--seed", str(seed)]
    for name, value in config.items():
        flag = name.replace("_", "-")
        if isinstance(value, bool):  # the simulator's on/off flags: --x / --no-x
            args.append(f"--{flag}" if value else f"--no-{flag}")
        else:
            args += ["--" + flag, str(value)]
    proc = spawn(args, log)
    wait_http(f"http://127.0.0.1:{port}/health", proc, log)
    return Replica(model, port, proc, log)


# --- the server ------------------------------------------------------------------------------


@dataclass
class Tenant:
    name: str
    key_id: str
    secret: str


@dataclass
class EngineReplica:
    """A real `vllm serve`, as the Server lists its replicas (its owner stops it)."""

    model: str
    url: str

    def stop(self) -> None:
        pass


@dataclass
class Server:
    tmp: Path
    replicas: list[Replica]
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None
    keys: dict[str, str] = field(default_factory=dict)
    starts: int = 0
    serve_args: list[str] = field(default_factory=list)  # extra `tollgate serve` options

    @property
    def data_dir(self) -> Path:
        return self.tmp / "data"

    @property
    def db_path(self) -> Path:
        return self.data_dir / "tollgate.db"

    @property
    def db_url(self) -> str:
        return f"sqlite:///{self.db_path}"

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log(self) -> Path:
        return self.tmp / "serve.log"

    # -- process

    def start(self) -> Server:
        self.port = self.port or free_port()
        args = [*TOLLGATE, "serve", "--port", str(self.port), *self.serve_args]
        for r in self.replicas:
            args += ["--replica", f"{r.model}={r.url}"]
        self.starts += 1
        with open(self.log, "a") as f:
            f.write(f"\n===== start #{self.starts} =====\n")
        self.proc = spawn(args, self.log, env={"TOLLGATE_DATA_DIR": str(self.data_dir)})
        wait_http(f"{self.base}/readyz", self.proc, self.log)
        self.keys = json.loads((self.data_dir / "demo-keys.json").read_text())
        return self

    def stop(self) -> None:
        if self.proc is not None:
            _stop_process(self.proc, grace=10)

    def kill9(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        _stop_process(self.proc)

    def replica(self, replica_id: str) -> Replica:
        """`tollgate serve --replica` names them replica-0, replica-1, ... in flag order."""
        return self.replicas[int(replica_id.rsplit("-", 1)[1])]

    # -- CLI

    def cli(self, *args: str, timeout: float = 60) -> str:
        done = subprocess.run(
            [*TOLLGATE, *args, "--database-url", self.db_url], cwd=REPO, capture_output=True,
            text=True, timeout=timeout,
            env={**os.environ, "TOLLGATE_DATA_DIR": str(self.data_dir)},
        )
        assert done.returncode == 0, f"tollgate {' '.join(args)} failed: {done.stderr}"
        return done.stdout

    def new_tenant(self, prefix: str, plan: str = "standard", **limits: int) -> Tenant:
        """A fresh tenant (unique name), its limits on every model, and a customer key; returns
        once the running server knows the key."""
        name = f"{prefix}-{uuid.uuid4().hex[:8]}"
        self.cli("tenants", "create", name, "--plan", plan)
        if limits:
            flags: list[str] = []
            for k, v in limits.items():
                flags += ["--" + k.replace("_", "-"), str(v)]
            self.cli("limits", "set", "--tenant", name, "--model", "*", *flags)
        out = self.cli("keys", "issue", "--tenant", name).strip().splitlines()
        secret = out[-1].strip()
        key_id = out[0].split(" key ")[1].split()[0]
        tenant = Tenant(name, key_id, secret)
        self.wait_key(secret)
        return tenant

    def new_tenants(self, specs: dict[str, dict[str, Any]]) -> dict[str, Tenant]:
        """Several tenants at once (the CLI is ~1 s per call): {label: {plan=..., **limits}}."""
        out: dict[str, Tenant] = {}
        errors: list[BaseException] = []

        def make(label: str, spec: dict[str, Any]) -> None:
            try:
                spec = dict(spec)
                out[label] = self.new_tenant(label, spec.pop("plan", "standard"), **spec)
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                errors.append(exc)

        threads = [threading.Thread(target=make, args=item) for item in specs.items()]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return out

    def wait_key(self, secret: str, valid: bool = True) -> None:
        def check() -> bool:
            r = httpx.get(f"{self.base}/v1/models", headers=auth(secret), timeout=5)
            return (r.status_code == 200) == valid

        poll(f"the server to see key {secret[:8]}... as {'valid' if valid else 'invalid'}", check)

    # -- the database

    def query(self, sql: str, params: Iterable[Any] = ()) -> list[sqlite3.Row]:
        conn = sqlite3.connect(f"file:{self.db_path}?mode=ro", uri=True, timeout=30)
        try:
            conn.row_factory = sqlite3.Row
            return conn.execute(sql, tuple(params)).fetchall()
        finally:
            conn.close()

    def events(self, request_id: str) -> list[tuple[str, dict[str, Any]]]:
        rows = self.query(
            "SELECT type, payload FROM events WHERE stream_id = ? ORDER BY stream_version",
            (request_id,),
        )
        return [(r["type"], json.loads(r["payload"])) for r in rows]

    def wait_event(self, request_id: str, type_: str, timeout: float = 10) -> dict[str, Any]:
        """The payload of the request's first `type_` event, once it is committed (refusals and
        terminal events are appended without waiting for the commit)."""
        return poll(
            f"{type_} in {request_id}",
            lambda: next((p for t, p in self.events(request_id) if t == type_), None),
            timeout,
        )

    def event_types(self, request_id: str) -> list[str]:
        return [t for t, _ in self.events(request_id)]

    def ledger(self, request_id: str) -> sqlite3.Row | None:
        rows = self.query("SELECT * FROM ledger_entries WHERE request_id = ?", (request_id,))
        return rows[0] if rows else None

    def wait_billed(self, request_id: str, timeout: float = 15.0) -> sqlite3.Row:
        """The billing fold runs shortly after the terminal event; the ledger_entries projection
        right after it."""
        return poll(f"the ledger entry of {request_id}", lambda: self.ledger(request_id), timeout)

    def wait_all_billed(self, timeout: float = 60.0) -> None:
        def caught_up() -> bool:
            rows = self.query(
                "SELECT count(DISTINCT e.stream_id) AS n FROM events e "
                "WHERE e.type = 'RequestAdmitted' AND NOT EXISTS "
                "(SELECT 1 FROM ledger_entries l WHERE l.request_id = e.stream_id)"
            )
            return rows[0]["n"] == 0

        poll("every admitted request to have a ledger entry", caught_up, timeout, 0.25)

    def lifecycle_problems(self, request_ids: Iterable[str] | None = None) -> list[str]:
        """DESIGN §4.2: every stream with RequestAdmitted has exactly one terminal event, one
        QuotaRefunded, one UsageBilled (and one ledger row). Returns the violations."""
        rows = self.query(
            "SELECT stream_id, "
            " sum(type = 'RequestAdmitted') AS admitted, "
            f" sum(type IN ({', '.join(repr(t) for t in TERMINALS)})) AS terminal, "
            " sum(type = 'QuotaRefunded') AS refunded, "
            " sum(type = 'UsageBilled') AS billed, "
            " (SELECT count(*) FROM ledger_entries l WHERE l.request_id = e.stream_id) AS ledger "
            "FROM events e WHERE stream_id LIKE 'req_%' GROUP BY stream_id"
        )
        wanted = None if request_ids is None else set(request_ids)
        problems = []
        for r in rows:
            if wanted is not None and r["stream_id"] not in wanted:
                continue
            if r["admitted"] == 0:
                if r["terminal"] or r["refunded"] or r["billed"]:
                    problems.append(f"{r['stream_id']}: lifecycle events without admission")
                continue
            got = (r["admitted"], r["terminal"], r["refunded"], r["billed"], r["ledger"])
            if got != (1, 1, 1, 1, 1):
                problems.append(
                    f"{r['stream_id']}: admitted/terminal/refunded/billed/ledger = {got}"
                )
        return problems

    def assert_lifecycle(
        self, request_ids: Iterable[str] | None = None, timeout: float = 20
    ) -> None:
        ids = None if request_ids is None else list(request_ids)
        deadline = time.monotonic() + timeout
        while True:
            problems = self.lifecycle_problems(ids)
            if not problems:
                return
            if time.monotonic() > deadline:
                pytest.fail("lifecycle invariant broken:\n" + "\n".join(problems[:30]))
            time.sleep(0.25)


def auth(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


RATE_LIMIT_HEADERS = tuple(
    f"x-ratelimit-{kind}-{what}"
    for kind in ("limit", "remaining", "reset")
    for what in ("requests", "tokens")
)


def build_server(
    tmp: Path, replica_specs: list[tuple[str, dict[str, Any]]], serve_args: list[str] | None = None
) -> Server:
    replicas: list[Replica] = []
    try:
        for i, (model, config) in enumerate(replica_specs):
            replicas.append(start_replica(tmp, model, seed=11 + i, **config))
        return Server(tmp, replicas, serve_args=list(serve_args or ())).start()
    except BaseException:
        for r in replicas:
            r.stop()
        raise


@contextlib.contextmanager
def running_server(
    tmp_factory: pytest.TempPathFactory,
    name: str,
    replica_specs: list[tuple[str, dict[str, Any]]],
    serve_args: list[str] | None = None,
) -> Iterator[Server]:
    tmp = tmp_factory.mktemp(name)
    server = build_server(tmp, replica_specs, serve_args)
    try:
        yield server
    finally:
        server.stop()
        for r in server.replicas:
            r.stop()


# Two fast replicas of MODEL (1 ms steps / speed: thousands of tokens a second) and one slow
# replica of SLOW_MODEL (~20 ms a token) for streams that must stay in flight for a while.
FAST = {"speed": 10, "step_base_ms": 10}
SLOW = {"speed": 1, "step_base_ms": 20}


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """The shared server: tests that need a quiet fleet or special replicas build their own."""
    with running_server(
        tmp_path_factory, "shared", [(MODEL, FAST), (MODEL, FAST), (SLOW_MODEL, SLOW)]
    ) as s:
        yield s


def long_body(model: str = SLOW_MODEL, tokens: int = 2000, **extra: Any) -> dict[str, Any]:
    return {
        "model": model, "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": tokens, "ignore_eos": True, **extra,
    }


def short_body(model: str = MODEL, tokens: int = 8, **extra: Any) -> dict[str, Any]:
    return {
        "model": model, "messages": [{"role": "user", "content": "Hello there!"}],
        "max_tokens": tokens, **extra,
    }


# --- `tollgate dev-cluster`, as its tests start it ------------------------------------------------


def three_free_ports() -> int:
    """A port whose next two are free too: the dev cluster's front address and its two edges."""
    for _ in range(50):
        port = free_port()
        if port < 65534 and _free(port + 1) and _free(port + 2):
            return port
    raise AssertionError("no three consecutive free ports")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


@dataclass
class DevCluster:
    """A running `tollgate dev-cluster`: its front port (the edges are the next two), its
    output (`out`; `banner`, what it printed once up), its data directory, and its database."""

    proc: subprocess.Popen[bytes]
    port: int
    out: Path
    banner: str
    data: Path
    database_url: str

    def cli(self, *args: str) -> str:
        """A `tollgate` command against the cluster's database; it must succeed."""
        done = subprocess.run(
            [*TOLLGATE, *args, "--database-url", self.database_url], cwd=REPO,
            capture_output=True, text=True, timeout=60,
            env={**os.environ, "TOLLGATE_DATA_DIR": str(self.data)},
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        return done.stdout


@contextlib.contextmanager
def dev_cluster(
    postgres_url: str, tmp_path: Path, *options: str, grace: float = 30
) -> Iterator[DevCluster]:
    """`tollgate dev-cluster` on `postgres_url` with the tests' model, fast simulated replicas
    and `options`, up once its banner is printed; stopped (every child with it, `grace` seconds
    to go) on the way out, unless the test stopped it itself."""
    port = three_free_ports()
    out, data = tmp_path / "dev-cluster.out", tmp_path / "data"
    proc = spawn(
        [*TOLLGATE, "dev-cluster", "--database-url", postgres_url, "--port", str(port),
         "--kafka-port", "0", "--model", MODEL, "--sim-speed", "20",
         "--log-dir", str(tmp_path / "logs"), *options],
        out, env={"TOLLGATE_DATA_DIR": str(data)},
    )  # fmt: skip
    try:
        poll("the dev cluster's banner",
             lambda: "Ctrl-C" in out.read_text() or proc.poll() is not None, timeout=180,
             every=0.5)  # fmt: skip
        banner = out.read_text()
        assert proc.poll() is None, banner
        yield DevCluster(proc, port, out, banner, data, postgres_url)
    finally:
        _stop_process(proc, grace=grace)
