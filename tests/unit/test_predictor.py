"""`predictor/` over an event log in memory (tests/fakes.py): training is reproducible and
calibrated per tenant, the model file round-trips and is refused when it is not one, the
replay compares the reservation policies on the same slice, and the edge's predictor learns
its history from the log."""

from __future__ import annotations

import json
import math
import random
import subprocess
import sys
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

import pytest

from tests import builders as b
from tests.fakes import InMemoryEventStore
from tollgate_llm.domain.control_plane.state import ControlView
from tollgate_llm.domain.prediction import Prediction
from tollgate_llm.domain.requests.events import (
    TERMINAL_EVENTS,
    TERMINAL_STATUS_OF,
    QuotaRefunded,
    RequestAdmitted,
    RequestCancelled,
    RequestCompleted,
    RequestEstimated,
    RequestPreempted,
    RequestRouted,
)
from tollgate_llm.ledger.store import NewEvent
from tollgate_llm.predictor import dataset, model_file
from tollgate_llm.predictor.dataset import examples, read_requests
from tollgate_llm.predictor.evaluate import Replay, evaluate, held_out, run
from tollgate_llm.predictor.runtime import LoadedPredictor
from tollgate_llm.predictor.status import realised
from tollgate_llm.predictor.train import NotEnoughData, TrainConfig, train

MODEL = b.MODEL
CAP = 4096
FAST = TrainConfig(max_epochs=40, max_seconds=60)


def synthetic_log(n: int = 1500, seed: int = 3) -> InMemoryEventStore:
    """Three tenants, every request asking max_tokens=4096: `chat` answers ~100 tokens; `docs`
    answers by its system prompt (bucket 0 about 50, bucket 1 about 400); `tiny` sends too few
    requests to be calibrated. Ten arrivals a second; 5 % of `chat` is cancelled halfway."""
    rng = random.Random(seed)
    store = InMemoryEventStore()
    timeline: list[tuple[float, int, list[NewEvent]]] = []
    for i in range(n):
        tenant = "tiny" if i % 50 == 0 else ("chat" if i % 2 else "docs")
        bucket = rng.randrange(2) if tenant == "docs" else 3
        median = 400 if (tenant == "docs" and bucket == 1) else (50 if tenant == "docs" else 100)
        out = max(1, round(median * math.exp(rng.gauss(0, 0.3))))
        prompt = rng.randint(50, 600)
        start = i * 0.1
        end = start + 0.05 * out  # 50 ms per output token
        rid = f"req_{i:032x}"
        at0, at1 = b.at(start), b.at(end)
        cancelled = tenant == "chat" and rng.random() < 0.05
        produced = out // 2 if cancelled else out
        admit = [
            RequestAdmitted(rid, tenant, f"key-{tenant}", MODEL, "standard", "edge-1"),
            RequestEstimated(rid, prompt, CAP, prompt + CAP, 1, 40_000, CAP, "", 2, bucket),
            RequestRouted(rid, "replica-1", 100_000),
        ]
        terminal = (
            RequestCancelled(rid, prompt, produced, 0, "client_disconnected", True)
            if cancelled
            else RequestCompleted(rid, prompt, produced, 0, "stop", 100, 20_000)
        )
        refund = QuotaRefunded(rid, max(0, CAP - produced), 1, produced + prompt)
        timeline.append((start, 0, [NewEvent(f"{rid}-{k}", rid, tenant, at0, e)
                                    for k, e in enumerate(admit)]))
        timeline.append((end, 1, [NewEvent(f"{rid}-{k + 3}", rid, tenant, at1, e)
                                  for k, e in enumerate((terminal, refund))]))
    versions: dict[str, int] = {}
    for _, _, batch in sorted(timeline, key=lambda t: (t[0], t[1])):
        rid = batch[0].stream_id
        store.append(rid, versions.get(rid, 0), batch)
        versions[rid] = versions.get(rid, 0) + len(batch)
    return store


def tenants() -> ControlView:
    view = ControlView()
    for name in ("chat", "docs", "tiny"):
        registered = b.tenant_registered(tenant_id=name, name=name)
        view.apply(b.record(registered, seconds=-60, stream_id=f"tenant-{name}"))
    return view


@pytest.fixture(scope="module")
def log() -> InMemoryEventStore:
    return synthetic_log()


@pytest.fixture(scope="module")
def trained(log: InMemoryEventStore) -> model_file.ModelFile:
    return train(log, FAST, now=b.at(10_000))


def test_the_log_is_read_with_the_shape_admission_saw(log: InMemoryEventStore) -> None:
    requests = read_requests(log)
    assert len(requests) == 1500
    first = requests[1]
    assert (first.shape.tenant_id, first.shape.output_cap_tokens, first.shape.message_count) == (
        "chat", CAP, 2,
    )
    assert {q.terminal for q in requests} == {"completed", "cancelled"}
    found = examples(requests, 20)
    # a tenant's first 20 answers are its history, not examples: `tiny` has 30 in all
    assert len(found) < len(requests)
    assert sum(e.tenant_id == "tiny" for e in found) == 10
    assert any(e.censored for e in found)


