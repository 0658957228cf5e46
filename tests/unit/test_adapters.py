"""LoRA adapters per tenant (issue 30, item 1), as specifications: registration and revocation
decided and folded (given / when / then), who may ask for an adapter, its price and its cost
to admission, the router's slot rules (pure) and the real fleet placing adapter requests on fed
scrapes, and the edge over fakes answering another tenant exactly as for an unknown model."""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import replace
from typing import Any

import orjson
import pytest

from tests import builders as b
from tests.unit.test_edge import CALLER, MODEL, Harness
from tests.unit.test_residency_routing import PlacedReplica
from tollgate_llm.api.services.auth import Caller
from tollgate_llm.api.services.edge import JsonOutcome
from tollgate_llm.api.services.errors import ApiError
from tollgate_llm.domain.capacity import (
    AdapterRef,
    AdapterSlots,
    Choice,
    Refusal,
    ReplicaLoad,
    SlotPlan,
    adapter_rounds,
    slot_plan,
)
from tollgate_llm.domain.control_plane.adapters import (
    AdapterBook,
    AdapterRegistered,
    AdapterRevoked,
    RegisterAdapter,
    RevokeAdapter,
    adapter_tpot_us,
    decide_adapter,
    price_key,
)
from tollgate_llm.domain.control_plane.decide import decide_control
from tollgate_llm.domain.control_plane.events import ApiKeyIssued, PriceSet, TenantRegistered
from tollgate_llm.domain.control_plane.state import ControlView
from tollgate_llm.domain.cost import Price
from tollgate_llm.domain.envelope import Event
from tollgate_llm.domain.errors import DomainError
from tollgate_llm.domain.governance.events import KeyAssigned, ProjectCreated, WorkspaceCreated
from tollgate_llm.domain.requests.decide import BillUsage, decide
from tollgate_llm.domain.requests.events import RequestAdmitted, RequestEstimated
from tollgate_llm.domain.requests.evolve import fold
from tollgate_llm.engine_adapter.fleet import Fleet
from tollgate_llm.engine_adapter.lora import AdapterBound, ReplicaLoras
from tollgate_llm.engine_adapter.vllm_http import ReplicaMetrics

PATH = "/adapters/support"


def given(*events: Event) -> AdapterBook:
    book = AdapterBook()
    for event in events:
        book.apply(event, b.at(0))
    return book


def registered(**kw: Any) -> AdapterRegistered:
    fields: dict[str, Any] = {
        "tenant_id": b.TENANT, "name": "support", "base_model": "llama-3.1-8b", "path": PATH,
        "rank": 8, "projects": "", "version": 1, **kw,
    }  # fmt: skip
    return AdapterRegistered(**fields)


def register(**kw: Any) -> RegisterAdapter:
    fields: dict[str, Any] = {
        "tenant_id": b.TENANT, "name": "support", "base_model": "llama-3.1-8b", "path": PATH,
        "rank": 8, **kw,
    }  # fmt: skip
    return RegisterAdapter(**fields)


# --- decide and fold -----------------------------------------------------------------------------


def test_a_first_registration_is_version_one() -> None:
    assert decide_adapter(given(), register()) == (registered(),)


def test_the_same_registration_again_changes_nothing() -> None:
    assert decide_adapter(given(registered()), register()) == ()


def test_new_weights_are_a_new_version_under_a_new_engine_name() -> None:
    (event,) = decide_adapter(given(registered()), register(path="/adapters/support-v2"))
    assert isinstance(event, AdapterRegistered) and event.version == 2
    book = given(registered(), event)
    live = book.live(b.TENANT, "support")
    assert live is not None and live.engine_name == f"{b.TENANT}/support@2"


def test_a_revoked_name_registered_again_gets_the_next_version() -> None:
    (event,) = decide_adapter(given(registered(), AdapterRevoked(b.TENANT, "support")), register())
    assert isinstance(event, AdapterRegistered) and event.version == 2


