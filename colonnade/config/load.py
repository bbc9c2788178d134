"""Reading configs: TOML files, ``--section.field=value`` overrides, field docs, TOML output.

A config file holds any subset of the sections of :class:`~colonnade.config.sections.Config`;
missing fields keep their defaults. Unknown sections or fields are errors that suggest the
closest valid name, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import itertools
import tomllib
import types
import typing
from pathlib import Path
from typing import Any

from colonnade.config.sections import SECTIONS, Config


class ConfigError(ValueError):
    """A configuration problem; the message names the field(s) and the fix."""


def _suggest(name: str, options: list[str]) -> str:
    close = difflib.get_close_matches(name, options, n=3)
    if not close:
        return f" Valid names: {', '.join(options)}."
    return " Did you mean " + " or ".join(f"'{c}'" for c in close) + "?"


@functools.cache
def _field_types(cls: type) -> dict[str, Any]:
    """Each field's annotated type (a section class never changes: resolved once, as
    ``get_type_hints`` compiles every annotation string on each call)."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _coerce(value: Any, tp: Any, where: str) -> Any:
    """Convert a TOML or CLI value to the annotated type ``tp`` or raise naming ``where``."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        is_none = value is None or (isinstance(value, str) and value.lower() in ("none", "null"))
        if is_none and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, where)
            except ConfigError as err:
                errors.append(str(err))
        raise ConfigError(errors[0] if errors else f"{where}: cannot be None")
    if origin is tuple:
        if isinstance(value, str):
            value = [v for v in value.split(",") if v.strip()] if value.strip() else []
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {value!r}")
        (item_tp, *_rest) = typing.get_args(tp)
        return tuple(_coerce(v, item_tp, where) for v in value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on"):
            return True
        if isinstance(value, str) and value.lower() in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"{where}: expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        try:
            as_float = float(str(value).replace("_", ""))
        except ValueError as err:
            raise ConfigError(f"{where}: expected an integer, got {value!r}") from err
        if not as_float.is_integer():
            raise ConfigError(f"{where}: expected an integer, got {value!r}")
        return int(as_float)
    if tp is float:
        try:
            return float(value)
        except (TypeError, ValueError) as err:
            raise ConfigError(f"{where}: expected a number, got {value!r}") from err
    if tp is str:
        return str(value)
    raise ConfigError(f"{where}: unsupported field type {tp!r}")


def _build_section(name: str, values: dict[str, Any], base: Any) -> Any:
    cls = SECTIONS[name]
    types_ = _field_types(cls)
    kwargs = {}
    for key, value in values.items():
        if key not in types_:
            raise ConfigError(f"unknown field '{name}.{key}'." + _suggest(key, list(types_)))
        kwargs[key] = _coerce(value, types_[key], f"{name}.{key}")
    return dataclasses.replace(base, **kwargs)


def config_from_dict(data: dict[str, Any], base: Config | None = None) -> Config:
    """Build a :class:`Config` from nested ``{section: {field: value}}`` over ``base``."""
    base = base or Config()
    sections = {}
    for name, values in data.items():
        if name not in SECTIONS:
            raise ConfigError(f"unknown config section '{name}'." + _suggest(name, list(SECTIONS)))
        if not isinstance(values, dict):
            raise ConfigError(f"config section '{name}' must be a table of fields")
        sections[name] = _build_section(name, values, getattr(base, name))
    return dataclasses.replace(base, **sections)


def parse_overrides(args: list[str]) -> dict[str, dict[str, Any]]:
    """Turn ``['--model.hidden_size=64', 'parallel.sp=true']`` into nested dicts (strings kept)."""
    out: dict[str, dict[str, Any]] = {}
    for arg in args:
        text = arg[2:] if arg.startswith("--") else arg
        if "=" not in text or "." not in text.split("=", 1)[0]:
            raise ConfigError(f"override '{arg}' must look like --section.field=value")
        key, value = text.split("=", 1)
        section, name = key.split(".", 1)
        if value.startswith("[") or value.startswith("("):
            value = ast.literal_eval(value)
        out.setdefault(section, {})[name] = value
    return out


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Read an optional TOML file, then apply CLI overrides; returns an unvalidated Config."""
    config = Config()
    if path is not None:
        path = Path(path)
        if not path.exists():
            raise ConfigError(f"config file '{path}' does not exist (see configs/ for presets)")
        with path.open("rb") as fh:
            try:
                data = tomllib.load(fh)
            except tomllib.TOMLDecodeError as err:
                raise ConfigError(f"config file '{path}' is not valid TOML: {err}") from err
        config = config_from_dict(data, config)
    if overrides:
        config = config_from_dict(parse_overrides(overrides), config)
    return config


def config_to_dict(config: Config) -> dict[str, dict[str, Any]]:
    """Nested plain dict of the config (tuples as lists) for TOML/JSON. A None field is dropped
    where None is its default, and written as "none" (which reads back as None) where it is
    not (checkpoint.save=none), so the text reads back as the same config."""
    out: dict[str, dict[str, Any]] = {}
    for name in SECTIONS:
        section = getattr(config, name)
        values = {}
        for f in dataclasses.fields(section):
            value = getattr(section, f.name)
            if value is None and f.default is None:
                continue
            if value is None:
                value = "none"
            values[f.name] = list(value) if isinstance(value, tuple) else value
        out[name] = values
    return out


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def config_to_toml(config: Config) -> str:
    """The config as TOML text (written next to every checkpoint and log)."""
    lines = []
    for name, values in config_to_dict(config).items():
        lines.append(f"[{name}]")
        lines.extend(f"{key} = {_toml_value(value)}" for key, value in values.items())
        lines.append("")
    return "\n".join(lines)


def field_docs(cls: type) -> dict[str, str]:
    """Docstrings under each dataclass field, read from the source (for --help)."""
    import inspect

    source = inspect.getsource(cls)
    tree = ast.parse(source)
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for prev, node in itertools.pairwise(body):
        if (
            isinstance(prev, ast.AnnAssign)
            and isinstance(prev.target, ast.Name)
            and isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            docs[prev.target.id] = " ".join(node.value.value.split())
    return docs
