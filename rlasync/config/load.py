"""Build a config from YAML and `key=value` overrides.

    config = load_config("configs/quickstart.yaml", ["learning_rate=1e-5", "max_steps=2"])

Values are coerced to the field's type by pydantic (so `"1e-5"` becomes a float); nested dataclass
sections take dotted keys (`cluster.num_learners=2`). An unknown key is an error naming the closest field.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import pydantic
import yaml

from rlasync.config.grpo import AsyncGRPOConfig

C = TypeVar("C")


def parse_override(text: str) -> tuple[str, Any]:
    """`"a.b=1e-5"` -> `("a.b", value)`; the value is parsed as YAML (`true`, `[1, 2]`, `null`, ...)."""
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ValueError(f"override {text!r}: write it as key=value (for example learning_rate=1e-5)")
    try:
        return key, yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or str(exc).split("\n", 1)[0]
        raise ValueError(
            f"override {text!r}: the value of {key} is not valid YAML ({problem}); quote it, e.g. {key}='...'"
        ) from None


def apply_overrides(data: dict[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """Return a copy of `data` with each dotted `key=value` override set."""
    out = _deep_copy(data)
    for text in overrides:
        key, value = parse_override(text)
        node = out
        *parents, leaf = key.split(".")
        for part in parents:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ValueError(f"override {text!r}: {part!r} is a value, not a section")
            node = child
        node[leaf] = value
    return out


def build_config(data: Mapping[str, Any], config_class: type[C] = AsyncGRPOConfig) -> C:  # type: ignore[assignment]
    """Validate a mapping into `config_class` (a dataclass), naming unknown keys and bad values."""
    check_keys(data, config_class)
    try:
        return pydantic.TypeAdapter(config_class).validate_python(dict(data))
    except pydantic.ValidationError as exc:
        raise ValueError(_explain(exc, config_class)) from None


def load_config(
    path: str | Path | None = None,
    overrides: Iterable[str] = (),
    config_class: type[C] = AsyncGRPOConfig,  # type: ignore[assignment]
) -> C:
    """Read YAML at `path` (optional), apply dotted overrides, and build `config_class`."""
    data = read_yaml(path) if path is not None else {}
    return build_config(apply_overrides(data, overrides), config_class)


def read_yaml(path: str | Path) -> dict[str, Any]:
    """The mapping in the YAML file at `path`; `ValueError` naming the file (and the line of a syntax error)."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise ValueError(
            f"config file {str(path)!r} does not exist (check the path, e.g. configs/quickstart.yaml)"
        ) from None
    except OSError as exc:
        raise ValueError(f"config file {str(path)!r} cannot be read: {exc.strerror or exc}") from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader) or {}  # noqa: S506 (a SafeLoader)
    except DuplicateKeyError as exc:
        raise ValueError(f"{path}: {exc}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).split("\n", 1)[0]
        raise ValueError(f"{path}{at}: YAML syntax error: {problem}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: the top level must be a mapping of config fields, got {type(data).__name__}")
    return data


class DuplicateKeyError(yaml.YAMLError):
    """A YAML mapping that names one key twice (PyYAML keeps the last silently)."""


class _UniqueKeyLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` that refuses a key written twice in one mapping, naming both lines."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
            except TypeError:  # an unhashable key: SafeLoader's own error follows
                continue
            line = key_node.start_mark.line + 1
            if first is not None:
                raise DuplicateKeyError(
                    f"the key {key!r} is written twice (line {first} and line {line}); keep one of them"
                )
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def check_keys(data: Mapping[str, Any], config_class: type, prefix: str = "") -> None:
    """Raise on keys that are not fields of `config_class` (recursing into dataclass sections)."""
    hints = typing.get_type_hints(config_class)
    names = [f.name for f in dataclasses.fields(config_class)]
    for key, value in data.items():
        if key not in names:
            close = difflib.get_close_matches(key, names, n=1)
            hint = f"; did you mean {prefix + close[0]!r}?" if close else ""
            raise ValueError(f"unknown config field {prefix + str(key)!r} for {config_class.__name__}{hint}")
        section = hints.get(key)
        if dataclasses.is_dataclass(section) and isinstance(section, type) and isinstance(value, Mapping):
            check_keys(value, section, prefix=f"{prefix}{key}.")


def _explain(exc: pydantic.ValidationError, config_class: type) -> str:
    lines = [f"invalid {config_class.__name__}:"]
    for error in exc.errors():
        where = ".".join(str(p) for p in error["loc"]) or "(config)"
        if error.get("type") == "value_error":  # raised by __post_init__: the message names field and fix
            lines.append(f"  {error['msg'].removeprefix('Value error, ')}")
        else:
            lines.append(f"  {where}: {error['msg']} (got {error.get('input')!r})")
    return "\n".join(lines)


def _deep_copy(data: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _deep_copy(v) if isinstance(v, Mapping) else v for k, v in data.items()}
