"""`tollgate dev-cluster`: the distributed mode on this machine, every part a child process
supervised together — the development broker, a simulated fleet, the relay, two Kafka workers,
two edges and the batch runner over one PostgreSQL store — with where each listens and the demo
keys printed.
A child that dies is reported and started again, with back-off (`streams.supervisor`)."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import itertools
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import httpx
import psycopg
from sqlalchemy.engine import make_url

from tollgate_llm.api.config import DEFAULT_MODELS, Settings
from tollgate_llm.api.replica_regions import simulated_region
from tollgate_llm.api.serve import demo_keys_file, ensure_demo_prices, seed_demo
from tollgate_llm.api.services.control_service import ControlService, hash_secret
from tollgate_llm.cli.dev import DEV_DATABASE_URL
from tollgate_llm.streams.dev_broker import DevBroker
from tollgate_llm.streams.supervisor import RestartBackoff
from tollgate_llm.streams.topics import DEFAULT_TOPIC

# The local test database of DESIGN.md §8 (127.0.0.1:5432, user postgres, trust auth).
_PR_SET_PDEATHSIG = 1
# The batch runner first (its items in flight are cancelled at the edge, billed nothing and run
# again later), then the edges (their in-flight requests end and are recorded), then what folds
# their events, then the fleet; the broker goes last, with the supervisor itself.
STOP_ORDER = ("runner", "edge", "relay", "worker", "replica")


class DevClusterError(Exception):
    """The cluster could not start: one line that says what to do."""


@dataclass(frozen=True)
class DevClusterSettings:
    database_url: str = DEV_DATABASE_URL
    host: str = "127.0.0.1"
    port: int = 8080  # one address in front of both edges, which listen on the next two ports
    kafka_port: int = 9092  # 0: a free port
    simulated_replicas: int = 1  # per model, shared by both edges
    models: tuple[str, ...] = DEFAULT_MODELS
    sim_speed: float = 1.0
    topic: str = DEFAULT_TOPIC
    log_dir: Path | None = None  # default: <data dir>/logs
    data_dir: Path = Path("data").resolve()  # the children's too
    log_format: str = "plain"  # every child's, replicas included (--log-format)
    stop_grace_s: float = 20.0
    # Regions a model's replicas are spread over in turn (--simulated-region), and that of a
    # replica given none (--region): what tenants pinned to regions are confined to.
    simulated_regions: tuple[str, ...] = ()
    region: str = ""
    # Each simulated replica's LoRA slots (--simulated-max-loras, vLLM's --max-loras): tenants'
    # adapters are loaded and unloaded on them as requests ask for them. 0: LoRA off.
    simulated_max_loras: int = 2


@dataclass
class Child:
    name: str
    kind: str  # one of STOP_ORDER
    args: list[str]
    log: Path
    url: str = ""
    proc: subprocess.Popen[bytes] | None = None
    reported: bool = False
    started_at: float = 0.0
    restart_at: float | None = None  # set when its death was seen: when to start it again
    restarts: int = 0
    backoff: RestartBackoff = field(default_factory=RestartBackoff)


@dataclass
class DevCluster:
    settings: DevClusterSettings
    out: IO[str] = field(default_factory=lambda: sys.stdout)
    children: list[Child] = field(default_factory=list)
    broker: DevBroker | None = None
    keys: dict[str, str] = field(default_factory=dict)
    front: FrontDoor | None = None
    _stopping: bool = False
    _broker_started_at: float = 0.0
    _broker_restart_at: float | None = None
    _broker_backoff: RestartBackoff = field(default_factory=RestartBackoff)
    # The batch runner's proof to the edges, shared by them in the environment (never a flag,
    # so it is in no process listing); drawn once, so a restarted child gets the same.
    batch_token: str = field(default_factory=lambda: secrets.token_urlsafe(32))

    @property
    def log_dir(self) -> Path:
        return self.settings.log_dir or self.settings.data_dir / "logs"

    def say(self, line: str) -> None:
        print(line, file=self.out, flush=True)

    # --- start ----------------------------------------------------------------------------

    def start(self) -> None:
        s = self.settings
        check_postgres(s.database_url)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        # Migrations and the demo tenants once, here, before any child races to do them.
        self.keys = demo_keys(s)
        self.broker = DevBroker(
            s.kafka_port or None, log_path=self.log_dir / "broker.log",
            popen_options={"process_group": 0, "preexec_fn": _die_with_parent},
        )  # fmt: skip
        if s.kafka_port and not _port_free(s.host, s.kafka_port):
            raise DevClusterError(f"port {s.kafka_port} is in use: give --kafka-port another")
        for port in (s.port, s.port + 1, s.port + 2):
            if not _port_free(s.host, port):
                raise DevClusterError(f"port {port} is in use: give --port another")
        try:
            self.broker.start()
        except RuntimeError as exc:
            raise DevClusterError(f"the development broker did not start: {exc}") from exc
        self._broker_started_at = time.monotonic()
        python = [sys.executable]
        tollgate = [*python, "-m", "tollgate_llm.cli"]
        replicas: list[str] = []
        lora = (["--enable-lora", "--max-loras", str(s.simulated_max_loras)]
                if s.simulated_max_loras else [])  # fmt: skip
        for m_index, model in enumerate(s.models):
            for i in range(s.simulated_replicas):
                port = _free_port(s.host)
                child = self._spawn(
                    f"replica-{model}-{i}", "replica",
                    # `tollgate replica-sim`, which sets up the log format the others use.
                    [*tollgate, "replica-sim", "--host", s.host, "--port", str(port),
                     "--model", model, "--seed", str(7 + 100 * m_index + i),
                     "--speed", str(s.sim_speed), *lora],
                    url=f"http://{s.host}:{port}",
                )  # fmt: skip
                region = simulated_region(s.simulated_regions, i, s.region)
                where = f"@{region}" if region else ""
                replicas += ["--replica", f"{model}={child.url}{where}"]
        for child in self.children:
            self._wait_http(child, "/health", 30)
        db = ["--database-url", s.database_url]
        self._spawn("relay", "relay", [*tollgate, "relay", *db])
        for i in (1, 2):
            self._spawn(f"worker-{i}", "worker", [*tollgate, "worker", *db])
        for i, port in enumerate((s.port + 1, s.port + 2), start=1):
            self._spawn(
                f"edge-{i}", "edge",
                [*tollgate, "api", "--host", s.host, "--port", str(port), "--no-demo", *db,
                 *replicas],
                url=f"http://{s.host}:{port}",
            )  # fmt: skip
        for child in self.children:
            if child.kind == "edge":
                self._wait_http(child, "/healthz", 90)
        # Pointed at the first edge: it feeds batch items there as flex requests, which that
        # edge routes over the whole fleet.
        self._spawn(
            "batch-runner", "runner",
            [*tollgate, "batch-runner", *db, "--edge-url", f"http://{s.host}:{s.port + 1}"],
        )  # fmt: skip
        for child in self.children:
            if child.proc is not None and child.proc.poll() is not None:
                raise DevClusterError(f"{child.name} exited at start: see {child.log}")
        self.front = FrontDoor(
            s.host, s.port, [(s.host, s.port + 1), (s.host, s.port + 2)]
        )  # fmt: skip
        self.front.start()

    def _spawn(self, name: str, kind: str, args: list[str], url: str = "") -> Child:
        child = Child(name, kind, args, self.log_dir / f"{name}.log", url)
        self._popen(child)
        self.children.append(child)
        return child

    def _popen(self, child: Child) -> None:
        env = {
            **os.environ,
            "TOLLGATE_DATABASE_URL": self.settings.database_url,
            "TOLLGATE_KAFKA_BOOTSTRAP": self.bootstrap,
            "TOLLGATE_KAFKA_TOPIC": self.settings.topic,
            "TOLLGATE_DATA_DIR": str(self.settings.data_dir),
            "TOLLGATE_BATCH_TOKEN": self.batch_token,
            "TOLLGATE_LOG_FORMAT": self.settings.log_format,
        }
        with open(child.log, "ab") as log:
            child.proc = subprocess.Popen(
                child.args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=env,
                # Its own process group: Ctrl-C reaches the supervisor only, which stops the
                # children in order; and the kernel ends a child whose supervisor was killed.
                process_group=0, preexec_fn=_die_with_parent,
            )  # fmt: skip
        child.started_at = time.monotonic()

    @property
    def bootstrap(self) -> str:
        assert self.broker is not None
        return self.broker.bootstrap

    def _wait_http(self, child: Child, path: str, timeout_s: float) -> None:
        assert child.proc is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if child.proc.poll() is not None:
                raise DevClusterError(
                    f"{child.name} exited with {child.proc.returncode} at start: see {child.log}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(child.url + path, timeout=2).status_code == 200:
                    return
            time.sleep(0.2)
        raise DevClusterError(f"{child.name} did not answer {path} in {timeout_s:.0f} s: "
                              f"see {child.log}")

    def banner(self) -> None:
        s = self.settings
        db = make_url(s.database_url).render_as_string(hide_password=True)
        broker_pid = self.broker.pid if self.broker else "?"
        lines = [
            "Tollgate dev cluster (distributed mode on this machine)",
            f"  {'database':32s} {db}",
            f"  {'kafka':32s} {self.bootstrap:26s} development broker, memory only, topic "
            f"{s.topic} (pid {broker_pid})",
        ]
        if self.front is not None:
            lines.append(f"  {'front (both edges)':32s} http://{s.host}:{s.port}")
        for child in self.children:
            pid = child.proc.pid if child.proc else "?"
            where = child.url or {
                "relay": "store -> topic", "worker": "topic -> ledger",
                "runner": "batches -> edge-1",
            }.get(child.kind, "")  # fmt: skip
            lines.append(f"  {child.name:32s} {where:26s} pid {pid}")
        lines.append(f"  {'logs':32s} {self.log_dir}")
        lines.append("demo keys:")
        lines += [f"  {name:16s} {secret}" for name, secret in self.keys.items()]
        edges = [c for c in self.children if c.kind == "edge"]
        if "demo-standard" in self.keys and edges:
            lines.append("try (the front address, or either edge):")
            lines.append(
                f"  curl -s http://{s.host}:{s.port}/v1/chat/completions -H 'Authorization: Bearer "
                f"{self.keys['demo-standard']}' -H 'Content-Type: application/json' -d "
                f"'{{\"model\": \"{s.models[0]}\", \"messages\": [{{\"role\": \"user\", "
                f"\"content\": \"Hello!\"}}]}}'"
            )
        lines.append("lags (relay, consumer group per partition, workers):")
        lines.append(
            f"  tollgate status --database-url '{db}' --kafka-bootstrap "
            f"{self.bootstrap} --topic {s.topic}"
        )
        lines.append("Ctrl-C (or SIGTERM) stops every part.")
        self.say("\n".join(lines))

    # --- supervise ------------------------------------------------------------------------

    def check(self) -> list[Child]:
        """Report each child (and the broker) that exited since the last check, and start
        again each dead child whose back-off has passed: a killed worker, relay, edge or
        replica comes back (an edge on its own port, which the front passes over meanwhile)."""
        died = []
        now = time.monotonic()
        for child in self.children:
            assert child.proc is not None
            code = child.proc.poll()
            if code is None or self._stopping:
                continue
            if child.restart_at is None:
                wait_s = child.backoff.after_exit(now - child.started_at)
                child.restart_at = child.started_at + wait_s
                died.append(child)
                self.say(
                    f"dev-cluster: {child.name} (pid {child.proc.pid}) exited with {code}; "
                    f"starting it again in {max(0.0, child.restart_at - now):.0f} s, the rest "
                    f"keep running (log: {child.log})"
                )
            if now >= child.restart_at:
                child.restart_at = None
                child.restarts += 1
                self._popen(child)
                self.say(f"dev-cluster: started {child.name} again (pid {child.proc.pid})")
        broker = self.broker
        if broker is not None and broker.returncode is not None and not self._stopping:
            # On its own port again, empty (memory only): the relay finds the topic gone and
            # publishes the store again as a new epoch, which the workers read from its start.
            if self._broker_restart_at is None:
                wait_s = self._broker_backoff.after_exit(now - self._broker_started_at)
                self._broker_restart_at = self._broker_started_at + wait_s
                self.say(
                    f"dev-cluster: kafka (pid {broker.pid}) exited with {broker.returncode}; "
                    f"starting it again in {max(0.0, self._broker_restart_at - now):.0f} s, "
                    f"the rest keep running (log: {self.log_dir / 'broker.log'})"
                )
            if now >= self._broker_restart_at:
                self._broker_restart_at = None
                self._broker_started_at = time.monotonic()
                try:
                    broker.start()
                except RuntimeError as exc:  # seen exited at the next check: backed off
                    self.say(f"dev-cluster: kafka did not start again: {exc}")
                else:
                    self.say(f"dev-cluster: started kafka again (pid {broker.pid})")
        return died

    def alive(self) -> bool:
        """Some child runs, or is to be started again."""
        return any(
            c.restart_at is not None or (c.proc is not None and c.proc.poll() is None)
            for c in self.children
        )

    def stop(self) -> None:
        """SIGTERM the children kind by kind (SIGKILL after the grace), then the broker."""
        self._stopping = True
        if self.front is not None:
            self.front.stop()
        for kind in STOP_ORDER:
            group = [c for c in self.children if c.kind == kind and c.proc is not None]
            for child in group:
                if child.proc is not None and child.proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        child.proc.terminate()
            deadline = time.monotonic() + self.settings.stop_grace_s
            for child in group:
                assert child.proc is not None
                try:
                    child.proc.wait(max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    self.say(f"dev-cluster: {child.name} ignored SIGTERM; killing it")
                    child.proc.kill()
                    child.proc.wait()
                if not child.reported:
                    child.reported = True
                    self.say(f"dev-cluster: stopped {child.name} (exit {child.proc.returncode})")
        if self.broker is not None:
            self.broker.stop()
            self.say("dev-cluster: stopped the broker")
            self.broker = None


def run(settings: DevClusterSettings) -> int:
    """Start everything, supervise until SIGTERM/SIGINT (or until every child is gone), stop
    everything. Returns the exit status."""
    cluster = DevCluster(settings)
    stop = started = False

    def on_signal(*_: object) -> None:
        nonlocal stop
        stop = True
        if not started:  # still starting (waiting on a child): stop what started, now
            raise KeyboardInterrupt

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        cluster.start()
        started = True
        cluster.banner()
        while not stop and cluster.alive():
            cluster.check()
            time.sleep(0.5)
        cluster.check()
        return 0 if stop else 1
    except KeyboardInterrupt:
        return 130
    finally:
        cluster.stop()
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class FrontDoor:
    """One address in front of the edges: each client connection goes to the next edge in turn
    and its bytes are copied both ways (a client that keeps its connection stays on one edge);
    an edge that refuses connections is passed over. A development convenience on a thread of
    the supervisor, not a load balancer (no health probes, no retries of a request)."""

    def __init__(self, host: str, port: int, edges: list[tuple[str, int]]) -> None:
        self.host, self.port, self.edges = host, port, edges
        self._turn = itertools.cycle(range(len(edges)))
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="front-door",
                                        daemon=True)  # fmt: skip
        self._server: asyncio.Server | None = None

    def start(self) -> None:
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._accept, self.host, self.port, reuse_address=True),
            self._loop,
        ).result(10)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # An edge that refuses the connection (killed, restarting) is passed over for the next:
        # the client is turned away only when none takes it.
        for _ in self.edges:
            host, port = self.edges[next(self._turn)]
            try:
                edge_reader, edge_writer = await asyncio.open_connection(host, port)
            except OSError:
                continue
            await asyncio.gather(_pipe(reader, edge_writer), _pipe(edge_reader, writer))
            return
        writer.close()

    def stop(self) -> None:
        async def close() -> None:
            if self._server is not None:
                self._server.close()

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(close(), self._loop).result(5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(Exception):
            writer.close()


# --- helpers ------------------------------------------------------------------------------------


def check_postgres(url: str) -> None:
    """The store must be PostgreSQL and reachable; say so in one line otherwise."""
    parsed = make_url(url)
    if not parsed.drivername.startswith("postgresql"):
        raise DevClusterError(
            f"the dev cluster needs PostgreSQL (TOLLGATE_DATABASE_URL), not {parsed.drivername}"
        )
    conninfo = parsed.set(drivername="postgresql").render_as_string(hide_password=False)
    try:
        psycopg.connect(conninfo, connect_timeout=5).close()
    except psycopg.OperationalError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise DevClusterError(
            f"PostgreSQL is not reachable at {parsed.render_as_string(hide_password=True)} "
            f"({first}); start it (pg_ctlcluster --skip-systemctl-redirect $(ls "
            "/etc/postgresql) main start) or set TOLLGATE_DATABASE_URL"
        ) from exc


def demo_keys(settings: DevClusterSettings) -> dict[str, str]:
    """Migrate, seed the demo tenants and prices, and return the demo keys — issued again when
    the saved ones are not this database's (another database, or one reset since)."""
    database_url, models = settings.database_url, settings.models
    # Only what seeding reads: this database and data directory, nothing from the environment.
    settings_ = Settings.model_construct(database_url=database_url, data_dir=settings.data_dir)
    keys = seed_demo(settings_)
    with ControlService.open(database_url) as service:
        known = all(service.view.key_by_hash(hash_secret(k)) for k in keys.values())
    if not known:
        demo_keys_file(settings_).unlink()
        keys = seed_demo(settings_)
    ensure_demo_prices(settings_, list(models))
    return {name: str(secret) for name, secret in keys.items()}


def _die_with_parent() -> None:
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _port_free(host: str, port: int) -> bool:
    with socket.socket() as s:
        # As uvicorn binds: a port left in TIME_WAIT by an earlier run is free.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])
