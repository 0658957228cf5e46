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
        [--train-seeds 0,1,2] [--tpm-per-offered 1.0,1.5] [--sim-speed 20] [--quantiles 0.95,0.85]

Steps 2 runs for a model of each of `--quantiles` (the first, the default's, in the main
tables; each other one judged against the same targets), beside the bound the generator's own
distributions set at that quantile (`_generator_ceiling`).

Writes bench/results/output_prediction.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx

from bench.common import RESULTS_DIR, ROOT, free_port, write_result

RESULTS = RESULTS_DIR / "output_prediction.json"
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
    from tollgate_llm.predictor.runtime import LoadedPredictor

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
    ap.add_argument(
        "--quantiles", default="0.95,0.85",
        help="the quantiles models are trained at: the first is the default's (its tables come "
        "first), each other one is judged against the same targets",
    )  # fmt: skip
    ap.add_argument("--data", default=None,
                    help="keep the generated log here; an existing one is reused, not regenerated")
    args = ap.parse_args()
    if args.quick:
        args.requests, args.train_seeds = min(args.requests, 3_000), "0"
    from tollgate_llm.domain.prediction import Prediction  # noqa: F401 - fail early without the package
    from tollgate_llm.ledger.control import ControlLog
    from tollgate_llm.ledger.store import SqlEventStore, create_engine_from_url
    from tollgate_llm.predictor.dataset import read_requests
    from tollgate_llm.predictor.evaluate import Replay, evaluate, held_out
    from tollgate_llm.predictor.train import TrainConfig, train

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
        quantiles = [float(q) for q in args.quantiles.split(",")]
        judged: dict[float, dict[str, Any]] = {}
        models = []
        for quantile in quantiles:
            per_seed: dict[str, list[dict[str, Any]]] = {}
            kv_runs: list[dict[str, Any]] = []
            for seed in (int(s) for s in args.train_seeds.split(",")):
                mf = train(store, TrainConfig(quantile=quantile, seed=seed))
                if quantile == quantiles[0]:
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
                print(f"p{quantile} seed {seed}: {mf.version}, {mf.training}", flush=True)
            judged[quantile] = {
                "quantile": quantile,
                "by_tpm_per_offered": {x: summarise(runs) for x, runs in per_seed.items()},
                "kv_cap": summarise(kv_runs),
                "generator_ceiling": _generator_ceiling(quantile=quantile)["observable"],
            }
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
        "by_tpm_per_offered": judged[quantiles[0]]["by_tpm_per_offered"],
        "kv_cap": judged[quantiles[0]]["kv_cap"],
        # The same judged for models trained at the other quantiles.
        "other_quantiles": [judged[q] for q in quantiles[1:]],
        "ceiling": ceiling(requests),
        "inference": timing, "targets": TARGETS,
    }  # fmt: skip
    write_result(RESULTS, result)
    print(json.dumps(result, indent=2))


