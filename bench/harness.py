"""The processes a gateway benchmark drives and measures: the servers under test (the upstream,
`tollgate serve` or the distributed mode of a checkout, LiteLLM) as process groups, another
commit's checkout for an A/B, their CPU from /proc, and wrk's closed-loop load."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from bench.common import ROOT, free_port, fresh_schema, wait_http

LUA = ROOT / "bench" / "lua" / "post.lua"
MODEL = "llama-3.1-8b-2026-05"
OUTPUT_TOKENS = 16
PROMPT = "Say hello to the benchmark, please."
LITELLM_KEY = "sk-litellm-bench-master"


# --- process helpers --------------------------------------------------------------------------

TICK = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            data = f.read()
    except OSError:
        return None
    return data[data.rindex(")") + 2 :].split()


def descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = _stat(int(entry))
            if st:
                children.setdefault(int(st[1]), []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        for c in children.get(p, []):
            out.append(c)
            todo.append(c)
    return out


def tree_cpu_s(pid: int) -> float:
    """utime+stime (+ reaped children's) of pid and its live descendants, in seconds."""
    ticks = 0
    for p in [pid, *descendants(pid)]:
        st = _stat(p)
        if st:  # fields 14-17 of stat: utime stime cutime cstime (st[0] is field 3)
            ticks += int(st[11]) + int(st[12]) + int(st[13]) + int(st[14])
    return ticks / TICK


def own_cpu_s(pid: int) -> float:
    """utime+stime of pid itself (no children), in seconds."""
    st = _stat(pid)
    return (int(st[11]) + int(st[12])) / TICK if st else 0.0


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds of each thread of pid, summed by thread name (comm, 15 chars)."""
    out: dict[str, float] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
        main_comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return out
    for tid in tids:
        try:
            comm = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                data = f.read()
        except OSError:
            continue
        st = data[data.rindex(")") + 2 :].split()
        # CPython 3.11 does not name OS threads: they all carry the process's comm
        name = "event_loop" if tid == str(pid) else comm if comm != main_comm else "other_threads"
        out[name] = out.get(name, 0.0) + (int(st[11]) + int(st[12])) / TICK
    return out


def post(url: str, body: dict[str, Any], auth: str = "") -> tuple[int, bytes]:
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json"},
    )
    if auth:
        req.add_header("Authorization", "Bearer " + auth)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


class Proc:
    def __init__(
        self,
        name: str,
        cmd: list[str],
        env: dict[str, str] | None = None,
        log_dir: Path | None = None,
        cwd: Path = ROOT,
    ) -> None:
        self.name = name
        log = open(  # noqa: SIM115  (the child owns it until the end of the run)
            (log_dir or Path(tempfile.gettempdir())) / f"bench-{name}.log", "wb"
        )
        self.log_path = log.name
        self.p = subprocess.Popen(
            cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=cwd
        )

    @property
    def pid(self) -> int:
        return self.p.pid

    def stop(self) -> None:
        if self.p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.p.pid, signal.SIGINT)
            try:
                self.p.wait(10)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.p.pid, signal.SIGKILL)
                self.p.wait(5)


# --- targets ----------------------------------------------------------------------------------


def start_otlp_sink(log_dir: Path) -> tuple[Proc, str]:
    """The tracing target's OTLP/HTTP sink (bench/gateway_children.py); its base URL."""
    port = free_port()
    cmd = [sys.executable, "-m", "bench.gateway", "otlp-sink", "--port", str(port)]
    proc = Proc("otlp-sink", cmd, None, log_dir)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url + "/stats", 30, proc.p)
    except BaseException:
        proc.stop()
        raise
    return proc, url


def sink_counts(sink_url: str, data_dir: Path) -> dict[str, Any]:
    """What the OTLP sink received, beside the requests the traced server admitted (its own
    SQLite log): the spans per request show every request was traced and exported."""
    import sqlite3

    with urllib.request.urlopen(sink_url + "/stats", timeout=10) as resp:
        counts = dict(json.loads(resp.read()))
    with contextlib.closing(sqlite3.connect(data_dir / "tollgate.db")) as db:
        admitted = db.execute(
            "SELECT count(*) FROM events WHERE type = 'RequestAdmitted'"
        ).fetchone()[0]
    counts["requests_admitted"] = admitted
    counts["spans_per_request"] = round(counts["spans"] / admitted, 2) if admitted else None
    return counts