def test_every_terminal_event_ends_a_logged_request() -> None:
    """Issue 28: the predictor's reader listed four of the five terminal events; a preempted
    flex request never ended in its data. Now it reads domain.registry' one list, and a preempted
    request ends (and, stopped by us, is no example)."""
    assert dataset.TERMINAL_STATUS_OF is TERMINAL_STATUS_OF
    assert dataset.TERMINAL_EVENTS is TERMINAL_EVENTS
    store = InMemoryEventStore()
    rid = f"req_{1:032x}"
    events = [
        RequestAdmitted(rid, "chat", "key-chat", MODEL, "standard", "edge-1"),
        RequestEstimated(rid, 100, CAP, 100 + CAP, 1, 40_000, CAP, "", 2, 3),
        RequestRouted(rid, "replica-1", 100_000),
        RequestPreempted(rid, 100, 17, 0, "replica-1", "req_other"),
    ]
    store.append(rid, 0, [NewEvent(f"{rid}-{k}", rid, "chat", b.at(k), e)
                          for k, e in enumerate(events)])  # fmt: skip
    (logged,) = read_requests(store)
    assert (logged.terminal, logged.completion_tokens) == ("preempted", 17)
    assert examples([logged], 0) == []


def test_training_is_reproducible_and_calibrated_per_tenant(
    log: InMemoryEventStore, trained: model_file.ModelFile
) -> None:
    again = train(log, FAST, now=b.at(10_000))
    assert again.version == trained.version and again.model == trained.model
    assert set(trained.model.tenant_offsets) == {"chat", "docs"}  # not `tiny`: too few
    assert trained.holdout_from is not None and trained.window_to < trained.holdout_from
    other_seed = train(log, replace(FAST, seed=1), now=b.at(10_000))
    assert other_seed.version != trained.version


def test_too_little_data_is_said_not_trained() -> None:
    with pytest.raises(NotEnoughData, match="usable requests"):
        train(synthetic_log(60), FAST)


def test_the_model_file_round_trips_and_a_foreign_file_is_refused(
    trained: model_file.ModelFile, tmp_path: Path
) -> None:
    path = model_file.save(trained, tmp_path)
    assert path.name == f"output-predictor-{trained.version}.json"
    assert model_file.load(path) == trained
    assert model_file.latest(tmp_path) == path
    data = json.loads(path.read_text())
    assert data["format"] == "tollgate-output-predictor" and data["format_version"] == 2
    assert set(data["tenant_scales"]) == set(data["tenant_offsets"])
    # A version-1 file (before per-tenant scales) is read, every tenant at scale 1.
    v1 = {k: v for k, v in data.items() if k != "tenant_scales"}
    (tmp_path / "v1.json").write_text(json.dumps({**v1, "format_version": 1}))
    old = model_file.load(tmp_path / "v1.json")
    assert old.model.tenant_scales == {}
    assert old.model.tenant_offsets == trained.model.tenant_offsets
    for broken, why in (
        ({**data, "format": "other"}, "not a tollgate-output-predictor"),
        ({**data, "format_version": 9}, "format_version 9"),
        ({**data, "layers": [{"weights": [[1.0]], "bias": [0.0]}]}, "inputs"),
        ({k: v for k, v in data.items() if k != "window"}, "malformed"),
    ):
        bad = tmp_path / "bad.json"
        bad.write_text(json.dumps(broken))
        with pytest.raises((model_file.ModelFileError, ValueError), match=why):
            model_file.load(bad)


def test_the_replay_reserves_less_refuses_less_and_covers_the_quantile(
    log: InMemoryEventStore, trained: model_file.ModelFile
) -> None:
    requests = read_requests(log)
    before, sliced = held_out(requests, trained)
    assert sliced and before and all(q.shape.at >= trained.holdout_from for q in sliced)
    # The slice is 30 s and starts with full buckets: tokens/min at half of what each tenant
    # used per minute still lets it all through when charged exactly (the oracle), not when
    # every request holds its 4,096-token cap while it runs.
    replay = Replay(sliced, before, tenants(), time_scale=1.0, tpm_per_offered=0.5)
    result = evaluate(replay, trained)
    cap, predicted, oracle = (result["policies"][p] for p in ("max_tokens", "predicted", "oracle"))
    assert cap["reserved_per_actual"] > 10 and predicted["reserved_per_actual"] < 3
    assert oracle["false_refusals"]["tokens"] == 0
    assert cap["false_refusals"]["tokens"] > predicted["false_refusals"]["tokens"]
    assert cap["peak_over_admission"] == 0.0  # reserving the cap never over-admits
    assert 0.85 <= predicted["coverage"] <= 1.0
    assert predicted["fallbacks"].get("unknown_tenant", 0) > 0  # `tiny` reserved its cap


