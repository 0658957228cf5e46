"""A plain install (real dependencies, no extras) in a fresh virtualenv gives a working CLI.

It once did not: the CLI imported the load generator's httpx at start-up, which only the `dev`
extra installed, so every command died with `ModuleNotFoundError`. This builds the wheel as a
user would get it, so a module or data file missing from the packaging fails here too.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def copy_sources(dest: Path) -> None:
    """What the wheel is built from, copied so that the build writes nothing into the checkout
    (setuptools builds in the source tree)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    setuptools = config["tool"]["setuptools"]
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    # The one package (its links to the folders kept as links) and the folders it maps.
    for pattern in setuptools["packages"]["find"]["include"]:
        name = pattern.rstrip("*")
        shutil.copytree(ROOT / name, dest / name, ignore=ignore, symlinks=True)
    for folder in setuptools["package-dir"].values():
        shutil.copytree(ROOT / folder, dest / folder, ignore=ignore)
    for name in ("pyproject.toml", config["project"]["readme"]):
        shutil.copy2(ROOT / name, dest / name)


def test_plain_install_runs_every_entry_point(tmp_path: Path) -> None:
    src, venv = tmp_path / "src", tmp_path / "venv"
    copy_sources(src)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    install = subprocess.run(
        [str(venv / "bin" / "pip"), "install", "--quiet", str(src)],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    assert install.returncode == 0, install.stderr

    def tollgate(*args: str) -> subprocess.CompletedProcess[str]:
        # Outside the checkout, so only the installed packages can be imported.
        return subprocess.run(
            [str(venv / "bin" / "tollgate"), *args],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=tmp_path,
            env=env,
        )

    # One top-level package: nothing else of ours lands in site-packages, where generic names
    # (`api`, `domain`, `cli` ...) would collide with other projects' packages.
    site = next((venv / "lib").glob("python3*/site-packages"))
    top = subprocess.run(
        [str(venv / "bin" / "python"), "-c",
         "from importlib.metadata import distribution as d\n"
         "print(sorted({f.parts[0] for f in d('tollgate-llm').files if f.parts[0] != '..'"
         " and not f.parts[0].endswith(('.dist-info', '__pycache__'))}))"],
        capture_output=True, text=True, cwd=tmp_path, env=env, check=True,
    )  # fmt: skip
    assert top.stdout.strip() == "['tollgate_llm']"
    folders = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"
    ].values()
    installed = {p.name for p in (site / "tollgate_llm").iterdir() if p.is_dir()}
    assert installed - {"__pycache__"} == set(folders)
    for bare in ("domain", "api", "cli", "ledger"):
        probe = subprocess.run(
            [str(venv / "bin" / "python"), "-c", f"import {bare}"], capture_output=True,
            cwd=tmp_path, env=env,
        )  # fmt: skip
        assert probe.returncode != 0, bare
    # The migrations are package data of the one package: a database is created from them.
    done = tollgate("db", "upgrade", "--database-url", f"sqlite:///{tmp_path / 'db.sqlite'}")
    assert done.returncode == 0, done.stderr

    commands = ([], ["serve"], ["loadgen"], ["replica-sim"], ["predictor"], ["predictor", "train"])
    for command in commands:
        done = tollgate(*command, "--help")
        assert done.returncode == 0, (command, done.stderr)
        assert "Usage: tollgate" in done.stdout
    # The profiles are package data: the help lists the ones the wheel carries.
    assert "seeds" in tollgate("loadgen", "--help").stdout

    # Without the predictor extra, training says in one line what to install (serving a
    # trained model needs nothing more: it is plain arithmetic).
    done = tollgate("predictor", "train", "--database-url", f"sqlite:///{tmp_path / 'x.db'}")
    assert done.returncode == 1
    assert "pip install 'tollgate-llm[predictor]'" in done.stderr

    # No extras, so the default client is missing and says in one line how to get it.
    probe = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import openai"], capture_output=True, cwd=tmp_path
    )
    assert probe.returncode != 0
    done = tollgate("loadgen", "--keys", str(tmp_path / "keys.json"))
    assert done.returncode == 1
    assert done.stderr.strip().splitlines() == [
        "Error: --client openai (the default) needs the openai SDK, which is not installed: "
        "pip install 'tollgate-llm[loadgen]', or use --client httpx"
    ]
