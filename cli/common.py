"""What every command shares: the store option, one-line errors, amounts and instants."""

from __future__ import annotations

import functools
import os
import sys
import typing
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any, TypeVar

import click

from tollgate_llm.api.config import Settings
from tollgate_llm.api.services.control_service import operator, usd_micros
from tollgate_llm.cli.options import SettingsProblem, settings_options
from tollgate_llm.domain.audit.events import Actor
from tollgate_llm.domain.errors import DomainError

F = TypeVar("F", bound=Callable[..., Any])

def database_option(fn: F) -> F:
    """--database-url and --config (generated from the settings, cli/options.py): the command
    is called with the store's URL as `database_url`."""

    @functools.wraps(fn)
    def with_url(*args: Any, settings: Settings, **kwargs: Any) -> Any:
        return fn(*args, database_url=settings.store_url(), **kwargs)

    return settings_options("database_url")(typing.cast(F, with_url))


def control_options(fn: F) -> F:
    """--database-url, --actor and --config, for a command that changes the control plane: it is
    called with the store's URL as `database_url` and who the change is recorded as made by as
    `actor` (--actor, TOLLGATE_ACTOR, else the OS user@host, unless `require_actor` is set)."""

    @functools.wraps(fn)
    def with_actor(*args: Any, settings: Settings, **kwargs: Any) -> Any:
        try:
            actor: Actor = operator(settings.actor, required=settings.require_actor)
        except DomainError as exc:
            raise SettingsProblem(exc.message) from None
        return fn(*args, database_url=settings.store_url(), actor=actor, **kwargs)

    return settings_options("database_url", "actor")(typing.cast(F, with_actor))


def one_line_errors(fn: F) -> F:
    """Known failures print `tollgate: error: ...` and exit 1; never a traceback (unless
    TOLLGATE_DEBUG=1)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except click.exceptions.Exit:
            raise
        except click.ClickException:
            raise
        except Exception as exc:  # noqa: BLE001 - the CLI's one place that renders every error
            # Read here, not from the settings: it must work when the settings themselves fail.
            if os.environ.get("TOLLGATE_DEBUG"):
                raise
            message = getattr(exc, "message", None) or str(exc) or type(exc).__name__
            click.echo(f"tollgate: error: {message}", err=True)
            sys.exit(1)

    return wrapper  # type: ignore[return-value]


def micros(text: str, option: str) -> int:
    """A decimal amount of dollars as micro-dollars, or a usage error naming `option` (the rule
    is the admin API's too: control_service.usd_micros)."""
    try:
        return usd_micros(text, option)
    except DomainError as exc:
        raise click.BadParameter(exc.message, param_hint=option) from None


def instant(text: str) -> datetime:
    try:
        parsed = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise click.BadParameter(f"{text!r} is not an ISO 8601 instant") from None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)



class LazyCommand(click.Command):
    """A subcommand whose module is imported only when it runs or prints its own help.

    `tollgate --help` lists it from `help` alone, so no other command imports what it needs
    (the load generator's httpx and rich views are not part of serving)."""

    def __init__(self, name: str, load: Callable[[], click.Command], help: str) -> None:
        super().__init__(name, help=help)
        self.load = load

    def make_context(
        self,
        info_name: str | None,
        args: list[str],
        parent: click.Context | None = None,
        **extra: Any,
    ) -> click.Context:
        # The group runs `ctx.command`, so handing over the real command's context is enough.
        return self.load().make_context(info_name, args, parent=parent, **extra)
