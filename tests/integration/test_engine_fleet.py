"""Fleet against simulated replicas over real HTTP: scraping, health, p2c routing under tier
ceilings, optimistic in-flight KV, and the measured TPOT p95."""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any

from tollgate_llm.domain.capacity import Choice, Refusal, UnknownModel
from tollgate_llm.engine_adapter.fleet import Fleet, histogram_quantile
from tollgate_llm.engine_adapter.simulator.engine import SimConfig
from tollgate_llm.engine_adapter.simulator.server import (
    SimulatedReplicaHandle,
    start_simulated_replica,
)
from tollgate_llm.engine_adapter.vllm_http import VLLMReplica, fetch_metrics, make_session

MODEL = "llama-2026-05"
FAST = {"step_base_ms": 1.0, "per_seq_ms": 0.05, "prefill_ms_per_1k_tokens": 1.0}
CAPACITY = 256 * 16  # tokens per replica with num_gpu_blocks=256


def run(
    fn: Callable[[list[SimulatedReplicaHandle], Fleet], Awaitable[None]],
    n: int = 3,
    reserved: tuple[int, ...] = (),
    **cfg: Any,
) -> None:
    async def main() -> None:
        handles = [
            await start_simulated_replica(
                SimConfig(
                    model=MODEL, seed=i, num_gpu_blocks=256, max_model_len=4096, **FAST, **cfg
                )
            )
            for i in range(n)
        ]
        async with make_session() as session:
            fleet = Fleet(session, scrape_interval_s=0.05)
            for i, h in enumerate(handles):
                fleet.add(VLLMReplica(f"r{i}", h.url, MODEL), reserved_only=i in reserved)
            try:
                await fn(handles, fleet)
            finally:
                await fleet.stop()
                for h in handles:
                    await h.stop()

    asyncio.run(main())


def test_unknown_model_and_no_healthy_replica() -> None:
    async def t(handles: list[SimulatedReplicaHandle], fleet: Fleet) -> None:
        rng = random.Random(1)
        # before any scrape nothing is known: refuse rather than route blind
        got = fleet.choose(MODEL, "standard", 10, rng)
        assert isinstance(got, Refusal) and got.reason == "capacity"
        await fleet.refresh()
        assert isinstance(fleet.choose("other-model", "standard", 10, rng), UnknownModel)
        assert isinstance(fleet.choose(MODEL, "standard", 10, rng), Choice)
        s = fleet.state("r0")
        assert s.healthy and s.capacity_tokens == CAPACITY and s.scraped_occupancy_ppm == 0

    run(t, n=1)


def test_dead_replica_is_marked_unhealthy_and_skipped() -> None:
    async def t(handles: list[SimulatedReplicaHandle], fleet: Fleet) -> None:
        await fleet.start()
        assert all(s.healthy for s in fleet.replicas(MODEL))
        await handles[1].stop()
        await asyncio.sleep(0.2)
        assert not fleet.state("r1").healthy and fleet.state("r1").last_error
        rng = random.Random(3)
        picks = Counter()
        for _ in range(200):
            c = fleet.choose(MODEL, "standard", 0, rng)
            assert isinstance(c, Choice)
            picks[c.replica_id] += 1
            fleet.release(c)
        assert set(picks) == {"r0", "r2"}

    run(t)


