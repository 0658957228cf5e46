"""Traffic profiles: data files (TOML) describing request shape, arrivals and client behaviour.

A profile is a list of request classes, each with a weight (share of the main arrival stream) or
its own `rate_per_min` (an independent Poisson side stream, e.g. a noisy neighbour), a model mix,
prompt and output length distributions, and client behaviour (streaming, max_tokens policy,
mid-stream disconnects, retries with Idempotency-Key). A class may import every class of another
profile with `profile = "NAME"`, which is how `mix` is built.

Length distributions:
  {dist = "lognormal", p50 = P, p95 = Q}   fitted exactly to the two quantiles:
                                           mu = ln P, sigma = (ln Q - ln P) / z(0.95)
  {dist = "fixed", value = N}
  {dist = "uniform", min = A, max = B}     integers, inclusive
every one optionally clipped with `min` / `max`.
"""

from __future__ import annotations

import math
import random
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

PROFILE_DIR = Path(__file__).parent / "profiles"
Z95 = 1.6448536269514722  # standard normal quantile at 0.95
ARRIVALS = ("poisson", "bursty")
DEMO_TIERS = {"demo-free": "free", "demo-standard": "standard", "demo-enterprise": "enterprise"}


class ProfileError(ValueError):
    """A profile file is missing, malformed or inconsistent; the message says where."""


# --- distributions --------------------------------------------------------------------------


@dataclass(frozen=True)
class Dist:
    kind: str  # lognormal | fixed | uniform
    a: float = 0.0  # lognormal: mu; fixed: value; uniform: low
    b: float = 0.0  # lognormal: sigma; uniform: high
    lo: int = 1
    hi: int = 10_000_000
    p50: float | None = None
    p95: float | None = None

    @staticmethod
    def lognormal_from_quantiles(p50: float, p95: float, lo: int = 1,
                                 hi: int = 10_000_000) -> Dist:
        mu = math.log(p50)
        sigma = (math.log(p95) - math.log(p50)) / Z95
        return Dist("lognormal", mu, sigma, lo, hi, p50, p95)

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            value = self.a
        elif self.kind == "uniform":
            value = rng.randint(int(self.a), int(self.b))
        else:
            value = rng.lognormvariate(self.a, self.b)
        return max(self.lo, min(self.hi, int(round(value))))

    def describe(self) -> str:
        if self.kind == "fixed":
            return f"fixed {int(self.a)}"
        if self.kind == "uniform":
            return f"uniform {int(self.a)}..{int(self.b)}"
        return f"lognormal p50 {self.p50:g} p95 {self.p95:g} (sigma {self.b:.3f})"


def parse_dist(raw: Any, where: str) -> Dist:
    if isinstance(raw, int) and not isinstance(raw, bool):
        if raw < 1:
            raise ProfileError(f"{where}: must be a positive integer, got {raw}")
        return Dist("fixed", raw, lo=raw, hi=raw)
    if not isinstance(raw, dict):
        raise ProfileError(f"{where}: expected a table like {{dist = \"lognormal\", p50 = 800, "
                           f"p95 = 6000}} or an integer, got {raw!r}")
    kind = raw.get("dist")
    known = {"dist", "p50", "p95", "value", "min", "max"}
    unknown = set(raw) - known
    if unknown:
        raise ProfileError(f"{where}: unknown key(s) {sorted(unknown)}; allowed {sorted(known)}")
    lo = _pos_int(raw.get("min", 1), f"{where}.min")
    hi = _pos_int(raw.get("max", 10_000_000), f"{where}.max")
    if lo > hi:
        raise ProfileError(f"{where}: min {lo} is above max {hi}")
    if kind == "lognormal":
        p50, p95 = raw.get("p50"), raw.get("p95")
        for name, value in (("p50", p50), ("p95", p95)):
            if not isinstance(value, int | float) or isinstance(value, bool) or value <= 0:
                raise ProfileError(f"{where}.{name}: lognormal needs a positive number")
        if p95 <= p50:  # type: ignore[operator]
            raise ProfileError(f"{where}: p95 ({p95}) must be above p50 ({p50})")
        return Dist.lognormal_from_quantiles(float(p50), float(p95), lo, hi)  # type: ignore[arg-type]
    if kind == "fixed":
        value = _pos_int(raw.get("value"), f"{where}.value")
        return Dist("fixed", value, lo=min(lo, value), hi=max(hi, value))
    if kind == "uniform":
        if "min" not in raw or "max" not in raw:
            raise ProfileError(f"{where}: uniform needs min and max")
        return Dist("uniform", lo, hi, lo, hi)
    raise ProfileError(f"{where}.dist: expected lognormal, fixed or uniform, got {kind!r}")


