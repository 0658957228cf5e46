"""Capacity policy and power-of-two choices, without I/O."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from tollgate_llm.domain.capacity import (
    CapacityRefusal,
    Placement,
    ReplicaLoad,
    admits,
    effective_occupancy_ppm,
    p2c_pick,
    place,
)


def load(rid: str, occ: float, reserved_only: bool = False) -> ReplicaLoad:
    return ReplicaLoad(rid, round(occ * 1_000_000), reserved_only)


def first_two(seq, k):  # a deterministic "sample": the first k candidates in order
    return list(seq)[:k]


@pytest.mark.parametrize(
    ("tier", "occ", "ok"),
    [
        ("free", 0.599999, True),
        ("free", 0.60, False),
        ("standard", 0.60, True),
        ("standard", 0.849999, True),
        ("standard", 0.85, False),
        ("enterprise", 0.85, True),
        ("enterprise", 0.919999, True),
        ("enterprise", 0.92, False),
    ],
)
def test_tier_ceilings_are_strict(tier: str, occ: float, ok: bool) -> None:
    assert admits(tier, load("r", occ)) is ok


def test_reserved_only_replicas_take_enterprise_only() -> None:
    r = load("r", 0.0, reserved_only=True)
    assert admits("enterprise", r)
    assert not admits("standard", r)
    assert not admits("free", r)
    got = place("standard", [r], first_two)
    assert isinstance(got, CapacityRefusal) and got.detail == "reserved_only"
    assert place("enterprise", [r], first_two) == Placement("r", 0)


def test_unknown_tier_is_an_error() -> None:
    with pytest.raises(ValueError):
        admits("platinum", load("r", 0.1))


def test_effective_occupancy_adds_inflight_in_integer_ppm() -> None:
    assert effective_occupancy_ppm(400_000, 1_000, 10_000) == 500_000
    assert effective_occupancy_ppm(400_000, 1, 3) == 400_000 + 333_333
    assert effective_occupancy_ppm(0, 5, 0) == 1_000_000  # unknown capacity counts as full


def test_p2c_keeps_the_less_occupied_of_the_two_drawn() -> None:
    a, b, c = load("a", 0.5), load("b", 0.2), load("c", 0.0)
    assert p2c_pick([a, b, c], first_two) is b  # c is emptiest but was not drawn
    assert p2c_pick([b, a], first_two) is b
    assert p2c_pick([a], first_two) is a
    assert p2c_pick([], first_two) is None


def test_p2c_tie_keeps_first_drawn() -> None:
    a, b = load("a", 0.3), load("b", 0.3)
    assert p2c_pick([a, b], first_two) is a


def test_p2c_spreads_load_and_never_picks_the_fuller_of_a_pair() -> None:
    rng = random.Random(7)
    loads = [load(f"r{i}", i / 10) for i in range(10)]
    picks = Counter(p2c_pick(loads, rng.sample).replica_id for _ in range(20_000))
    assert "r9" not in picks  # the fullest can only lose its pair
    assert picks["r0"] > picks["r1"] > picks["r5"]  # emptier replicas win more often ...
    assert picks["r0"] < 20_000 * 0.3  # ... but nobody takes the herd: p(r0) = 2/10 - 1/90 ~ 0.19


def test_free_and_standard_refused_when_the_pick_is_over_ceiling() -> None:
    loads = [load("a", 0.7), load("b", 0.65), load("c", 0.1)]
    got = place("free", loads, first_two)
    assert isinstance(got, CapacityRefusal)
    assert got.reason == "capacity" and got.detail == "over_ceiling"
    assert got.ceiling_ppm == 600_000 and got.best_occupancy_ppm == 100_000
    assert place("standard", loads, first_two) == Placement("b", 650_000)


def test_enterprise_tries_other_replicas_when_the_pick_is_over_092() -> None:
    loads = [load("a", 0.95), load("b", 0.93), load("c", 0.91), load("d", 0.5, True)]
    assert place("enterprise", loads, first_two) == Placement("d", 500_000)
    got = place("enterprise", [load("a", 0.95), load("b", 0.93)], first_two)
    assert isinstance(got, CapacityRefusal) and got.ceiling_ppm == 920_000


def test_no_candidates_is_a_capacity_refusal() -> None:
    got = place("enterprise", [], first_two)
    assert isinstance(got, CapacityRefusal) and got.detail == "no_replica"


def test_domain_capacity_imports_only_the_standard_library() -> None:
    import ast
    import pathlib
    import sys

    import tollgate_llm.domain.capacity as mod

    tree = ast.parse(pathlib.Path(mod.__file__).read_text())
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            roots.add(node.module.split(".")[0])
    assert roots <= set(sys.stdlib_module_names) | {"__future__"}, roots
