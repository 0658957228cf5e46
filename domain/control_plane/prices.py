"""The price book: each model's prices (`PriceSet`) and flex discounts (`FlexDiscountSet`) on
its "prices-<model>" stream, folded with their history (`ControlView.prices`), so a request is
billed at the price in force when it was admitted whenever the bill is made.
"""

from __future__ import annotations

import bisect
from datetime import datetime
from typing import Final, TypeVar

from tollgate_llm.domain.control_plane.events import FlexDiscountSet, PriceSet
from tollgate_llm.domain.cost import Price, base_model
from tollgate_llm.domain.envelope import Event
from tollgate_llm.domain.errors import DomainError

__all__ = [
    "DEFAULT_FLEX_DISCOUNT_PPM", "PRICE_EVENTS", "PriceBook", "flex_price", "in_force", "insort",
]  # fmt: skip

PRICE_EVENTS: Final = (PriceSet, FlexDiscountSet)
# The flex class's discount where a model has no FlexDiscountSet: OpenAI's flex and Batch price.
DEFAULT_FLEX_DISCOUNT_PPM: Final = 500_000

_T = TypeVar("_T")


class PriceBook:
    """Prices and flex discounts by model name or version, each a history by effective instant
    (and `seq`, the order recorded, among entries of the same instant)."""

    def __init__(self) -> None:
        self._prices: dict[str, list[tuple[datetime, int, Price]]] = {}
        self._flex_discounts: dict[str, list[tuple[datetime, int, int]]] = {}

    def apply(self, event: Event, at: datetime, seq: int) -> None:
        match event:
            case PriceSet():
                price = Price(
                    event.model,
                    event.prompt_micros_per_mtok,
                    event.completion_micros_per_mtok,
                    event.cached_micros_per_mtok,
                    event.currency,
                )
                # A price is never in force before it was recorded: a back-dated PriceSet must not
                # re-price requests that already ran (and may already be billed).
                effective = max(event.effective_at, at)
                insort(self._prices.setdefault(event.model, []), (effective, seq, price))
            case FlexDiscountSet():
                effective = max(event.effective_at, at)  # never before it was recorded
                discounts = self._flex_discounts.setdefault(event.model, [])
                insort(discounts, (effective, seq, event.discount_ppm))

    def price(
        self, model: str, at: datetime, service_tier: str = "default", adapter: str = ""
    ) -> Price:
        """The price in force for a model (exact version first, else its base name) at `at`;
        for the flex class, that price less the flex discount in force at `at`. `adapter` (a
        LoRA adapter's price key, `Adapter.price_key`): its own price first, where one was set."""
        for name in (adapter, model, base_model(model)) if adapter else (model, base_model(model)):
            found = in_force(self._prices.get(name), at)
            if found is not None:
                if service_tier == "flex":
                    return flex_price(found, self.flex_discount_ppm(model, at))
                return found
        raise DomainError("no_price", f"no price for {model!r} in force at {at}", field="model")

    def flex_discount_ppm(self, model: str, at: datetime) -> int:
        """The flex discount in force for a model at `at` (exact version first, else its base
        name), in ppm of its price; OpenAI's 50 % where none was ever set."""
        for name in (model, base_model(model)):
            found = in_force(self._flex_discounts.get(name), at)
            if found is not None:
                return found
        return DEFAULT_FLEX_DISCOUNT_PPM

    def ever_priced(self, name: str) -> bool:
        """Whether a price was ever set under `name` (a model, or an adapter's price key)."""
        return bool(self._prices.get(name))

    def currencies(self) -> frozenset[str]:
        """Every currency a price was ever set in (ISO 4217 codes)."""
        return frozenset(
            price.currency for history in self._prices.values() for _, _, price in history
        )


def flex_price(price: Price, discount_ppm: int) -> Price:
    """`price` less `discount_ppm` of it, each rate rounded half up to a whole micro-unit."""

    def off(micros: int) -> int:
        return (micros * (1_000_000 - discount_ppm) + 500_000) // 1_000_000

    return Price(
        price.model,
        off(price.prompt_micros_per_mtok),
        off(price.completion_micros_per_mtok),
        off(price.cached_micros_per_mtok),
        price.currency,
    )


def in_force(history: list[tuple[datetime, int, _T]] | None, at: datetime) -> _T | None:
    """The entry of a dated history in force at `at` (None: none yet)."""
    if not history:
        return None
    index = bisect.bisect_right(history, at, key=lambda entry: entry[0])
    return history[index - 1][2] if index else None


def insort(history: list[tuple[datetime, int, _T]], entry: tuple[datetime, int, _T]) -> None:
    # Ordered by (instant, seq), which is unique, so the payload is never compared.
    bisect.insort(history, entry, key=lambda e: (e[0], e[1]))
