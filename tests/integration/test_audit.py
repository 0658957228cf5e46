"""Issue 30, item 4 on SQLite and PostgreSQL: every control-plane change records who made it, when
and what changed (old -> new), and `tollgate audit verify` finds an event edited or deleted in
the store itself (the append-only triggers switched off, as someone with the database's owner
rights could), naming the stream and the versions."""

from __future__ import annotations

import contextlib
import getpass
import json
import socket
import threading
from collections.abc import Iterator
from datetime import UTC, datetime

import pytest
import sqlalchemy as sa

from tests.integration.test_cli import ok, one_line_error, run
from tollgate_llm.api.services.control_service import ControlService, operator
from tollgate_llm.domain.audit.events import Actor
from tollgate_llm.domain.control_plane.decide import SetLimits
from tollgate_llm.domain.control_plane.state import tenant_stream
from tollgate_llm.domain.errors import DomainError
from tollgate_llm.ledger.ids import new_event_id
from tollgate_llm.ledger.store import NewEvent, SqlEventStore

ALICE = Actor("operator", "alice")
EDIT = ("UPDATE events SET payload = replace(payload, :old, :new) "
        "WHERE stream_id = 'tenant-acme' AND stream_version = :version")  # fmt: skip


@pytest.fixture
def service(url: str) -> Iterator[ControlService]:
    with ControlService.open(url, ALICE) as opened:
        yield opened


def verify(url: str) -> tuple[int, str, str]:
    done = run("audit", "verify", url=url)
    return done.returncode, done.stdout, done.stderr


def tamper(engine: sa.Engine, sql: str, **params: object) -> None:
    """Run `sql` on the events table with its append-only guard off (and back on)."""
    with engine.begin() as conn:
        if engine.dialect.name == "postgresql":
            conn.execute(sa.text("ALTER TABLE events DISABLE TRIGGER events_no_update_delete"))
            conn.execute(sa.text(sql), params)
            conn.execute(sa.text("ALTER TABLE events ENABLE TRIGGER events_no_update_delete"))
        else:
            conn.execute(sa.text("DROP TRIGGER events_no_update"))
            conn.execute(sa.text("DROP TRIGGER events_no_delete"))
            conn.execute(sa.text(sql), params)
            for verb in ("UPDATE", "DELETE"):
                conn.execute(sa.text(
                    f"CREATE TRIGGER events_no_{verb.lower()} BEFORE {verb} ON events "
                    "BEGIN SELECT RAISE(ABORT, 'events are append-only'); END"
                ))  # fmt: skip


def a_tenant_with_history(service: ControlService) -> None:
    service.create_tenant("acme", "standard")  # versions 1, 2
    service.set_limits("acme", "*", rpm=100)  # 3, 4
    service.set_limits("acme", "*", rpm=50)  # 5, 6
    service.change_plan("acme", "enterprise")  # 7, 8


def test_each_cli_change_names_its_actor_and_each_old_and_new_value(url: str) -> None:
    ok("tenants", "create", "acme", url=url)
    ok("limits", "set", "--tenant", "acme", "--model", "*", "--rpm", "100", "--actor", "alice",
       url=url)  # fmt: skip
    done = run("limits", "set", "--tenant", "acme", "--model", "*", "--rpm", "50", url=url,
               env={"TOLLGATE_ACTOR": "bob"})  # fmt: skip
    assert done.returncode == 0, done.stderr
    # A deployment that requires an actor refuses a change without one, recording nothing
    refused = run("keys", "issue", "--tenant", "acme", url=url,
                  env={"TOLLGATE_REQUIRE_ACTOR": "true"})  # fmt: skip
    one_line_error(refused, "requires an actor", "--actor")
    assert refused.returncode == 2
    ok("keys", "issue", "--tenant", "acme", "--actor", "carol", url=url)
    records = json.loads(ok("audit", "--tenant", "acme", "--format", "json", url=url))["data"]
    assert [(r["command"], r["actor"]) for r in records] == [
        ("IssueApiKey", "carol"), ("SetLimits", "bob"), ("SetLimits", "alice"),
        ("RegisterTenant", f"{getpass.getuser()}@{socket.gethostname()}"),
    ]  # fmt: skip
    assert records[1]["changes"] == [
        {"subject": "limits model=*", "field": "rpm", "old": "100", "new": "50"}
    ]
    assert {r["actor_kind"] for r in records} == {"operator"}
    by_bob = json.loads(ok("audit", "--actor", "bob", "--format", "json", url=url))["data"]
    assert [r["command"] for r in by_bob] == ["SetLimits"]
    since = records[1]["at"]
    later = json.loads(ok("audit", "--since", since, "--format", "json", url=url))["data"]
    assert [r["command"] for r in later] == ["IssueApiKey", "SetLimits"]
    assert "limits model=*: rpm 100 -> 50" in ok("audit", "--tenant", "acme", url=url)
    code, out, err = verify(url)
    assert code == 0 and err == "" and "tenant-acme\tsealed through 8" in out, (out, err)


