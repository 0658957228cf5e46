"""ledger/batches.py on SQLite and real PostgreSQL: files are the tenant's alone, expire, and
are deleted; an item's result and an output file are kept once whoever writes them twice."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from tollgate_llm.ledger.batches import BatchStore, ItemResult, StoredFile
from tollgate_llm.ledger.engine import create_engine_from_url
from tollgate_llm.ledger.schema import upgrade

NOW = datetime(2026, 12, 2, 12, 0, tzinfo=UTC)


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def store(request: pytest.FixtureRequest) -> BatchStore:
    url = request.getfixturevalue(f"{request.param}_url")
    upgrade(url)
    engine = create_engine_from_url(url)
    request.addfinalizer(engine.dispose)
    return BatchStore(engine)


def stored(file_id: str = "file-1", tenant: str = "acme", hours: float = 24) -> StoredFile:
    return StoredFile(file_id, tenant, "batch", "in.jsonl", 5, NOW, NOW + timedelta(hours=hours))


def test_a_file_is_its_tenants_alone(store: BatchStore) -> None:
    assert store.put_file(stored(), b"hello")
    assert store.content("acme", "file-1", NOW) == b"hello"
    assert store.file("acme", "file-1", NOW) == stored()
    assert store.file("other", "file-1", NOW) is None
    assert store.content("other", "file-1", NOW) is None
    assert not store.delete_file("other", "file-1")
    assert store.delete_file("acme", "file-1")
    assert store.content("acme", "file-1", NOW) is None


def test_a_file_written_twice_is_kept_once(store: BatchStore) -> None:
    assert store.put_file(stored(), b"first")
    assert not store.put_file(stored(), b"second")
    assert store.content("acme", "file-1", NOW) == b"first"


def test_expired_files_are_not_served_and_are_purged(store: BatchStore) -> None:
    store.put_file(stored("file-old", hours=1), b"old")
    store.put_file(stored("file-new", hours=48), b"new")
    later = NOW + timedelta(hours=2)
    assert store.content("acme", "file-old", later) is None
    assert store.purge_expired(later) == 1
    assert store.content("acme", "file-new", later) == b"new"
    store.set_expiry("file-new", later)
    assert store.purge_expired(later) == 1


def test_an_items_first_result_wins(store: BatchStore) -> None:
    first = ItemResult("a", "req_1", 200, b'{"x": 1}')
    assert store.put_result("batch_1", first, NOW) == first
    assert store.put_result("batch_1", ItemResult("a", "req_2", 200, b"{}"), NOW) == first
    assert store.results("batch_1") == {"a": first}
    store.delete_results("batch_1")
    assert store.results("batch_1") == {}


def test_the_registry_lists_a_tenants_batches_newest_first_and_the_open_ones(
    store: BatchStore,
) -> None:
    for i in range(5):
        store.register(f"batch_{i}", "acme" if i != 2 else "other", NOW + timedelta(seconds=i))
    assert store.batch_ids("acme", None, 2) == ["batch_4", "batch_3"]
    assert store.batch_ids("acme", "batch_3", 10) == ["batch_1", "batch_0"]
    assert store.batch_ids("acme", "batch_2", 10) == []  # another tenant's cursor
    store.mark_ended("batch_0", NOW)
    assert store.open_batches() == ["batch_1", "batch_2", "batch_3", "batch_4"]
