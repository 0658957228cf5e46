"""The `tollgate` CLI as a user runs it: a real subprocess, real databases, one-line errors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import sqlalchemy as sa

TOLLGATE = str(Path(sys.executable).with_name("tollgate"))


def run(
    *args: str, url: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [TOLLGATE, *args, "--database-url", url] if url else [TOLLGATE, *args],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, **(env or {})},
    )


def ok(*args: str, url: str) -> str:
    done = run(*args, url=url)
    assert done.returncode == 0, done.stderr
    return done.stdout


def one_line_error(done: subprocess.CompletedProcess[str], *words: str) -> None:
    assert done.returncode != 0
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr  # never a traceback
    assert "Traceback" not in done.stderr
    for word in words:
        assert word in lines[0], lines[0]


@pytest.fixture(params=["sqlite", "postgres"])
def url(request: pytest.FixtureRequest) -> str:
    return request.getfixturevalue("sqlite_url" if request.param == "sqlite" else "postgres_url")


def test_tenants_keys_limits_round_trip(url: str) -> None:
    assert "database at revision" in ok("db", "upgrade", url=url)
    ok("tenants", "create", "acme", "--plan", "standard", url=url)
    out = ok("keys", "issue", "--tenant", "acme", "--scope", "finance", url=url)
    secret = out.strip().splitlines()[-1]
    assert secret.startswith("tg_") and len(secret) > 30
    ok(
        "limits",
        "set",
        "--tenant",
        "acme",
        "--model",
        "llama-3.1-8b",
        "--rpm",
        "7",
        "--max-output",
        "99",
        url=url,
    )
    shown = ok("limits", "show", "--tenant", "acme", "--model", "llama-3.1-8b-2026-05", url=url)
    assert "rpm\t7" in shown and "max_output\t99" in shown and "plan\tstandard" in shown
    assert "acme\tstandard" in ok("tenants", "list", url=url)

    engine = sa.create_engine(url)
    with engine.connect() as conn:
        payloads = [r[0] for r in conn.execute(sa.text("SELECT payload FROM events"))]
    engine.dispose()
    assert secret not in "".join(payloads)  # keys are stored only as hashes


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (("tenants", "create", "Bad Name!"), ("tenant",)),
        (("tenants", "create", "acme", "--plan", "platinum"), ("plan",)),
        (("keys", "issue", "--tenant", "nobody"), ("nobody",)),
        (("limits", "set", "--tenant", "nobody", "--model", "*", "--rpm", "5"), ("nobody",)),
    ],
)
def test_bad_input_is_one_line_and_writes_nothing(
    url: str, args: tuple[str, ...], words: tuple[str, ...]
) -> None:
    ok("db", "upgrade", url=url)
    engine = sa.create_engine(url)
    with engine.connect() as conn:
        before = conn.execute(sa.text("SELECT COUNT(*) FROM events")).scalar()
    one_line_error(run(*args, url=url), *words)
    with engine.connect() as conn:
        after = conn.execute(sa.text("SELECT COUNT(*) FROM events")).scalar()
    engine.dispose()
    assert after == before


def test_duplicate_tenant_and_negative_limits(url: str) -> None:
    ok("tenants", "create", "acme", url=url)
    one_line_error(run("tenants", "create", "acme", url=url), "acme")
    done = run("limits", "set", "--tenant", "acme", "--model", "*", "--rpm", "-3", url=url)
    assert done.returncode != 0 and "Traceback" not in done.stderr and "rpm" in done.stderr


def test_bad_and_unreachable_databases() -> None:
    one_line_error(run("db", "upgrade", url="nosuchdb://x"), "database URL")
    one_line_error(run("db", "upgrade", url="sqlite:///:memory:"), "file path")
    one_line_error(
        run("db", "upgrade", url="postgresql+psycopg://postgres@127.0.0.1:1/none"),
        "cannot reach",
    )
    one_line_error(run("tenants", "list", url="sqlite:////nonexistent-dir/x.db"), "does not exist")


def test_projection_rebuild_prints_digests(url: str) -> None:
    ok("tenants", "create", "acme", url=url)
    first = ok("projections", "rebuild", url=url)
    second = ok("projections", "rebuild", url=url)
    assert first == second and "ledger_entries" in first and "sha256" in first
    one_line_error(run("projections", "rebuild", "nope", url=url), "unknown projection")
