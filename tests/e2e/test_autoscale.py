"""`tollgate serve --autoscale` closes the loop on simulated replicas: load raises the signal, a
replica joins after its cold start; with the load gone the signal comes down after the cool-down
and a replica is drained and removed. The signal and its terms are on /metrics and /v1/fleet."""

from __future__ import annotations

import json
import subprocess
import threading
from pathlib import Path

import httpx
import pytest

from tests.e2e.conftest import (
    MODEL,
    REPO,
    TOLLGATE,
    _stop_process,
    auth,
    free_port,
    poll,
    spawn,
    wait_http,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_the_signal_adds_and_removes_simulated_replicas(tmp_path: Path) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    data = tmp_path / "data"
    env = {"TOLLGATE_DATA_DIR": str(data)}
    log = tmp_path / "serve.log"
    proc = spawn(
        [*TOLLGATE, "serve", "--port", str(port), "--model", MODEL, "--simulated-replicas", "1",
         "--autoscale", "--cold-start-s", "2", "--scale-down-after-s", "4",
         "--sim-gpu-blocks", "256", "--sim-speed", "1"],
        log, env,
    )
    stop = threading.Event()
    try:
        wait_http(f"{base}/readyz", proc, log, timeout=60)
        keys = json.loads((data / "demo-keys.json").read_text())
        out = subprocess.run(
            [*TOLLGATE, "keys", "issue", "--tenant", "tollgate-ops", "--scope", "admin"],
            cwd=REPO, capture_output=True, text=True, env={**env}, timeout=60, check=True,
        )
        admin = out.stdout.strip().splitlines()[-1]

        def fleet() -> dict:  # type: ignore[type-arg]
            r = httpx.get(f"{base}/v1/fleet", headers=auth(admin), timeout=10)
            return r.json() if r.status_code == 200 else {}

        poll("the admin key", lambda: fleet().get("models"), timeout=10)
        assert fleet()["models"][MODEL]["replicas"] == 1
        forbidden = httpx.get(f"{base}/v1/fleet", headers=auth(keys["demo-standard"]))
        assert forbidden.status_code == 403

        def load() -> None:  # long generations holding KV: 256 blocks fill up fast
            body = {"model": MODEL, "max_tokens": 400, "ignore_eos": True,
                    "messages": [{"role": "user", "content": " ".join(["word"] * 300)}]}
            with httpx.Client(timeout=60) as client:
                while not stop.is_set():
                    client.post(f"{base}/v1/chat/completions",
                                headers=auth(keys["demo-enterprise"]), json=body)

        workers = [threading.Thread(target=load, daemon=True) for _ in range(12)]
        for w in workers:
            w.start()
        grown = poll("a second replica serving",
                     lambda: fleet()["models"][MODEL]["replicas"] >= 2 and fleet(), timeout=60)
        terms = grown["models"][MODEL]["terms"]
        assert terms["desired_replicas"] >= 2 and terms["needed_tokens"] > 0
        metrics = httpx.get(f"{base}/metrics", timeout=10).text
        assert f'tollgate_desired_replicas{{model="{MODEL}"}}' in metrics

        stop.set()
        for w in workers:
            w.join(60)
        poll("the fleet back to one replica after the cool-down",
             lambda: fleet()["models"][MODEL]["replicas"] == 1
             and not any(r["draining"] for r in fleet()["replicas"]), timeout=90)
        assert "stopped" in log.read_text()
    finally:
        stop.set()
        _stop_process(proc, grace=15)
