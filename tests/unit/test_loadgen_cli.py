"""`tollgate loadgen` refuses what it could not finish before it sends anything."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from tollgate_llm.loadgen import cli


def invoke_with_plot(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Any, list[Any]]:
    """Run the command with --plot, the load itself replaced by a recorder of its start."""
    keys = tmp_path / "keys.json"
    keys.write_text(json.dumps({"acme": "tg_not-a-key"}))
    started: list[Any] = []

    async def run(*args: Any) -> int:
        started.append(args)
        return 0

    monkeypatch.setattr(cli, "_main", run)
    args = ["--keys", str(keys), "--client", "httpx", "--no-live", "--plot", str(tmp_path / "p")]
    return CliRunner().invoke(cli.loadgen, args), started


def test_plot_without_matplotlib_is_refused_before_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what `import matplotlib` fails on
    result, started = invoke_with_plot(tmp_path, monkeypatch)
    assert started == []
    assert result.exit_code == 1
    assert result.stderr.strip().splitlines() == [
        "Error: --plot needs matplotlib, which is not installed: "
        "pip install 'tollgate-llm[loadgen]'"
    ]
    assert not (tmp_path / "p").exists()


def test_plot_with_matplotlib_starts_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    result, started = invoke_with_plot(tmp_path, monkeypatch)
    assert len(started) == 1, result.output
    assert result.exit_code == 0
