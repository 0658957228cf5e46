"""Where replicas run, as configured: `--replica MODEL=URL@REGION`, `--region` for a replica
given none, `--simulated-region` for the simulated fleet (api/replica_regions.py)."""

from __future__ import annotations

import pytest

from tollgate_llm.api.config import Settings
from tollgate_llm.api.serve import parse_replica_flags, parse_replicas, simulated_regions


def test_a_replica_names_its_region_after_its_url_and_the_setting_covers_the_rest() -> None:
    flags = ("m=http://10.0.0.5:8000/@eu-west", "m=http://10.0.0.6:8000", "n=https://h@us-east")
    assert parse_replicas(flags, "eu-central") == [
        ("replica-0", "m", "http://10.0.0.5:8000", "eu-west"),
        ("replica-1", "m", "http://10.0.0.6:8000", "eu-central"),
        ("replica-2", "n", "https://h", "us-east"),
    ]
    # The region never reaches the URL the engine is called at.
    assert parse_replica_flags(flags)[0] == ("replica-0", "m", "http://10.0.0.5:8000")
    assert parse_replicas(("m=http://h:1",)) == [("replica-0", "m", "http://h:1", "")]


def test_a_region_that_is_not_a_region_name_is_refused_naming_the_flag() -> None:
    with pytest.raises(ValueError, match="--replica 'http://h:1@EU West'"):
        parse_replicas(("m=http://h:1@EU West",))


def test_simulated_replicas_take_the_regions_in_turn_per_model() -> None:
    settings = Settings(simulated_regions=("eu-west,us-east",), region="ap-south")
    assert settings.simulated_regions == ("eu-west", "us-east")
    replicas = [(f"sim-{m}-{i}", m, "") for m in ("a", "b") for i in range(3)]
    assert simulated_regions(settings, replicas) == {
        "sim-a-0": "eu-west", "sim-a-1": "us-east", "sim-a-2": "eu-west",
        "sim-b-0": "eu-west", "sim-b-1": "us-east", "sim-b-2": "eu-west",
    }  # fmt: skip
    assert set(simulated_regions(Settings(region="ap-south"), replicas).values()) == {"ap-south"}
    with pytest.raises(ValueError, match="a region matches"):
        Settings(simulated_regions=("Europe",))