def _p95(values: list[int], q: float = 0.95) -> float:
    """The empirical `q` quantile (linear interpolation, as numpy's default)."""
    v = sorted(values)
    pos = q * (len(v) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def ceiling(requests: list[Any], bin_size: int = 200) -> dict[str, Any]:
    """What an ideal p95 reservation could reach with the shape's features: every completed
    request of the log reserves the empirical p95 of its group, for finer and finer groups of
    what admission knows: the tenant; the tenant and its system-prompt bucket; and those with
    the prompt size (equal-count bins of `bin_size` requests within each bucket). In-sample, so
    each group's coverage is its p95 by construction: a lower bound on reserved/actual for any
    p95 predictor with these features (a finer grouping would fit noise). Per tenant and
    overall: Σ reserved / Σ produced."""
    done = [q for q in requests if q.terminal == "completed"]
    groupings = {
        "tenant": lambda q: (),
        "tenant_bucket": lambda q: (q.shape.system_prompt_bucket,),
    }
    out: dict[str, Any] = {"completed_requests": len(done), "bin_size": bin_size}

    def ratio(groups: dict[Any, list[Any]]) -> dict[str, Any]:
        reserved: dict[str, float] = {}
        produced: dict[str, int] = {}
        for members in groups.values():
            p = _p95([q.completion_tokens for q in members])
            t = members[0].shape.tenant_id
            reserved[t] = reserved.get(t, 0.0) + p * len(members)
            produced[t] = produced.get(t, 0) + sum(q.completion_tokens for q in members)
        return {
            "overall": round(sum(reserved.values()) / max(1, sum(produced.values())), 3),
            "by_tenant": {t: round(reserved[t] / max(1, produced[t]), 3) for t in sorted(reserved)},
        }

    for name, key in groupings.items():
        groups: dict[Any, list[Any]] = {}
        for q in done:
            groups.setdefault((q.shape.tenant_id, *key(q)), []).append(q)
        out[name] = ratio(groups)
    by_bucket: dict[Any, list[Any]] = {}
    for q in done:
        by_bucket.setdefault((q.shape.tenant_id, q.shape.system_prompt_bucket), []).append(q)
    binned: dict[Any, list[Any]] = {}
    for k, members in by_bucket.items():
        members.sort(key=lambda q: q.shape.prompt_tokens)
        bins = max(1, len(members) // bin_size)
        for i, q in enumerate(members):
            binned.setdefault((*k, i * bins // len(members)), []).append(q)
    out["tenant_bucket_prompt"] = ratio(binned)
    out["generator_latent"] = _generator_ceiling()
    return out


def _generator_ceiling(
    draws: int = 100_000, seed: int = 1, quantile: float = 0.95
) -> dict[str, Any]:
    """The same from the generator's own distributions (predictor/generate.py and the simulated
    model's σ 0.15 following), at `quantile`, by drawing requests: `observable` conditions on
    what a shape tells (the assistant of a chat, the document of a summary; nothing for an
    agent's step), `asked_length` on the length the prompt text asks for, which no feature
    carries (σ 0.15 alone)."""
    import math
    import random

    from tollgate_llm.predictor.generate import SHARES, plan_request

    rng, follow = random.Random(seed), random.Random(seed + 1)
    kinds = list(SHARES)
    weights = [SHARES[k] for k in kinds]
    rows = []
    for _ in range(draws):
        kind = rng.choices(kinds, weights)[0]
        p = plan_request(kind, rng)
        out = max(1, round(follow.lognormvariate(math.log(max(1, p.asked_tokens)), 0.15)))
        shown: tuple[Any, ...] = (p.messages[0]["content"][:40],)
        if kind == "summarisation":  # the document's size, in 2.5 % bins of its words
            shown += (int(40 * math.log(len(p.messages[-1]["content"].split()))),)
        rows.append((kind, shown, out))

    def ratio(key: Any) -> dict[str, Any]:
        groups: dict[Any, list[int]] = {}
        for r in rows:
            groups.setdefault((r[0], key(r)), []).append(r[2])
        reserved: dict[str, float] = {}
        produced: dict[str, int] = {}
        for (kind, _), outs in groups.items():
            reserved[kind] = reserved.get(kind, 0.0) + _p95(outs, quantile) * len(outs)
            produced[kind] = produced.get(kind, 0) + sum(outs)
        return {
            "overall": round(sum(reserved.values()) / sum(produced.values()), 3),
            "by_kind": {k: round(reserved[k] / produced[k], 3) for k in kinds},
        }

    # Knowing the asked length leaves only the simulated model's lognormal σ 0.15: the quantile
    # / mean = e^(z σ − σ²/2) (z = 1.645 at p95), whatever the length.
    sigma, z = 0.15, statistics.NormalDist().inv_cdf(quantile)
    return {"draws": draws, "seed": seed, "quantile": quantile,
            "observable": ratio(lambda r: r[1]),
            "asked_length": round(math.exp(z * sigma - sigma * sigma / 2), 3)}  # fmt: skip


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
            "coverage_by_tenant": {
                t: med(policy, "by_tenant", t, "coverage")
                for t in runs[0]["policies"][policy]["by_tenant"]
            },
            "peak_over_admission_by_tenant": {
                t: med(policy, "peak_over_admission_by_tenant", t)
                for t in runs[0]["policies"][policy]["peak_over_admission_by_tenant"]
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
