"""The container image (deploy/Containerfile, issue 29 item 1; long tier only: building it takes
minutes and needs root, debootstrap and podman): deploy/build-image.sh debootstraps a Debian
rootfs, imports it as the base and builds the image from this checkout; the image runs as in
the manifests (user 10001, read-only root, the data directory a volume), `tollgate serve`
inside answers a chat completion and a stream from the host through a published port, bills
them, and on `podman stop` (SIGTERM) finishes a stream in flight before it exits 0.

On a host where crun cannot set up containers (a cgroup v1/v2 hybrid) the test runs podman
with runc (TOLLGATE_PODMAN_RUNTIME, default runc when it is installed), and with file and
process limits below the caller's hard limits (podman's default nofile of 1048576 is refused
where the caller's hard limit is lower): deploy/README.md, "The image"."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import REPO, auth, free_port, poll

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ULIMITS = ["--ulimit", "nofile=4096:4096", "--ulimit", "nproc=4096:4096"]


def podman_command() -> list[str]:
    runtime = os.environ.get("TOLLGATE_PODMAN_RUNTIME", "runc" if shutil.which("runc") else "")
    return ["podman", *(["--runtime", runtime] if runtime else [])]


def run(*args: str, timeout: float = 120, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        [*podman_command(), *args], capture_output=True, text=True, timeout=timeout
    )
    if check:
        assert done.returncode == 0, f"podman {args}: {done.stdout[-2000:]}{done.stderr[-2000:]}"
    return done


@pytest.fixture(scope="module")
def image(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    missing = [t for t in ("podman", "debootstrap") if shutil.which(t) is None]
    if missing or os.geteuid() != 0:
        pytest.fail(
            f"the image test needs root and {missing or 'podman, debootstrap'}: "
            "apt-get install -y podman buildah debootstrap runc"
        )
    name = f"localhost/tollgate:test-{uuid.uuid4().hex[:8]}"
    env = {
        **os.environ,
        "TOLLGATE_ROOTFS": str(tmp_path_factory.mktemp("rootfs")),
        "PODMAN_ULIMITS": " ".join(ULIMITS),
    }
    runtime = podman_command()[2:]
    if runtime:
        env["PODMAN_RUNTIME"] = runtime[0]
    log = tmp_path_factory.mktemp("build") / "build.log"
    started = time.monotonic()
    with open(log, "w") as out:
        done = subprocess.run(
            [str(REPO / "deploy" / "build-image.sh"), name],
            stdout=out, stderr=subprocess.STDOUT, env=env, timeout=1800,
        )  # fmt: skip
    assert done.returncode == 0, log.read_text()[-4000:]
    print(f"image {name} built in {time.monotonic() - started:.0f} s")
    try:
        yield name
    finally:
        run("rmi", "-f", name, check=False)


def test_the_image_serves_bills_and_drains(image: str, tmp_path: Path) -> None:
    name = f"tollgate-test-{uuid.uuid4().hex[:8]}"
    volume = f"{name}-data"
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    run(
        "run", "-d", "--name", name, *ULIMITS, "--read-only", "-v", f"{volume}:/var/lib/tollgate",
        "-p", f"127.0.0.1:{port}:8080", image,
    )  # fmt: skip
    try:

        def ready() -> bool:
            try:
                return httpx.get(f"{base}/readyz", timeout=5).status_code == 200
            except httpx.HTTPError:
                return False

        poll("the container's /readyz", ready, timeout=180, every=1,
             detail=lambda: run("logs", name, check=False).stderr[-3000:])  # fmt: skip
        keys = json.loads(run("exec", name, "cat", "/var/lib/tollgate/demo-keys.json").stdout)
        user = run("exec", name, "id", "-u").stdout.strip()
        assert user == "10001"

        body = {"model": "llama-3.1-8b-2026-05", "max_tokens": 8,
                "messages": [{"role": "user", "content": "Hello from the host"}]}  # fmt: skip
        r = httpx.post(f"{base}/v1/chat/completions", headers=auth(keys["demo-standard"]),
                       json=body, timeout=30)  # fmt: skip
        assert r.status_code == 200, r.text
        answer = r.json()
        assert answer["usage"]["completion_tokens"] == 8
        request_id = r.headers["x-request-id"]

        def billed() -> bool:
            ledger = httpx.get(
                f"{base}/v1/billing/ledger", params={"tenant": "demo-standard"},
                headers=auth(keys["finance"]), timeout=10,
            )  # fmt: skip
            return ledger.status_code == 200 and request_id in ledger.text

        poll("the request billed in the container's ledger", billed, timeout=60, every=0.5)

        # SIGTERM with a stream in flight: the stream ends complete, then the process exits 0.
        streamed: dict[str, object] = {}

        def stream() -> None:
            long = {
                "model": "llama-3.1-70b-2026-05",
                "stream": True,
                "max_tokens": 300,
                "ignore_eos": True,
                "messages": [{"role": "user", "content": "A story"}],
            }
            chunks = []
            with httpx.stream(
                "POST",
                f"{base}/v1/chat/completions",
                json=long,
                headers=auth(keys["demo-enterprise"]),
                timeout=120,
            ) as s:
                for line in s.iter_lines():
                    if line.startswith("data: "):
                        chunks.append(line)
            streamed["chunks"] = chunks  # fmt: skip

        reader = threading.Thread(target=stream)
        reader.start()
        poll("the stream in flight", lambda: httpx.get(
            f"{base}/metrics", timeout=5).text.count("tollgate_in_flight 1.0") == 1,
            timeout=30, every=0.1)  # fmt: skip
        stopping = time.monotonic()
        run("stop", "-t", "120", name, timeout=180)
        drained_s = time.monotonic() - stopping
        reader.join(30)
        chunks = streamed["chunks"]
        assert isinstance(chunks, list) and chunks[-1] == "data: [DONE]", chunks[-3:]
        assert sum('"content"' in c for c in chunks) >= 290
        state = run("inspect", name, "--format", "{{.State.ExitCode}}").stdout.strip()
        assert state == "0", run("logs", name, check=False).stderr[-3000:]
        print(f"drained a stream in flight and exited in {drained_s:.1f} s")
    finally:
        run("rm", "-f", name, check=False)
        run("volume", "rm", "-f", volume, check=False)
