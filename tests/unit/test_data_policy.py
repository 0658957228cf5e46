"""Residency and retention as control-plane facts (domain/control_plane/data_policy.py): given
the tenant's facts, when a command is decided, then its events; and what the view answers."""

from __future__ import annotations

import pytest

from tests import builders as b
from tollgate_llm.domain.control_plane.data_policy import (
    ClearResidency,
    ResidencyCleared,
    ResidencySet,
    RetentionSet,
    SetResidency,
    SetRetention,
    parse_regions,
)
from tollgate_llm.domain.control_plane.decide import ControlCommand, decide_control
from tollgate_llm.domain.control_plane.state import ControlView
from tollgate_llm.domain.envelope import Event
from tollgate_llm.domain.errors import DomainError
from tollgate_llm.domain.governance.events import KeyAssigned, ProjectCreated, WorkspaceCreated
from tollgate_llm.domain.registry import from_payload, to_payload


def given(*events: Event) -> ControlView:
    view = ControlView()
    base = (
        b.tenant_registered(), b.key_issued(), WorkspaceCreated(b.TENANT, "ws", "ws"),
        ProjectCreated(b.TENANT, "p1", "p1", "ws"),
    )  # fmt: skip
    for i, event in enumerate((*base, *events), start=1):
        view.apply(b.record(event, version=i, seconds=i, stream_id="tenant-acme"))
    return view


def when(view: ControlView, command: ControlCommand) -> tuple[Event, ...]:
    return decide_control(view, command)


def test_a_tenant_is_pinned_to_its_regions_and_a_repeat_changes_nothing() -> None:
    view = given()
    events = when(view, SetResidency(b.TENANT, parse_regions("eu-west, eu-central,eu-west")))
    assert events == (ResidencySet(b.TENANT, "", "eu-central,eu-west"),)
    view = given(*events)
    assert view.regions(b.TENANT, b.KEY) == frozenset({"eu-west", "eu-central"})
    assert when(view, SetResidency(b.TENANT, ("eu-central", "eu-west"))) == ()


def test_a_project_narrows_its_tenant_and_never_widens_it() -> None:
    view = given(ResidencySet(b.TENANT, "", "eu-central,eu-west"))
    with pytest.raises(DomainError) as refused:
        when(view, SetResidency(b.TENANT, ("us-east",), "p1"))
    assert (refused.value.rule, refused.value.field) == ("region_outside_tenant", "regions")
    view = given(ResidencySet(b.TENANT, "", "eu-central,eu-west"),
                 ResidencySet(b.TENANT, "p1", "eu-west"),
                 KeyAssigned(b.TENANT, b.KEY, "p1"))  # fmt: skip
    assert view.regions(b.TENANT, b.KEY) == frozenset({"eu-west"})
    # The tenant narrowed later: the project's pin is intersected, possibly to nowhere.
    view = given(ResidencySet(b.TENANT, "p1", "eu-west"), KeyAssigned(b.TENANT, b.KEY, "p1"),
                 ResidencySet(b.TENANT, "", "eu-central"))  # fmt: skip
    assert view.regions(b.TENANT, b.KEY) == frozenset()


def test_an_unpinned_tenant_runs_anywhere_and_clearing_unpins_it() -> None:
    assert given().regions(b.TENANT, b.KEY) is None
    view = given(ResidencySet(b.TENANT, "", "eu-west"))
    assert when(view, ClearResidency(b.TENANT)) == (ResidencyCleared(b.TENANT, ""),)
    assert (
        given(ResidencySet(b.TENANT, "", "eu-west"), ResidencyCleared(b.TENANT, "")).regions(
            b.TENANT, b.KEY
        )
        is None
    )
    assert when(given(), ClearResidency(b.TENANT)) == ()


@pytest.mark.parametrize(
    ("command", "rule", "field"),
    [
        (SetResidency(b.TENANT, ("EU-West",)), "bad_region", "regions"),
        (SetResidency(b.TENANT, ("x" * 33,)), "bad_region", "regions"),
        (SetResidency(b.TENANT, ()), "no_regions", "regions"),
        (SetResidency(b.TENANT, tuple(f"r{i}" for i in range(17))), "too_many_regions", "regions"),
        (SetResidency(b.TENANT, ("eu-west",), "no-such-project"), "unknown_project", "project"),
        (SetResidency("nobody", ("eu-west",)), "unknown_tenant", "tenant_id"),
        (SetRetention(b.TENANT, "forever"), "bad_retention", "tier"),
    ],
)
def test_malformed_commands_are_refused_naming_the_field(
    command: ControlCommand, rule: str, field: str
) -> None:
    with pytest.raises(DomainError) as refused:
        when(given(), command)
    assert (refused.value.rule, refused.value.field) == (rule, field)


def test_zero_retention_at_either_level_wins() -> None:
    assert given().retention(b.TENANT, b.KEY) == "standard"
    assert when(given(), SetRetention(b.TENANT, "zero", "p1")) == (
        RetentionSet(b.TENANT, "p1", "zero"),
    )
    project_zero = given(RetentionSet(b.TENANT, "p1", "zero"))
    assert project_zero.retention(b.TENANT, b.KEY) == "standard"  # the key is not in p1
    assert (
        given(RetentionSet(b.TENANT, "p1", "zero"), KeyAssigned(b.TENANT, b.KEY, "p1")).retention(
            b.TENANT, b.KEY
        )
        == "zero"
    )
    tenant_zero = given(RetentionSet(b.TENANT, "", "zero"), KeyAssigned(b.TENANT, b.KEY, "p1"),
                        RetentionSet(b.TENANT, "p1", "standard"))  # fmt: skip
    assert tenant_zero.retention(b.TENANT, b.KEY) == "zero"
    assert when(tenant_zero, SetRetention(b.TENANT, "zero")) == ()
    back = given(RetentionSet(b.TENANT, "", "zero"), RetentionSet(b.TENANT, "", "standard"))
    assert back.retention(b.TENANT, b.KEY) == "standard"


@pytest.mark.parametrize(
    "event",
    [
        ResidencySet(b.TENANT, "p1", "eu-central,eu-west"),
        ResidencyCleared(b.TENANT, ""),
        RetentionSet(b.TENANT, "", "zero"),
    ],  # fmt: skip
    ids=lambda e: e.EVENT_TYPE,
)
def test_the_events_round_trip_through_their_payload(event: Event) -> None:
    assert from_payload(event.EVENT_TYPE, event.EVENT_VERSION, to_payload(event)) == event