def test_a_replica_that_stalls_keeps_its_traffic_for_the_grace_then_loses_it() -> None:
    """A probe that times out on a connection the replica took is a busy replica (vLLM's API
    server stalls for seconds on a loaded host while its engine generates): routed on its last
    scrape for `slow_grace_s`, not dropped after `stale_after_s` as a refused one is."""

    async def main() -> None:
        async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.read()  # takes the request, never answers

        server = await asyncio.start_server(silent, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        sim = await start_simulated_replica(
            SimConfig(model=MODEL, num_gpu_blocks=256, max_model_len=4096, **FAST)
        )
        async with make_session() as session:
            fleet = Fleet(session, stale_after_s=0.2, slow_grace_s=1.0, scrape_timeout_s=0.1)
            fleet.add(VLLMReplica("r0", f"http://127.0.0.1:{port}", MODEL))
            state = fleet.state("r0")
            rng = random.Random(5)
            # One good scrape (taken from a simulator), then the replica stops answering.
            scraped = await fetch_metrics(session, sim.url)
            fleet.apply_scrape(state, scraped, scrape_started_at=time.monotonic(),
                               now=time.monotonic())  # fmt: skip
            assert isinstance(fleet.choose(MODEL, "standard", 10, rng), Choice)
            await fleet.refresh(check_health_too=True)
            assert state.slow and "no answer" in (state.last_error or "")
            await asyncio.sleep(0.4)  # past stale_after_s, within the grace
            assert isinstance(fleet.choose(MODEL, "standard", 10, rng), Choice)
            await asyncio.sleep(0.8)  # past the grace
            got = fleet.choose(MODEL, "standard", 10, rng)
            assert isinstance(got, Refusal) and got.detail == "no_replica"
            # It answers again: one good scrape ends the stall.
            fleet.apply_scrape(state, scraped, scrape_started_at=time.monotonic(),
                               now=time.monotonic())  # fmt: skip
            assert not state.slow and isinstance(fleet.choose(MODEL, "standard", 10, rng), Choice)
            await fleet.stop()
        await sim.stop()
        server.close()

    asyncio.run(main())


def test_optimistic_inflight_closes_the_scrape_blind_spot() -> None:
    async def t(handles: list[SimulatedReplicaHandle], fleet: Fleet) -> None:
        await fleet.refresh()  # one scrape, no background scraper: the blind spot stays open
        rng = random.Random(5)
        est = CAPACITY // 8  # each request adds 0.125 occupancy to its replica
        choices = []
        while True:
            c = fleet.choose(MODEL, "free", est, rng)
            if isinstance(c, Refusal):
                break
            choices.append(c)
        # free enters while below 0.60: at 0, .125, .25, .375 and .5 on each replica, then refusal
        assert Counter(c.replica_id for c in choices) == {"r0": 5, "r1": 5}
        assert c.detail == "over_ceiling" and c.best_occupancy_ppm == 625_000
        std = fleet.choose(MODEL, "standard", est, rng)
        assert isinstance(std, Choice) and std.occupancy_ppm == 625_000
        for ch in [*choices, std]:
            fleet.release(ch)
        assert all(s.inflight_tokens == 0 for s in fleet.replicas(MODEL))
        assert isinstance(fleet.choose(MODEL, "free", est, rng), Choice)
        # a fresh scrape absorbs what was dispatched before it was asked for
        await fleet.refresh()
        assert all(s.inflight_tokens == 0 for s in fleet.replicas(MODEL))

    run(t, n=2)


def test_reserved_only_replica_takes_enterprise_only() -> None:
    async def t(handles: list[SimulatedReplicaHandle], fleet: Fleet) -> None:
        await fleet.refresh()
        rng = random.Random(9)
        for _ in range(50):
            c = fleet.choose(MODEL, "standard", 1, rng)
            assert isinstance(c, Choice) and c.replica_id == "r0"
            fleet.release(c)
        got = {fleet.choose(MODEL, "enterprise", 1, rng).replica_id for _ in range(50)}
        assert got == {"r0", "r1"}

    run(t, n=2, reserved=(1,))


def test_route_stream_release_and_measured_tpot() -> None:
    async def t(handles: list[SimulatedReplicaHandle], fleet: Fleet) -> None:
        await fleet.start()
        assert fleet.tpot_p95(MODEL) is None
        rng = random.Random(11)

        async def one(i: int) -> int:
            c = fleet.choose(MODEL, "standard", 300, rng)
            assert isinstance(c, Choice)
            try:
                body = {"messages": [{"role": "user", "content": f"q{i}"}], "max_tokens": 12}
                last = None
                async for chunk in c.replica.stream_chat(
                    {**body, "ignore_eos": True}, request_id=f"f{i}", cache_salt="t"
                ):
                    last = chunk
                assert last is not None
                return last["usage"]["completion_tokens"]
            finally:
                fleet.release(c)

        assert await asyncio.gather(*(one(i) for i in range(12))) == [12] * 12
        assert sum(len(h.records) for h in handles) == 12
        await asyncio.sleep(0.15)
        est = fleet.tpot_p95(MODEL)
        assert est is not None and est.samples == 12
        assert 0 < est.p95_us <= 10_000 and est.age_s < 1.0  # first bucket: le=0.01 s

    run(t)


def test_histogram_quantile_interpolates_like_prometheus() -> None:
    b = [(0.01, 0), (0.025, 50), (0.05, 100), (float("inf"), 100)]
    assert histogram_quantile(0.5, b) == 0.025
    assert abs(histogram_quantile(0.95, b) - 0.0475) < 1e-9
    assert histogram_quantile(0.95, [(0.01, 0), (float("inf"), 0)]) is None
    assert histogram_quantile(0.99, [(0.01, 0), (float("inf"), 10)]) == 0.01


def test_dashboard_views() -> None:
    async def t(handles: list[SimulatedReplicaHandle], fleet: Fleet) -> None:
        assert fleet.healthy_count() == 0
        await fleet.refresh()
        assert fleet.healthy_count() == 2 and fleet.healthy_count(MODEL) == 2
        assert fleet.healthy_count("other") == 0
        s = fleet.replicas()[0]
        assert (s.replica_id, s.model, s.kv_usage, s.healthy) == ("r0", MODEL, 0.0, True)

    run(t, n=2)