@pytest.mark.parametrize(
    ("command", "rule", "field"),
    [
        (register(name="Support"), "bad_adapter_name", "name"),
        (register(name="a/b"), "bad_adapter_name", "name"),
        (register(name="x" * 65), "bad_adapter_name", "name"),
        (register(path="relative/dir"), "bad_path", "path"),
        (register(path="/" + "p" * 1024), "string_above_max_length", "path"),
        (register(rank=0), "bad_rank", "rank"),
        (register(rank=1025), "bad_rank", "rank"),
        (register(projects=tuple(f"p{i}" for i in range(17))), "too_many_projects", "projects"),
    ],
)
def test_a_malformed_registration_names_its_field(command: RegisterAdapter, rule: str,
                                                  field: str) -> None:  # fmt: skip
    with pytest.raises(DomainError) as refused:
        decide_adapter(given(), command)
    assert (refused.value.rule, refused.value.field) == (rule, field)


def test_revoking_is_once_and_only_what_exists() -> None:
    book = given(registered())
    assert decide_adapter(book, RevokeAdapter(b.TENANT, "support")) == (
        AdapterRevoked(b.TENANT, "support"),
    )
    assert decide_adapter(given(registered(), AdapterRevoked(b.TENANT, "support")),
                          RevokeAdapter(b.TENANT, "support")) == ()  # fmt: skip
    with pytest.raises(DomainError, match="no adapter 'other'"):
        decide_adapter(book, RevokeAdapter(b.TENANT, "other"))


def test_only_its_tenant_and_the_projects_it_names_see_an_adapter() -> None:
    book = given(registered(projects="p1,p2"), registered(tenant_id="bolt", name="mine"))
    assert book.visible(b.TENANT, "support", "p1") is not None
    assert book.visible(b.TENANT, "support", "p3") is None
    assert book.visible(b.TENANT, "support", None) is None  # an organization key
    assert book.visible("bolt", "support", "p1") is None  # another tenant's name
    assert book.visible(b.TENANT, "mine", None) is None
    revoked = given(registered(), AdapterRevoked(b.TENANT, "support"))
    assert revoked.visible(b.TENANT, "support", None) is None
    assert revoked.get(b.TENANT, "support") is not None  # still listed, as revoked


def control(*extra: Event) -> ControlView:
    view = ControlView()
    events = (b.tenant_registered(), b.key_issued(), b.price_set(effective_at=b.at(-60)), *extra)
    for i, event in enumerate(events, start=1):
        stream = "prices-x" if isinstance(event, PriceSet) else "tenant-acme"
        view.apply(b.record(event, version=i, seconds=-60 + i, stream_id=stream))
    return view


def test_the_control_plane_checks_the_base_the_name_and_the_projects() -> None:
    view = control()
    assert decide_control(view, register()) == (registered(),)
    with pytest.raises(DomainError) as refused:
        decide_control(view, register(base_model="no-such-model"))
    assert (refused.value.rule, refused.value.field) == ("no_model_profile", "base")
    for name in ("llama-3.1-8b", "llama-3.1-8b-2026-05"):
        with pytest.raises(DomainError, match="is a model's name"):
            decide_control(view, register(name=name))
    with pytest.raises(DomainError, match="no project 'p1'"):
        decide_control(view, register(projects=("p1",)))
    with pytest.raises(DomainError, match="no tenant 'nobody'"):
        decide_control(view, register(tenant_id="nobody"))


def test_an_adapter_is_billed_at_its_own_price_else_its_bases() -> None:
    own = PriceSet(price_key(b.TENANT, "support"), 7_000_000, 9_000_000, 1_000_000, b.at(-60))
    view = control(own)
    at = b.at(0)
    assert view.price(MODEL, at, adapter=price_key(b.TENANT, "support")).prompt_micros_per_mtok \
        == 7_000_000  # fmt: skip
    assert view.price(MODEL, at, adapter=price_key(b.TENANT, "other")) == view.price(MODEL, at)


def test_a_bill_takes_its_own_adapters_price_and_no_other() -> None:
    state = fold(b.stream(replace(b.admitted(), adapter="support"), b.routed(), b.completed()))
    own = Price(price_key(b.TENANT, "support"), 7_000_000, 9_000_000, 0)
    (bill,) = decide(state, BillUsage(own))
    assert bill.adapter == "support" and bill.prompt_micros_per_mtok == 7_000_000  # type: ignore[attr-defined]
    theirs = Price(price_key("bolt", "support"), 1, 1, 1)
    with pytest.raises(DomainError, match="price for adapter:bolt/support"):
        decide(state, BillUsage(theirs))


