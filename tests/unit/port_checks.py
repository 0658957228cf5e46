"""The edge's ports held to their implementations under mypy: each function below only type
checks while its argument satisfies the port it returns, so an adapter or a fake that drifts
from its port (a renamed method, a parameter more, another return type) fails
`mypy tests/unit/port_checks.py` (`tests/unit/test_port_checks.py` runs it). Nothing here runs.
"""

from __future__ import annotations

from tests.fakes import (
    FakeClock,
    FakeFleet,
    FakeIdempotency,
    FakePredictor,
    FakeReplica,
    FakeSink,
    FixedTokens,
)
from tollgate_llm.api import ports
from tollgate_llm.api.services.idempotency_service import AsyncIdempotency
from tollgate_llm.engine_adapter.estimators import WordTokenEstimator
from tollgate_llm.engine_adapter.fleet import Fleet, ScrapedReplica
from tollgate_llm.engine_adapter.tokenizers import ChatTemplateEstimator
from tollgate_llm.engine_adapter.vllm_http import VLLMReplica
from tollgate_llm.ledger.commits import LoopCommits
from tollgate_llm.ledger.ids import new_event_id, utcnow
from tollgate_llm.predictor.runtime import LoadedPredictor

# --- the adapters the composition root (api/runtime.py) injects


def fleet(adapter: Fleet) -> ports.Fleet:
    return adapter


def replica(adapter: VLLMReplica) -> ports.Replica:
    return adapter


def scraped_replica(adapter: VLLMReplica) -> ScrapedReplica:
    return adapter


def tokens(adapter: WordTokenEstimator) -> ports.TokenEstimator:
    return adapter


def model_tokens(adapter: ChatTemplateEstimator) -> ports.TokenEstimator:
    return adapter


def predictor(adapter: LoadedPredictor) -> ports.OutputPredictor:
    return adapter


def events(adapter: LoopCommits) -> ports.EventSink:
    return adapter


def idempotency(adapter: AsyncIdempotency) -> ports.Idempotency:
    return adapter


CLOCK: ports.Clock = utcnow
NEW_ID: ports.IdSource = new_event_id

# --- the fakes tests/unit/test_edge.py injects instead


def fake_fleet(fake: FakeFleet) -> ports.Fleet:
    return fake


def fake_replica(fake: FakeReplica) -> ports.Replica:
    return fake


def fake_tokens(fake: FixedTokens) -> ports.TokenEstimator:
    return fake


def fake_predictor(fake: FakePredictor) -> ports.OutputPredictor:
    return fake


def fake_events(fake: FakeSink) -> ports.EventSink:
    return fake


def fake_idempotency(fake: FakeIdempotency) -> ports.Idempotency:
    return fake


def fake_clock(fake: FakeClock) -> ports.Clock:
    return fake
