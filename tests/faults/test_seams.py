"""The seams of ledger/faults.py, in-process: each kind does what it says at a real adapter (the
SQL event store, checkpoints inside a transaction), the spec is reproducible from its seed, an
unknown seam or kind refuses to start, and the older crash points keep their meaning."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest
import sqlalchemy as sa

from tests import builders as b
from tollgate_llm.domain.cost import Estimate
from tollgate_llm.domain.requests.decide import AdmitRequest
from tollgate_llm.ledger import faults, schema
from tollgate_llm.ledger.checkpoints import Checkpoints
from tollgate_llm.ledger.engine import create_engine_from_url
from tollgate_llm.ledger.errors import StoreUnavailable
from tollgate_llm.ledger.finance import FinanceQueries
from tollgate_llm.ledger.store import NewEvent, SqlEventStore

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def armed(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The adapters' seams wrapped in this process (a process started without TOLLGATE_FAULTS
    leaves them unwrapped), disarmed afterwards."""
    monkeypatch.setenv(faults.FAULTS_ENV, "")
    for owner, method, name in (
        (SqlEventStore, "_append_many", "store.append"),
        (SqlEventStore, "_read", "store.read"),
        (SqlEventStore, "_sqlite_tail", "store.read"),
        (Checkpoints, "set", "db.checkpoint"),
        (FinanceQueries, "requests", "db.read"),
    ):
        monkeypatch.setattr(owner, method, faults.seam(name)(getattr(owner, method)))
    yield
    faults.arm("")


def test_unset_a_seam_is_the_method_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(faults.FAULTS_ENV, raising=False)

    def method() -> None: ...

    assert faults.seam("store.append")(method) is method


@pytest.fixture
def store(sqlite_url: str) -> Iterator[SqlEventStore]:
    schema.upgrade(sqlite_url)
    engine = create_engine_from_url(sqlite_url)
    yield SqlEventStore(engine)
    engine.dispose()


def _request(store: SqlEventStore) -> str:
    rid = "req_" + uuid.uuid4().hex
    at = datetime.now(UTC)
    events = b.decided(
        AdmitRequest(rid, "acme", "key-1", "m", "standard", "edge-1", Estimate(1, 1, 1, 1)),
        at=at,
    )
    store.append(rid, 0, [NewEvent(str(uuid.uuid4()), rid, "acme", at, e) for e in events])
    return rid


def test_before_raises_and_writes_nothing(store: SqlEventStore, armed: None) -> None:
    faults.arm("store.append:before@1")
    with pytest.raises(StoreUnavailable):
        _request(store)
    assert store.last_position() == 0
    _request(store)  # the 2nd hit is not armed
    assert store.last_position() > 0


def test_after_commits_then_raises(store: SqlEventStore, armed: None) -> None:
    faults.arm("store.append:after@1")
    with pytest.raises(StoreUnavailable):
        _request(store)
    assert store.last_position() > 0  # the unknown outcome: it happened


def test_after_inside_a_transaction_commits_it_then_raises(
    store: SqlEventStore, armed: None
) -> None:
    checkpoints = Checkpoints(store.engine)
    faults.arm("db.checkpoint:after@1")
    with pytest.raises(sa.exc.OperationalError), store.engine.begin() as conn:
        checkpoints.set("fold", 42, conn)
    assert checkpoints.get("fold") == 42


def test_drop_invalidates_the_connection(store: SqlEventStore, armed: None) -> None:
    checkpoints = Checkpoints(store.engine)
    faults.arm("db.checkpoint:drop@1")
    with store.engine.connect() as conn:
        with pytest.raises(sa.exc.OperationalError), conn.begin():
            checkpoints.set("fold", 7, conn)
        assert conn.invalidated
    assert checkpoints.find("fold") is None


def test_a_dropped_read_of_the_request_list_fails_whole_and_the_next_reads_again(
    store: SqlEventStore, armed: None
) -> None:
    """`db.read` (support's request list): a drop closes the pool's connections and raises the
    error the routes answer 503 for; the next read reconnects and answers."""
    from tollgate_llm.api.services.errors import store_unavailable

    finance = FinanceQueries(store.engine)
    since, until = datetime(2026, 1, 1, tzinfo=UTC), datetime(2100, 1, 1, tzinfo=UTC)
    faults.arm("db.read:drop@1")
    with pytest.raises(sa.exc.OperationalError) as failed:
        finance.requests("acme", since, until)
    answer = store_unavailable(failed.value)
    assert answer is not None and answer.status == 503
    assert finance.requests("acme", since, until) == []


def test_hang_sleeps_then_goes_on(store: SqlEventStore, armed: None) -> None:
    faults.arm("hang=0.3;store.read:hang@1")
    start = time.monotonic()
    assert store.read_all(0) == []
    assert time.monotonic() - start >= 0.3


def test_probability_is_reproducible_from_the_seed(armed: None) -> None:
    def fired(seed: int) -> list[bool]:
        faults.arm(f"seed={seed};store.append:before@p=0.3")
        return [faults._choose("store.append") is not None for _ in range(200)]

    assert fired(42) == fired(42)
    assert fired(42) != fired(43)
    assert 30 < sum(fired(42)) < 90


def test_gate_holds_the_faults_until_its_file_exists(tmp_path: Path, armed: None) -> None:
    gate = tmp_path / "armed"
    faults.arm(f"gate={gate};store.append:before@1")
    assert faults._choose("store.append") is None  # neither fires nor counts
    gate.touch()
    time.sleep(0.15)
    assert faults._choose("store.append") == "before"


@pytest.mark.parametrize(
    "spec",
    ["nowhere.append:before", "store.append:explode", "store.append:before@0",
     "store.append:before@p=1.5", "billing.after_append:before", "seed=x"],
)  # fmt: skip
def test_an_unknown_seam_kind_or_trigger_refuses_to_start(spec: str) -> None:
    with pytest.raises(ValueError, match="TOLLGATE_FAULTS"):
        faults.parse_faults(spec)
    done = subprocess.run(
        [sys.executable, "-c", "import tollgate_llm.ledger.faults"], cwd=ROOT, capture_output=True,
        env={**os.environ, "PYTHONPATH": str(ROOT), "TOLLGATE_FAULTS": spec},
    )  # fmt: skip
    assert done.returncode != 0 and b"TOLLGATE_FAULTS" in done.stderr


def test_die_kills_the_process_at_the_seam_and_old_points_still_work() -> None:
    script = (
        "from tollgate_llm.ledger import faults\nfaults.point('fold.after_read')\nprint('alive')"
    )
    for env in ({"TOLLGATE_FAULTS": "fold.after_read:die@1"},
                {"TOLLGATE_FAULT_POINTS": "fold.after_read"}):  # fmt: skip
        done = subprocess.run(
            [sys.executable, "-c", script], cwd=ROOT, capture_output=True,
            env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        )  # fmt: skip
        assert done.returncode == -9 and b"alive" not in done.stdout, done


def test_every_seam_is_listed_and_described() -> None:
    assert set(faults.KINDS) == {"before", "after", "hang", "drop", "die"}
    for name, (description, family) in faults.SEAMS.items():
        assert description and family in ("store", "db", "broker", "engine"), name
