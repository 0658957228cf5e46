"""`tollgate config show`: the settings a process would run with, secrets masked."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from tollgate_llm.api.config import Settings, shown
from tollgate_llm.cli.common import one_line_errors
from tollgate_llm.cli.options import settings_options


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, tuple | list):
        return "[" + ", ".join(_toml(item) for item in value) + "]"
    return json.dumps(str(value))  # a TOML basic string: JSON's escapes are TOML's


def render_toml(values: dict[str, Any]) -> str:
    """The settings as a TOML file that `--config` reads back (masked secrets aside)."""
    lines, tables = [], []
    for name, value in values.items():
        if name == "config":
            continue
        if isinstance(value, dict):
            tables.append(f"\n[{name}]")
            tables.extend(f"{json.dumps(key)} = {_toml(item)}" for key, item in value.items())
        elif value is None:
            lines.append(f"# {name}: not set")
        else:
            lines.append(f"{name} = {_toml(value)}")
    return "\n".join(lines + tables)


@click.group()
def config() -> None:
    """Tollgate's settings: command line over environment (TOLLGATE_<NAME>) over the --config
    file over the defaults."""


@config.command("show")
@click.option("--json", "as_json", is_flag=True, help="one JSON object instead of TOML")
@settings_options()
@one_line_errors
def config_show(settings: Settings, as_json: bool) -> None:
    """Print the effective settings (secrets masked: database passwords, tokens, Kafka
    credentials), as a TOML file that --config reads back."""
    values = shown(settings)
    if as_json:
        click.echo(json.dumps(values, default=str, indent=2))
        return
    if settings.config is not None:
        click.echo(f"# with {Path(settings.config)}")
    click.echo(render_toml(values))


COMMANDS = (config,)
