"""The fakes and the adapters satisfy the edge's ports: mypy over `tests/unit/port_checks.py`
(and `tests/fakes.py`, whose explicit port subclasses it checks as overrides) finds nothing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_fake_and_adapter_satisfies_its_port() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--follow-imports=silent", "--no-error-summary",
         "tests/unit/port_checks.py", "tests/fakes.py"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
