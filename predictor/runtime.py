"""The `OutputPredictor` the edge is given (api/ports.py): a model file loaded into
`domain.prediction.Forecaster`, its history warmed from the log's recent requests so that a
restarted edge predicts at once, and the coverage figures `/metrics` and `predictor status`
show. Imports no torch: the model is plain arithmetic."""

from __future__ import annotations

from pathlib import Path

from tollgate_llm.domain.prediction import (
    CoverageTracker,
    Forecaster,
    History,
    Prediction,
    RequestShape,
    Skip,
)
from tollgate_llm.ledger.store import EventStore
from tollgate_llm.predictor import model_file
from tollgate_llm.predictor.dataset import read_requests, timeline

COVERAGE_MARGIN = 0.03  # the tenant falls back below quantile − 3 points
COVERAGE_WINDOW = 500  # over its last 500 predicted, completed requests
COVERAGE_MIN_SAMPLES = 300  # a calibrated model (p95) trips this by chance about never
WARM_REQUESTS = 20_000  # the most recent requests read at start-up to rebuild the history


class LoadedPredictor:
    def __init__(
        self,
        loaded: model_file.ModelFile | None,
        *,
        margin: float = COVERAGE_MARGIN,
        window: int = COVERAGE_WINDOW,
        min_samples: int = COVERAGE_MIN_SAMPLES,
    ) -> None:
        self.loaded = loaded
        quantile = loaded.model.quantile if loaded else 0.95
        min_history = loaded.min_history if loaded else 20
        self.forecaster = Forecaster(
            loaded.model if loaded else None,
            History(min_history),
            CoverageTracker(quantile, margin=margin, window=window, min_samples=min_samples),
        )

    @classmethod
    def from_path(cls, path: Path) -> LoadedPredictor:
        """A file, or the newest model file in a directory (none there: no model, every
        request reserves its cap, which `/metrics` counts as `no_model`)."""
        found = _model_at(path)
        return cls(model_file.load(found) if found is not None else None)

    def reload(self, path: Path) -> bool:
        """Load the newest model at `path` if it is not the one in use (a retrained model:
        every tenant's coverage starts again, its history is kept). A file that cannot be read
        is left for the next try, and the model in use stays."""
        found = _model_at(path)
        if found is None:
            return False
        try:
            loaded = model_file.load(found)
        except (OSError, model_file.ModelFileError):
            return False
        if self.loaded is not None and loaded.version == self.loaded.version:
            return False
        self.loaded = loaded
        self.forecaster.history.min_history = loaded.min_history
        self.forecaster.coverage.target = loaded.model.quantile
        self.forecaster.replace_model(loaded.model)
        return True

    @property
    def version(self) -> str | None:
        return self.loaded.version if self.loaded else None

    def warm(self, store: EventStore, max_requests: int = WARM_REQUESTS) -> int:
        """Feed the history with the log's most recent completed requests (what this edge
        would have seen had it been running); returns how many."""
        fed = 0
        # About seven events per request: start that far back in the log, not at its beginning.
        after = max(0, store.last_position() - 10 * max_requests)
        found = read_requests(store, max_requests=max_requests, after_position=after)
        for is_end, q in timeline(found):
            if is_end and q.terminal == "completed":
                s = q.shape
                self.forecaster.history.observe(
                    s.tenant_id, s.key_id, s.model, s.system_prompt_bucket, q.completion_tokens,
                    prompt_tokens=s.prompt_tokens,
                )  # fmt: skip
                fed += 1
        return fed

    def predict(self, shape: RequestShape) -> Prediction | Skip:
        return self.forecaster.predict(shape)

    def observe(
        self, shape: RequestShape, reserved_output_tokens: int | None, output_tokens: int
    ) -> None:
        self.forecaster.observe(shape, reserved_output_tokens, output_tokens)

    def coverage(self) -> dict[str, tuple[float, int, bool]]:
        """Per tenant: (realised coverage, requests it is over, falling back)."""
        tracker = self.forecaster.coverage
        out = {}
        for tenant in tracker.tenants():
            found = tracker.coverage(tenant)
            if found is not None:
                out[tenant] = (*found, tracker.falling_back(tenant))
        return out


def _model_at(path: Path) -> Path | None:
    """A file as given (missing: None, the directory was meant and is not there yet), or the
    newest model file of a directory."""
    if path.is_dir():
        return model_file.latest(path)
    return path if path.exists() else None
