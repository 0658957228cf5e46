"""Click options generated from the settings object (api/config.py): name, type, default and help
come from each field, so no option restates a setting by hand.

`@settings_options("host", "port", ...)` gives a command those settings' options and `--config`,
and calls it with one `settings` argument: the command line over the environment over the file
over the defaults. An option's value counts only when it was given on the command line, so an
unset option never hides the environment or the file."""

from __future__ import annotations

import functools
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar

import annotated_types
import click
from click.core import ParameterSource
from pydantic import ValidationError
from pydantic.fields import FieldInfo
from pydantic_settings import SettingsError

from tollgate_llm.api.config import ENV_PREFIX, ConfigFileError, Settings, load_settings

F = TypeVar("F", bound=Callable[..., Any])


class SettingsProblem(click.ClickException):
    """A setting that cannot be used (an unknown key in the file, a value out of range): one
    line, exit code 2, like click's own usage errors."""

    exit_code = 2

    def show(self, file: Any = None) -> None:
        click.echo(f"tollgate: error: {self.format_message()}", err=True)


def _extra(field: FieldInfo) -> dict[str, Any]:
    return field.json_schema_extra if isinstance(field.json_schema_extra, dict) else {}


def flag_of(name: str) -> str:
    """The option a setting has on the command line."""
    return _extra(Settings.model_fields[name]).get("flag") or "--" + name.replace("_", "-")


def env_of(name: str) -> str:
    return ENV_PREFIX + name.upper()


def _bounds(field: FieldInfo) -> dict[str, Any]:
    bounds: dict[str, Any] = {}
    for meta in field.metadata:
        if isinstance(meta, annotated_types.Ge):
            bounds["min"] = meta.ge
        elif isinstance(meta, annotated_types.Gt):
            bounds.update(min=meta.gt, min_open=True)
        elif isinstance(meta, annotated_types.Le):
            bounds["max"] = meta.le
        elif isinstance(meta, annotated_types.Lt):
            bounds.update(max=meta.lt, max_open=True)
    return bounds


def _click_type(annotation: Any, field: FieldInfo) -> tuple[Any, bool]:
    """The click type of a field's annotation, and whether the option repeats."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        (annotation,) = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    if typing.get_origin(annotation) is tuple:
        return str, True
    if typing.get_origin(annotation) is Literal:
        return click.Choice([str(a) for a in typing.get_args(annotation)]), False
    bounds = _bounds(field)
    if annotation is int:
        if bounds.get("min_open") or bounds.get("max_open"):
            raise TypeError("an integer setting's bounds are inclusive (ge, le)")
        return (click.IntRange(**bounds) if bounds else int), False
    if annotation is float:
        return (click.FloatRange(**bounds) if bounds else float), False
    if annotation is Path:
        return click.Path(path_type=Path), False
    return str, False


def option_for(name: str, flag: str | None = None, default: Any = None) -> Callable[[F], F]:
    """The click option of one setting. `flag`: another name on this command (batch-runner's
    --concurrency); `default`: this command's own default, shown in its help."""
    field = Settings.model_fields[name]
    extra = _extra(field)
    if extra.get("option") is False:  # a secret, or a setting only files and variables give
        raise ValueError(f"setting {name} has no command-line option")
    flag = flag or flag_of(name)
    shown = field.default if default is None else default
    hint = f"env {env_of(name)}"
    if extra.get("negate"):
        return click.option(flag, name, is_flag=True, default=None, flag_value=False,
                            help=f"{extra['negate']} [{hint}=false]")  # fmt: skip
    kind, multiple = _click_type(field.annotation, field)
    if field.annotation is bool:
        return click.option(flag, name, is_flag=True, default=None, flag_value=True,
                            help=f"{field.description} [{hint}]")  # fmt: skip
    if multiple and name == "trusted_proxies":  # one comma-separated value, as before
        multiple = False
    if multiple:
        hint += ", comma-separated"
    # The default is shown in the help, not given to click: an option left out must leave the
    # environment and the file their say.
    if shown not in (None, "", ()) and not callable(shown):
        hint += "; default: " + (",".join(shown) if isinstance(shown, tuple) else str(shown))
    return click.option(
        flag, name, type=kind, multiple=multiple, default=None, help=f"{field.description} [{hint}]"
    )


config_option = click.option(
    "--config",
    "config",
    type=click.Path(path_type=Path, dir_okay=False),
    default=None,
    help="a TOML file of settings, below the environment and the command line [env "
    "TOLLGATE_CONFIG]",
)


def settings_options(
    *names: str,
    flags: Mapping[str, str] | None = None,
    defaults: Mapping[str, Any] | None = None,
) -> Callable[[F], F]:
    """Give a command the options of `names` and --config; it is called with `settings`.
    `defaults`: this command's own defaults, below the file and the environment."""
    flags = dict(flags or {})
    defaults = dict(defaults or {})

    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            ctx = click.get_current_context()
            given: dict[str, Any] = {}
            for name in (*names, "config"):
                value = kwargs.pop(name)
                if ctx.get_parameter_source(name) is ParameterSource.COMMANDLINE:
                    given[name] = value
            kwargs["settings"] = settings_from(given, defaults, flags)
            return fn(*args, **kwargs)

        decorated: Any = wrapper
        for name in reversed(names):
            decorated = option_for(name, flags.get(name), defaults.get(name))(decorated)
        return typing.cast(F, config_option(decorated))

    return decorate


def settings_from(
    given: Mapping[str, Any],
    defaults: Mapping[str, Any] | None = None,
    flags: Mapping[str, str] | None = None,
) -> Settings:
    """Load the settings; a problem with them is a SettingsProblem naming the setting, its
    option and its variable."""
    try:
        settings = load_settings(**given)
    except ConfigFileError as exc:
        raise SettingsProblem(str(exc)) from None
    except SettingsError as exc:  # an environment value that does not parse
        raise SettingsProblem(str(exc)) from None
    except ValidationError as exc:
        problems = []
        for error in exc.errors():
            name = str(error["loc"][0]) if error["loc"] else ""
            where = name
            if name in Settings.model_fields:
                flag = (flags or {}).get(name) or flag_of(name)
                where = f"{name} ({flag}, {env_of(name)})"
            problems.append(f"setting {where}: {error['msg']}")
        raise SettingsProblem("; ".join(problems)) from None
    for name, value in (defaults or {}).items():
        if name not in settings.model_fields_set:
            setattr(settings, name, value)
    return settings
