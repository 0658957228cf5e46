"""The `tollgate` CLI as a user runs it: a real subprocess, real databases, one-line errors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from datetime import UTC, datetime, timedelta
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


def test_amounts_that_are_not_amounts_are_refused_naming_the_option(url: str) -> None:
    ok("tenants", "create", "acme", url=url)
    ok("workspaces", "create", "ws", "--tenant", "acme", url=url)
    ok("projects", "create", "bot", "--tenant", "acme", "--workspace", "ws", url=url)
    budget = ["budgets", "set", "--tenant", "acme", "--project", "bot", "--period", "month"]
    engine = sa.create_engine(url)
    with engine.connect() as conn:
        before = conn.execute(sa.text("SELECT COUNT(*) FROM events")).scalar()
    for amount in ("nan", "inf", "-1", "1e999999999", "2000000000", "0.0000001", "abc"):
        done = run(*budget, f"--usd={amount}", url=url)
        assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
        assert "--usd" in done.stderr and "decimal.InvalidOperation" not in done.stderr
    big = str(10**23)
    done = run("runs", "policy", "--tenant", "acme", "--project", "bot", "--max-calls", big,
               url=url)  # fmt: skip
    one_line_error(done, "max_calls", "at most")
    with engine.connect() as conn:
        after = conn.execute(sa.text("SELECT COUNT(*) FROM events")).scalar()
    engine.dispose()
    assert after == before
    assert "25.00 USD" in ok(*budget, "--usd", "25.00", url=url)


def test_per_end_user_limits_take_a_project_and_a_rate_or_a_daily_budget(url: str) -> None:
    ok("tenants", "create", "acme", url=url)
    ok("workspaces", "create", "ws", "--tenant", "acme", url=url)
    ok("projects", "create", "bot", "--tenant", "acme", "--workspace", "ws", url=url)
    engine = sa.create_engine(url)
    with engine.connect() as conn:
        before = conn.execute(sa.text("SELECT COUNT(*) FROM events")).scalar()
    per_end_user = ["limits", "set", "--tenant", "acme", "--per-end-user"]
    for args, words in [
        (("--rpm", "1"), ("--per-end-user takes --project",)),
        (("--project", "bot", "--workspace", "ws", "--rpm", "1"), ("no other level",)),
        (("--project", "bot", "--rpm", "1", "--max-context", "9"), ("rpm or tpm", "max_context")),
        # The budget alone is valid: the other limit is refused before anything is recorded.
        (("--project", "bot", "--usd-per-day", "1", "--kv-seconds", "9"), ("kv_gib_seconds",)),
        (("--project", "bot", "--rpm", "1", "--reserved-kv-seconds", "9"), ("organization",)),
        (("--project", "bot", "--rpm", "1", "--usd-per-day", "x"), ("--usd-per-day",)),
    ]:
        done = run(*per_end_user, *args, url=url)
        assert done.returncode != 0 and "Traceback" not in done.stderr, done.stderr
        assert all(word in done.stderr for word in words), (args, done.stderr)
    with engine.connect() as conn:
        after = conn.execute(sa.text("SELECT COUNT(*) FROM events")).scalar()
    assert after == before
    out = ok(*per_end_user, "--project", "bot", "--rpm", "2", "--usd-per-day", "1", url=url)
    assert "rpm 2, 1 USD a day" in out
    with engine.connect() as conn:
        kinds = [r[0] for r in conn.execute(sa.text(
            "SELECT type FROM events WHERE type IN ('LevelLimitsSet', 'BudgetSet')"
        ))]  # fmt: skip
    engine.dispose()
    assert sorted(kinds) == ["BudgetSet", "LevelLimitsSet"]


def test_an_invoice_is_for_the_current_month_unless_a_period_is_named(url: str) -> None:
    from tollgate_llm.ledger.schema import ledger_entries

    ok("tenants", "create", "acme", url=url)
    now = datetime.now(UTC)
    last_month = now.replace(day=1) - timedelta(days=1)
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        for n, (when, amount) in enumerate(((now, 700), (last_month, 300))):
            conn.execute(ledger_entries.insert().values(
                request_id=f"req-{n}", tenant_id="acme", key_id="key-1", model="m-2026-05",
                prompt_tokens=10, completion_tokens=5, cached_tokens=0,
                prompt_micros_per_mtok=1, completion_micros_per_mtok=1, cached_micros_per_mtok=1,
                amount_micros=amount, terminal="completed", admitted_at=when, finished_at=when,
                billed_at=when, position=n + 1,
            ))  # fmt: skip
    engine.dispose()
    invoice = json.loads(ok("ledger", "invoice", "acme", "--format", "json", url=url))
    assert invoice["period"] == now.strftime("%Y-%m")
    assert (invoice["requests"], invoice["amount_micros"]) == (1, 700)
    period = last_month.strftime("%Y-%m")
    invoice = json.loads(ok("ledger", "invoice", "acme", "--period", period, "--format", "json",
                            url=url))  # fmt: skip
    assert invoice["period"] == period
    assert (invoice["requests"], invoice["amount_micros"]) == (1, 300)
    table = ok("ledger", "invoice", "acme", url=url)
    assert f"invoice acme {now.strftime('%Y-%m')}: total" in table


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


def test_only_the_load_generator_imports_its_http_client() -> None:
    # `tollgate --help` lists `loadgen` without importing it; running it loads the real command.
    probe = (
        "import sys\n"
        "from tollgate_llm.cli import main\n"
        "try:\n"
        "    main(sys.argv[1:])\n"
        "except SystemExit:\n"
        "    pass\n"
        "print(sorted(m for m in ('httpx', 'tollgate_llm.loadgen.cli') if m in sys.modules))\n"
    )
    for args, imported in (
        (["--help"], "[]"),
        (["serve", "--help"], "[]"),
        (["loadgen", "--help"], "['httpx', 'tollgate_llm.loadgen.cli']"),
    ):
        done = subprocess.run(
            [sys.executable, "-c", probe, *args], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip().splitlines()[-1] == imported, args


def test_serving_imports_no_development_tool(tmp_path: Path) -> None:
    # The dev-cluster's proxy and supervisor and --autoscale's simulated actuator live in
    # cli/dev/, imported only by what uses them. `tollgate_llm.api.serve.run` is replaced by a
    # probe: the command line is what is under test, up to the point where serving starts.
    probe = (
        "import sys\n"
        "import tollgate_llm.api.serve\n"
        "def run(settings, actuator_factory=None):\n"
        "    print('actuator', getattr(actuator_factory, '__name__', None))\n"
        "tollgate_llm.api.serve.run = run\n"
        "from tollgate_llm.cli import main\n"
        "try:\n"
        "    main(sys.argv[1:])\n"
        "except SystemExit:\n"
        "    pass\n"
        "print(sorted(m for m in sys.modules if m.startswith('tollgate_llm.cli.dev.')))\n"
    )
    env = {**os.environ, "TOLLGATE_DATA_DIR": str(tmp_path)}
    for args, actuator, imported in (
        (["--help"], None, "[]"),
        (["serve", "--help"], None, "[]"),
        (["api", "--help"], None, "[]"),
        (["serve"], "actuator None", "[]"),
        (
            ["serve", "--autoscale"], "actuator SimulatedActuator",
            "['tollgate_llm.cli.dev.actuator']",
        ),  # fmt: skip
    ):
        done = subprocess.run(
            [sys.executable, "-c", probe, *args], capture_output=True, text=True, timeout=60,
            env=env,
        )  # fmt: skip
        lines = done.stdout.strip().splitlines()
        assert lines[-1] == imported, (args, done.stdout, done.stderr)
        if actuator:
            assert actuator in lines, (args, done.stdout)


def test_the_lazy_loadgen_entry_shows_the_commands_own_summary() -> None:
    from tollgate_llm.cli import main
    from tollgate_llm.loadgen.cli import loadgen

    lazy = main.commands["loadgen"]
    assert lazy is not loadgen
    for limit in (45, 60, 200):
        assert lazy.get_short_help_str(limit) == loadgen.get_short_help_str(limit)


def test_models_register_from_a_config_json_and_from_flags(url: str, tmp_path: Path) -> None:
    import json

    config = tmp_path / "config.json"
    config.write_text(json.dumps({
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "hidden_size": 128, "dtype": "bfloat16", "max_position_embeddings": 4096,
    }))  # fmt: skip
    out = ok("models", "register", "--model", "tiny-llama-2026-05", "--hf-config", str(config),
             url=url)  # fmt: skip
    assert "512 KV bytes per token" in out
    shown = json.loads(ok("models", "show", "--model", "tiny-llama-2026-05", url=url))
    assert shown["kv_bytes_per_token"] == 512 and shown["max_model_len"] == 4096
    # flags override the file; an MLA profile from flags alone
    ok("models", "register", "--model", "tiny-llama-2026-05", "--hf-config", str(config),
       "--dtype-bytes", "1", url=url)  # fmt: skip
    shown = json.loads(ok("models", "show", "--model", "tiny-llama-2026-05", url=url))
    assert shown["kv_bytes_per_token"] == 256 and len(shown["history"]) == 2
    ok("models", "register", "--model", "mla-x", "--layers", "4", "--mla-rank", "512",
       "--rope-dim", "64", "--dtype-bytes", "2", url=url)  # fmt: skip
    shown = json.loads(ok("models", "show", "--model", "mla-x", url=url))
    assert shown["attention"] == "mla" and shown["kv_bytes_per_token"] == (512 + 64) * 2 * 4
    one_line_error(run("models", "register", "--model", "y", "--layers", "2", url=url),
                   "--dtype-bytes", "--kv-heads", "--head-dim")  # fmt: skip
    done = run("models", "show", "--model", "nobody-2026-05", url=url)
    one_line_error(done, "no model profile", "tollgate models register --model nobody-2026-05")


def test_serve_runs_from_a_config_file_with_the_environment_over_it(tmp_path: Path) -> None:
    """`tollgate serve --config F`: every setting from the file (its port, data directory and
    fleet), one from the environment over the file, and its fold worker child on the same
    file: a request is served and billed."""
    import socket
    import time

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    data = tmp_path / "data"
    config = tmp_path / "tollgate.toml"
    config.write_text(
        f'port = {port}\ndata_dir = "{data}"\nsimulated_replicas = 1\n'
        'models = ["llama-3.1-8b-2026-05"]\nsim_speed = 5.0\nkeep_alive_s = 9\n'
        'metrics_token = "file-token-0123"\n'
    )
    shown = ok("config", "show", "--config", str(config), url="")
    assert f"port = {port}" in shown and "keep_alive_s = 9" in shown
    assert "file-token" not in shown  # masked
    env = {k: v for k, v in os.environ.items() if not k.startswith("TOLLGATE_")}
    env["TOLLGATE_METRICS_TOKEN"] = "env-token-4567"  # the environment over the file
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [TOLLGATE, "serve", "--config", str(config)], stdout=out, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, env=env, cwd=tmp_path,
        )  # fmt: skip
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None, log.read_text()
            try:
                if httpx.get(f"{base}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        banner = log.read_text()
        assert f"database: sqlite:///{data / 'tollgate.db'}" in banner
        assert "fleet: 1 replicas of llama-3.1-8b-2026-05" in banner
        keys = json.loads((data / "demo-keys.json").read_text())  # the file's data directory
        done = httpx.post(
            f"{base}/v1/chat/completions",
            headers={"Authorization": f"Bearer {keys['demo-standard']}"},
            json={"model": "llama-3.1-8b-2026-05", "max_tokens": 4,
                  "messages": [{"role": "user", "content": "Hello!"}]},
            timeout=30,
        )  # fmt: skip
        assert done.status_code == 200, done.text
        # /metrics answers the environment's token, not the file's.
        for token, status in (("env-token-4567", 200), ("file-token-0123", 401)):
            answer = httpx.get(f"{base}/metrics", timeout=10,
                               headers={"Authorization": f"Bearer {token}"})  # fmt: skip
            assert answer.status_code == status, (token, answer.status_code)
        # Billed by the fold worker child, which read the same file (its data directory).
        engine = sa.create_engine(f"sqlite:///{data / 'tollgate.db'}")
        try:
            deadline = time.monotonic() + 30
            while True:
                with engine.connect() as conn:
                    billed = conn.execute(sa.text("SELECT COUNT(*) FROM ledger_entries")).scalar()
                if billed or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
        finally:
            engine.dispose()
        assert billed, log.read_text()
        workers = subprocess.run(["ps", "-ww", "-o", "args=", "--ppid", str(proc.pid)],
                                 capture_output=True, text=True).stdout  # fmt: skip
        assert f"--config {config}" in workers, workers
    finally:
        proc.terminate()
        proc.wait(20)
