"""The live progress view (rich Live on a terminal; a plain line every few seconds otherwise)."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.0f} ms" if v >= 0.01 else f"{v * 1000:.1f} ms"


def render(n: dict[str, Any], elapsed: float, header: str) -> Table:
    table = Table(title=header, title_justify="left", show_header=True, expand=False)
    for col in ("elapsed", "sent", "in flight", "2xx", "429", "503", "4xx", "errors",
                "cancelled", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99"):
        table.add_column(col, justify="right")
    table.add_row(
        f"{elapsed:.1f} s", str(n["sent"]), str(n["in_flight"]), str(n["2xx"]), str(n["429"]),
        str(n["503"]), str(n["4xx"]), str(n["errors"]), str(n["cancelled"]),
        _ms(n["ttft_p50"]), _ms(n["ttft_p99"]), _ms(n["tpot_p50"]), _ms(n["tpot_p99"]),
    )
    return table


def plain(n: dict[str, Any], elapsed: float) -> str:
    return (f"[{elapsed:6.1f}s] sent {n['sent']} in-flight {n['in_flight']} 2xx {n['2xx']} "
            f"429 {n['429']} 503 {n['503']} 4xx {n['4xx']} errors {n['errors']} "
            f"cancelled {n['cancelled']} TTFT p50/p99 {_ms(n['ttft_p50'])}/{_ms(n['ttft_p99'])} "
            f"TPOT p50/p99 {_ms(n['tpot_p50'])}/{_ms(n['tpot_p99'])}")


async def live_view(runner: Any, header: str, enabled: bool = True) -> None:
    """Runs until cancelled. Writes to stderr so `--out -`-style stdout stays clean."""
    console = Console(stderr=True)
    if enabled and console.is_terminal:
        with Live(render(runner.stats.live_numbers(), 0, header), console=console,
                  auto_refresh=False, transient=False) as live:
            try:
                while True:
                    await asyncio.sleep(0.25)
                    live.update(render(runner.stats.live_numbers(), runner.elapsed(), header),
                                refresh=True)
            except asyncio.CancelledError:
                live.update(render(runner.stats.live_numbers(), runner.elapsed(), header),
                            refresh=True)
                raise
    else:
        last = time.monotonic()
        with contextlib.suppress(asyncio.CancelledError):
            while True:
                await asyncio.sleep(0.25)
                if enabled and time.monotonic() - last >= 5:
                    last = time.monotonic()
                    print(plain(runner.stats.live_numbers(), runner.elapsed()), file=sys.stderr,
                          flush=True)
