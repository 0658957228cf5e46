"""`tollgate serve --autoscale`'s actuator: simulated replicas added and removed by the
autoscaling signal. A development tool: the command line hands it to `api.serve.run`."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from tollgate_llm.api.config import Settings
from tollgate_llm.api.serve import start_simulated_replica_of
from tollgate_llm.engine_adapter.fleet import Fleet
from tollgate_llm.engine_adapter.vllm_http import VLLMReplica

log = logging.getLogger("tollgate.serve")


class SimulatedActuator:
    """`tollgate serve --autoscale`: simulated replicas added by the autoscaling signal, each
    serving only after the configured cold start (a real replica loads its weights meanwhile),
    and stopped once the fleet has drained and removed them."""

    def __init__(
        self, settings: Settings, fleet: Callable[[], Fleet], handles: dict[str, Any]
    ) -> None:
        self.settings = settings
        self.fleet = fleet
        self.handles = handles  # replica id -> simulated replica handle
        self._starting: dict[str, int] = {}
        self._next = dict.fromkeys(settings.models, settings.simulated_replicas)
        self._tasks: set[asyncio.Task[None]] = set()

    def starting(self, model: str) -> int:
        return self._starting.get(model, 0)

    async def add(self, model: str) -> None:
        self._starting[model] = self.starting(model) + 1
        task = asyncio.get_running_loop().create_task(self._start(model))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _start(self, model: str) -> None:
        try:
            await asyncio.sleep(self.settings.cold_start_s)
            index = self._next.get(model, 0)
            self._next[model] = index + 1
            handle = await start_simulated_replica_of(self.settings, model, index)
            replica_id = f"sim-{model}-{index}"
            self.handles[replica_id] = handle
            self.fleet().add(VLLMReplica(replica_id, handle.url, model))
            await self.fleet().refresh(check_health_too=True)
            log.info("replica %s of %s serving after its cold start", replica_id, model)
        finally:
            self._starting[model] -= 1

    async def remove(self, replica_id: str) -> None:
        handle = self.handles.pop(replica_id, None)
        if handle is not None:
            await handle.stop()
            log.info("replica %s stopped", replica_id)
