"""Capacity policy: which replica a request may enter, by tier and KV occupancy, and the router's
answers (`Choice`, `Refusal`, `UnknownModel`) over any replica that has an id.

Pure: occupancy arrives as integer parts per million, randomness arrives as a `sample` function.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final, Generic, Protocol, TypeVar

PPM: Final = 1_000_000

# Admission ceilings on the chosen replica's *effective* occupancy (scraped + this router's
# optimistic in-flight). A request is admitted while occupancy is strictly below its ceiling.
FREE_CEILING_PPM: Final = 600_000
STANDARD_CEILING_PPM: Final = 850_000
# Enterprise is never placed into a replica at or above 0.92: past that point the engine starts
# preempting, and what enterprise bought is latency, not a queue position.
ENTERPRISE_CEILING_PPM: Final = 920_000

TIER_CEILINGS_PPM: Final[dict[str, int]] = {
    "free": FREE_CEILING_PPM,
    "standard": STANDARD_CEILING_PPM,
    "enterprise": ENTERPRISE_CEILING_PPM,
}

# Flex work (`service_tier: "flex"`) is admitted only into KV that interactive traffic is not
# using: strictly below every tier's ceiling, so a flex request never takes the room a free
# request would still be admitted into, and what it holds is given back by preemption.
FLEX_CEILING_PPM: Final = 500_000


@dataclass(frozen=True, slots=True)
class FlexPolicy:
    """Where flex work may run. `backfill_reserved`: it may enter replicas kept for reserved
    (enterprise) traffic while they are below the flex ceiling, because an enterprise request
    that needs the room preempts it (`preemption_plan`)."""

    ceiling_ppm: int = FLEX_CEILING_PPM
    backfill_reserved: bool = True

    def __post_init__(self) -> None:
        lowest = min(TIER_CEILINGS_PPM.values())
        if not 0 < self.ceiling_ppm < lowest:
            raise ValueError(
                f"the flex ceiling must be within (0, {lowest}) ppm, below every tier's ceiling"
            )


DEFAULT_FLEX: Final = FlexPolicy()

T = TypeVar("T")
Sample = Callable[[Sequence[T], int], Sequence[T]]


class Placed(Protocol):
    """What the router's answers need of a replica: its id. The edge's `Replica` port
    (`api/ports.py`) adds how a generation is opened on it."""

    @property
    def replica_id(self) -> str: ...


R_co = TypeVar("R_co", bound=Placed, covariant=True)


@dataclass(frozen=True, slots=True)
class Choice(Generic[R_co]):
    """A replica the router dispatched to. Hand it back to `Fleet.release` when the request ends."""

    replica: R_co
    occupancy_ppm: int  # effective occupancy at choice, for RequestRouted
    est_kv_tokens: int
    dispatch_id: int
    # Flex requests on this replica to abort before this one runs (request ids): the router gave
    # their KV to it. The caller preempts them (`Edge.preempt`); the router already counts their
    # KV as free.
    preempt: tuple[str, ...] = ()
    # Those of them that another edge serves (from `Fleet.others_flex`): the caller asks for
    # their preemption through the log, and tells `others_flex.ask`, which then counts their
    # KV as being freed.
    preempt_remote: tuple[str, ...] = ()
    region: str = ""  # the replica's region ("" when it was given none), for RequestRouted

    @property
    def replica_id(self) -> str:
        return self.replica.replica_id


@dataclass(frozen=True, slots=True)
class Refusal:
    """No replica may take the request: a 503 capacity answer, never a 429."""

    model: str
    detail: str  # no_replica | over_ceiling | reserved_only
    ceiling_ppm: int
    best_occupancy_ppm: int | None = None
    reason: str = "capacity"


@dataclass(frozen=True, slots=True)
class UnknownModel:
    """No replica serves this model version at all: the gateway answers 404."""

    model: str


@dataclass(frozen=True, slots=True)
class TpotEstimate:
    """Fleet-wide p95 time per output token over the last 30 s, for one model."""

    p95_us: int
    samples: int  # finished requests in the window
    age_s: float  # since the window last held any request


@dataclass(frozen=True, slots=True)
class ReplicaLoad:
    """One healthy replica as the policy sees it."""

    replica_id: str
    occupancy_ppm: int  # effective occupancy: scraped + optimistic in-flight
    reserved_only: bool = False  # only enterprise traffic (and flex backfill) may enter
    # Flex requests this router runs there, newest last: (request id, estimated KV tokens as ppm
    # of the replica's capacity). What preemption could free for an interactive request.
    flex: tuple[tuple[str, int], ...] = ()
    region: str = ""  # where it runs (domain.residency); "" when it was given none


@dataclass(frozen=True, slots=True)
class Placement:
    replica_id: str
    occupancy_ppm: int


@dataclass(frozen=True, slots=True)
class CapacityRefusal:
    """Why no replica could take the request. `reason` is always "capacity" (a 503, never a 429)."""

    detail: str  # no_replica | over_ceiling | reserved_only
    ceiling_ppm: int
    best_occupancy_ppm: int | None = None
    reason: str = "capacity"


def effective_occupancy_ppm(scraped_ppm: int, inflight_tokens: int, capacity_tokens: int) -> int:
    """Scraped occupancy plus what this router dispatched since the scrape, in ppm.

    A replica with unknown capacity counts as full so that nothing is routed to it blind.
    """
    if capacity_tokens <= 0:
        return PPM
    return max(0, scraped_ppm) + max(0, inflight_tokens) * PPM // capacity_tokens


def tier_ceiling_ppm(tier: str) -> int:
    try:
        return TIER_CEILINGS_PPM[tier]
    except KeyError:
        raise ValueError(f"unknown tier {tier!r}") from None


def admits(tier: str, load: ReplicaLoad) -> bool:
    """Whether `load` may take one more request of `tier`."""
    if load.reserved_only and tier != "enterprise":
        return False
    return load.occupancy_ppm < tier_ceiling_ppm(tier)


def place_flex(
    candidates: Sequence[ReplicaLoad], sample: Sample[ReplicaLoad], flex: FlexPolicy = DEFAULT_FLEX
) -> Placement | CapacityRefusal:
    """Choose a replica for a flex request: the p2c winner, if it is below the flex ceiling.

    Judged on the winner alone, as free is: flex is the first work to be refused, and a refusal
    costs it nothing (it is not billed, and a batch item is simply tried later)."""
    ceiling = flex.ceiling_ppm
    if not candidates:
        return CapacityRefusal(detail="no_replica", ceiling_ppm=ceiling)
    eligible = [c for c in candidates if flex.backfill_reserved or not c.reserved_only]
    if not eligible:
        return CapacityRefusal(detail="reserved_only", ceiling_ppm=ceiling)
    pick = p2c_pick(eligible, sample)
    assert pick is not None
    if pick.occupancy_ppm < ceiling:
        return Placement(pick.replica_id, pick.occupancy_ppm)
    best = min(c.occupancy_ppm for c in eligible)
    return CapacityRefusal(detail="over_ceiling", ceiling_ppm=ceiling, best_occupancy_ppm=best)


@dataclass(frozen=True, slots=True)
class Preemption:
    """Abort `victims` (flex request ids) on `replica_id`, then place the interactive request
    there: its occupancy without them is `occupancy_ppm`."""

    replica_id: str
    victims: tuple[str, ...]
    occupancy_ppm: int


def preemption_plan(tier: str, candidates: Sequence[ReplicaLoad]) -> Preemption | None:
    """For an interactive request of `tier` that `place` refused for capacity: the replica where
    aborting the fewest flex requests brings the occupancy under the tier's ceiling, or None.

    Victims are taken newest first (vLLM's own choice under `--scheduling-policy priority`: the
    largest (priority, arrival)), which loses the least generated work. Replicas the tier may not
    enter are never considered, so preemption never lets a tier in where it has no right to be.
    """
    ceiling = tier_ceiling_ppm(tier)
    best: Preemption | None = None
    for load in candidates:
        if not load.flex or (load.reserved_only and tier != "enterprise"):
            continue
        occupancy, victims = load.occupancy_ppm, []
        for request_id, ppm in reversed(load.flex):
            if occupancy < ceiling:
                break
            victims.append(request_id)
            occupancy -= ppm
        if occupancy >= ceiling:
            continue  # even without all its flex work this replica has no room
        if best is None or len(victims) < len(best.victims):
            best = Preemption(load.replica_id, tuple(victims), max(0, occupancy))
    return best


def p2c_pick(candidates: Sequence[ReplicaLoad], sample: Sample[ReplicaLoad]) -> ReplicaLoad | None:
    """Power of two choices: the less occupied of two replicas drawn at random.

    Drawing two instead of taking the global minimum is what stops every router herding onto the
    one replica that looked emptiest in the last scrape. A tie keeps the first drawn.
    """
    if not candidates:
        return None
    if len(candidates) == 1:
        return candidates[0]
    a, b = sample(candidates, 2)
    return b if b.occupancy_ppm < a.occupancy_ppm else a


def place(
    tier: str, candidates: Sequence[ReplicaLoad], sample: Sample[ReplicaLoad]
) -> Placement | CapacityRefusal:
    """Choose a replica for a request of `tier` among the healthy replicas of its model.

    free and standard are judged on the p2c winner alone: the other draw is at least as full, so
    looking further would turn p2c back into "pick the emptiest". Enterprise that finds the winner
    at or over its ceiling tries the other draw and then every remaining replica, emptiest first.
    """
    ceiling = tier_ceiling_ppm(tier)
    if not candidates:
        return CapacityRefusal(detail="no_replica", ceiling_ppm=ceiling)
    eligible = [c for c in candidates if tier == "enterprise" or not c.reserved_only]
    if not eligible:
        return CapacityRefusal(detail="reserved_only", ceiling_ppm=ceiling)
    pick = p2c_pick(eligible, sample)
    assert pick is not None
    if admits(tier, pick):
        return Placement(pick.replica_id, pick.occupancy_ppm)
    if tier == "enterprise":
        for other in sorted(eligible, key=lambda c: c.occupancy_ppm):
            if admits(tier, other):
                return Placement(other.replica_id, other.occupancy_ppm)
    best = min(c.occupancy_ppm for c in eligible)
    return CapacityRefusal(detail="over_ceiling", ceiling_ppm=ceiling, best_occupancy_ppm=best)


# --- LoRA adapter slots ------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class AdapterRef:
    """A request for a LoRA adapter, as the router and the replica need it: the engine's name
    for this registration (`domain.control_plane.adapters.engine_name`), the directory a replica
    loads it from, and the name the client asked for (what its answer says it was served)."""

    engine_name: str
    path: str
    answer_as: str


@dataclass(frozen=True, slots=True)
class AdapterSlots:
    """A replica's LoRA slots as the router sees them. `max_loras` is vLLM's `--max-loras` (0:
    LoRA is not enabled there, so it serves no adapter); `held` the adapters registered there,
    least recently used first; `busy` those of them with a request in flight.

    The router keeps at most `max_loras` adapters registered on a replica, so that every one it
    holds can run in the same batch: vLLM would register more, but a request whose adapter finds
    the batch's slots taken waits in its queue (`waiting_by_reason="deferred"`) however empty
    the KV cache is, which is a queue the router could not see."""

    max_loras: int
    held: tuple[str, ...] = ()
    busy: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class SlotPlan:
    """What placing an adapter's request on a replica takes: `load` it first (it is not held
    there), after unloading `evict` (the least recently used idle adapter) to free its slot."""

    load: bool = False
    evict: str | None = None


def slot_plan(adapter: str, slots: AdapterSlots) -> SlotPlan | None:
    """How a replica could serve `adapter`: as it is (held), by loading it into a free slot or
    into the slot of its least recently used idle adapter; None when it cannot (LoRA off, or
    every slot held by an adapter with a request in flight)."""
    if slots.max_loras <= 0:
        return None
    if adapter in slots.held:
        return SlotPlan()
    if len(slots.held) < slots.max_loras:
        return SlotPlan(load=True)
    idle = [name for name in slots.held if name not in slots.busy]
    return SlotPlan(load=True, evict=idle[0]) if idle else None


L = TypeVar("L", bound=ReplicaLoad)


def adapter_rounds(
    adapter: str, loads: Sequence[L], slots_of: Callable[[str], AdapterSlots]
) -> tuple[list[L], list[L]]:
    """The replicas an adapter's request may be placed on, in two rounds: those that hold it
    (tried first: no load, and the engine's LoRA cache is warm), then those with a slot for it.
    A replica in neither has no slot: it is not capacity for this request, however empty."""
    holding: list[L] = []
    loadable: list[L] = []
    for load in loads:
        plan = slot_plan(adapter, slots_of(load.replica_id))
        if plan is None:
            continue
        (loadable if plan.load else holding).append(load)
    return holding, loadable
