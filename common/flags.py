"""Configuration dataclass fields as command-line flags, environment variables and keys of a
`--config FILE`.

A field's value comes from, highest first: its flag on the command line, the YAML file named
by `--config`, its PDSERVE_<NAME> variable, the dataclass default. The file sets the flags'
defaults of the command it is given to, so its keys are that command's flag names (`kv-backend`
or `kv_backend`) and every flag is accepted, the dataclass fields and the command's own.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from dataclasses import field
from typing import Any, Literal, TypeVar, get_args, get_origin

import yaml

from pdserve.common.errors import ConfigError

T = TypeVar("T")


def flag(default: Any, help: str, **kw: Any) -> Any:
    """A dataclass field that is also a flag: its default and its help text."""
    return field(default=default, metadata={"help": help, **kw})


def _flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def _base_type(tp: Any) -> tuple[type, tuple[Any, ...] | None]:
    """(python type, choices) for a field annotation such as `int`, `str | None`, Literal."""
    origin = get_origin(tp)
    if origin is Literal:
        values = get_args(tp)
        return type(values[0]), values
    if origin in (typing.Union, types.UnionType):
        inner = [a for a in get_args(tp) if a is not type(None)]
        return _base_type(inner[0])
    return tp, None


def add_flags(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = ()) -> None:
    """Adds one option per dataclass field; the default is resolved later (env, then field)."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.name in skip or any(a.dest == f.name for a in parser._actions):
            continue
        tp, choices = _base_type(hints[f.name])
        help_text = (
            f"{f.metadata.get('help', '')} (default: {f.default}; env PDSERVE_{f.name.upper()})"
        )
        if tp is bool:
            parser.add_argument(
                _flag_name(f.name),
                dest=f.name,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=help_text,
            )
        elif f.metadata.get("repeat"):  # given several times: a comma-separated value
            parser.add_argument(_flag_name(f.name), dest=f.name, type=tp, action=_Repeat,
                                default=None, help=help_text)  # fmt: skip
        else:
            parser.add_argument(
                _flag_name(f.name),
                dest=f.name,
                type=tp,
                choices=choices,
                default=None,
                help=help_text,
            )


class _Repeat(argparse._AppendAction):
    """Appends, but the first use on the command line replaces a default (a --config file's
    list): a flag given overrides the file, as every other flag does."""

    def __call__(self, parser: Any, ns: Any, values: Any, option_string: Any = None) -> None:
        seen = ns.__dict__.setdefault("_repeated", set())
        items = list(getattr(ns, self.dest) or []) if self.dest in seen else []
        seen.add(self.dest)
        setattr(ns, self.dest, [*items, values])


def _parse_env(raw: str, tp: type, name: str) -> Any:
    if tp is bool:
        return raw.strip().lower() in ("1", "true", "yes", "on")
    try:
        return tp(raw)
    except ValueError as exc:
        raise ConfigError(f"PDSERVE_{name.upper()}={raw!r} is not a valid {tp.__name__}") from exc


def from_args(cls: type[T], args: argparse.Namespace | None = None, **overrides: Any) -> T:
    """Flag value if given, else PDSERVE_<NAME> from the environment, else the field default."""
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name in overrides:
            values[f.name] = overrides[f.name]
            continue
        given = getattr(args, f.name, None) if args is not None else None
        if isinstance(given, list):  # a repeatable flag (flag(..., repeat=True))
            given = ",".join(given)
        if given is not None:
            values[f.name] = given
            continue
        env = os.environ.get(f"PDSERVE_{f.name.upper()}")
        if env is not None:
            tp, choices = _base_type(hints[f.name])
            value = _parse_env(env, tp, f.name)
            if choices and value not in choices:
                raise ConfigError(f"PDSERVE_{f.name.upper()}={env!r}: choose one of {choices}")
            values[f.name] = value
    return cls(**values)


def add_shared_flags(parser: argparse.ArgumentParser, cls: type, names: tuple[str, ...]) -> None:
    """Options for some fields of `cls` with the field's own default, for a command that takes
    the value as it is (the planner models the serving commands: one definition for both)."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for name in names:
        f = fields[name]
        tp, choices = _base_type(hints[name])
        help_text = f"{f.metadata.get('help', '')} (default: {f.default})"
        if tp is bool:
            action: Any = argparse.BooleanOptionalAction
            parser.add_argument(_flag_name(name), dest=name, action=action, default=f.default,
                                help=help_text)  # fmt: skip
        else:
            parser.add_argument(_flag_name(name), dest=name, type=tp, choices=choices,
                                default=f.default, help=help_text)  # fmt: skip


def add_config_flag(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config",
        dest="config_file",  # `pdserve compare --config` is its study file, a different thing
        metavar="FILE",
        default=None,
        help="YAML file of this command's flag values (e.g. `kv-backend: tcp`); flags on the "
        "command line override it, it overrides PDSERVE_* variables",
    )


def apply_config_file(parser: argparse.ArgumentParser, path: str) -> dict[str, Any]:
    """Make the values of the YAML file at `path` the defaults of `parser`'s flags; returns
    them. A key that is no flag of this command, or a value of the wrong type, is an error
    that names it."""
    where = f"--config {path}"
    try:
        with open(path, encoding="utf-8") as fh:
            data = yaml.safe_load(fh)
    except OSError as exc:
        raise ConfigError(f"{where}: {exc.strerror or exc}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"{where}: not valid YAML ({exc})") from exc
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: expected a mapping of flag names to values")
    actions = {a.dest: a for a in parser._actions if a.option_strings}
    values: dict[str, Any] = {}
    for key, value in data.items():
        dest = str(key).lstrip("-").replace("-", "_")
        action = actions.get(dest)
        if action is None or dest in ("help", "config_file"):
            no_flag = f"this command has no {_flag_name(dest)}"
            raise ConfigError(f"{where}: unknown key {key!r} ({no_flag})")
        values[dest] = _file_value(action, value, f"{where}: {key}")
    parser.set_defaults(**values)
    return values


def _file_value(action: argparse.Action, value: Any, where: str) -> Any:
    """A YAML value as the flag's type, checked as argparse checks a command-line value."""
    if isinstance(action, argparse._AppendAction):  # repeatable flags take a list
        items = value if isinstance(value, list) else [value]
        return [_scalar(action, v, where) for v in items]
    if isinstance(action, (argparse.BooleanOptionalAction, argparse._StoreConstAction)):
        if not isinstance(value, bool):
            raise ConfigError(f"{where}: expected true or false, got {value!r}")
        if isinstance(action, argparse._StoreConstAction):  # store_true / store_false
            return action.const if value else action.default
        return value
    return _scalar(action, value, where)


def _scalar(action: argparse.Action, value: Any, where: str) -> Any:
    tp = action.type if callable(action.type) else str
    if isinstance(value, bool) and action.choices is not None and "on" in action.choices:
        value = "on" if value else "off"  # YAML 1.1 reads a bare on/off as true/false
    if value is None or isinstance(value, (list, dict, bool)):
        raise ConfigError(f"{where}: expected one value, got {value!r}")
    if tp is int and isinstance(value, float):
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    try:  # a custom type (parse_slo, say) reads the text a command line would carry
        out = tp(value) if tp in (int, float, str) else tp(str(value))
    except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
        raise ConfigError(f"{where}: {value!r} is not a valid value ({exc})") from exc
    if action.choices is not None and out not in action.choices:
        raise ConfigError(f"{where}: {out!r}: choose one of {list(action.choices)}")
    return out