def _pos_int(value: Any, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ProfileError(f"{where}: must be a positive integer, got {value!r}")
    return value


def _prob(value: Any, where: str) -> float:
    if not isinstance(value, int | float) or isinstance(value, bool) or not 0 <= value <= 1:
        raise ProfileError(f"{where}: must be a probability in [0, 1], got {value!r}")
    return float(value)


def _pos_num(value: Any, where: str, allow_zero: bool = False) -> float:
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if not ok or value < 0 or (value == 0 and not allow_zero):
        raise ProfileError(f"{where}: must be a {'non-negative' if allow_zero else 'positive'} "
                           f"number, got {value!r}")
    return float(value)


# --- classes and profiles -------------------------------------------------------------------


@dataclass(frozen=True)
class Retry:
    max_retries: int = 0
    on_status: tuple[int, ...] = (429, 503)
    backoff_s: float = 0.5  # base of exponential backoff with full jitter
    honour_retry_after: bool = False  # agent loops often do not; capped at max_wait_s if they do
    max_wait_s: float = 10.0
    idempotency_key: bool = True
    replay_probability: float = 0.0  # resend a completed request (lost response): a replay


@dataclass(frozen=True)
class RequestClass:
    name: str
    weight: float
    models: tuple[tuple[str, float], ...]
    prompt_tokens: Dist
    output_tokens: Dist
    max_tokens: str | int = "output"  # "output": the sampled output length; int: always that
    ignore_eos: bool = True  # the engine then generates exactly max_tokens (vLLM bench practice)
    stream: float | None = None  # probability of streaming; None: the run's --stream-ratio
    disconnect_probability: float = 0.0
    disconnect_after: Dist | None = None  # content chunks received before the client drops
    retry: Retry = field(default_factory=Retry)
    tenants: tuple[str, ...] = ()  # only these tenants send this class (empty: any)
    rate_per_min: float | None = None  # its own Poisson stream instead of a weight
    shared_prefix_tokens: int = 0  # a per-tenant system prompt repeated (prefix-cache hits)
    source: str = ""


@dataclass(frozen=True)
class Profile:
    name: str
    source: str
    description: str
    classes: tuple[RequestClass, ...]
    arrival: str = "poisson"
    burst: float = 4.0  # bursty: rate multiplier inside a burst
    burst_fraction: float = 0.1  # bursty: long-run share of time spent in bursts
    burst_mean_s: float = 2.0  # bursty: mean burst length
    default_rate: float = 5.0  # req/s when neither --rate nor --concurrency is given
    stream_ratio: float | None = None
    tenants: tuple[tuple[str, float], ...] = ()  # default tenant mix (by name)
    path: str = ""

    @property
    def weighted(self) -> tuple[RequestClass, ...]:
        return tuple(c for c in self.classes if c.rate_per_min is None)

    @property
    def side_streams(self) -> tuple[RequestClass, ...]:
        return tuple(c for c in self.classes if c.rate_per_min is not None)


PROFILE_KEYS = {"name", "source", "description", "arrival", "burst", "burst_fraction",
                "burst_mean_s", "default_rate", "stream_ratio", "tenants", "classes"}
CLASS_KEYS = {"name", "weight", "models", "model", "prompt_tokens", "output_tokens", "max_tokens",
              "ignore_eos", "stream", "disconnect", "retry", "tenants", "rate_per_min",
              "shared_prefix_tokens", "profile"}
RETRY_KEYS = {"max_retries", "on_status", "backoff_s", "honour_retry_after", "max_wait_s",
              "idempotency_key", "replay_probability"}


def available_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.toml"))


def resolve_path(name_or_path: str) -> Path:
    path = Path(name_or_path)
    if path.suffix == ".toml" and path.exists():
        return path
    candidate = PROFILE_DIR / f"{name_or_path}.toml"
    if candidate.exists():
        return candidate
    raise ProfileError(f"unknown profile {name_or_path!r}: give a path to a .toml file or one of "
                       f"{', '.join(available_profiles())}")


def load_profile(name_or_path: str, _stack: tuple[str, ...] = ()) -> Profile:
    path = resolve_path(name_or_path)
    key = str(path.resolve())
    if key in _stack:
        raise ProfileError(f"{path.name}: profiles import each other in a cycle")
    try:
        raw = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise ProfileError(f"{path}: not valid TOML: {exc}") from None
    return parse_profile(raw, str(path), _stack + (key,))


def parse_profile(raw: dict[str, Any], where: str = "<profile>",
                  _stack: tuple[str, ...] = ()) -> Profile:
    unknown = set(raw) - PROFILE_KEYS
    if unknown:
        raise ProfileError(f"{where}: unknown key(s) {sorted(unknown)}; allowed "
                           f"{sorted(PROFILE_KEYS)}")
    name = raw.get("name")
    if not isinstance(name, str) or not name:
        raise ProfileError(f"{where}: `name` is required")
    source = raw.get("source")
    if not isinstance(source, str) or not source.strip():
        raise ProfileError(f"{where}: `source` is required: say where the numbers come from")
    arrival = raw.get("arrival", "poisson")
    if arrival not in ARRIVALS:
        raise ProfileError(f"{where}.arrival: expected one of {ARRIVALS}, got {arrival!r}")
    burst = _pos_num(raw.get("burst", 4.0), f"{where}.burst")
    if burst < 1:
        raise ProfileError(f"{where}.burst: must be at least 1")
    burst_fraction = _prob(raw.get("burst_fraction", 0.1), f"{where}.burst_fraction")
    if arrival == "bursty" and not 0 < burst_fraction < 1:
        raise ProfileError(f"{where}.burst_fraction: must be strictly between 0 and 1")
    if arrival == "bursty" and burst * burst_fraction > 1:
        raise ProfileError(f"{where}: burst x burst_fraction = {burst * burst_fraction:g} > 1; "
                           "the bursts alone would exceed the mean rate")
    tenants_raw = raw.get("tenants", {})
    if not isinstance(tenants_raw, dict):
        raise ProfileError(f"{where}.tenants: expected a table name = weight")
    tenants = tuple((str(k), _pos_num(v, f"{where}.tenants.{k}")) for k, v in tenants_raw.items())
    stream_ratio = raw.get("stream_ratio")
    if stream_ratio is not None:
        stream_ratio = _prob(stream_ratio, f"{where}.stream_ratio")
    classes_raw = raw.get("classes")
    if not isinstance(classes_raw, list) or not classes_raw:
        raise ProfileError(f"{where}: at least one [[classes]] entry is required")
    classes: list[RequestClass] = []
    for i, entry in enumerate(classes_raw):
        classes.extend(_parse_class(entry, f"{where}: classes[{i}]", source, _stack))
    if not any(c.rate_per_min is None for c in classes):
        raise ProfileError(f"{where}: every class has rate_per_min; give at least one a weight")
    return Profile(
        name=name, source=source, description=str(raw.get("description", "")),
        classes=tuple(classes), arrival=arrival, burst=burst, burst_fraction=burst_fraction,
        burst_mean_s=_pos_num(raw.get("burst_mean_s", 2.0), f"{where}.burst_mean_s"),
        default_rate=_pos_num(raw.get("default_rate", 5.0), f"{where}.default_rate"),
        stream_ratio=stream_ratio, tenants=tenants, path=where,
    )


def _parse_class(entry: Any, where: str, source: str,
                 stack: tuple[str, ...]) -> list[RequestClass]:
    if not isinstance(entry, dict):
        raise ProfileError(f"{where}: expected a table")
    unknown = set(entry) - CLASS_KEYS
    if unknown:
        raise ProfileError(f"{where}: unknown key(s) {sorted(unknown)}; allowed "
                           f"{sorted(CLASS_KEYS)}")
    weight = _pos_num(entry.get("weight", 1.0), f"{where}.weight")
    rate = entry.get("rate_per_min")
    if rate is not None:
        rate = _pos_num(rate, f"{where}.rate_per_min")
    tenants = entry.get("tenants", [])
    if not isinstance(tenants, list) or not all(isinstance(t, str) for t in tenants):
        raise ProfileError(f"{where}.tenants: expected a list of tenant names")
    if "profile" in entry:  # import another profile's classes, overriding what is given here
        allowed = {"profile", "weight", "rate_per_min", "tenants", "name"}
        extra = set(entry) - allowed
        if extra:
            raise ProfileError(f"{where}: with `profile`, only {sorted(allowed)} may be set; "
                               f"got {sorted(extra)}")
        try:
            imported = load_profile(str(entry["profile"]), stack)
        except ProfileError as exc:
            raise ProfileError(f"{where}: {exc}") from None
        total = sum(c.weight for c in imported.weighted) or 1.0
        out = []
        for c in imported.classes:
            changes: dict[str, Any] = {"source": imported.source}
            if rate is not None:
                # the whole imported profile becomes one side stream, split by its weights
                share = c.weight / total if c.rate_per_min is None else 0
                changes["rate_per_min"] = rate * share if share else c.rate_per_min
            elif c.rate_per_min is None:
                changes["weight"] = weight * c.weight / total
            if tenants:
                changes["tenants"] = tuple(tenants)
            changes["name"] = f"{imported.name}/{c.name}" if c.name != imported.name else c.name
            out.append(_replace(c, **changes))
        return [c for c in out if c.rate_per_min is None or c.rate_per_min > 0]

    name = entry.get("name")
    if not isinstance(name, str) or not name:
        raise ProfileError(f"{where}: `name` is required")
    models_raw = entry.get("models", entry.get("model"))
    if isinstance(models_raw, str):
        models = ((models_raw, 1.0),)
    elif isinstance(models_raw, dict) and models_raw:
        models = tuple((str(k), _pos_num(v, f"{where}.models.{k}")) for k, v in models_raw.items())
    else:
        raise ProfileError(f"{where}: `model = \"NAME\"` or `models = {{NAME = weight}}` required")
    if "prompt_tokens" not in entry or "output_tokens" not in entry:
        raise ProfileError(f"{where}: prompt_tokens and output_tokens are required")
    prompt = parse_dist(entry["prompt_tokens"], f"{where}.prompt_tokens")
    output = parse_dist(entry["output_tokens"], f"{where}.output_tokens")
    max_tokens = entry.get("max_tokens", "output")
    if max_tokens != "output":
        max_tokens = _pos_int(max_tokens, f"{where}.max_tokens")
    ignore_eos = entry.get("ignore_eos", True)
    if not isinstance(ignore_eos, bool):
        raise ProfileError(f"{where}.ignore_eos: expected true or false")
    stream = entry.get("stream")
    if stream is not None:
        stream = _prob(float(stream) if isinstance(stream, bool) else stream, f"{where}.stream")
    disc_p, disc_after = 0.0, None
    disconnect = entry.get("disconnect")
    if disconnect is not None:
        if not isinstance(disconnect, dict):
            raise ProfileError(f"{where}.disconnect: expected {{probability = P, after_chunks = "
                               "{dist = ...}}}")
        extra = set(disconnect) - {"probability", "after_chunks"}
        if extra:
            raise ProfileError(f"{where}.disconnect: unknown key(s) {sorted(extra)}")
        disc_p = _prob(disconnect.get("probability", 1.0), f"{where}.disconnect.probability")
        disc_after = parse_dist(disconnect.get("after_chunks", {"dist": "uniform", "min": 1,
                                                                "max": 50}),
                                f"{where}.disconnect.after_chunks")
        if disc_p > 0 and stream == 0:
            raise ProfileError(f"{where}: disconnect needs streaming, but stream = 0")
    retry = Retry()
    retry_raw = entry.get("retry")
    if retry_raw is not None:
        if not isinstance(retry_raw, dict):
            raise ProfileError(f"{where}.retry: expected a table")
        extra = set(retry_raw) - RETRY_KEYS
        if extra:
            raise ProfileError(f"{where}.retry: unknown key(s) {sorted(extra)}; allowed "
                               f"{sorted(RETRY_KEYS)}")
        on_status = retry_raw.get("on_status", [429, 503])
        if not isinstance(on_status, list) or not all(isinstance(s, int) for s in on_status):
            raise ProfileError(f"{where}.retry.on_status: expected a list of HTTP statuses")
        max_retries = retry_raw.get("max_retries", 2)
        if not isinstance(max_retries, int) or isinstance(max_retries, bool) or not \
                0 <= max_retries <= 10:
            raise ProfileError(f"{where}.retry.max_retries: expected an integer 0..10")
        retry = Retry(
            max_retries=max_retries, on_status=tuple(on_status),
            backoff_s=_pos_num(retry_raw.get("backoff_s", 0.5), f"{where}.retry.backoff_s", True),
            honour_retry_after=bool(retry_raw.get("honour_retry_after", False)),
            max_wait_s=_pos_num(retry_raw.get("max_wait_s", 10.0), f"{where}.retry.max_wait_s"),
            idempotency_key=bool(retry_raw.get("idempotency_key", True)),
            replay_probability=_prob(retry_raw.get("replay_probability", 0.0),
                                     f"{where}.retry.replay_probability"),
        )
    prefix = entry.get("shared_prefix_tokens", 0)
    if not isinstance(prefix, int) or prefix < 0:
        raise ProfileError(f"{where}.shared_prefix_tokens: expected a non-negative integer")
    return [RequestClass(
        name=name, weight=weight, models=models, prompt_tokens=prompt, output_tokens=output,
        max_tokens=max_tokens, ignore_eos=ignore_eos, stream=stream,
        disconnect_probability=disc_p, disconnect_after=disc_after, retry=retry,
        tenants=tuple(tenants), rate_per_min=rate, shared_prefix_tokens=prefix, source=source,
    )]


def _replace(c: RequestClass, **changes: Any) -> RequestClass:
    import dataclasses

    return dataclasses.replace(c, **changes)


# --- sampling ----------------------------------------------------------------------------------


@dataclass
class RequestSpec:
    """One logical request, fully decided before it is sent (so a seed reproduces a run)."""

    cls: str
    tenant: str
    model: str
    prompt_tokens: int  # target prompt length as the simulated engine counts it
    output_tokens: int  # sampled output length
    max_tokens: int
    ignore_eos: bool
    stream: bool
    disconnect_after: int | None  # content chunks, None: read to the end
    retry: Retry
    shared_prefix_tokens: int
    replay: bool  # resend after completion with the same Idempotency-Key
    seq: int = 0


def weighted_choice(rng: random.Random, items: tuple[tuple[Any, float], ...] | list[Any]) -> Any:
    total = sum(w for _, w in items)
    x = rng.random() * total
    for item, w in items:
        x -= w
        if x < 0:
            return item
    return items[-1][0]


def tenant_mix(profile: Profile, tenants: list[str]) -> tuple[tuple[str, float], ...]:
    """The profile's tenant weights restricted to the tenants we have keys for; uniform when the
    profile names none of them."""
    named = tuple((t, w) for t, w in profile.tenants if t in tenants)
    return named or tuple((t, 1.0) for t in tenants)


def sample_request(cls: RequestClass, tenants: tuple[tuple[str, float], ...],
                   rng: random.Random, stream_ratio: float) -> RequestSpec:
    pool = tuple((t, w) for t, w in tenants if not cls.tenants or t in cls.tenants)
    if not pool:  # the class names tenants we have no key for: use whoever we have
        pool = tenants
    tenant = weighted_choice(rng, pool)
    model = weighted_choice(rng, cls.models)
    prompt = cls.prompt_tokens.sample(rng)
    output = cls.output_tokens.sample(rng)
    max_tokens = output if cls.max_tokens == "output" else int(cls.max_tokens)
    p_stream = cls.stream if cls.stream is not None else stream_ratio
    stream = rng.random() < p_stream
    disconnect_after = None
    if stream and cls.disconnect_after is not None and rng.random() < cls.disconnect_probability:
        disconnect_after = cls.disconnect_after.sample(rng)
    replay = rng.random() < cls.retry.replay_probability
    return RequestSpec(
        cls=cls.name, tenant=tenant, model=model, prompt_tokens=prompt, output_tokens=output,
        max_tokens=max_tokens, ignore_eos=cls.ignore_eos, stream=stream,
        disconnect_after=disconnect_after, retry=cls.retry,
        shared_prefix_tokens=min(cls.shared_prefix_tokens, max(0, prompt - 16)), replay=replay,
    )


def tier_of(tenant: str, declared: dict[str, str] | None = None) -> str:
    if declared and tenant in declared:
        return declared[tenant]
    if tenant in DEMO_TIERS:
        return DEMO_TIERS[tenant]
    for tier in ("free", "standard", "enterprise"):
        if tier in tenant:
            return tier
    return "-"
