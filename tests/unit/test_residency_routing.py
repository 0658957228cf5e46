"""Data residency in routing (issue 30, item 2): a request of a tenant pinned to regions is never
routed to a replica outside them, by any step of the router (p2c, the enterprise scan, flex
preemption, other edges' flex work) or of admission (the consented fallback); with no room in
its regions it is refused 503 `region_unavailable`, and every RequestRouted says the region.

The router is the real one (`engine_adapter.fleet.Fleet`, scrapes fed directly), the edge the
real one over the fakes of tests/fakes.py."""

from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests import builders as b
from tests.fakes import FakeReplica
from tests.unit.test_cross_edge_preemption import _records
from tests.unit.test_edge import CALLER, MODEL, OTHER, Harness
from tollgate_llm.api.services.edge import JsonOutcome
from tollgate_llm.api.services.errors import ApiError
from tollgate_llm.domain.capacity import Choice, Refusal
from tollgate_llm.domain.control_plane.data_policy import ResidencySet, RetentionSet
from tollgate_llm.domain.control_plane.events import FallbackAllowed
from tollgate_llm.domain.remote_flex import RemoteFlex
from tollgate_llm.domain.requests.events import RequestAdmitted, RequestRejected, RequestRouted
from tollgate_llm.domain.residency import REGION_UNAVAILABLE, confine, in_region
from tollgate_llm.engine_adapter.fleet import Fleet
from tollgate_llm.engine_adapter.vllm_http import ReplicaMetrics

REGIONS = ("eu-west", "eu-central", "us-east", "")  # "": a replica given no region
TIERS = ("free", "standard", "enterprise")


class PlacedReplica(FakeReplica):
    """A fake replica the real fleet can hold (what its scraper and registry read)."""

    def __init__(self, replica_id: str, model: str) -> None:
        super().__init__(replica_id, model)
        self.url = f"http://{replica_id}.invalid"
        self.max_model_len: int | None = None

    def close(self) -> None:
        pass


def feed(fleet: Fleet, replica_id: str, occupancy: float) -> None:
    now = time.monotonic()
    metrics = ReplicaMetrics(kv_cache_usage=occupancy, num_gpu_blocks=64, block_size=16)
    fleet.apply_scrape(fleet.state(replica_id), metrics, scrape_started_at=now, now=now)


replica_specs = st.lists(
    st.tuples(st.sampled_from(REGIONS), st.integers(0, 100), st.booleans()),
    min_size=1, max_size=6,
)  # fmt: skip
allowed_regions = st.frozensets(st.sampled_from(REGIONS[:3]), max_size=3)


# --- the pure rule -------------------------------------------------------------------------------


def test_a_replica_given_no_region_serves_no_pinned_request() -> None:
    assert in_region("", None) and in_region("us-east", None)
    assert not in_region("", frozenset({"eu-west"}))
    assert not in_region("us-east", frozenset({"eu-west"})) and not in_region(
        "eu-west", frozenset()
    )
    assert in_region("eu-west", frozenset({"eu-west", "eu-central"}))


# --- the router ----------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(
    specs=replica_specs,
    allowed=allowed_regions,
    tier=st.sampled_from(TIERS),
    flex=st.booleans(),
    flex_load=st.lists(st.integers(1, 400), max_size=6),
    theirs=st.lists(st.tuples(st.integers(0, 5), st.integers(50, 600)), max_size=4),
    seed=st.integers(0, 2**16),
)
def test_no_pinned_request_is_ever_routed_out_of_its_regions(
    specs: list[tuple[str, int, bool]], allowed: frozenset[str], tier: str, flex: bool,
    flex_load: list[int], theirs: list[tuple[int, int]], seed: int,
) -> None:  # fmt: skip
    rng = random.Random(seed)
    fleet = Fleet(None)  # type: ignore[arg-type]  # never scrapes here: scrapes are fed
    for i, (region, percent, reserved) in enumerate(specs):
        fleet.add(PlacedReplica(f"r{i}", MODEL), reserved_only=reserved, region=region)
        feed(fleet, f"r{i}", percent / 100)
    # Flex work of unpinned requests anywhere (what a preemption may free), and other edges'.
    for n, tokens in enumerate(flex_load):
        fleet.choose(MODEL, "free", tokens, rng, service_tier="flex", request_id=f"flex-{n}")
    if theirs:
        view = RemoteFlex("edge-a")
        for n, (index, tokens) in enumerate(theirs):
            on = f"r{index % len(specs)}"
            for record in _records(f"theirs-{n}", "edge-b", replica=on, tokens=tokens):
                view.apply(record)
        fleet.others_flex = view
    where = {s.replica_id: s.region for s in fleet.replicas()}
    flex_on = {rid: s.replica_id for s in fleet.replicas() for rid, _ in s.flex.values()}

    choice = fleet.choose(
        MODEL, tier, 50, rng, service_tier="flex" if flex else "default", request_id="pinned",
        regions=allowed,
    )  # fmt: skip

    if isinstance(choice, Choice):
        assert choice.region in allowed and where[choice.replica_id] == choice.region
        # What it preempts runs where it is placed: nothing moves to another region for it.
        assert all(flex_on[v] == choice.replica_id for v in choice.preempt if v in flex_on)
    else:
        assert isinstance(choice, Refusal)
        if not any(in_region(region, allowed) for region, _, _ in specs):
            assert choice.detail == REGION_UNAVAILABLE