def start_upstream(kind: str, gap_ms: float, log_dir: Path) -> tuple[Proc, str]:
    port = free_port()
    if kind == "cheap":
        cmd = [
            sys.executable,
            "-m",
            "bench.gateway",
            "upstream",
            "--port",
            str(port),
            "--model",
            MODEL,
            "--gap-ms",
            str(gap_ms),
        ]
    else:  # the simulated vLLM replica, as fast as it goes, exactly 16 tokens, big KV
        cmd = [
            sys.executable,
            "-m",
            "tollgate_llm.engine_adapter.simulator",
            "--port",
            str(port),
            "--model",
            MODEL,
            "--step-base-ms",
            str(gap_ms),
            "--per-seq-ms",
            "0",
            "--prefill-ms-per-1k-tokens",
            "0",
            "--mean-output-tokens",
            "16",
            "--output-sigma",
            "0.0",
            "--num-gpu-blocks",
            "65536",
            "--max-num-seqs",
            "256",
            "--max-model-len",
            "32768",
        ]
    proc = Proc("upstream", cmd, log_dir=log_dir)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health", 30, proc.p)
    return proc, url


def start_floor(upstream: str, log_dir: Path) -> tuple[Proc, str]:
    """The bare aiohttp pass-through (`python -m bench.gateway floor`) in front of `upstream`."""
    port = free_port()
    cmd = [sys.executable, "-m", "bench.gateway", "floor", "--port", str(port),
           "--upstream", upstream]  # fmt: skip
    proc = Proc("floor", cmd, log_dir=log_dir)
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health", 30, proc.p)
    return proc, url


NGINX_CONF = """\
daemon off;
worker_processes 1;
{user}pid {work}/nginx.pid;
error_log {work}/nginx-error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_body_temp_path {work}/nginx-tmp/body;
    proxy_temp_path {work}/nginx-tmp/proxy;
    fastcgi_temp_path {work}/nginx-tmp/fastcgi;
    uwsgi_temp_path {work}/nginx-tmp/uwsgi;
    scgi_temp_path {work}/nginx-tmp/scgi;
    upstream bench_upstream {{
        server {upstream};
        keepalive 256;
    }}
    server {{
        listen 127.0.0.1:{port};
        location / {{
            proxy_pass http://bench_upstream;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
        }}
    }}
}}
"""


def start_nginx(upstream: str, log_dir: Path) -> tuple[Proc, str]:
    """Debian's nginx as a plain reverse proxy in front of `upstream` (one worker process,
    kept-alive upstream connections, responses unbuffered so that stream chunks pass as they
    come): the compiled floor. Its configuration is generated under `log_dir`; it runs in the
    foreground (`daemon off`), a child of this process, its worker a child of it."""
    nginx = shutil.which("nginx") or "/usr/sbin/nginx"
    if not Path(nginx).exists():
        raise RuntimeError("nginx not found: apt-get update && apt-get install -y nginx")
    port = free_port()
    (log_dir / "nginx-tmp").mkdir(exist_ok=True)
    conf = log_dir / "nginx.conf"
    conf.write_text(NGINX_CONF.format(
        work=log_dir, port=port, upstream=upstream.removeprefix("http://"),
        # as root the worker would otherwise switch to `nobody` and lose the temp directories
        user="user root;\n" if os.geteuid() == 0 else "",
    ))  # fmt: skip
    proc = Proc("nginx", [nginx, "-e", str(log_dir / "nginx-error.log"), "-p", str(log_dir),
                          "-c", str(conf)], log_dir=log_dir)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health", 30, proc.p)
    return proc, url