def test_the_oracle_reserves_exactly_what_was_produced(
    log: InMemoryEventStore, trained: model_file.ModelFile
) -> None:
    before, sliced = held_out(read_requests(log), trained)
    replay = Replay(sliced, before, tenants(), limits_override={"tpm": 10**9})
    outcome = run(replay, "oracle")
    assert outcome.reserved_per_actual == pytest.approx(1.0, abs=0.01)
    assert outcome.refused == {}


def test_the_loaded_predictor_warms_its_history_from_the_log(
    log: InMemoryEventStore, trained: model_file.ModelFile, tmp_path: Path
) -> None:
    model_file.save(trained, tmp_path)
    loaded = LoadedPredictor.from_path(tmp_path)
    shape = read_requests(log)[-1].shape
    assert loaded.predict(shape) == "little_history"
    assert loaded.warm(log) > 1000
    answer = loaded.predict(replace(shape, at=shape.at + timedelta(seconds=1)))
    assert isinstance(answer, Prediction) and answer.model_version == trained.version
    assert answer.output_tokens < CAP
    assert not loaded.reload(tmp_path)  # the same model: nothing to do
    assert LoadedPredictor.from_path(tmp_path / "missing").predict(shape) == "no_model"


def test_status_reads_realised_coverage_from_the_log(trained: model_file.ModelFile) -> None:
    store = InMemoryEventStore()
    at = trained.trained_at + timedelta(seconds=5)
    for i, (reserved, produced) in enumerate([(100, 90), (100, 120), (100, 100), (4096, 70)]):
        rid = f"req_{i:032x}"
        version = trained.version if reserved < CAP else ""
        store.append(rid, 0, [
            NewEvent(f"{rid}-a", rid, "chat", at, RequestAdmitted(rid, "chat", "k", MODEL,
                                                                  "standard", "e")),
            NewEvent(f"{rid}-e", rid, "chat", at, RequestEstimated(
                rid, 10, reserved, 10 + reserved, 1, 40_000, CAP, version, 1, -1)),
            NewEvent(f"{rid}-c", rid, "chat", at, RequestCompleted(rid, 10, produced, 0, "stop",
                                                                   1, 1)),
        ])  # fmt: skip
    row = realised(store, trained)["chat"]
    assert (row["predicted"], row["coverage"], row["fallbacks"]) == (3, round(2 / 3, 4), 1)


def test_serving_never_imports_torch() -> None:
    code = (
        "import sys, api.http.app, api.runtime, api.services.edge, predictor.runtime, "
        "predictor.evaluate, predictor.status; print('torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=Path(__file__).resolve().parents[2], timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"


def test_the_simulated_model_answers_about_as_long_as_it_is_asked() -> None:
    from tollgate_llm.engine_adapter.simulator.chat_body import _asked_length
    from tollgate_llm.engine_adapter.simulator.engine import SimConfig, SimEngine

    ask = "some text. Answer in about 120 words."
    assert _asked_length([{"role": "user", "content": ask}]) == 120
    later = {"role": "user", "content": "hi"}
    assert _asked_length([{"role": "user", "content": ask}, later]) is None  # the last one asks
    engine = SimEngine(SimConfig(seed=1))
    eos = sorted(
        engine.submit(f"r{i}", [1, 2, 3], 4096, ignore_eos=False, priority=0, salt=None,
                      seed=None, stream=False, asked_length=200).eos_at or 0
        for i in range(400)
    )  # fmt: skip
    assert 185 <= eos[200] <= 215 and eos[20] > 120 and eos[380] < 330  # σ 0.15 around 200


def test_calibration_picks_per_tenant_how_much_to_lean_on_the_shared_score() -> None:
    """`flat`'s answers ignore the score (its best p95 is a constant: scale 0); `follows`'s
    track it exactly (scale 1). Each keeps the pair that reserves least at the same rank."""
    from tollgate_llm.domain.prediction import FEATURES, Layer
    from tollgate_llm.predictor.dataset import Example
    from tollgate_llm.predictor.train import _calibrate

    n = len(FEATURES)
    weights = [0.0] * n
    weights[0] = 1.0  # score = the first feature
    layers = (Layer((tuple(weights),), (0.0,)),)
    rng = random.Random(5)
    cap = math.log1p(CAP) / 10
    rows = []
    for i in range(400):
        x = rng.uniform(0.2, 0.6)
        feats = [x] + [0.0] * (n - 1)
        feats[FEATURES.index("log_output_cap_tokens")] = cap
        noise = rng.gauss(0.0, 0.01)
        flat = 0.4 + noise
        rows.append(Example("flat", b.at(i), feats, flat, False, None))  # type: ignore[arg-type]
        rows.append(Example("follows", b.at(i), feats, x + noise, False, None))  # type: ignore[arg-type]
    offsets, scales, tenants = _calibrate(layers, rows, rows, FAST)
    assert scales == {"flat": 0.0, "follows": 1.0}
    assert tenants["flat"]["scale"] == 0.0 and offsets["flat"] == pytest.approx(0.416, abs=0.01)
    assert offsets["follows"] == pytest.approx(0.016, abs=0.01)
