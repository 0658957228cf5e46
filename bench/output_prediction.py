"""Learned output-length reservations (issue 18), on traffic generated through the real path:

1. `tollgate serve` with simulated replicas running `--sim-speed` times faster than real
   (and no predictor: the log is recorded under today's rule), and
   `tollgate predictor generate` (predictor/generate.py: chat, summarisation, long-tailed
   agents, every client asking max_tokens=4096) against it, seeded.
2. For each training seed: `predictor.train` (p95, the latest 20 % of requests held out) and
   `predictor.evaluate` on the held-out slice, its time stretched back by `--sim-speed`, with
   max_tokens, the model and an oracle, in two settings, one limit binding in each:
   tokens/min = X × each tenant's own offered tokens/min (X from `--tpm-per-offered`) with no
   KV cap to speak of; and a 256 GiB·s concurrent KV cap (the free plan's) with no tokens/min
   limit to speak of.
3. Inference: `LoadedPredictor.predict` (what admission calls), its history warmed from the log,
   timed call by call over the held-out requests' shapes; p50 / p99 per run.

Figures are medians over the training seeds (evaluation) and the runs (inference).

    python -m bench.output_prediction [--quick] [--requests 12000] [--rate 30] [--seed 1]
        [--train-seeds 0,1,2] [--tpm-per-offered 1.0,1.5] [--sim-speed 20]

Writes bench/results/output_prediction.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results" / "output_prediction.json"
TOLLGATE = str(Path(sys.executable).with_name("tollgate"))
MODEL = "llama-3.1-8b-2026-05"
KV_GIB_SECONDS = 256
UNBOUND = 10**9  # a limit that never binds, for the setting where the other one does
TARGETS = {
    "reserved_per_actual_max": 1.5,
    "reserved_per_actual_with_max_tokens_min": 10.0,
    "coverage_within_points": 2.0,
    "false_token_429_reduction_min": 5.0,
    "peak_over_admission_max": 0.05,
    "inference_p99_us_max": 20.0,
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def generate(data: Path, requests: int, rate: float, seed: int, speed: float) -> dict[str, Any]:
    port = free_port()
    env = {**os.environ, "TOLLGATE_DATA_DIR": str(data)}
    env.pop("TOLLGATE_DATABASE_URL", None)
    log = open(data.parent / "serve.log", "wb")  # noqa: SIM115 - the process keeps it
    proc = subprocess.Popen(
        [TOLLGATE, "serve", "--port", str(port), "--model", MODEL, "--simulated-replicas", "3",
         "--sim-speed", str(speed), "--no-predictor"],
        env=env, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
    )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"tollgate serve did not start (see {data.parent}/serve.log)")
            try:
                if httpx.get(f"{base}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        started = time.monotonic()
        done = subprocess.run(
            [TOLLGATE, "predictor", "generate", "--url", base, "--requests", str(requests),
             "--rate", str(rate), "--seed", str(seed), "--model", MODEL],
            env=env, cwd=ROOT, capture_output=True, text=True, check=True,
        )  # fmt: skip
        print(done.stdout, flush=True)
        return {"output": done.stdout.strip().splitlines(),
                "seconds": round(time.monotonic() - started, 1)}  # fmt: skip
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()


def inference(store: Any, mf: Any, shapes: list[Any], runs: int, calls: int) -> dict[str, Any]:
    from predictor.runtime import LoadedPredictor

    loaded = LoadedPredictor(mf)
    loaded.warm(store)
    # As `tollgate serve` runs the edge (api/serve.py): start-up objects frozen out of the
    # collector, full collections rarer.
    gc.collect()
    gc.freeze()
    gc.set_threshold(700, 10, 1000)
    clock = time.perf_counter_ns
    p50s, p99s, predicted = [], [], 0
    for _ in range(runs):
        samples = []
        predict = loaded.predict
        for i in range(calls):
            shape = shapes[i % len(shapes)]
            t0 = clock()
            answer = predict(shape)
            samples.append(clock() - t0)
            predicted += not isinstance(answer, str)
        samples.sort()
        p50s.append(samples[len(samples) // 2] / 1000)
        p99s.append(samples[int(len(samples) * 0.99)] / 1000)
    return {
        "runs": runs, "calls_per_run": calls,
        "predicted_share": round(predicted / (runs * calls), 3),
        "p50_us_runs": [round(v, 2) for v in p50s], "p99_us_runs": [round(v, 2) for v in p99s],
        "p50_us_median": round(statistics.median(p50s), 2),
        "p99_us_median": round(statistics.median(p99s), 2),
    }  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--requests", type=int, default=12_000)
    ap.add_argument("--rate", type=float, default=30.0)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--train-seeds", default="0,1,2")
    ap.add_argument("--tpm-per-offered", default="1.0,1.25,1.5,2.0")
    ap.add_argument("--sim-speed", type=float, default=20.0)
    ap.add_argument("--data", default=None,
                    help="keep the generated log here; an existing one is reused, not regenerated")
    args = ap.parse_args()
    if args.quick:
        args.requests, args.train_seeds = min(args.requests, 3_000), "0"
    from domain.prediction import Prediction  # noqa: F401 - fail early without the package
    from ledger.control import ControlLog
    from ledger.store import SqlEventStore, create_engine_from_url
    from predictor.dataset import read_requests
    from predictor.evaluate import Replay, evaluate, held_out
    from predictor.train import TrainConfig, train

    with tempfile.TemporaryDirectory(prefix="tollgate-bench-pred-") as tmp:
        data = Path(args.data) if args.data else Path(tmp) / "data"
        data.mkdir(parents=True, exist_ok=True)
        record = data / "generation.json"
        if (data / "tollgate.db").exists() and args.data:
            generation = json.loads(record.read_text())  # what made the log being reused
        else:
            generation = generate(data, args.requests, args.rate, args.seed, args.sim_speed)
            generation.update(requests=args.requests, rate_per_s=args.rate, seed=args.seed,
                              sim_speed=args.sim_speed)  # fmt: skip
            record.write_text(json.dumps(generation, indent=2))
        engine = create_engine_from_url(f"sqlite:///{data / 'tollgate.db'}")
        store = SqlEventStore(engine)
        requests = read_requests(store)
        control = ControlLog(store).view
        per_seed: dict[str, list[dict[str, Any]]] = {}
        kv_runs: list[dict[str, Any]] = []
        models = []
        for seed in (int(s) for s in args.train_seeds.split(",")):
            mf = train(store, TrainConfig(seed=seed))
            models.append(mf)
            before, sliced = held_out(requests, mf)
            for x in args.tpm_per_offered.split(","):
                replay = Replay(sliced, before, control, {"kv_gib_seconds": UNBOUND},
                                generation["sim_speed"], float(x))  # fmt: skip
                per_seed.setdefault(x, []).append(evaluate(replay, mf))
            replay = Replay(sliced, before, control,
                            {"kv_gib_seconds": KV_GIB_SECONDS, "tpm": UNBOUND},
                            generation["sim_speed"])  # fmt: skip
            kv_runs.append(evaluate(replay, mf))
            print(f"seed {seed}: {mf.version}, {mf.training}", flush=True)
        first = models[0]
        _, sliced = held_out(requests, first)
        shapes = [replace(q.shape) for q in sliced]
        timing = inference(store, first, shapes, runs=5, calls=20_000 if args.quick else 100_000)
        engine.dispose()

    result = {
        "generator": "predictor/generate.py", "generation_seed": generation["seed"],
        "requests_sent": generation["requests"], "rate_per_s": generation["rate_per_s"],
        "sim_speed": generation["sim_speed"], "generation": generation,
        "logged_requests": len(requests),
        "train_seeds": args.train_seeds, "quantile": first.model.quantile,
        "held_out_requests": len(sliced), "kv_gib_seconds": KV_GIB_SECONDS,
        "training_seconds": [m.training["seconds"] for m in models],
        "examples": first.examples,
        "by_tpm_per_offered": {x: summarise(runs) for x, runs in per_seed.items()},
        "kv_cap": summarise(kv_runs),
        "inference": timing, "targets": TARGETS,
    }  # fmt: skip
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the training seeds of each policy's figures."""

    def med(policy: str, *path: str) -> float | None:
        values = []
        for r in runs:
            v: Any = r["policies"][policy]
            for key in path:
                v = v.get(key) if isinstance(v, dict) else None
            if v is not None:
                values.append(v)
        return round(statistics.median(values), 4) if values else None

    out: dict[str, Any] = {"runs": len(runs), "tpm": runs[0]["slice"]["tpm"]}
    for policy in ("max_tokens", "predicted", "oracle"):
        out[policy] = {
            "admitted": med(policy, "admitted"),
            "reserved_per_actual": med(policy, "reserved_per_actual"),
            "coverage": med(policy, "coverage"),
            "refused_tokens": med(policy, "refused", "tokens") or 0,
            "false_refused_tokens": med(policy, "false_refusals", "tokens"),
            "refused_kv": med(policy, "refused", "concurrency") or 0,
            "false_refused_kv": med(policy, "false_refusals", "concurrency"),
            "peak_over_admission": med(policy, "peak_over_admission"),
            "by_tenant": {
                t: med(policy, "by_tenant", t, "reserved_per_actual")
                for t in runs[0]["policies"][policy]["by_tenant"]
            },
            "fallbacks": runs[0]["policies"][policy]["fallbacks"],
        }
    cap, model = out["max_tokens"]["false_refused_tokens"], out["predicted"]["false_refused_tokens"]
    out["false_token_429_reduction"] = (
        round(cap / model, 2) if cap is not None and model else None
    )
    return out


if __name__ == "__main__":
    main()