def test_confine_keeps_only_the_allowed_regions_in_order() -> None:
    fleet = Fleet(None)  # type: ignore[arg-type]
    for i, region in enumerate(("eu-west", "us-east", "", "eu-central")):
        fleet.add(PlacedReplica(f"r{i}", MODEL), region=region)
        feed(fleet, f"r{i}", 0.1)
    loads = [s.load() for s in fleet.replicas()]
    kept = confine(loads, frozenset({"eu-central", "eu-west"}))
    assert [load.replica_id for load in kept] == ["r0", "r3"]
    assert confine(loads, None) == loads


# --- admission: fallbacks, refusals, what is recorded --------------------------------------------


class PinnedHarness(Harness):
    """The edge harness over a real fleet: MODEL and OTHER each have a replica per region."""

    def __init__(self, pin: str | None, occupancy: dict[str, float], **kw: Any) -> None:
        super().__init__(**kw)
        self.fleet = fleet = Fleet(None)  # type: ignore[arg-type]
        for model in (MODEL, OTHER):
            for region in ("eu-west", "us-east"):
                replica_id = f"{model}@{region}"
                fleet.add(PlacedReplica(replica_id, model), region=region)
                feed(fleet, replica_id, occupancy.get(replica_id, 0.1))
        self.edge.fleet = self.edge.admission.fleet = self.edge.admission.quota.fleet = fleet
        facts: list[Any] = [FallbackAllowed(b.TENANT, MODEL, OTHER)]
        if pin is not None:
            facts.append(ResidencySet(b.TENANT, "", pin))
        for i, event in enumerate(facts, start=10):
            self.control.apply(b.record(event, version=i, seconds=-30, stream_id="tenant-acme"))

    def routed(self) -> list[RequestRouted]:
        return [r.event for r in self.sink.store.read_all() if isinstance(r.event, RequestRouted)]


async def _ask(h: Harness, n: int, **body: Any) -> int:
    raw = orjson.dumps({
        "model": MODEL, "messages": [{"role": "user", "content": "two words"}], **body,
    })  # fmt: skip
    try:
        out = await h.edge.chat(
            CALLER, raw, request_id=f"req_{n:032x}", idempotency_key=None, retry_count=0
        )
    except ApiError as exc:
        assert exc.status == 503 and exc.code == "region_unavailable", exc.message
        return exc.status
    assert isinstance(out, JsonOutcome)
    return out.status


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    occupancy=st.dictionaries(
        st.sampled_from([f"{m}@{r}" for m in (MODEL, OTHER) for r in ("eu-west", "us-east")]),
        st.integers(0, 100).map(lambda p: p / 100),
    ),
    flex=st.lists(st.booleans(), min_size=1, max_size=6),
)
def test_admission_with_fallbacks_keeps_a_pinned_tenant_in_its_region(
    occupancy: dict[str, float], flex: list[bool]
) -> None:
    h = PinnedHarness("eu-west", occupancy)

    async def go() -> list[int]:
        return [
            await _ask(h, n, max_tokens=5, **({"service_tier": "flex"} if f else {}))
            for n, f in enumerate(flex, start=1)
        ]

    statuses = asyncio.run(go())
    routed = h.routed()
    assert len(routed) == statuses.count(200)
    assert all(r.region == "eu-west" and r.replica_id.endswith("@eu-west") for r in routed)


def test_a_full_region_is_refused_503_region_unavailable_while_another_region_is_idle() -> None:
    h = PinnedHarness("eu-west", {f"{MODEL}@eu-west": 0.99, f"{OTHER}@eu-west": 0.99})

    async def go() -> None:
        with pytest.raises(ApiError) as refused:
            await h.chat(max_tokens=5)
        assert (refused.value.status, refused.value.code) == (503, "region_unavailable")
        assert "Retry-After" in refused.value.headers

    asyncio.run(go())
    assert h.routed() == []
    (rejected,) = [r.event for r in h.sink.store.read_all() if isinstance(r.event, RequestRejected)]
    assert rejected.reason == "capacity"
    assert rejected.detail.startswith("region_unavailable (eu-west)")


def test_an_unpinned_tenant_is_served_anywhere_and_its_region_is_recorded() -> None:
    h = PinnedHarness(None, {f"{MODEL}@eu-west": 0.99})

    async def go() -> None:
        out = await h.chat(max_tokens=5)
        assert isinstance(out, JsonOutcome) and out.status == 200

    asyncio.run(go())
    (routed,) = h.routed()
    assert routed.region == "us-east"


def test_the_fallback_is_taken_in_region_when_the_model_asked_for_has_no_room_there() -> None:
    h = PinnedHarness("eu-west", {f"{MODEL}@eu-west": 0.99})

    async def go() -> None:
        out = await h.chat(max_tokens=5)
        assert isinstance(out, JsonOutcome)
        assert out.headers["X-Tollgate-Downgraded-From"] == MODEL

    asyncio.run(go())
    (routed,) = h.routed()
    assert (routed.replica_id, routed.region) == (f"{OTHER}@eu-west", "eu-west")


def test_a_zero_retention_tenant_is_told_so_and_its_admission_records_the_tier() -> None:
    h = PinnedHarness(None, {})
    h.control.apply(b.record(RetentionSet(b.TENANT, "", "zero"), version=20,
                             stream_id="tenant-acme"))  # fmt: skip

    async def go() -> None:
        out = await h.chat(max_tokens=5)
        assert isinstance(out, JsonOutcome)
        assert out.headers["X-Tollgate-Retention"] == "zero"

    asyncio.run(go())
    (admitted,) = [r.event for r in h.sink.store.read_all() if isinstance(r.event, RequestAdmitted)]
    assert admitted.retention == "zero"
