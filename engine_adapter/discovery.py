"""What each replica serves, read once at start-up from its /v1/models: the engine's name for the
model, its context length, and where its tokenizer is; from them each replica gets the name to
send, the output cap and the prompt estimator (engine_adapter/tokenizers.py)."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import aiohttp

from tollgate_llm.engine_adapter.tokenizers import PromptTokenEstimator, estimator_for
from tollgate_llm.engine_adapter.vllm_http import (
    ModelCard,
    ReplicaUnavailable,
    VLLMReplica,
    fetch_models,
)

log = logging.getLogger("tollgate.discovery")


class ReplicaMismatch(Exception):
    """A replica that does not serve what it was registered for (a configuration error)."""


@dataclass(frozen=True, slots=True)
class ServedModel:
    """One model version as the fleet serves it (from the first replica that answered)."""

    model: str
    served_name: str
    max_model_len: int | None
    estimator: PromptTokenEstimator | None
    tokenizer_dir: str | None


def pick_card(replica: VLLMReplica, cards: Sequence[ModelCard]) -> ModelCard:
    """The card of the replica's model: the one named like it, else the only one (a replica
    started without --served-model-name serves its path)."""
    for card in cards:
        if card.id == replica.model:
            return card
    if len(cards) == 1:
        return cards[0]
    names = ", ".join(c.id for c in cards) or "nothing"
    raise ReplicaMismatch(
        f"replica {replica.replica_id} at {replica.url} serves {names}, not {replica.model}; "
        f"start it with --served-model-name {replica.model}"
    )


async def discover(
    session: aiohttp.ClientSession,
    replicas: Sequence[VLLMReplica],
    *,
    simulated: bool,
    tokenizers: Mapping[str, str] | None = None,
    default_max_model_len: Mapping[str, int] | None = None,
) -> dict[str, ServedModel]:
    """Configure each replica from its /v1/models and return what each model version is served
    as. `tokenizers` (model -> directory) wins over the `root` the replica reports; a replica
    that cannot be reached keeps its defaults (`default_max_model_len`, the profile's) and is
    described by the next one that answers."""
    tokenizers = tokenizers or {}
    estimators: dict[str, PromptTokenEstimator | None] = {}
    served: dict[str, ServedModel] = {}
    for replica in replicas:
        try:
            card: ModelCard | None = pick_card(replica, await fetch_models(session, replica.url))
        except ReplicaUnavailable as exc:
            log.warning(
                "replica %s: %s; using the model profile's defaults", replica.replica_id, exc
            )
            card = None
        directory = tokenizers.get(replica.model)
        if directory is None and card is not None and card.root and Path(card.root).is_dir():
            directory = card.root
        key = "simulated" if simulated else (directory or "")
        if key not in estimators:
            estimators[key] = estimator_for(simulated=simulated, model_dir=directory)
        estimator = estimators[key]
        max_model_len = (card.max_model_len if card else None) or (
            default_max_model_len or {}
        ).get(replica.model)
        replica.configure(
            served_model=card.id if card else None,
            max_model_len=max_model_len,
            estimator=estimator,
        )
        if replica.model not in served or served[replica.model].max_model_len is None:
            served[replica.model] = ServedModel(
                replica.model, replica.served_model, max_model_len, estimator, directory
            )
    for model in served.values():
        if model.estimator is None:
            log.warning(
                "%s: no tokenizer readable here (give --tokenizer %s=DIR): admission estimates "
                "its prompts roughly and max_tokens is capped at the context only",
                model.model, model.model,
            )  # fmt: skip
    return served
