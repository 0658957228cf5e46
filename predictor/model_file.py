"""The exported model's file: JSON, versioned, self-describing (predictor/README.md, "Model
files"). Reading one needs neither torch nor numpy."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from tollgate_llm.domain.prediction import ExportedModel, Layer
from tollgate_llm.domain.registry import parse_instant

FORMAT = "tollgate-output-predictor"
FORMAT_VERSION = 2  # 2: per-tenant scales; a version-1 file (no scales) is still read
_READS = (1, 2)
# Offsets for ~100k tenants fit; anything bigger is not one of ours.
MAX_FILE_BYTES = 16 * 1024 * 1024
PREFIX = "output-predictor-"


class ModelFileError(ValueError):
    """A model file that is not one, or not one this code can read; the message says why."""


@dataclass(frozen=True)
class ModelFile:
    """A trained model and what it was trained on."""

    model: ExportedModel
    trained_at: datetime
    window_from: datetime  # the first and last admission of the requests it learned from
    window_to: datetime
    holdout_from: datetime | None  # requests admitted from then on were held out
    examples: int
    seed: int
    min_history: int
    training: dict[str, Any] = field(default_factory=dict)  # loss, epochs, seconds, versions
    tenants: dict[str, dict[str, Any]] = field(default_factory=dict)  # calibration, per tenant

    @property
    def version(self) -> str:
        return self.model.version


def new_version(trained_at: datetime, layers: list[dict[str, Any]]) -> str:
    """`op-<UTC instant>-<8 hex of the weights>`: ordered by training time, and two files with
    the same name hold the same weights."""
    digest = hashlib.sha256(json.dumps(layers, sort_keys=True).encode()).hexdigest()[:8]
    return f"op-{trained_at.strftime('%Y%m%dT%H%M%SZ')}-{digest}"


def to_json(mf: ModelFile) -> dict[str, Any]:
    m = mf.model
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "version": m.version,
        "quantile": m.quantile,
        "features": list(m.features),
        "output": "ln(1 + output_tokens) / 10 at the quantile, before the tenant offset",
        "layers": [
            {"weights": [list(row) for row in layer.weights], "bias": list(layer.bias)}
            for layer in m.layers
        ],
        "activation": "relu between layers, none after the last",
        "tenant_offsets": dict(sorted(m.tenant_offsets.items())),
        "tenant_scales": dict(sorted(m.tenant_scales.items())),
        "trained_at": _instant(mf.trained_at),
        "window": {"from": _instant(mf.window_from), "to": _instant(mf.window_to)},
        "holdout_from": _instant(mf.holdout_from) if mf.holdout_from else None,
        "examples": mf.examples,
        "seed": mf.seed,
        "min_history": mf.min_history,
        "training": mf.training,
        "tenants": mf.tenants,
    }


def from_json(data: Any) -> ModelFile:
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ModelFileError(f"not a {FORMAT} file")
    if data.get("format_version") not in _READS:
        raise ModelFileError(
            f"format_version {data.get('format_version')!r}; this code reads {_READS}"
        )
    try:
        layers = tuple(
            Layer(
                tuple(tuple(float(w) for w in row) for row in layer["weights"]),
                tuple(float(b) for b in layer["bias"]),
            )
            for layer in data["layers"]
        )
        offsets = {str(t): float(o) for t, o in data["tenant_offsets"].items()}
        scales = {str(t): float(s) for t, s in (data.get("tenant_scales") or {}).items()}
        model = ExportedModel(
            str(data["version"]), float(data["quantile"]), layers, offsets,
            tuple(data["features"]), scales,
        )  # fmt: skip
        window = data["window"]
        holdout = data.get("holdout_from")
        return ModelFile(
            model=model,
            trained_at=_parse(data["trained_at"]),
            window_from=_parse(window["from"]),
            window_to=_parse(window["to"]),
            holdout_from=_parse(holdout) if holdout else None,
            examples=int(data["examples"]),
            seed=int(data["seed"]),
            min_history=int(data["min_history"]),
            training=dict(data.get("training") or {}),
            tenants=dict(data.get("tenants") or {}),
        )
    except ModelFileError:
        raise
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelFileError(f"malformed model file: {exc}") from None


# --- the files of every trained model (this one and the router's, router_file.py) -------------


def write_whole(directory: Path, name: str, data: dict[str, Any]) -> Path:
    """Write a model's JSON whole or not at all (a temporary file renamed into place)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)
    return path


def read_bounded(path: Path, error: type[ValueError]) -> Any:
    """A model file's JSON, refused (as `error`, saying why) above MAX_FILE_BYTES or not JSON."""
    size = path.stat().st_size
    if size > MAX_FILE_BYTES:
        raise error(f"{path} is {size} bytes, above the {MAX_FILE_BYTES} a model may be")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise error(f"{path} is not JSON: {exc.msg} at line {exc.lineno}") from None


def newest(directory: Path, pattern: str) -> Path | None:
    """The newest file matching `pattern` in `directory` (versions sort by training time)."""
    if not directory.is_dir():
        return None
    found = sorted(directory.glob(pattern))
    return found[-1] if found else None


def save(mf: ModelFile, directory: Path) -> Path:
    return write_whole(directory, f"{PREFIX}{mf.version}.json", to_json(mf))


def load(path: Path) -> ModelFile:
    return from_json(read_bounded(path, ModelFileError))


def latest(directory: Path) -> Path | None:
    """The newest model file in `directory`, or None."""
    return newest(directory, f"{PREFIX}op-*.json")


def _instant(at: datetime) -> str:
    return at.isoformat().replace("+00:00", "Z")


def _parse(text: str) -> datetime:
    return parse_instant(text)
