"""The one settings object (api/config.py) and the options generated from it (cli/options.py):
command line over environment over file over default, an unknown file key refused by name, and
secrets masked when shown."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from tollgate_llm.api.config import DEFAULT_MODELS, Settings, load_settings
from tollgate_llm.cli import main
from tollgate_llm.cli import serve as cli_serve

# Every option `tollgate serve` had before its options were generated (README and tests use them).
SERVE_FLAGS = (
    "--host", "--port", "--database-url", "--simulated-replicas", "--replica", "--tokenizer",
    "--model", "--sim-speed", "--autoscale", "--cold-start-s", "--scale-down-after-s",
    "--sim-gpu-blocks", "--sim-max-seqs", "--flex-ceiling", "--batch-window",
    "--batch-concurrency", "--no-demo", "--trusted-proxies", "--metrics-token",
    "--auth-failures-per-minute", "--slow-reader-timeout", "--stream-buffer-chunks",
    "--lease-renew-s", "--client-send-buffer", "--keep-alive-s", "--no-fold-worker",
    "--predictor", "--no-predictor", "--log-format",
)  # fmt: skip


@pytest.fixture(autouse=True)
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test says which TOLLGATE_ variables exist; the machine's own never leak in."""
    for name in list(os.environ):
        if name.startswith("TOLLGATE_"):
            monkeypatch.delenv(name)


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> list[Settings]:
    """`tollgate serve` up to the point where it would start serving: the settings it got."""
    seen: list[Settings] = []
    monkeypatch.setattr(cli_serve, "run_serve", seen.append)
    return seen


