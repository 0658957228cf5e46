"""Gateway overhead: the same cheap upstream reached (a) directly, (b) through Tollgate and
(c) through the LiteLLM proxy, all in one run.

Closed loop: `wrk` (Debian) with bench/lua/post.lua, non-streaming and streaming, at 16 and 64
connections: requests/s, latency p50/p99, and the server's CPU ms per request from
/proc/PID/stat (utime+stime of the process, its live descendants and its reaped children,
before/after, divided by the requests wrk completed).
Open loop: a separate generator process (`python -m bench.gateway openloop`) fires on a fixed
schedule at an offered rate (200 req/s) and measures latency from the *scheduled* send time, so a
stalled server cannot hide its queue (no coordinated omission). Reported: Tollgate's added p99.

The upstream is `python -m bench.gateway upstream`: a minimal aiohttp server that speaks the
vLLM SSE shape (16 content chunks, then a usage chunk when asked, then [DONE]; continuous usage
when asked), non-streaming JSON, /health, /v1/models and a static vLLM /metrics. Every frame is
pre-rendered; each chunk is its own write, `--gap-ms` apart (default 1 ms: chunks arrive one by
one as they do from a real engine, instead of being coalesced into one read). Both modes follow
one token schedule: token i is ready at start + (i + 1) gaps; the JSON answer goes when the last
one is, a stream sends each when it is.
`--upstream sim` uses the simulated replica (engine_adapter.simulator) instead, for comparison.

Run: .venv/bin/python -m bench.gateway [--quick] [--runs 3] [--duration 10] [--no-litellm]
     [--profile]   (py-spy record of the edge and its fold worker under load; top functions
                    into the JSON)
Needs: `apt-get install -y wrk`; LiteLLM in a separate venv (default /tmp/litellm-venv,
`python3 -m venv /tmp/litellm-venv && /tmp/litellm-venv/bin/pip install 'litellm[proxy]' py-spy`).
Writes bench/results/gateway.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "gateway.json"
LUA = ROOT / "bench" / "lua" / "post.lua"
MODEL = "llama-3.1-8b-2026-05"
OUTPUT_TOKENS = 16
PROMPT = "Say hello to the benchmark, please."
LITELLM_KEY = "sk-litellm-bench-master"

# Targets printed beside the figures (from the issue).
TARGET_CPU_RATIO = 10  # Tollgate CPU/request <= LiteLLM's / 10
TARGET_P99_ADDED_MS = 5.0  # at 200 req/s open loop
# A restructuring must not cost more than this of the CPU per request (issue 11), A/B in one run.
AB_MAX_RATIO = 1.05
# Issue 15: the gateway's CPU per request with a four-level path and budgets on, against a key
# of the organization in the same run.
BUDGETS_MAX_RATIO = 1.10
ISSUE_LITELLM_CPU_MS = {"json": 21.0, "stream": 50.0}
CALIBRATION_CPU_MS = {
    "bare aiohttp pass-through": {"json": 0.36, "stream": 0.49},
    "FastAPI + pydantic + aiohttp": {"json": 0.63, "stream": 1.5},
}


# --- the cheap upstream -----------------------------------------------------------------------


def _render_frames(model: str, *, include_usage: bool, continuous: bool) -> list[bytes]:
    import orjson

    prompt = 17
    frames = []
    base = {
        "id": "chatcmpl-bench",
        "object": "chat.completion.chunk",
        "created": 1767225600,
        "model": model,
    }
    for i in range(OUTPUT_TOKENS):
        delta: dict[str, Any] = {"content": f" tok{i}"}
        if i == 0:
            delta = {"role": "assistant", "content": " tok0"}
        chunk: dict[str, Any] = {
            **base,
            "choices": [
                {
                    "index": 0,
                    "delta": delta,
                    "logprobs": None,
                    "finish_reason": "length" if i == OUTPUT_TOKENS - 1 else None,
                }
            ],
        }
        if continuous:
            chunk["usage"] = {
                "prompt_tokens": prompt,
                "total_tokens": prompt + i + 1,
                "completion_tokens": i + 1,
            }
        frames.append(b"data: " + orjson.dumps(chunk) + b"\n\n")
    if include_usage:
        usage = {
            "prompt_tokens": prompt,
            "total_tokens": prompt + OUTPUT_TOKENS,
            "completion_tokens": OUTPUT_TOKENS,
            "prompt_tokens_details": {"cached_tokens": 0},
        }
        frames.append(b"data: " + orjson.dumps({**base, "choices": [], "usage": usage}) + b"\n\n")
    frames.append(b"data: [DONE]\n\n")
    return frames


def _completion_json(model: str) -> bytes:
    import orjson

    return orjson.dumps(
        {
            "id": "chatcmpl-bench",
            "object": "chat.completion",
            "created": 1767225600,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {
                        "role": "assistant",
                        "content": "".join(f" tok{i}" for i in range(16)),
                    },
                    "logprobs": None,
                    "finish_reason": "length",
                }
            ],
            "usage": {
                "prompt_tokens": 17,
                "total_tokens": 33,
                "completion_tokens": 16,
                "prompt_tokens_details": {"cached_tokens": 0},
            },
        }
    )


def _metrics_text(model: str) -> bytes:
    lab = f'engine="0",model_name="{model}"'
    lines = [
        f"vllm:num_requests_running{{{lab}}} 0.0",
        f"vllm:num_requests_waiting{{{lab}}} 0.0",
        f"vllm:kv_cache_usage_perc{{{lab}}} 0.0",
        f"vllm:num_preemptions_total{{{lab}}} 0.0",
        'vllm:cache_config_info{block_size="16",engine="0",num_gpu_blocks="1048576"} 1.0',
    ]
    for le in ("0.01", "0.025", "0.05", "0.075", "0.1", "+Inf"):
        lines.append(f'vllm:request_time_per_output_token_seconds_bucket{{{lab},le="{le}"}} 0.0')
    lines.append(f"vllm:request_time_per_output_token_seconds_count{{{lab}}} 0.0")
    lines.append(f"vllm:request_time_per_output_token_seconds_sum{{{lab}}} 0.0")
    return ("\n".join(lines) + "\n").encode()


def serve_upstream(port: int, model: str, gap_ms: float) -> None:
    import orjson
    from aiohttp import web

    variants = {
        (inc, cont): _render_frames(model, include_usage=inc, continuous=cont)
        for inc in (False, True)
        for cont in (False, True)
    }
    completion = _completion_json(model)
    metrics = _metrics_text(model)
    gap = gap_ms / 1000.0

    async def chat(request: web.Request) -> web.StreamResponse:
        body = orjson.loads(await request.read())
        loop = asyncio.get_running_loop()
        start = loop.time()
        if not body.get("stream"):
            if gap:
                await asyncio.sleep(gap * OUTPUT_TOKENS)
            return web.Response(body=completion, content_type="application/json")
        opts = body.get("stream_options") or {}
        frames = variants[
            (bool(opts.get("include_usage")), bool(opts.get("continuous_usage_stats")))
        ]
        resp = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
        )
        await resp.prepare(request)
        last = len(frames) - 1
        for i, frame in enumerate(frames):
            if gap and i < OUTPUT_TOKENS:
                # Token i is ready at start + (i + 1) gaps, as in the JSON answer, which is sent
                # when the last one is: sleeping a gap after each write instead let the timer's
                # overshoot pile up over 16 sleeps and made streams ~1-4 ms slower than JSON.
                await asyncio.sleep(max(0.0, start + (i + 1) * gap - loop.time()))
            elif i < last:
                await asyncio.sleep(0)
            await resp.write(frame)
        await resp.write_eof()
        return resp

    async def health(request: web.Request) -> web.Response:
        return web.Response(body=b"")

    async def models(request: web.Request) -> web.Response:
        return web.Response(
            body=orjson.dumps(
                {
                    "object": "list",
                    "data": [
                        {
                            "id": model,
                            "object": "model",
                            "created": 0,
                            "owned_by": "vllm",
                            "max_model_len": 32768,
                        }
                    ],
                }
            ),
            content_type="application/json",
        )

    async def metrics_h(request: web.Request) -> web.Response:
        return web.Response(body=metrics, content_type="text/plain")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    app.router.add_get("/health", health)
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics_h)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


# --- the open-loop generator ------------------------------------------------------------------


async def _open_loop(
    url: str, body: bytes, auth: str, rate: float, duration: float, stream: bool
) -> dict[str, Any]:
    import aiohttp

    headers = {"Content-Type": "application/json"}
    if auth:
        headers["Authorization"] = "Bearer " + auth
    n = int(rate * duration)
    lat: list[float] = []
    statuses: Counter[str] = Counter()
    late: list[float] = []
    first_error: dict[str, str] = {}
    loop = asyncio.get_running_loop()
    conn = aiohttp.TCPConnector(limit=0, keepalive_timeout=60)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as session:

        async def one(scheduled: float) -> None:
            try:
                async with session.post(url, data=body, headers=headers) as resp:
                    await resp.read()
                    statuses[str(resp.status)] += 1
                    if resp.status == 200:
                        lat.append(loop.time() - scheduled)
            except Exception as exc:  # counted, never silent
                statuses[type(exc).__name__] += 1
                first_error.setdefault(type(exc).__name__, repr(exc)[:200])

        # warm the pool: a few connections before the clock starts
        await asyncio.gather(*(one(loop.time()) for _ in range(8)))
        lat.clear()
        statuses.clear()
        tasks = []
        t0 = loop.time() + 0.05
        for i in range(n):
            scheduled = t0 + i / rate
            delay = scheduled - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            late.append(loop.time() - scheduled)
            tasks.append(asyncio.ensure_future(one(scheduled)))
        await asyncio.gather(*tasks)
        elapsed = loop.time() - t0
    lat.sort()
    late.sort()

    def pct(xs: list[float], p: float) -> float:
        return xs[min(len(xs) - 1, int(p / 100 * len(xs)))] * 1000 if xs else float("nan")

    return {
        "offered_rps": rate,
        "sent": n,
        "ok": len(lat),
        "statuses": dict(statuses),
        "achieved_rps": round(len(lat) / elapsed, 1),
        "latency_ms": {
            "p50": pct(lat, 50),
            "p90": pct(lat, 90),
            "p99": pct(lat, 99),
            "p999": pct(lat, 99.9),
            "max": lat[-1] * 1000 if lat else float("nan"),
        },
        "send_lateness_ms": {"p50": pct(late, 50), "p99": pct(late, 99)},
        "stream": stream,
        "first_errors": first_error,
    }


# --- process helpers --------------------------------------------------------------------------

TICK = os.sysconf("SC_CLK_TCK")
nan = float("nan")


def _stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            data = f.read()
    except OSError:
        return None
    return data[data.rindex(")") + 2 :].split()


def _descendants(pid: int) -> list[int]:
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
    for p in [pid, *_descendants(pid)]:
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


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float = 60.0, proc: subprocess.Popen | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{proc.args[:3]} exited with {proc.returncode} before {url} was up")
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except Exception:
            pass
        time.sleep(0.25)
    raise RuntimeError(f"{url} not up after {timeout}s")


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
            "engine_adapter.simulator",
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
    # Another tree must import its own code: `python -m bench` puts this checkout on PYTHONPATH,
    # and the fold worker child (`python -m ...`) imports from its working directory.
    env.pop("PYTHONPATH", None)
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
    env.pop("PYTHONPATH", None)
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
    upstream: str, work: Path, stack: contextlib.ExitStack
) -> tuple[Proc, str, str, list[Proc], tuple[int, ...]]:
    """The distributed mode beside the embedded one: the development broker, a fresh
    PostgreSQL schema, one `tollgate api` edge, `tollgate relay` and one Kafka `tollgate worker`.
    Returns the edge, its URL and key, the relay and worker, and the pipeline's pids (relay,
    worker, broker; the broker is stopped by `stack`)."""
    from bench.pipeline import fresh_schema
    from streams.dev_broker import DevBroker

    broker = DevBroker(log_path=work / "bench-broker.log")
    broker.start()
    stack.callback(broker.stop)
    url = stack.enter_context(fresh_schema())
    env = {"TOLLGATE_DATABASE_URL": url, "TOLLGATE_KAFKA_BOOTSTRAP": broker.bootstrap,
           "TOLLGATE_KAFKA_TOPIC": "bench-gateway.events"}  # fmt: skip
    tollgate = str(ROOT / ".venv" / "bin" / "tollgate")
    full_env = {**os.environ, **env}
    # The pipeline first: the edge is ready only once a worker reports.
    pipeline = [Proc(name, [tollgate, name], full_env, work) for name in ("relay", "worker")]
    for proc in pipeline:
        stack.callback(proc.stop)
    edge, edge_url, key = start_tollgate(
        upstream, work / "data-distributed", work, name="distributed", command="api",
        env_extra=env,
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


def _commit(tree: Path) -> str:
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


def closed_loop_once(
    target: str,
    url: str,
    auth: str,
    server_pid: int,
    upstream_pid: int,
    stream: bool,
    conns: int,
    seconds: float,
    warmup: float,
    pipeline_pids: tuple[int, ...] = (),
) -> dict[str, Any]:
    """`pipeline_pids`: other processes that work for this target (the distributed mode's
    relay, worker and broker), measured beside it as `pipeline_cpu_ms_per_req`."""
    body = body_for(stream)
    if warmup > 0:
        run_wrk(url, body, auth, conns, warmup)

    def pipeline_cpu() -> float:
        return sum(tree_cpu_s(p) for p in pipeline_pids)

    cpu0, up0, own0, pipe0 = (
        tree_cpu_s(server_pid), tree_cpu_s(upstream_pid), own_cpu_s(server_pid), pipeline_cpu()
    )  # fmt: skip
    th0 = thread_cpu_s(server_pid)
    w = run_wrk(url, body, auth, conns, seconds)
    th1 = thread_cpu_s(server_pid)
    cpu1, up1, own1, pipe1 = (
        tree_cpu_s(server_pid), tree_cpu_s(upstream_pid), own_cpu_s(server_pid), pipeline_cpu()
    )  # fmt: skip
    n = max(1, w["requests"])
    # threads that ended during the run are in neither snapshot: their time shows in the total
    threads = {k: round((v - th0.get(k, 0.0)) * 1000 / n, 3) for k, v in th1.items()}
    threads = {k: v for k, v in sorted(threads.items(), key=lambda kv: -kv[1]) if v > 0}
    errors = sum(w["errors"].values())
    return {
        "requests": w["requests"],
        "errors": w["errors"],
        "error_total": errors,
        "non_2xx": w.get("non_2xx", {}),
        "rps": round(w["requests"] / (w["duration_us"] / 1e6), 1),
        "p50_ms": w["latency_us"]["p50"] / 1000,
        "p99_ms": w["latency_us"]["p99"] / 1000,
        # no request finished: CPU per request is undefined, not CPU / 1
        "cpu_ms_per_req": round((cpu1 - cpu0) * 1000 / n, 3) if w["requests"] else None,
        # the edge process alone, without its fold worker child (embedded mode)
        "edge_cpu_ms_per_req": round((own1 - own0) * 1000 / n, 3) if w["requests"] else None,
        "pipeline_cpu_ms_per_req": round((pipe1 - pipe0) * 1000 / n, 3) if w["requests"] else None,
        "upstream_cpu_ms_per_req": round((up1 - up0) * 1000 / n, 3),
        "server_cpu_cores": round((cpu1 - cpu0) / (w["duration_us"] / 1e6), 2),
        "server_thread_cpu_ms_per_req": threads,
    }


def open_loop_once(
    url: str, auth: str, rate: float, seconds: float, stream: bool, server_pid: int | None
) -> dict[str, Any]:
    cmd = [
        sys.executable,
        "-m",
        "bench.gateway",
        "openloop",
        "--url",
        url + "/v1/chat/completions",
        "--body",
        json.dumps(body_for(stream)),
        "--auth",
        auth,
        "--rate",
        str(rate),
        "--duration",
        str(seconds),
    ]
    cpu0 = tree_cpu_s(server_pid) if server_pid else 0.0
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=seconds + 120)
    if out.returncode != 0:
        raise RuntimeError(f"open-loop generator failed: {out.stderr[-2000:]}")
    result = dict(json.loads(out.stdout.strip().splitlines()[-1]))
    if server_pid:
        result["cpu_ms_per_req"] = round(
            (tree_cpu_s(server_pid) - cpu0) * 1000 / max(1, result["ok"]), 3
        )
    return result


def med(xs: list[float | None]) -> float:
    xs = [x for x in xs if x is not None and x == x]
    return round(statistics.median(xs), 3) if xs else float("nan")


def paired_ratios(
    raw_runs: dict[tuple[str, str, int], list[dict[str, Any]]], target: str, reference: str,
    mode: str, conns: int, field: str = "cpu_ms_per_req",
) -> list[float]:  # fmt: skip
    """`field` of `target` over `reference`, run by run. Each run's cells are back to back, so
    the ratio within a run shares its noise; the median of these ratios is an A/B figure (the
    ratio of two medians mixes runs measured minutes apart on a noisy machine)."""
    return [
        a[field] / b[field]
        for a, b in zip(
            raw_runs[(target, mode, conns)], raw_runs[(reference, mode, conns)], strict=True
        )
        if a[field] and b[field]
    ]


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    keys = (
        "rps",
        "p50_ms",
        "p99_ms",
        "cpu_ms_per_req",
        "edge_cpu_ms_per_req",
        "pipeline_cpu_ms_per_req",
        "upstream_cpu_ms_per_req",
        "server_cpu_cores",
    )
    out: dict[str, Any] = {k: med([r.get(k) for r in runs]) for k in keys}
    out["errors_total"] = sum(r["error_total"] for r in runs)
    names = {k for r in runs for k in r.get("server_thread_cpu_ms_per_req", {})}
    out["server_thread_cpu_ms_per_req"] = {
        k: med([r.get("server_thread_cpu_ms_per_req", {}).get(k, 0.0) for r in runs]) for k in names
    }
    out["runs"] = runs
    return out


def profile_tollgate(
    pid: int, url: str, auth: str, stream: bool, seconds: float, py_spy: str, out_dir: Path
) -> dict[str, Any]:
    """py-spy record (raw collapsed stacks) of the edge and of each child process (the fold
    worker) while wrk loads Tollgate; top self and inclusive, per process."""
    mode = "stream" if stream else "json"
    pids = {"edge": pid, **{f"child-{c}": c for c in _descendants(pid)}}
    spies = {}
    for name, p in pids.items():
        raw = out_dir / f"tollgate-{mode}-{name.split('-')[0]}.txt"
        cmd = [
            py_spy, "record", "--pid", str(p), "--duration", str(int(seconds)), "--rate", "100",
            "--format", "raw", "--threads", "--output", str(raw), "--nonblocking",
        ]
        spy = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        spies[name] = (spy, raw)
    time.sleep(1.0)
    run_wrk(url, body_for(stream), auth, 16, seconds - 1.5)
    out: dict[str, Any] = {}
    for name, (spy, raw) in spies.items():
        _, err = spy.communicate(timeout=seconds + 60)
        key = "worker" if name.startswith("child") else name
        if not raw.exists():
            out[key] = {"error": err.decode(errors="replace")[-500:]}
        else:
            out[key] = _collapse(raw)
    return out


def _collapse(raw: Path) -> dict[str, Any]:
    """Top self and inclusive frames of a py-spy raw profile, in % of its samples."""
    self_c: Counter[str] = Counter()
    incl: Counter[str] = Counter()
    threads: Counter[str] = Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        c = int(count)
        frames = stack.split(";")
        thread = "?"
        while frames and frames[0].startswith(("process", "thread")):
            if frames[0].startswith("thread"):  # "thread (TID): NAME"
                thread = frames[0].split(":", 1)[-1].strip()
                thread = "AnyIO worker" if thread.startswith("AnyIO") else thread
            frames = frames[1:]
        threads[thread] += c
        total += c
        if not frames:
            continue
        self_c[frames[-1]] += c
        for f in set(frames):
            incl[f] += c

    def top(c: Counter[str], n: int) -> list[list[Any]]:
        return [[f, round(100 * v / max(1, total), 1)] for f, v in c.most_common(n)]

    return {
        "samples": total,
        "raw": str(raw.relative_to(ROOT)) if raw.is_relative_to(ROOT) else str(raw),
        "threads_pct": top(threads, 10),
        "top_self_pct": top(self_c, 25),
        "top_inclusive_pct": top(incl, 40),
    }


# --- main -------------------------------------------------------------------------------------


def machine() -> dict[str, Any]:
    cpu = "?"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem_kb = 0
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        mem_kb = int(f.readline().split()[1])
    return {
        "nproc": os.cpu_count(),
        "ram_gib": round(mem_kb / 2**20, 1),
        "cpu": cpu,
        "python": platform.python_version(),
        "kernel": platform.release(),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="gateway overhead: direct vs Tollgate vs LiteLLM")
    sub = ap.add_subparsers(dest="cmd")
    up = sub.add_parser("upstream", help="run the cheap vLLM-shaped upstream")
    up.add_argument("--port", type=int, required=True)
    up.add_argument("--model", default=MODEL)
    up.add_argument("--gap-ms", type=float, default=1.0)
    ol = sub.add_parser("openloop", help="one open-loop run; prints a JSON line")
    ol.add_argument("--url", required=True)
    ol.add_argument("--body", required=True)
    ol.add_argument("--auth", default="")
    ol.add_argument("--rate", type=float, default=200)
    ol.add_argument("--duration", type=float, default=15)
    ap.add_argument("--quick", action="store_true", help="1 run, short durations")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--duration", type=float, default=10, help="seconds per wrk run")
    ap.add_argument("--warmup", type=float, default=2)
    ap.add_argument("--connections", default="16,64")
    ap.add_argument("--rate", type=float, default=200, help="open-loop offered req/s")
    ap.add_argument("--rates", default="50,200", help="open-loop offered rates, in order")
    ap.add_argument("--open-duration", type=float, default=20)
    ap.add_argument("--upstream", choices=("cheap", "sim"), default="cheap")
    ap.add_argument("--gap-ms", type=float, default=1.0, help="upstream gap between chunks")
    ap.add_argument("--litellm-venv", default="/tmp/litellm-venv")
    ap.add_argument("--no-litellm", action="store_true")
    ap.add_argument("--profile", action="store_true", help="py-spy Tollgate under load")
    ap.add_argument("--modes", default="json,stream")
    ap.add_argument("--no-open-loop", action="store_true")
    ap.add_argument("--closed-targets", default="", help="subset, e.g. tollgate (default all)")
    ap.add_argument("--output", default=str(RESULTS))
    ap.add_argument(
        "--baseline",
        default="",
        help="another checkout (with its own .venv) served beside this one as target "
        "'baseline', interleaved, for an A/B of Tollgate's CPU per request",
    )
    ap.add_argument(
        "--baseline-commit",
        default="",
        help="like --baseline, on a checkout of this commit built under the temp dir",
    )
    ap.add_argument(
        "--budgets",
        action="store_true",
        help="also serve target 'budgets': a second `tollgate serve` whose key sits on a "
        "four-level path (organization, workspace, project, key) with limits and day and month "
        "budgets at every level; its CPU per request is paired with 'tollgate' (issue 15)",
    )
    ap.add_argument(
        "--distributed",
        action="store_true",
        help="also serve the distributed mode (one `tollgate api` edge on a fresh PostgreSQL "
        "schema, the relay, one Kafka worker, the development broker) as target 'distributed'",
    )
    args = ap.parse_args(argv)

    if args.cmd == "upstream":
        serve_upstream(args.port, args.model, args.gap_ms)
        return
    if args.cmd == "openloop":
        res = asyncio.run(
            _open_loop(
                args.url,
                args.body.encode(),
                args.auth,
                args.rate,
                args.duration,
                bool(json.loads(args.body).get("stream")),
            )
        )
        print(json.dumps(res))
        return

    if args.baseline_commit and not args.baseline:
        args.baseline = str(baseline_checkout(args.baseline_commit))
    if args.quick:
        args.runs, args.duration, args.warmup, args.open_duration = 1, 4, 1, 8
    if shutil.which("wrk") is None:
        sys.exit("wrk not found: apt-get update && apt-get install -y wrk")
    conns = [int(c) for c in args.connections.split(",")]
    venv = Path(args.litellm_venv)
    use_litellm = not args.no_litellm and (venv / "bin" / "litellm").exists()
    if not args.no_litellm and not use_litellm:
        print(f"LiteLLM not found in {venv}; skipping it (see the module docstring)", flush=True)

    work = Path(tempfile.mkdtemp(prefix="tollgate-bench-gw-"))
    procs: list[Proc] = []
    pipeline: dict[str, tuple[int, ...]] = {}  # target -> its pipeline's pids
    stack = contextlib.ExitStack()
    deaths: list[dict[str, Any]] = []
    result: dict[str, Any] = {
        "benchmark": "gateway",
        "measured_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine(),
        "command": "python -m bench.gateway " + " ".join(sys.argv[1:] if argv is None else argv),
        "upstream": {"kind": args.upstream, "gap_ms": args.gap_ms, "output_tokens": OUTPUT_TOKENS},
        "runs": args.runs,
        "duration_s": args.duration,
        "connections": conns,
        "targets": {
            "tollgate_cpu_per_req_max_fraction_of_litellm": 1 / TARGET_CPU_RATIO,
            "p99_added_ms_at_200rps_max": TARGET_P99_ADDED_MS,
        },
        "issue_reference_ms": {"litellm_1.108": ISSUE_LITELLM_CPU_MS, **CALIBRATION_CPU_MS},
    }
    try:
        upstream, up_url = start_upstream(args.upstream, args.gap_ms, work)
        procs.append(upstream)
        tg, tg_url, tg_key = start_tollgate(up_url, work / "data", work)
        procs.append(tg)
        targets = {"direct": (up_url, "", upstream.pid), "tollgate": (tg_url, tg_key, tg.pid)}
        if args.baseline:
            tree = Path(args.baseline).resolve()
            base, base_url, base_key = start_tollgate(
                up_url, work / "data-baseline", work, tree, "baseline"
            )
            procs.append(base)
            targets["baseline"] = (base_url, base_key, base.pid)
            result["baseline"] = {"tree": str(tree), "commit": _commit(tree)}
        if args.budgets:
            bud, bud_url, _ = start_tollgate(up_url, work / "data-budgets", work, name="budgets")
            procs.append(bud)
            targets["budgets"] = (bud_url, add_budget_path(ROOT, work / "data-budgets"), bud.pid)
        if args.distributed:
            edge, edge_url, edge_key, _, pids = start_distributed(up_url, work, stack)
            procs.append(edge)  # the relay and worker stop with `stack`
            targets["distributed"] = (edge_url, edge_key, edge.pid)
            pipeline["distributed"] = pids
        if use_litellm:
            ll, ll_url, ll_key = start_litellm(venv, up_url, work)
            procs.append(ll)
            targets["litellm"] = (ll_url, ll_key, ll.pid)
            result["litellm_version"] = litellm_version(venv)
        for name, (url, key, _) in targets.items():
            for stream in (False, True):
                status, text = post(url + "/v1/chat/completions", body_for(stream), key)
                if status != 200:
                    raise RuntimeError(f"{name} smoke request answered {status}: {text[:300]!r}")
        print(f"targets up: {', '.join(f'{k}={v[0]}' for k, v in targets.items())}", flush=True)

        modes = args.modes.split(",")
        chosen = args.closed_targets.split(",") if args.closed_targets else list(targets)
        closed: dict[str, Any] = {t: {} for t in targets if t in chosen}
        raw_runs: dict[tuple[str, str, int], list[dict[str, Any]]] = {}
        for run in range(args.runs):
            for mode in modes:
                for c in conns:
                    for name, (url, key, pid) in targets.items():  # interleaved: same noise
                        if name not in chosen:
                            continue
                        r = closed_loop_once(
                            name,
                            url,
                            key,
                            pid,
                            upstream.pid,
                            mode == "stream",
                            c,
                            args.duration,
                            args.warmup,
                            pipeline.get(name, ()),
                        )
                        raw_runs.setdefault((name, mode, c), []).append(r)
                        print(
                            f"run {run + 1}/{args.runs} {name:8s} {mode:6s} c={c:<3d} "
                            f"{r['rps']:8.1f} req/s p50 {r['p50_ms']:7.2f} ms p99 "
                            f"{r['p99_ms']:7.2f} ms cpu {r['cpu_ms_per_req'] or nan:6.3f} ms/req "
                            f"(upstream {r['upstream_cpu_ms_per_req']:.3f}) err {r['error_total']} "
                            f"{r['non_2xx'] or ''}",
                            flush=True,
                        )
        for (name, mode, c), runs in raw_runs.items():
            closed[name].setdefault(mode, {})[str(c)] = summarise(runs)
        result["closed_loop"] = closed

        # open loop: direct vs Tollgate, interleaved, non-streaming and streaming, each rate.
        # Tollgate may not survive an offered rate above its capacity: it is restarted (fresh
        # data dir) before the next run if it died, and the death is recorded.
        open_res: dict[str, Any] = {}
        rates = [float(r) for r in args.rates.split(",")] if args.rates else [args.rate]
        for rate in [] if args.no_open_loop else rates:
            for mode in modes:
                per: dict[str, list[dict[str, Any]]] = {"direct": [], "tollgate": []}
                for run in range(args.runs):
                    for name in ("direct", "tollgate"):
                        if name == "tollgate" and tg.p.poll() is not None:
                            deaths.append(
                                {
                                    "after": f"{mode} {rate:.0f} req/s run {run}",
                                    "returncode": tg.p.returncode,
                                }
                            )
                            print(f"tollgate exited ({tg.p.returncode}); restarting", flush=True)
                            tg, tg_url, tg_key = start_tollgate(
                                up_url, work / f"data-{len(deaths)}", work
                            )
                            procs.append(tg)
                            targets["tollgate"] = (tg_url, tg_key, tg.pid)
                        url, key, pid = targets[name]
                        r = open_loop_once(
                            url, key, rate, args.open_duration, mode == "stream", pid
                        )
                        per[name].append(r)
                        print(
                            f"open {run + 1}/{args.runs} {name:8s} {mode:6s} {rate:.0f} req/s: "
                            f"p50 {r['latency_ms']['p50']:.2f} p99 {r['latency_ms']['p99']:.2f} "
                            f"ms ok {r['ok']}/{r['sent']} {r['statuses']}",
                            flush=True,
                        )
                added = [
                    t["latency_ms"]["p99"] - d["latency_ms"]["p99"]
                    for d, t in zip(per["direct"], per["tollgate"], strict=True)
                ]
                added50 = [
                    t["latency_ms"]["p50"] - d["latency_ms"]["p50"]
                    for d, t in zip(per["direct"], per["tollgate"], strict=True)
                ]
                open_res.setdefault(mode, {})[f"{rate:.0f}"] = {
                    "offered_rps": rate,
                    "duration_s": args.open_duration,
                    "direct_p50_ms": med([r["latency_ms"]["p50"] for r in per["direct"]]),
                    "direct_p99_ms": med([r["latency_ms"]["p99"] for r in per["direct"]]),
                    "tollgate_p50_ms": med([r["latency_ms"]["p50"] for r in per["tollgate"]]),
                    "tollgate_p99_ms": med([r["latency_ms"]["p99"] for r in per["tollgate"]]),
                    "tollgate_ok_fraction": round(
                        sum(r["ok"] for r in per["tollgate"])
                        / max(1, sum(r["sent"] for r in per["tollgate"])),
                        3,
                    ),
                    "added_p50_ms": med(added50),
                    "added_p99_ms": med(added),
                    "added_p99_ms_runs": [round(a, 3) for a in added],
                    "tollgate_cpu_ms_per_req": med([r["cpu_ms_per_req"] for r in per["tollgate"]]),
                    "non_200": sum(
                        sum(v for k, v in r["statuses"].items() if k != "200")
                        for rs in per.values()
                        for r in rs
                    ),
                    "runs": per,
                }
        result["open_loop"] = open_res

        # verdicts
        verdicts: dict[str, Any] = {}
        if "litellm" in closed and "tollgate" in closed:
            for mode in modes:
                for c in conns:
                    t = closed["tollgate"][mode][str(c)]["cpu_ms_per_req"]
                    ll = closed["litellm"][mode][str(c)]["cpu_ms_per_req"]
                    verdicts[f"cpu_ratio_{mode}_c{c}"] = {
                        "tollgate_ms": t,
                        "litellm_ms": ll,
                        "litellm_over_tollgate": round(ll / t, 1) if t and ll == ll else None,
                        "target": f">= {TARGET_CPU_RATIO}",
                        # None: LiteLLM finished no request in that cell, nothing to compare
                        "met": bool(ll / t >= TARGET_CPU_RATIO) if t and ll == ll else None,
                    }
        if "baseline" in closed and "tollgate" in closed:
            for mode in modes:
                for c in conns:
                    t = closed["tollgate"][mode][str(c)]["cpu_ms_per_req"]
                    base_ms = closed["baseline"][mode][str(c)]["cpu_ms_per_req"]
                    paired = paired_ratios(raw_runs, "tollgate", "baseline", mode, c)
                    ratio = med(paired) if paired else None
                    verdicts[f"ab_cpu_{mode}_c{c}"] = {
                        "tollgate_ms": t,
                        "baseline_ms": base_ms,
                        "tollgate_over_baseline_per_run": [round(r, 3) for r in paired],
                        "tollgate_over_baseline": round(ratio, 3) if ratio else None,
                        "target": f"<= {AB_MAX_RATIO}",
                        "met": bool(ratio <= AB_MAX_RATIO) if ratio else None,
                    }
        if "budgets" in closed and "tollgate" in closed:
            for mode in modes:
                for c in conns:
                    # Edge and fold worker together (budgets are decided on the edge and trued
                    # up by the bills).
                    paired = paired_ratios(raw_runs, "budgets", "tollgate", mode, c)
                    ratio = med(paired) if paired else None
                    verdicts[f"budgets_cpu_{mode}_c{c}"] = {
                        "budgets_ms": closed["budgets"][mode][str(c)]["cpu_ms_per_req"],
                        "plain_ms": closed["tollgate"][mode][str(c)]["cpu_ms_per_req"],
                        "budgets_over_plain_per_run": [round(r, 3) for r in paired],
                        "budgets_over_plain": round(ratio, 3) if ratio else None,
                        "target": f"<= {BUDGETS_MAX_RATIO}",
                        "met": bool(ratio <= BUDGETS_MAX_RATIO) if ratio else None,
                    }
        if "distributed" in closed and "tollgate" in closed:
            for mode in modes:
                for c in conns:
                    # The edge process alone in both modes.
                    paired = paired_ratios(
                        raw_runs, "distributed", "tollgate", mode, c, "edge_cpu_ms_per_req"
                    )
                    dist = closed["distributed"][mode][str(c)]
                    emb = closed["tollgate"][mode][str(c)]
                    ratio = med(paired) if paired else None
                    verdicts[f"distributed_cpu_{mode}_c{c}"] = {
                        "distributed_edge_ms": dist["edge_cpu_ms_per_req"],
                        "embedded_edge_ms": emb["edge_cpu_ms_per_req"],
                        "distributed_over_embedded_per_run": [round(r, 3) for r in paired],
                        "distributed_over_embedded": ratio,
                        "distributed_pipeline_ms": dist["pipeline_cpu_ms_per_req"],
                        "embedded_total_ms": emb["cpu_ms_per_req"],
                        "target": "(comparison)",
                        "met": None,
                    }
        for mode, per_rate in open_res.items():
            for rate_s, o in per_rate.items():
                a = o["added_p99_ms"]
                ok = o["tollgate_ok_fraction"] >= 0.999
                verdicts[f"p99_added_{mode}_{rate_s}"] = {
                    "mode": mode,
                    "offered_rps": o["offered_rps"],
                    "added_ms": a,
                    "tollgate_ok_fraction": o["tollgate_ok_fraction"],
                    "target": f"<= {TARGET_P99_ADDED_MS}",
                    # failed requests are not in the p99: a rate Tollgate drops is a miss
                    "met": bool(ok and a == a and a <= TARGET_P99_ADDED_MS),
                }
        result["verdicts"] = verdicts

        if args.profile:
            spy = shutil.which("py-spy") or str(venv / "bin" / "py-spy")
            if tg.p.poll() is not None:
                tg, tg_url, tg_key = start_tollgate(up_url, work / "data-profile", work)
                procs.append(tg)
            result["profile"] = {}
            for mode in modes:
                try:
                    result["profile"][mode] = profile_tollgate(
                        tg.pid,
                        tg_url,
                        tg_key,
                        mode == "stream",
                        max(8.0, args.duration),
                        spy,
                        RESULTS.parent,
                    )
                except Exception as exc:  # recorded, the figures above still get written
                    result["profile"][mode] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
    except BaseException as exc:
        result["aborted"] = f"{type(exc).__name__}: {exc}"[:1000]
        raise
    finally:
        for p in reversed(procs):
            p.stop()
        stack.close()
        result["logs"] = str(work)
        result["tollgate_deaths"] = deaths
        out = Path(args.output)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result.get("verdicts", {}), indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
