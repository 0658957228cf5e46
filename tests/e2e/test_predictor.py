"""Learned output-length reservations end to end: traffic generated through a real server and
simulated replicas, a model trained on its log (torch), judged on the held-out slice, then
loaded by a restarted server, whose admissions reserve the prediction and record its version
while the engine is still asked for the client's max_tokens."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx
import pytest

from tests.e2e.conftest import (
    FAST,
    MODEL,
    Server,
    auth,
    poll,
    running_server,
)  # fmt: skip

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Server, dict]]:
    with running_server(tmp_path_factory, "predictor", [(MODEL, FAST), (MODEL, FAST)]) as server:
        # 900 requests at 30/s, on a shared machine: longer than the CLI's default wait.
        out = server.cli(
            "predictor", "generate", "--url", server.base, "--requests", "900", "--rate", "30",
            "--seed", "5", "--model", MODEL, timeout=600,
        )  # fmt: skip
        # Some may meet a full fleet (503): what was admitted is what the model learns from.
        answered = int(out.split("200: ")[1].split(",")[0].split("}")[0])
        assert "sent 900" in out and answered >= 700, out
        server.wait_all_billed()
        trained = server.cli(
            "predictor", "train", "--out", str(server.data_dir / "predictor"), "--holdout",
            "0.15", "--min-calibration", "20", "--max-seconds", "60",
        )  # fmt: skip
        assert "tenants predicted" in trained, trained
        status = json.loads(server.cli("predictor", "status", "--json"))
        yield server, status


def test_training_writes_a_model_that_knows_each_generated_tenant(
    trained: tuple[Server, dict],
) -> None:
    _, status = trained
    assert status["model"].startswith("op-") and status["quantile"] == 0.95
    assert status["training"]["loss"] == "pinball"
    offsets = {t: row["offset"] for t, row in status["tenants"].items()}
    assert {"gen-chat", "gen-summarisation"} <= {t for t, o in offsets.items() if o is not None}


def test_evaluation_replays_the_held_out_slice_with_each_policy(
    trained: tuple[Server, dict],
) -> None:
    server, status = trained
    result = json.loads(server.cli("predictor", "evaluate", "--json", "--tpm-per-offered", "1.0"))
    assert result["model_version"] == status["model"]
    assert result["slice"]["requests"] > 50
    cap, predicted = result["policies"]["max_tokens"], result["policies"]["predicted"]
    assert cap["reserved_per_actual"] > 5  # every client asked for 4,096
    assert predicted["reserved_per_actual"] < cap["reserved_per_actual"] / 2
    assert predicted["predicted"] > 0 and predicted["coverage"] is not None


def test_a_restarted_server_reserves_the_prediction_and_records_its_version(
    trained: tuple[Server, dict],
) -> None:
    server, status = trained
    server.stop()
    server.start()  # loads the newest model in data/predictor, history warmed from the log
    out = server.cli("keys", "issue", "--tenant", "gen-chat").strip().splitlines()
    secret = out[-1].strip()
    server.wait_key(secret)
    body = {
        "model": MODEL, "max_tokens": 4096,
        "messages": [{"role": "user", "content": "tell me. Answer in about 50 words."}],
    }  # fmt: skip
    r = httpx.post(f"{server.base}/v1/chat/completions", json=body, headers=auth(secret),
                   timeout=30)  # fmt: skip
    assert r.status_code == 200, r.text
    rid = r.headers["x-request-id"]
    estimated = server.wait_event(rid, "RequestEstimated")
    assert estimated["predictor_version"] == status["model"]
    assert estimated["output_cap_tokens"] == 4096
    assert estimated["reserved_output_tokens"] < 4096
    assert estimated["message_count"] == 1 and estimated["system_prompt_bucket"] == -1
    done = server.wait_event(rid, "QuotaRefunded")
    assert done["refunded_tokens"] >= 0

    def predicted() -> float:
        text = httpx.get(f"{server.base}/metrics", timeout=5).text
        return sum(
            float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith('tollgate_output_predicted_total{tenant="gen-chat"}')
        )  # fmt: skip

    assert poll("the prediction counted", predicted) >= 1