def toml(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "tollgate.toml"
    path.write_text(text)
    return path


def invoke(*args: str, env: dict[str, str] | None = None) -> Any:
    return CliRunner().invoke(main, list(args), env=env, catch_exceptions=False)


def test_command_line_over_environment_over_file_over_default(
    tmp_path: Path, served: list[Settings]
) -> None:
    config = toml(tmp_path, """
port = 9000
host = "0.0.0.0"
keep_alive_s = 30
models = ["m-a-2026-05", "m-b-2026-05"]
seed_demo = true
""")  # fmt: skip
    done = invoke(
        "serve", "--config", str(config), "--port", "9200", "--no-demo",
        env={"TOLLGATE_PORT": "9100", "TOLLGATE_HOST": "10.1.2.3",
             "TOLLGATE_TRUSTED_PROXIES": "10.0.0.0/8, 192.168.0.0/16"},
    )  # fmt: skip
    assert done.exit_code == 0, done.output
    (settings,) = served
    assert settings.port == 9200  # command line over environment over file
    assert settings.host == "10.1.2.3"  # environment over file
    assert settings.keep_alive_s == 30  # file over default
    assert settings.models == ("m-a-2026-05", "m-b-2026-05")
    assert settings.seed_demo is False  # --no-demo over the file's true
    assert settings.trusted_proxies == ("10.0.0.0/8", "192.168.0.0/16")
    assert settings.sim_gpu_blocks == 8_192  # nobody said: the default
    assert settings.fold_worker is True


def test_an_option_left_out_leaves_the_environment_and_the_file_their_say(
    tmp_path: Path, served: list[Settings]
) -> None:
    # An option's own default would hide them: the generated options have none.
    config = toml(tmp_path, "port = 9000\nlog_format = 'json'\nsim_speed = 4.0\n")
    done = invoke("serve", "--config", str(config), env={"TOLLGATE_SIM_SPEED": "2.5"})
    assert done.exit_code == 0, done.output
    (settings,) = served
    assert (settings.port, settings.log_format, settings.sim_speed) == (9000, "json", 2.5)
    assert settings.models == DEFAULT_MODELS


def test_the_config_file_may_also_be_named_by_the_environment(tmp_path: Path) -> None:
    config = toml(tmp_path, "keep_alive_s = 31\n")
    done = invoke("config", "show", "--json", env={"TOLLGATE_CONFIG": str(config)})
    assert done.exit_code == 0, done.output
    assert json.loads(done.output)["keep_alive_s"] == 31


def test_an_unknown_key_in_the_file_is_refused_by_name_with_exit_code_2(
    tmp_path: Path, served: list[Settings]
) -> None:
    config = toml(tmp_path, "port = 9000\nprot = 9001\n")
    done = invoke("serve", "--config", str(config))
    assert done.exit_code == 2
    assert done.stderr.strip().splitlines() == [
        f"tollgate: error: {config}: unknown setting 'prot' (did you mean 'port'?)"
    ]
    assert served == []  # nothing started


def test_a_value_that_does_not_fit_names_the_setting_its_option_and_its_variable(
    tmp_path: Path,
) -> None:
    done = invoke("relay", env={"TOLLGATE_KAFKA_PARTITIONS": "none"})
    assert done.exit_code == 2
    assert "kafka_partitions (--partitions, TOLLGATE_KAFKA_PARTITIONS)" in done.stderr
    config = toml(tmp_path, "flex_ceiling = 1.5\n")
    done = invoke("config", "show", "--config", str(config))
    assert done.exit_code == 2 and "flex_ceiling (--flex-ceiling" in done.stderr


def test_a_missing_or_broken_file_is_an_error_that_names_it(tmp_path: Path) -> None:
    done = invoke("config", "show", "--config", str(tmp_path / "absent.toml"))
    assert done.exit_code == 2 and "absent.toml: no such configuration file" in done.stderr
    done = invoke("config", "show", "--config", str(toml(tmp_path, "port = \n")))
    assert done.exit_code == 2 and "tollgate.toml" in done.stderr


def test_config_show_masks_every_secret(tmp_path: Path) -> None:
    config = toml(tmp_path, """
database_url = "postgresql+psycopg://tollgate:hunter2-db@db.internal:5432/tollgate"
session_secret = "session-secret-0123456789"

[kafka]
"sasl.username" = "tollgate"
"sasl.password" = "hunter2-kafka"
"security.protocol" = "SASL_SSL"
""")  # fmt: skip
    env = {
        "TOLLGATE_METRICS_TOKEN": "metrics-token-0123",
        "TOLLGATE_BATCH_TOKEN": "batch-0123456789abcdef",
        "TOLLGATE_KAFKA_SSL_KEY_PASSWORD": "hunter2-tls",
    }
    for fmt in ([], ["--json"]):
        done = invoke("config", "show", "--config", str(config), *fmt, env=env)
        assert done.exit_code == 0, done.output
        for secret in ("hunter2", "session-secret-0123", "metrics-token-0123", "batch-0123"):
            assert secret not in done.output, (fmt, secret)
        # What is not secret is still there to read.
        assert "tollgate:***@db.internal:5432/tollgate" in done.output
        assert "SASL_SSL" in done.output
    shown = json.loads(done.output)
    assert shown["kafka"] == {"sasl.username": "tollgate", "sasl.password": "***",
                              "security.protocol": "SASL_SSL", "ssl.key.password": "***"}
    assert shown["metrics_token"] == shown["batch_token"] == shown["session_secret"] == "***"


def test_config_show_prints_a_file_that_config_reads_back(tmp_path: Path) -> None:
    config = toml(tmp_path, "port = 9000\nmodels = ['m-2026-05']\nmetrics_host = '0.0.0.0'\n")
    first = invoke("config", "show", "--config", str(config))
    assert first.exit_code == 0, first.output
    again = toml(tmp_path, first.output)
    assert load_settings(again) == load_settings(config)


def test_the_kafka_variables_are_librdkafka_settings_except_tollgates_own(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name, value in {
        "TOLLGATE_KAFKA_BOOTSTRAP": "k:9092", "TOLLGATE_KAFKA_TOPIC": "t.events",
        "TOLLGATE_KAFKA_PARTITIONS": "3", "TOLLGATE_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
        "TOLLGATE_WORKER_KAFKA_CLIENT": "faust",
    }.items():  # fmt: skip
        monkeypatch.setenv(name, value)
    settings = load_settings()
    assert (settings.kafka_bootstrap, settings.kafka_topic, settings.kafka_partitions) == (
        "k:9092", "t.events", 3,
    )
    assert settings.worker_kafka_client == "faust"
    assert settings.kafka_client_settings() == {"security.protocol": "SASL_SSL"}


def test_a_kafka_variable_wins_over_the_files_table_key_by_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = toml(tmp_path, '[kafka]\n"sasl.username" = "file"\n"linger.ms" = "5"\n')
    monkeypatch.setenv("TOLLGATE_KAFKA_SASL_USERNAME", "env")
    assert load_settings(config).kafka_client_settings() == {
        "sasl.username": "env", "linger.ms": "5",
    }


def test_every_serve_option_is_still_there_and_generated_from_a_setting() -> None:
    serve = main.commands["serve"]
    flags = {opt for param in serve.params for opt in param.opts}
    assert set(SERVE_FLAGS) <= flags
    for param in serve.params:
        if param.name in ("config", "help"):
            continue
        field = Settings.model_fields[str(param.name)]
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        # A flag that turns a setting off (--no-demo) says so in its own words.
        said = extra.get("negate") or field.description
        assert said and said in (param.help or "")
        assert f"TOLLGATE_{str(param.name).upper()}" in (param.help or "")


def test_the_api_edge_takes_serves_options_but_not_its_embedded_worker() -> None:
    serve, api = main.commands["serve"], main.commands["api"]
    assert {p.name for p in serve.params} - {p.name for p in api.params} == {"fold_worker"}


def test_the_default_store_is_a_sqlite_file_under_the_data_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TOLLGATE_DATA_DIR", str(tmp_path / "d"))
    settings = load_settings()
    assert settings.database_url == f"sqlite:///{tmp_path / 'd' / 'tollgate.db'}"
    assert not (tmp_path / "d").exists()  # loading settings creates nothing
    assert settings.store_url() == settings.database_url and (tmp_path / "d").is_dir()
