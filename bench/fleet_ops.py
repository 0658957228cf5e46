"""Operating the fleet (issue 17), measured on the embedded demo with simulated replicas:

1. **Goodput by tier under the `mix` load profile**: `tollgate serve` (the default simulated
   fleet), `tollgate loadgen --demo --profile mix` for a while, then the replay
   (`GET /v1/billing/goodput?group_by=tier`) beside the edge's live counters.
2. **The autoscaling signal's lead under a ramp**: two simulated replicas with small KV caches,
   arrivals growing linearly until a replica's KV occupancy crosses 0.85; `/v1/fleet` is sampled
   every 0.5 s. Lead = (first instant any replica is at ≥ 0.85) − (first instant the signal
   asks for a third replica); target: ≥ the configured cold start.

    python -m bench.fleet_ops [--quick] [--mix-seconds 60] [--cold-start-s 20]

Writes bench/results/fleet_ops.json.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.common import RESULTS_DIR, ROOT, free_port, write_result

RESULTS = RESULTS_DIR / "fleet_ops.json"
TOLLGATE = str(Path(sys.executable).with_name("tollgate"))
MODEL = "llama-3.1-8b-2026-05"


def serve(data: Path, *flags: str) -> tuple[subprocess.Popen[bytes], str, dict[str, str]]:
    port = free_port()
    env = {**os.environ, "TOLLGATE_DATA_DIR": str(data)}
    env.pop("TOLLGATE_DATABASE_URL", None)
    log = open(data.parent / f"serve-{port}.log", "wb")  # noqa: SIM115 - the process keeps it
    proc = subprocess.Popen([TOLLGATE, "serve", "--port", str(port), *flags], env=env,
                            stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"tollgate serve exited {proc.returncode}")
        try:
            if httpx.get(base + "/readyz", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    keys = json.loads((data / "demo-keys.json").read_text())
    return proc, base, keys


def cli(data: Path, *args: str) -> str:
    env = {**os.environ, "TOLLGATE_DATA_DIR": str(data)}
    env.pop("TOLLGATE_DATABASE_URL", None)
    done = subprocess.run([TOLLGATE, *args], env=env, capture_output=True, text=True, cwd=ROOT,
                          check=True, timeout=120)
    return done.stdout


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


def live_by_tier(base: str) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    text = httpx.get(base + "/metrics", timeout=10).text
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "tollgate_requests_attained_total":
                outcome = "attained"
            elif s.name == "tollgate_requests_not_attained_total":
                outcome = s.labels["outcome"]
            else:
                continue
            tier = out.setdefault(s.labels["tier"], {})
            tier[outcome] = tier.get(outcome, 0) + int(s.value)
    return out


def goodput_under_mix(work: Path, seconds: float, rate: float) -> dict[str, Any]:
    data = work / "mix" / "data"
    data.mkdir(parents=True)
    proc, base, keys = serve(data)
    try:
        cmd = [TOLLGATE, "loadgen", "--demo", "--base-url", base, "--profile", "mix",
               "--rate", str(rate), "--duration", str(seconds), "--no-live", "--no-reconcile",
               "--client", "httpx", "--seed", "1"]
        env = {**os.environ, "TOLLGATE_DATA_DIR": str(data)}
        subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, timeout=seconds + 300)
        time.sleep(3)  # the fold worker writes the request log within ~100 ms of each end
        replay = httpx.get(base + "/v1/billing/goodput", params={"group_by": "tier"},
                           headers={"Authorization": f"Bearer {keys['finance']}"}, timeout=60)
        replay.raise_for_status()
        live = live_by_tier(base)
    finally:
        stop(proc)
    tiers = {}
    for row in replay.json()["data"]:
        tiers[row["tier"]] = {
            "offered": row["offered"],
            "served": row["served"],
            "attained": row["attained"],
            "goodput_pct": None if row["goodput_ppm"] is None else row["goodput_ppm"] / 1e4,
            "attainment_pct": (None if row["attainment_ppm"] is None
                               else row["attainment_ppm"] / 1e4),
            "outcomes": {k: row[k] for k in ("missed_ttft", "missed_tpot", "cancelled",
                                             "failed", "refused_capacity", "shed",
                                             "refused_quota", "invalid") if row[k]},
            "live_equals_replay": live.get(row["tier"], {}) == {
                k: v for k, v in row.items()
                if k not in ("tier", "served", "offered", "attainment_ppm", "goodput_ppm") and v
            },
        }
    return {"seconds": seconds, "rate": rate, "profile": "mix", "tiers": tiers}


async def _ramp(base: str, key: str, admin: str, start_rate: float, slope: float,
                limit_s: float) -> dict[str, Any]:
    # Long generations of a short prompt, on replicas whose KV holds ~190 of them: each request
    # is half a percent of a replica, as on a real GPU, so what crosses 0.85 is load, not the
    # luck of where a few big requests landed.
    body = {"model": MODEL, "max_tokens": 300, "ignore_eos": True,
            "messages": [{"role": "user", "content": " ".join(["word"] * 20)}]}
    headers = {"Authorization": f"Bearer {key}"}
    samples: list[dict[str, Any]] = []
    first_ask = crossing = None
    rng = random.Random(3)
    started = time.monotonic()
    tasks: set[asyncio.Task[Any]] = set()
    async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=400)) as c:

        async def one() -> None:
            # a failed request is load that did not arrive: the samples show what the fleet held
            with contextlib.suppress(httpx.HTTPError):
                await c.post(base + "/v1/chat/completions", headers=headers, json=body)

        async def observe() -> None:
            nonlocal first_ask, crossing
            while crossing is None:
                await asyncio.sleep(0.5)
                t = time.monotonic() - started
                view = (await c.get(base + "/v1/fleet",
                                    headers={"Authorization": f"Bearer {admin}"})).json()
                model = view["models"][MODEL]
                occupancy = max(r["kv_occupancy"] for r in view["replicas"])
                desired = model["desired_replicas"] or 0
                terms = model["terms"] or {}
                samples.append({
                    "t": round(t, 1), "desired": desired, "max_occupancy": occupancy,
                    "occupancies": [r["kv_occupancy"] for r in view["replicas"]],
                    "waiting": [r["waiting"] for r in view["replicas"]],
                    "held_tokens": terms.get("held_tokens"),
                    "forecast_tokens": terms.get("forecast_tokens"),
                    "trend_tokens_per_s": terms.get("trend_tokens_per_s"),
                    "rate": start_rate + slope * t,
                })
                if first_ask is None and desired > 2:
                    first_ask = t
                if occupancy >= 0.85:
                    crossing = t

        watcher = asyncio.ensure_future(observe())
        while crossing is None and time.monotonic() - started < limit_s:
            t = time.monotonic() - started
            await asyncio.sleep(rng.expovariate(start_rate + slope * t))
            task = asyncio.ensure_future(one())
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        watcher.cancel()
        for task in list(tasks):
            task.cancel()
    return {"first_ask_s": first_ask, "crossing_s": crossing, "samples": samples}


def ramp_lead(work: Path, cold_start_s: float, slope: float) -> dict[str, Any]:
    data = work / "ramp" / "data"
    data.mkdir(parents=True)
    proc, base, keys = serve(data, "--model", MODEL, "--simulated-replicas", "2",
                             "--sim-gpu-blocks", "2048", "--sim-max-seqs", "512",
                             "--cold-start-s", str(cold_start_s))
    try:
        cli(data, "limits", "set", "--tenant", "demo-enterprise", "--model", "*",
            "--rpm", "10000000", "--tpm", "1000000000", "--kv-seconds", "100000000")
        admin = cli(data, "keys", "issue", "--tenant", "tollgate-ops", "--scope", "admin")
        admin = admin.strip().splitlines()[-1]
        time.sleep(1.5)
        result = asyncio.run(
            _ramp(base, keys["demo-enterprise"], admin, 1.0, slope, limit_s=600)
        )
    finally:
        stop(proc)
    ask, cross = result["first_ask_s"], result["crossing_s"]
    lead = None if ask is None or cross is None else round(cross - ask, 1)
    return {
        "cold_start_s": cold_start_s,
        "slope_requests_per_s2": slope,
        "first_ask_s": ask,
        "crossing_085_s": cross,
        "lead_s": lead,
        "target_lead_s": cold_start_s,
        "met": None if lead is None else lead >= cold_start_s,
        "samples_every_5th": result["samples"][::5],  # the whole series every 2.5 s
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--only", choices=("mix", "ramp"), default=None)
    ap.add_argument("--mix-seconds", type=float, default=60)
    ap.add_argument("--mix-rate", type=float, default=6)
    ap.add_argument("--cold-start-s", type=float, default=20)
    ap.add_argument("--slope", type=float, default=0.1, help="arrivals added per second, per s")
    args = ap.parse_args(argv)
    if args.quick:
        args.mix_seconds = 20
    work = Path(tempfile.mkdtemp(prefix="tollgate-bench-fleet-"))
    result = {
        "benchmark": "fleet_ops",
        "command": "python -m bench.fleet_ops " + " ".join(sys.argv[1:] if argv is None else argv),
        "goodput_mix": (goodput_under_mix(work, args.mix_seconds, args.mix_rate)
                        if args.only != "ramp" else None),
        "ramp": ramp_lead(work, args.cold_start_s, args.slope) if args.only != "mix" else None,
        "logs": str(work),
    }
    write_result(RESULTS, result)
    if result["ramp"]:
        print(json.dumps({k: v for k, v in result["ramp"].items() if "samples" not in k}, indent=2))
    print(json.dumps(result["goodput_mix"], indent=2))


if __name__ == "__main__":
    main()