def start_tollgate(
    upstream: str, data_dir: Path, log_dir: Path, tree: Path = ROOT, name: str = "tollgate",
    command: str = "serve", env_extra: dict[str, str] | None = None,
    extra_args: tuple[str, ...] = (), wrapper: tuple[str, ...] = (), ready_timeout_s: float = 90,
) -> tuple[Proc, str, str]:
    """`tollgate serve` of the checkout `tree` (its own .venv: for an A/B, another commit);
    `command` "api" with TOLLGATE_DATABASE_URL in `env_extra`: an edge of the distributed mode.
    `wrapper`: a command the edge runs under (e.g. valgrind), given the tree's python."""
    port = free_port()
    env = {**os.environ, "TOLLGATE_DATA_DIR": str(data_dir)}
    env.pop("TOLLGATE_DATABASE_URL", None)
    env.update(env_extra or {})
    # Another tree must import its own code, and a worktree whose .venv is another checkout's
    # (an editable install points there) too: the tree first on PYTHONPATH, which the fold
    # worker child inherits.
    env["PYTHONPATH"] = str(tree)
    bin_dir = tree / ".venv" / "bin"
    # extra serve flags for experiments, e.g. "--no-fold-worker"
    args = (*extra_args, *os.environ.get("TOLLGATE_BENCH_SERVE_ARGS", "").split())
    launcher = [*wrapper, str(bin_dir / "python")] if wrapper else []
    proc = Proc(
        name,
        [
            *launcher,
            str(bin_dir / "tollgate"),
            command,
            "--replica",
            f"{MODEL}={upstream}",
            "--port",
            str(port),
            *args,
        ],
        env,
        log_dir,
        cwd=tree,
    )
    url = f"http://127.0.0.1:{port}"
    # Without a fold worker /readyz stays 503 (no heartbeat): then the edge's liveness.
    ready = "/healthz" if "--no-fold-worker" in args else "/readyz"
    try:
        wait_http(url + ready, ready_timeout_s, proc.p)
    except BaseException:
        proc.stop()  # not handed to the caller yet: it would outlive the run
        raise
    key = json.loads((data_dir / "demo-keys.json").read_text())["demo-enterprise"]
    subprocess.run(
        [
            str(bin_dir / "tollgate"),
            "limits",
            "set",
            "--tenant",
            "demo-enterprise",
            "--model",
            "*",
            "--rpm",
            "10000000",
            "--tpm",
            "1000000000",
            "--kv-seconds",
            "100000000",
        ],
        env=env,
        check=True,
        cwd=tree,
        capture_output=True,
    )
    time.sleep(1.5)  # the control-plane follower picks the new limits up within 0.5 s
    return proc, url, key


BUDGET_PATH = ("bench-ws", "bench-project")


def add_budget_path(tree: Path, data_dir: Path, tenant: str = "demo-enterprise") -> str:
    """A four-level path for `tenant` in the store under `data_dir`: workspace, project, and a
    key of that project, with requests/min, tokens/min and KV limits at every level and a day
    and a month budget at each (all far above what a run spends: the decisions are taken, none
    refuses). Returns the new key: its requests are admitted on the whole path."""
    env = {**os.environ, "TOLLGATE_DATA_DIR": str(data_dir)}
    env.pop("TOLLGATE_DATABASE_URL", None)
    env["PYTHONPATH"] = str(tree)
    tollgate = str(tree / ".venv" / "bin" / "tollgate")

    def cli(*args: str) -> str:
        done = subprocess.run(
            [tollgate, *args], env=env, cwd=tree, capture_output=True, text=True, check=True
        )
        return done.stdout

    workspace, project = BUDGET_PATH
    cli("workspaces", "create", workspace, "--tenant", tenant)
    cli("projects", "create", project, "--tenant", tenant, "--workspace", workspace)
    issued = cli("keys", "issue", "--tenant", tenant, "--project", project).split()
    key_id = next(w for w in issued if w.startswith("key_"))
    secret = issued[-1]
    levels = [[], ["--workspace", workspace], ["--project", project], ["--key", key_id]]
    for level in levels:
        if level:  # the organization's limits are set by start_tollgate
            cli("limits", "set", "--tenant", tenant, *level, "--model", "*", "--rpm", "10000000",
                "--tpm", "1000000000", "--kv-seconds", "100000000")  # fmt: skip
        for period in ("day", "month"):
            cli("budgets", "set", "--tenant", tenant, *level, "--period", period,
                "--usd", "1000000000")  # fmt: skip
    time.sleep(1.5)  # the control-plane follower picks the hierarchy up within 0.5 s
    return secret


def start_distributed(
    upstream: str, work: Path, stack: contextlib.ExitStack, tree: Path = ROOT,
    name: str = "distributed",
) -> tuple[Proc, str, str, list[Proc], tuple[int, ...]]:
    """The distributed mode beside the embedded one: the development broker, a fresh
    PostgreSQL schema, one `tollgate api` edge, `tollgate relay` and one Kafka `tollgate worker`,
    all of the checkout `tree` (another commit's, for an A/B; each call its own broker, schema
    and topic). Returns the edge, its URL and key, the relay and worker, and the pipeline's pids
    (relay, worker, broker; the broker is stopped by `stack`)."""
    from tollgate_llm.streams.dev_broker import DevBroker

    broker = DevBroker(log_path=work / f"bench-broker-{name}.log")
    broker.start()
    stack.callback(broker.stop)
    url = stack.enter_context(fresh_schema())
    env = {"TOLLGATE_DATABASE_URL": url, "TOLLGATE_KAFKA_BOOTSTRAP": broker.bootstrap,
           "TOLLGATE_KAFKA_TOPIC": f"bench-{name}.events"}  # fmt: skip
    tollgate = str(tree / ".venv" / "bin" / "tollgate")
    # The tree first on the path, as `start_tollgate` does: its own code, whatever its .venv's.
    full_env = {**os.environ, **env, "PYTHONPATH": str(tree)}
    # The pipeline first: the edge is ready only once a worker reports.
    pipeline = [
        Proc(f"{name}-{cmd}", [tollgate, cmd], full_env, work) for cmd in ("relay", "worker")
    ]
    for proc in pipeline:
        stack.callback(proc.stop)
    edge, edge_url, key = start_tollgate(
        upstream, work / f"data-{name}", work, tree, name=name, command="api", env_extra=env,
    )  # fmt: skip
    pids = tuple(p.pid for p in pipeline) + ((broker.pid,) if broker.pid else ())
    return edge, edge_url, key, pipeline, pids