def test_an_adapters_rank_stretches_the_time_per_token_admission_assumes() -> None:
    assert adapter_tpot_us(40_000, 0) == 40_000
    assert adapter_tpot_us(40_000, 16) == 40_640  # +1.6 %
    assert adapter_tpot_us(40_000, 64) == 42_560  # +6.4 %


# --- the router's slot rules ---------------------------------------------------------------------


def test_a_slot_plan_serves_a_held_adapter_as_it_is_and_loads_into_a_free_or_idle_slot() -> None:
    assert slot_plan("a", AdapterSlots(0)) is None  # LoRA off
    assert slot_plan("a", AdapterSlots(2, ("a",))) == SlotPlan()
    assert slot_plan("b", AdapterSlots(2, ("a",))) == SlotPlan(load=True)
    # Full: the least recently used idle one makes room; one in use is never unloaded.
    assert slot_plan("c", AdapterSlots(2, ("a", "b"), frozenset({"a"}))) == SlotPlan(True, "b")
    assert slot_plan("c", AdapterSlots(2, ("a", "b"))) == SlotPlan(True, "a")
    assert slot_plan("c", AdapterSlots(2, ("a", "b"), frozenset({"a", "b"}))) is None


def test_replicas_holding_the_adapter_come_first_and_those_without_a_slot_not_at_all() -> None:
    loads = [ReplicaLoad(f"r{i}", 100_000) for i in range(4)]
    slots = {
        "r0": AdapterSlots(1, ("x",), frozenset({"x"})),  # its one slot busy with another
        "r1": AdapterSlots(2, ("a",)), "r2": AdapterSlots(2), "r3": AdapterSlots(0),
    }  # fmt: skip
    holding, loadable = adapter_rounds("a", loads, slots.__getitem__)
    assert [x.replica_id for x in holding] == ["r1"]
    assert [x.replica_id for x in loadable] == ["r2"]


# --- the real fleet on fed scrapes ---------------------------------------------------------------


REF = AdapterRef(f"{b.TENANT}/support@1", PATH, "support")
OTHER_REF = AdapterRef(f"{b.TENANT}/other@1", "/adapters/other", "other")


class LoraReplica(PlacedReplica):
    """A replica the real fleet holds that records what each chat asked the engine for."""

    def __init__(self, replica_id: str, model: str) -> None:
        super().__init__(replica_id, model)
        self.asked: list[tuple[str, str]] = []  # (engine name, answer's name)

    async def open_chat(  # type: ignore[override]
        self, body: dict[str, Any], *, adapter: Any = None, **kw: Any,
    ) -> Any:  # fmt: skip
        if adapter is not None:
            self.asked.append((adapter.engine_name, adapter.answer_as))
        return await super().open_chat(body, **kw)


def fleet_of(*specs: tuple[float, int | None]) -> Fleet:
    """Replicas r0, r1, ... at these occupancies, reporting these --max-loras (None: nothing
    reported yet)."""
    fleet = Fleet(None)  # type: ignore[arg-type]  # never scrapes here: scrapes are fed
    now = time.monotonic()
    for i, (occupancy, max_loras) in enumerate(specs):
        fleet.add(LoraReplica(f"r{i}", MODEL))
        metrics = ReplicaMetrics(
            kv_cache_usage=occupancy, num_gpu_blocks=64, block_size=16, max_loras=max_loras
        )
        fleet.apply_scrape(fleet.state(f"r{i}"), metrics, scrape_started_at=now, now=now)
    return fleet


def choose(fleet: Fleet, ref: AdapterRef | None = REF, tier: str = "standard") -> Any:
    return fleet.choose(MODEL, tier, 10, random.Random(3), adapter=ref)


def test_the_replica_holding_the_adapter_is_preferred_over_an_emptier_one() -> None:
    fleet = fleet_of((0.5, 2), (0.0, 2))
    fleet.state("r0").loras.held["tenant/x"] = 0
    fleet.state("r0").loras.held[REF.engine_name] = 0
    for _ in range(5):
        choice = choose(fleet)
        assert isinstance(choice, Choice) and choice.replica_id == "r0"
        fleet.release(choice)


