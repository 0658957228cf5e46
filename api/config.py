"""Tollgate's one settings object, read once when a process starts: the command line over the
environment (TOLLGATE_<NAME>) over a TOML file (`--config`) over the defaults written here.

Each field is a setting: its name is the file's key and, upper-cased after TOLLGATE_, the
environment variable; its description is the command line's help, and the command line's
options are generated from these fields (cli/options.py). Nothing below this module reads the
environment for a setting: the values are passed down."""

from __future__ import annotations

import difflib
import os
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator
from pydantic.fields import FieldInfo
from pydantic_settings import (
    BaseSettings,
    NoDecode,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from tollgate_llm.domain.batches.state import window_seconds
from tollgate_llm.domain.capacity import FLEX_CEILING_PPM
from tollgate_llm.domain.control_plane.data_policy import REGION
from tollgate_llm.domain.leases import LEASE_RENEW_S, LEASE_TTL_S
from tollgate_llm.engine_adapter.exchange import MAX_BUFFERED_CHUNKS

DEFAULT_MODELS = ("llama-3.1-8b-2026-05", "llama-3.1-70b-2026-05")
ENV_PREFIX = "TOLLGATE_"
# librdkafka settings arrive as TOLLGATE_KAFKA_<SETTING> (`TOLLGATE_KAFKA_SECURITY_PROTOCOL` ->
# `security.protocol`) or the file's [kafka] table: a production cluster's TLS and SASL with
# no code change. These TOLLGATE_KAFKA_ variables are settings of their own, not librdkafka's.
KAFKA_ENV_PREFIX = "TOLLGATE_KAFKA_"
# Shown masked by `tollgate config show`: a librdkafka setting whose name has one of these words.
SECRET_WORDS = ("password", "secret", "token", "key", "credentials")

# A list setting from the environment or the command line is comma-separated ("a,b"); in the
# file it is a TOML array (a comma-separated string works too).
Names = Annotated[tuple[str, ...], NoDecode]


def cli(
    flag: str | None = None, *, negate: str | None = None, secret: bool = False,
    option: bool = True,
) -> dict[str, Any]:
    """How a field appears on the command line and in `config show`: `flag` when it is not
    `--<name>`; `negate`: the help of `flag` when it turns off a boolean that defaults on;
    `secret`: masked when shown; `option=False`: settable only in the file and the environment
    (a secret never on a command line, where a process listing shows it)."""
    return {"flag": flag, "negate": negate, "secret": secret, "option": option}


class ConfigFileError(ValueError):
    """The configuration file cannot be used: missing, not TOML, or naming an unknown key."""


class Settings(BaseSettings):
    """Every setting of every `tollgate` process. A command uses the ones it needs."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_ignore_empty=True,
        extra="forbid",
        validate_default=True,
    )

    # --- where the data is ---------------------------------------------------------------------
    # Empty: the SQLite file tollgate.db under the data directory, filled in when loaded.
    database_url: str = Field(
        "",
        description="sqlite:///path.db or postgresql+psycopg://user@host/db (default: a SQLite "
        "file under the data directory)",
        json_schema_extra=cli(secret=True),
    )
    data_dir: Path = Field(
        Path("data"),
        description="local files: the SQLite store, demo keys, predictor models, session secret",
        json_schema_extra=cli(option=False),
    )
    config: Path | None = Field(
        None,
        description="a TOML file of settings (its keys: these settings' names)",
        json_schema_extra=cli(option=False),
    )

    # --- the edge ------------------------------------------------------------------------------
    host: str = Field("127.0.0.1", description="the address the API listens on")
    port: int = Field(8080, ge=0, le=65535, description="the port the API listens on")
    replicas: Names = Field(
        (),
        description="a real vLLM replica: MODEL=URL[@REGION] (MODEL: the version Tollgate "
        "serves; the engine's own name for it is read from its /v1/models; REGION: where it "
        "runs, for tenants pinned to regions); repeatable",
        json_schema_extra=cli("--replica"),
    )
    region: str = Field(
        "", pattern=r"^([a-z0-9][a-z0-9-]{0,31})?$",
        description="the region of a replica given none (--replica MODEL=URL without @REGION, "
        "and the simulated ones); empty: none, so it serves no tenant pinned to regions",
    )  # fmt: skip
    simulated_regions: Names = Field(
        (),
        description="regions the simulated replicas of each model are spread over, in turn",
        json_schema_extra=cli("--simulated-region"),
    )
    tokenizers: Names = Field(
        (),
        description="MODEL=DIR: the model's tokenizer.json and chat template, for the prompt "
        "estimate, when the replica's model directory is not readable here; repeatable",
        json_schema_extra=cli("--tokenizer"),
    )
    models: Names = Field(
        DEFAULT_MODELS,
        description="model versions to simulate; repeatable",
        json_schema_extra=cli("--model"),
    )
    simulated_replicas: int = Field(
        2, ge=0, description="simulated vLLM replicas per model when no --replica is given"
    )
    sim_speed: float = Field(1.0, gt=0, description="speed multiplier of the simulated engines")
    # Recorded on each price as it is set (PriceSet.currency), so changing it re-prices nothing
    # already billed: a past bill keeps the currency its price was set in.
    currency: str = Field(
        "USD", pattern=r"^[A-Z]{3}$",
        description="the ISO 4217 code of the prices set from now on (and of their bills)",
    )  # fmt: skip
    sim_seed: int = Field(7, description="the simulated engines' random seed",
                          json_schema_extra=cli(option=False))  # fmt: skip
    sim_gpu_blocks: int = Field(
        8_192, ge=16, description="KV blocks of 16 tokens per simulated replica"
    )
    sim_max_num_seqs: int = Field(
        # vLLM's usual default: KV, not sequence slots, binds.
        256, ge=1, description="sequences a simulated replica runs at once",
        json_schema_extra=cli("--sim-max-seqs"),
    )  # fmt: skip
    # The simulated replicas schedule as `vllm serve --scheduling-policy priority` (the tier's
    # and the flex class's `priority` field is honoured), as real ones should be started.
    sim_scheduling_policy: Literal["priority", "fcfs"] = Field(
        "priority", description="the simulated replicas' vLLM scheduling policy",
        json_schema_extra=cli(option=False),
    )  # fmt: skip
    autoscale: bool = Field(
        False,
        description="add and remove simulated replicas by the autoscaling signal "
        "(tollgate_desired_replicas)",
    )
    cold_start_s: float = Field(
        60.0, ge=0, description="how long a new replica takes before it serves: the signal's lead"
    )
    scale_down_after_s: float = Field(
        120.0,
        ge=0,
        description="how long the signal must stay below the fleet before a replica is removed",
    )
    flex_ceiling: float = Field(
        FLEX_CEILING_PPM / 1_000_000,
        gt=0,
        lt=1,
        description="KV occupancy below which a replica takes flex work (below every tier's "
        "ceiling)",
    )
    batch_windows: Names = Field(
        (),
        description="a Batch API completion window offered beside 24h, e.g. 30s (tests, "
        "demos); repeatable",
        json_schema_extra=cli("--batch-window"),
    )
    # The runner backs off when flex is refused or preempted.
    batch_concurrency: int = Field(
        8, ge=1, le=1024, description="batch items the batch runner keeps in flight at most"
    )
    # How the batch runner proves itself to the edge: set it, or `tollgate serve` draws one at
    # start and hands it to its fold worker in the environment; never stored.
    batch_token: str = Field(
        "", description="the batch runner's proof to the edges (16+ characters)",
        json_schema_extra=cli(secret=True, option=False),
    )  # fmt: skip
    edge_url: str | None = Field(
        None, description="an edge (`tollgate api`) the batch runner sends batch items to"
    )
    seed_demo: bool = Field(
        True,
        description="seed the demo tenants and keys",
        json_schema_extra=cli("--no-demo", negate="do not seed the demo tenants and keys"),
    )
    trusted_proxies: Names = Field(
        (),
        description="comma-separated CIDRs of proxies whose X-Forwarded-For names the client "
        "for the per-address limits (default: none, the TCP peer counts)",
    )
    metrics_token: str | None = Field(
        None,
        description="/metrics answers only `Authorization: Bearer TOKEN` (Prometheus: "
        "`authorization: {credentials: TOKEN}`)",
        json_schema_extra=cli(secret=True),
    )
    # A person with a wrong key makes a few; a client that polls with a key not yet known to
    # the edge (≤ 0.2 s) makes a handful.
    auth_failures_per_minute: int = Field(
        100,
        ge=0,
        description="failed authentications per minute from one client address before every "
        "authentication from it is refused for a while (0: no limit)",
    )
    # A client that pauses reads again well within 10 s; one gone silent no longer holds KV for
    # minutes.
    slow_reader_s: float = Field(
        10.0,
        ge=0,
        description="seconds a streaming client may read nothing while its buffer is full "
        "before its generation is cancelled and billed as far as the engine got (0: never)",
        json_schema_extra=cli("--slow-reader-timeout"),
    )
    stream_buffer_chunks: int = Field(
        MAX_BUFFERED_CHUNKS,
        ge=2,
        description="chunks buffered per stream for a client that reads slower than the engine "
        "writes",
    )
    # Fixed by default: autotuned, the send buffer grew to megabytes on loopback, so 50 clients
    # that read nothing never filled the edge's buffer and each got all 2,000 tokens generated
    # (issue 27, item 4). 64 KiB (the kernel doubles it) is a few seconds of any token stream
    # and far more than a round trip of one, so a reading client never waits on it.
    client_send_buffer_bytes: int = Field(
        64 * 1024,
        ge=0,
        description="bytes of kernel send buffer per client connection (0: the kernel's "
        "autotuning)",
        json_schema_extra=cli("--client-send-buffer"),
    )
    # Longer than the idle expiry of the usual clients (httpx and so the openai SDK: 5 s,
    # aiohttp: 15 s, a cloud load balancer: 60 s): with uvicorn's 5 s, an httpx client reusing
    # a connection idle for just under 5 s got ReadError on about one request in twenty.
    keep_alive_s: int = Field(
        75,
        ge=1,
        description="seconds an idle client connection is kept open (keep it above the "
        "clients' own idle expiry, or a client may reuse a connection just as it is closed)",
    )
    lease_renew_s: float = Field(
        LEASE_RENEW_S,
        ge=0.05,
        description="seconds between this edge's lease renewals (one event for all its "
        "streams): what a crash of the edge can leave unbilled",
    )
    max_body_bytes: int = Field(
        4 * 1024 * 1024, ge=1024, description="the largest request body (413 above)",
        json_schema_extra=cli(option=False),
    )  # fmt: skip
    fold_worker: bool = Field(
        True,
        description="start the fold worker (billing, read models, leases) as a child process",
        json_schema_extra=cli(
            "--no-fold-worker",
            negate="do not start the fold worker (billing, read models, leases) as a child "
            "process; run `tollgate worker` against the same database instead",
        ),
    )
    predictor_path: str | None = Field(
        None,
        description="an output-predictor model file, or a directory whose newest model is used "
        "(default: the data directory's predictor/, where `tollgate predictor train` writes)",
        json_schema_extra=cli("--predictor"),
    )
    predictor_enabled: bool = Field(
        True,
        description="reserve each request's output by the output predictor",
        json_schema_extra=cli("--no-predictor", negate="reserve every request's whole output cap"),
    )
    predictor_reload_s: float = Field(
        30.0, gt=0, description="how soon a newer model file in the directory is picked up",
        json_schema_extra=cli(option=False),
    )  # fmt: skip
    session_secret: str | None = Field(
        None,
        description="signs the web pages' session cookies, the same on every edge (default: "
        "drawn once into the data directory's session-secret)",
        json_schema_extra=cli(secret=True, option=False),
    )
    # The event loop shares the GIL with the fold and group-commit threads; with the default
    # 5 ms a busy fold thread made every socket send cost up to 5 ms (py-spy: 18 % of the loop
    # in transport.write). 0.5 ms keeps the loop responsive; the threads barely notice.
    switch_interval_s: float = Field(
        0.0005, gt=0, description="the interpreter's thread switch interval while serving",
        json_schema_extra=cli(option=False),
    )  # fmt: skip
    scrape_interval_s: float = Field(
        0.25, gt=0, description="how often the replicas' /metrics are read",
        json_schema_extra=cli(option=False),
    )  # fmt: skip
    tpot_target_us: int = Field(
        40_000, ge=1, description="the time-per-output-token target, microseconds",
        json_schema_extra=cli(option=False),
    )  # fmt: skip
    metrics_max_tenants: int = Field(
        50, ge=1, description="tenants named in metric labels; the rest are 'other'",
        json_schema_extra=cli(option=False),
    )  # fmt: skip
    # SQLite: deleted content (a batch file, a purged replay) leaves the files within this long.
    sqlite_checkpoint_s: float = Field(
        60.0, gt=0, description="seconds between SQLite WAL checkpoints",
        json_schema_extra=cli(option=False),
    )  # fmt: skip

    # --- the pipeline --------------------------------------------------------------------------
    lease_ttl_s: float = Field(
        float(LEASE_TTL_S),
        ge=1.0,
        description="seconds without a renewal after which a request's lease expires",
        json_schema_extra=cli("--lease-ttl"),
    )
    pipeline_stale_s: float = Field(
        10.0,
        ge=0,
        description="seconds a lagging part of the pipeline (the relay, a consumer group, a "
        "worker's heartbeat) may go without moving before it is stale",
        json_schema_extra=cli("--stale-after"),
    )
    unbilled_alarm_s: float = Field(
        30.0,
        ge=0,
        description="seconds a terminal event may go without its ledger row before it alarms",
        json_schema_extra=cli("--unbilled-alarm-after"),
    )
    kafka_bootstrap: str | None = Field(
        None,
        description="host:port[,host:port]: the Kafka cluster of the distributed mode (other "
        "librdkafka settings: TOLLGATE_KAFKA_<SETTING> or the file's [kafka] table)",
    )
    kafka_topic: str = Field(
        "tollgate.events", description="the event topic", json_schema_extra=cli("--topic")
    )
    kafka_partitions: int = Field(
        8,
        ge=1,
        description="partitions of the event topic when the relay creates it",
        json_schema_extra=cli("--partitions"),
    )
    worker_kafka_client: Literal["confluent", "faust"] = Field(
        "confluent",
        description="the library that reads the topic: confluent-kafka or faust-streaming; the "
        "same folds and the same exactly-once transaction either way (streams/README.md)",
        json_schema_extra=cli("--kafka-client"),
    )
    kafka: dict[str, str] = Field(
        default_factory=dict,
        description="librdkafka settings by their own names (security.protocol, sasl.username, "
        "...)",
        json_schema_extra=cli(secret=True, option=False),
    )
    metrics_port: int = Field(
        0,
        ge=0,
        le=65535,
        description="serve Prometheus /metrics on this port (0: off)",
    )
    metrics_host: str = Field(
        "127.0.0.1",
        description="the address of a worker's or the relay's /metrics (0.0.0.0 for a remote "
        "Prometheus)",
        json_schema_extra=cli(option=False),
    )

    # --- the control plane's audit trail -------------------------------------------------------
    # Who a command-line change is recorded as made by (the admin API records the key's id).
    actor: str | None = Field(
        None, min_length=1, max_length=200,
        description="who the control-plane changes of this command are recorded as made by, in "
        "the audit trail (default: the OS user@host)",
    )  # fmt: skip
    require_actor: bool = Field(
        False,
        description="refuse a control-plane change from the command line that does not name its "
        "actor (--actor or TOLLGATE_ACTOR)",
        json_schema_extra=cli(option=False),
    )

    # --- every process -------------------------------------------------------------------------
    log_format: Literal["plain", "json"] = Field(
        "plain",
        description="the log on stderr: plain text lines or json, one object a line",
    )

    @field_validator("replicas", "tokenizers", "models", "batch_windows", "trusted_proxies",
                     "simulated_regions", mode="before")  # fmt: skip
    @classmethod
    def _split_names(cls, value: Any) -> Any:
        if isinstance(value, str):
            return tuple(part.strip() for part in value.split(",") if part.strip())
        return value

    @field_validator("batch_windows")
    @classmethod
    def _windows(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for window in value:
            if window_seconds(window, (window,)) is None:
                raise ValueError(f"{window!r}: a window is 1-99999 followed by s, m or h")
        return value

    @field_validator("simulated_regions")
    @classmethod
    def _regions(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        # Repeated (`--simulated-region a --simulated-region b`) or comma-separated, alike.
        regions = tuple(part.strip() for item in value for part in item.split(",") if part.strip())
        for region in regions:
            if not REGION.fullmatch(region):
                raise ValueError(f"{region!r}: a region matches {REGION.pattern}")
        return regions

    @model_validator(mode="after")
    def _resolve(self) -> Settings:
        # An empty list is no list at all: the defaults, as when the option was not given.
        # What is filled in here stays unset (a command's own default may still replace it).
        if not self.models:
            self.models = DEFAULT_MODELS
            self.__pydantic_fields_set__.discard("models")
        if not self.database_url:
            self.database_url = self._default_store_url()
            self.__pydantic_fields_set__.discard("database_url")
        return self

    @property
    def flex_ceiling_ppm(self) -> int:
        return round(self.flex_ceiling * 1_000_000)

    def _default_store_url(self) -> str:
        return f"sqlite:///{self.data_path() / 'tollgate.db'}"

    def store_url(self) -> str:
        """The database URL; the default SQLite file's directory is created first."""
        if self.database_url == self._default_store_url():
            self.data_path().mkdir(parents=True, exist_ok=True)
        return self.database_url

    def data_path(self) -> Path:
        return self.data_dir.resolve()

    def predictor_dir(self) -> Path:
        """Where `tollgate predictor train` writes model files and `tollgate serve` loads the
        newest from."""
        return self.data_path() / "predictor"

    def kafka_client_settings(self) -> dict[str, str]:
        """The librdkafka settings beyond the bootstrap servers, by librdkafka's names."""
        return dict(self.kafka)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # The command line (passed in as init values) over the environment over the file.
        return (init_settings, env_settings, _KafkaEnvironment(settings_cls),
                _ConfigFile(settings_cls))  # fmt: skip


class _KafkaEnvironment(PydanticBaseSettingsSource):
    """TOLLGATE_KAFKA_<SETTING> variables that are not settings of their own, as the `kafka`
    table (merged over the file's: a variable wins over the file key by key)."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # everything is done in __call__

    def __call__(self) -> dict[str, Any]:
        own = {ENV_PREFIX + name.upper() for name in Settings.model_fields}
        found = {
            name.removeprefix(KAFKA_ENV_PREFIX).lower().replace("_", "."): value
            for name, value in os.environ.items()
            if name.startswith(KAFKA_ENV_PREFIX) and name not in own
        }
        if not found:
            return {}
        return {"kafka": {**found, **self.current_state.get("kafka", {})}}


class _ConfigFile(PydanticBaseSettingsSource):
    """The TOML file named by the `config` setting (--config or TOLLGATE_CONFIG), below the
    command line and the environment. An unknown key is an error that names it."""

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # everything is done in __call__

    def __call__(self) -> dict[str, Any]:
        path = self.current_state.get("config")
        if not path:
            return {}
        values = read_config_file(Path(path))
        if "kafka" in values and "kafka" in self.current_state:
            values = {**values, "kafka": {**values["kafka"], **self.current_state["kafka"]}}
        return values


def read_config_file(path: Path) -> dict[str, Any]:
    """A configuration file's settings; ConfigFileError names the file and what is wrong."""
    try:
        values = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigFileError(f"{path}: no such configuration file") from None
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigFileError(f"{path}: {exc}") from None
    known = set(Settings.model_fields) - {"config"}
    for key in values:
        if key not in known:
            near = difflib.get_close_matches(key, sorted(known), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ConfigFileError(f"{path}: unknown setting {key!r}{hint}")
    return values


def load_settings(config: Path | str | None = None, **given: Any) -> Settings:
    """The settings of this process: `given` (the command line) over the environment over the
    file `config` over the defaults."""
    if config is not None:
        given["config"] = Path(config)
    return Settings(**given)


def mask_url(url: str) -> str:
    """A database URL with its password replaced by ***."""
    from sqlalchemy.engine import make_url

    try:
        parsed = make_url(url)
    except Exception:  # noqa: BLE001 - not a URL at all: show nothing of it
        return "***"
    return parsed.render_as_string(hide_password=True)


def shown(settings: Settings) -> dict[str, Any]:
    """The effective settings with every secret masked (`tollgate config show`)."""
    out: dict[str, Any] = {}
    for name, field in Settings.model_fields.items():
        value = getattr(settings, name)
        extra = field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}
        if name == "kafka":
            value = {
                key: "***" if any(word in key.lower() for word in SECRET_WORDS) else setting
                for key, setting in sorted(value.items())
            }
        elif extra.get("secret") and value:
            value = mask_url(value) if name == "database_url" else "***"
        out[name] = value
    return out
