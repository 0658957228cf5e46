"""`tollgate replica-sim` and `python -m tollgate_llm.engine_adapter.simulator`: one simulated
replica in this process until interrupted, every `SimConfig` field a flag."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
from typing import Any

from tollgate_llm.engine_adapter.simulator.server import VLLM_VERSION, start_simulated_replica
from tollgate_llm.engine_adapter.simulator.state import SimConfig


def _arg_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m tollgate_llm.engine_adapter.simulator",
        description="Simulated vLLM 0.33 replica",
    )
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    for f in dataclasses.fields(SimConfig):
        flag = "--" + f.name.replace("_", "-")
        default = f.default
        if isinstance(default, bool):
            ap.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
        elif f.name == "max_num_queued_reqs":
            ap.add_argument(flag, type=int, default=None)
        else:
            ap.add_argument(flag, type=type(default), default=default)
    return ap


async def _serve(args: argparse.Namespace) -> None:
    cfg = SimConfig(**{f.name: getattr(args, f.name) for f in dataclasses.fields(SimConfig)})
    handle = await start_simulated_replica(cfg, args.host, args.port)
    print(f"simulated vLLM {VLLM_VERSION} replica {cfg.model!r} on {handle.url}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await handle.stop()


def serve_forever(host: str = "127.0.0.1", port: int = 8000, **config: Any) -> None:
    """Run one replica in this process until interrupted; `config` holds SimConfig fields."""
    args = _arg_parser().parse_args(["--host", host, "--port", str(port)])
    for name, value in config.items():
        if not hasattr(args, name):
            raise TypeError(f"unknown SimConfig field {name!r}")
        setattr(args, name, value)
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(args))


def main(argv: list[str] | None = None) -> None:
    """`python -m tollgate_llm.engine_adapter.simulator`: plain log lines at INFO on stderr (a
    client's disconnect is one such line); `tollgate replica-sim` takes `--log-format json` too."""
    args = _arg_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(_serve(args))