def test_an_adapter_is_loaded_where_there_is_a_slot_and_its_slot_held_while_it_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[tuple[str, str]] = []

    async def load(session: Any, url: str, name: str, path: str) -> None:
        calls.append(("load", name))

    async def unload(session: Any, url: str, name: str) -> None:
        calls.append(("unload", name))

    monkeypatch.setattr("tollgate_llm.engine_adapter.lora.load_adapter", load)
    monkeypatch.setattr("tollgate_llm.engine_adapter.lora.unload_adapter", unload)

    async def opened(choice: Any) -> None:
        assert isinstance(choice, Choice)
        await choice.replica.open_chat({}, request_id="req", cache_salt="salt")

    fleet = fleet_of((0.1, 1))
    first = choose(fleet)
    assert isinstance(first, Choice) and isinstance(first.replica, AdapterBound)
    loras = fleet.state("r0").loras
    assert loras.held == {REF.engine_name: 1}
    # Its one slot is busy: another adapter has nowhere to go, however empty the KV cache.
    refused = choose(fleet, OTHER_REF)
    assert isinstance(refused, Refusal) and refused.detail == "no_adapter_slot"
    fleet.release(first)
    assert loras.held == {} and calls == []  # never opened, never loaded: its slot is free
    again, also = choose(fleet), choose(fleet)
    asyncio.run(opened(again))
    asyncio.run(opened(also))
    assert calls == [("load", REF.engine_name)]  # loaded once for both
    fleet.release(again)
    fleet.release(also)
    assert loras.held == {REF.engine_name: 0}
    # Idle now: the other adapter takes its slot, the first unloaded before it loads.
    second = choose(fleet, OTHER_REF)
    assert isinstance(second, Choice) and list(loras.held) == [OTHER_REF.engine_name]
    asyncio.run(opened(second))
    assert calls[1:] == [("unload", REF.engine_name), ("load", OTHER_REF.engine_name)]


def test_a_full_holder_gives_way_to_a_replica_that_loads_it() -> None:
    fleet = fleet_of((0.95, 2), (0.2, 2))
    fleet.state("r0").loras.held[REF.engine_name] = 0
    choice = choose(fleet)
    assert isinstance(choice, Choice) and choice.replica_id == "r1"
    assert REF.engine_name in fleet.state("r1").loras.held


def test_a_replica_yet_to_report_its_slots_has_vllms_default_one_until_lora_is_off() -> None:
    fleet = fleet_of((0.1, None))
    assert fleet.state("r0").loras.max_loras == 1
    fleet.state("r0").loras.disabled = True
    refused = choose(fleet)
    assert isinstance(refused, Refusal) and refused.detail == "no_adapter_slot"
    assert isinstance(choose(fleet, None), Choice)  # the base model is served as ever


def test_what_the_engine_lists_replaces_what_another_router_changed() -> None:
    loras = ReplicaLoras()
    loras.reported = 2
    loras.held.update({"a": 0, "b": 1})
    loras.sync({"b", "c"})  # another edge unloaded a and loaded c; b runs here
    assert list(loras.held) == ["c", "b"]  # c counted least recently used
    assert loras.slots() == AdapterSlots(2, ("c", "b"), frozenset({"b"}))


def test_a_bound_replica_asks_the_engine_for_the_adapter_and_answers_with_its_name() -> None:
    ready: list[bool] = []

    async def loaded() -> None:
        ready.append(True)

    inner = LoraReplica("r0", MODEL)
    bound = AdapterBound(inner, REF, loaded, lambda: None)
    asyncio.run(bound.open_chat({}, request_id="req", cache_salt="salt"))
    assert ready == [True] and inner.asked == [(REF.engine_name, "support")]
    assert (bound.replica_id, bound.model) == ("r0", MODEL)


# --- the edge ------------------------------------------------------------------------------------

BOLT = Caller("key-bolt", "bolt", "customer", "standard", "salt-bolt")