def start_litellm(venv: Path, upstream: str, log_dir: Path) -> tuple[Proc, str, str]:
    port = free_port()
    cfg = log_dir / "litellm.yaml"
    cfg.write_text(
        "model_list:\n"
        f"  - model_name: {MODEL}\n"
        "    litellm_params:\n"
        f"      model: openai/{MODEL}\n"
        f"      api_base: {upstream}/v1\n"
        "      api_key: sk-upstream\n"
        "general_settings:\n"
        f"  master_key: {LITELLM_KEY}\n"
        "litellm_settings:\n"
        "  telemetry: false\n"
        # no internet here: without this every stream waits ~23 s on a HF tokenizer download
        "  disable_hf_tokenizer_download: true\n"
    )
    env = {
        **os.environ,
        "LITELLM_LOG": "ERROR",
        "LITELLM_TELEMETRY": "False",
        "NO_DOCS": "True",
        "DISABLE_ADMIN_UI": "True",
    }
    for var in ("DATABASE_URL", "LITELLM_MASTER_KEY"):
        env.pop(var, None)
    proc = Proc(
        "litellm",
        [
            str(venv / "bin" / "litellm"),
            "--config",
            str(cfg),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--num_workers",
            "1",
        ],
        env,
        log_dir,
    )
    url = f"http://127.0.0.1:{port}"
    wait_http(url + "/health/liveliness", 180, proc.p)
    return proc, url, LITELLM_KEY


def commit_of(tree: Path) -> str:
    out = subprocess.run(
        ["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    return out.stdout.strip() or "?"


def baseline_checkout(commit: str) -> Path:
    """A detached checkout of `commit` with its own .venv, built once and kept for re-runs."""
    tree = Path(tempfile.gettempdir()) / f"tollgate-baseline-{commit}"
    if not (tree / ".venv" / "bin" / "tollgate").exists():
        if not tree.exists():
            subprocess.run(
                ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), commit],
                check=True,
            )
        subprocess.run([sys.executable, "-m", "venv", str(tree / ".venv")], check=True)
        subprocess.run(
            # [dev]: before the load generator left api/, a plain install's CLI needed httpx.
            [str(tree / ".venv" / "bin" / "pip"), "install", "--quiet", "-e", f"{tree}[dev]"],
            check=True,
        )
    return tree


def litellm_version(venv: Path) -> str:
    out = subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-c",
            "import importlib.metadata as m; print(m.version('litellm'))",
        ],
        capture_output=True,
        text=True,
    )
    return out.stdout.strip() or "?"


# --- measurements -----------------------------------------------------------------------------


def body_for(stream: bool) -> dict[str, Any]:
    b: dict[str, Any] = {
        "model": MODEL,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": OUTPUT_TOKENS,
    }
    if stream:
        b["stream"] = True
    return b


def run_wrk(
    url: str, body: dict[str, Any], auth: str, conns: int, seconds: float
) -> dict[str, Any]:
    env = {**os.environ, "BENCH_BODY": json.dumps(body), "BENCH_AUTH": auth}
    cmd = [
        "wrk",
        "-t1",
        f"-c{conns}",
        f"-d{max(1, round(seconds))}s",
        "--timeout",
        "10s",
        "-s",
        str(LUA),
        url + "/v1/chat/completions",
    ]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=seconds + 60)
    summary: dict[str, Any] | None = None
    statuses: dict[str, int] = {}
    for line in out.stdout.splitlines():
        if line.startswith("BENCH_JSON "):
            summary = dict(json.loads(line[len("BENCH_JSON ") :]))
        elif line.startswith("BENCH_STATUS "):
            _, status, n = line.split()
            statuses[status] = statuses.get(status, 0) + int(n)
    if summary is None:
        raise RuntimeError(f"wrk gave no summary: {out.stdout}\n{out.stderr}")
    summary["non_2xx"] = statuses
    return summary