def test_an_edited_fact_is_found(url: str, service: ControlService) -> None:
    a_tenant_with_history(service)
    assert verify(url)[0] == 0
    # When someone raises the limit in the store itself
    tamper(service.store.engine, EDIT, version=5, old='"rpm":50', new='"rpm":5000')
    # Then verify fails, naming the stream and where
    code, _, err = verify(url)
    assert code == 1
    assert "tenant-acme: version 6: the audit record's seal does not match" in err
    assert "versions 5-6 was edited or deleted" in err
    assert len(err.strip().splitlines()) == 1  # the records after it still verify


def test_an_edited_actor_is_found(url: str, service: ControlService) -> None:
    a_tenant_with_history(service)
    # When the last record's actor is rewritten (no record follows to chain it)
    tamper(service.store.engine, EDIT, version=8, old='"alice"', new='"mallory"')
    code, _, err = verify(url)
    assert code == 1 and "tenant-acme: version 8: the audit record's seal" in err


def test_a_deleted_fact_is_found(url: str, service: ControlService) -> None:
    a_tenant_with_history(service)
    tamper(service.store.engine,
           "DELETE FROM events WHERE stream_id = 'tenant-acme' AND stream_version = 3")  # fmt: skip
    code, _, err = verify(url)
    assert code == 1
    assert "tenant-acme: version 3 missing: an event was deleted" in err
    assert "version 4: the audit record's seal does not match" in err


def test_a_deleted_audit_record_is_found(url: str, service: ControlService) -> None:
    a_tenant_with_history(service)
    # The last record gone: what it sealed is sealed by nothing
    tamper(service.store.engine,
           "DELETE FROM events WHERE stream_id = 'tenant-acme' AND stream_version = 8")  # fmt: skip
    code, _, err = verify(url)
    assert code == 1 and "tenant-acme: versions 7-7 are sealed by no audit record" in err
    # A record in the middle gone: a gap, and the next seal no longer chains
    tamper(service.store.engine,
           "DELETE FROM events WHERE stream_id = 'tenant-acme' AND stream_version = 4")  # fmt: skip
    code, _, err = verify(url)
    assert "version 4 missing" in err and "version 6: the audit record's seal" in err


def test_events_before_the_trail_are_sealed_by_the_first_record(
    url: str, service: ControlService
) -> None:
    # Given a stream written before the trail existed (no audit record)
    service.create_tenant("acme", "standard")
    store: SqlEventStore = service.store
    version = store.stream_version(tenant_stream("acme"))
    legacy = SetLimits("acme", "*", rpm=10)
    from tollgate_llm.domain.control_plane.decide import decide_control

    facts = decide_control(service.view, legacy)
    store.append(tenant_stream("acme"), version, [
        NewEvent(new_event_id(), tenant_stream("acme"), "acme", datetime.now(UTC), f)
        for f in facts
    ])  # fmt: skip
    code, _, err = verify(url)
    assert code == 1 and "versions 3-3 are sealed by no audit record" in err
    # When the next command is audited, its record seals them too, with the old value known
    with ControlService.open(url, ALICE) as fresh:
        fresh.set_limits("acme", "*", rpm=20)
    assert verify(url)[0] == 0
    last = json.loads(ok("audit", "--tenant", "acme", "--limit", "1", "--format", "json",
                         url=url))["data"][0]  # fmt: skip
    assert last["changes"] == [
        {"subject": "limits model=*", "field": "rpm", "old": "10", "new": "20"}
    ]


def test_commands_racing_on_one_stream_each_seal_the_chain(url: str) -> None:
    errors: list[BaseException] = []
    with contextlib.ExitStack() as stack:
        # Opened one after the other (each migrates the database first), then run at once.
        services = [stack.enter_context(ControlService.open(url, Actor("operator", f"op{i}")))
                    for i in range(3)]  # fmt: skip
        services[0].create_tenant("acme", "standard")

        def change(mine: ControlService, start: int) -> None:
            try:
                for rpm in range(start, start + 6):
                    while True:  # a command that kept losing the race says: run it again
                        try:
                            mine.set_limits("acme", "*", rpm=rpm)
                            break
                        except DomainError as exc:
                            if exc.rule != "concurrent_change":
                                raise
            except BaseException as exc:  # noqa: BLE001 - re-raised below
                errors.append(exc)

        threads = [threading.Thread(target=change, args=(mine, 100 * (i + 1)))
                   for i, mine in enumerate(services)]  # fmt: skip
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert errors == []
    code, out, err = verify(url)
    assert code == 0, err
    records = json.loads(ok("audit", "--tenant", "acme", "--format", "json", url=url))["data"]
    assert len(records) == 1 + 18
    # Each record's old value is the value the stream held just before it
    chain = [r["changes"][0] for r in reversed(records) if r["command"] == "SetLimits"]
    assert all(b["old"] == a["new"] for a, b in zip(chain, chain[1:], strict=False))


def test_the_cli_default_actor_is_the_os_user_at_this_host() -> None:
    assert operator(None, required=False).name == f"{getpass.getuser()}@{socket.gethostname()}"
    assert operator("ci-bot", required=True) == Actor("operator", "ci-bot")