class AdapterHarness(Harness):
    def __init__(self, projects: str = "") -> None:
        super().__init__()
        facts: list[tuple[str, Event]] = [
            ("tenant-acme", registered(projects=projects)),
            ("tenant-bolt", TenantRegistered("bolt", "bolt", "standard", "salt-bolt")),
            ("tenant-bolt", ApiKeyIssued("bolt", "key-bolt", "b" * 64, "customer")),
        ]
        if projects:
            facts += [("tenant-acme", WorkspaceCreated(b.TENANT, "ws", "ws")),
                      ("tenant-acme", ProjectCreated(b.TENANT, "p1", "p1", "ws"))]  # fmt: skip
        for i, (stream, event) in enumerate(facts, start=20):
            self.control.apply(b.record(event, version=i, seconds=-30, stream_id=stream))

    async def ask(self, caller: Caller, model: str, n: int) -> JsonOutcome | ApiError:
        raw = orjson.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}],
                            "max_tokens": 5})  # fmt: skip
        try:
            out = await self.edge.chat(
                caller, raw, request_id=f"req_{n:032x}", idempotency_key=None, retry_count=0
            )
        except ApiError as exc:
            return exc
        assert isinstance(out, JsonOutcome)
        return out


def events_of(h: Harness, kind: type[Event]) -> list[Any]:
    return [r.event for r in h.sink.store.read_all() if isinstance(r.event, kind)]


def test_the_tenant_is_served_through_its_adapter_and_admission_charges_its_rank() -> None:
    h = AdapterHarness()

    async def go() -> None:
        base = await h.ask(CALLER, MODEL, 1)
        served = await h.ask(CALLER, "support", 2)
        assert isinstance(base, JsonOutcome) and isinstance(served, JsonOutcome)

    asyncio.run(go())
    assert h.fleet.adapters == [None, REF]
    admitted = events_of(h, RequestAdmitted)
    assert [(a.model, a.adapter) for a in admitted] == [(MODEL, ""), (MODEL, "support")]
    base_est, lora_est = events_of(h, RequestEstimated)
    assert lora_est.tpot_us == adapter_tpot_us(base_est.tpot_us, 8) > base_est.tpot_us
    assert lora_est.kv_byte_seconds > base_est.kv_byte_seconds


def test_another_tenant_asking_for_the_name_gets_exactly_the_unknown_models_answer() -> None:
    h = AdapterHarness()

    async def go() -> tuple[Any, Any]:
        return await h.ask(BOLT, "support", 1), await h.ask(CALLER, "support-nobody", 2)

    theirs, nobodys = asyncio.run(go())
    assert isinstance(theirs, ApiError) and isinstance(nobodys, ApiError)
    assert (theirs.status, theirs.code, theirs.param) == (nobodys.status, nobodys.code, "model")
    assert theirs.message == nobodys.message.replace("support-nobody", "support")
    assert h.fleet.adapters == []  # nothing was routed for either


def test_an_adapter_kept_to_a_project_is_unknown_to_the_organizations_key() -> None:
    h = AdapterHarness(projects="p1")
    in_project = Caller("key-p1", b.TENANT, "customer", "standard", "salt-acme")
    for i, event in enumerate(
        (
            ApiKeyIssued(b.TENANT, "key-p1", "c" * 64, "customer"),
            KeyAssigned(b.TENANT, "key-p1", "p1"),
        ),
        start=40,
    ):
        h.control.apply(b.record(event, version=i, seconds=-20, stream_id="tenant-acme"))

    async def go() -> tuple[Any, Any]:
        return await h.ask(CALLER, "support", 1), await h.ask(in_project, "support", 2)

    org, project = asyncio.run(go())
    assert isinstance(org, ApiError) and org.status == 404
    assert isinstance(project, JsonOutcome) and project.status == 200


def test_a_revoked_adapter_is_unknown_from_the_next_request() -> None:
    h = AdapterHarness()
    h.control.apply(b.record(AdapterRevoked(b.TENANT, "support"), version=50,
                             seconds=-1, stream_id="tenant-acme"))  # fmt: skip
    out = asyncio.run(h.ask(CALLER, "support", 1))
    assert isinstance(out, ApiError) and out.status == 404
