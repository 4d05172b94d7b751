"""The process-level environment variables rlasync reads, declared once (vLLM's `envs.py` is the model): each with
its name, type, default and meaning, read through a typed accessor when asked (`rlasync.envs.RLASYNC_CACHE`, a
`Path`), so a process that sets one later sees the new value.

Only what belongs to a process or a machine lives here. A knob of a run is a config field instead, which crosses
Ray with the settings to every actor: the learner's kernel switches are the config's `kernels` section
(`rlasync.config.kernels.KernelSettings`), not variables, because a variable set where the driver runs never reaches
the actors of an existing cluster (`ray job submit`, KubeRay). No other module of rlasync/, actors/, bench/, tests/
or .ci/, nor examples/' notebooks (whose own parameters are `NOTEBOOK_*`), reads an `RLASYNC_*` variable
(tests/unit/test_envs.py), and no other module names one: rlasync's cache folder is `cache_dir()` here.

    RLASYNC_CACHE   Path   ~/.cache/rlasync   where model aliases are prepared (`models/<alias>`, rlasync.model.registry)
                                              and inductor keeps compiled graphs (`inductor/`, rlasync.model.compilation)

Imports nothing of rlasync.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any


@dataclass(frozen=True)
class Variable:
    """One declared variable: `parse(raw)` turns its value (None or "" when unset) into the typed value."""

    name: str
    type: type
    default: str  # the default as the docs say it
    meaning: str
    parse: Callable[[str | None], Any]


def _cache_dir(raw: str | None) -> Path:
    return Path(raw).expanduser() if raw else Path.home() / ".cache" / "rlasync"


VARIABLES: dict[str, Variable] = {
    variable.name: variable
    for variable in (
        Variable(
            "RLASYNC_CACHE",
            Path,
            "~/.cache/rlasync",
            "where model aliases are prepared, under models/<alias> (rlasync.model.registry), and inductor's compile "
            "cache, under inductor/ (rlasync.model.compilation)",
            _cache_dir,
        ),
    )
}

if TYPE_CHECKING:
    RLASYNC_CACHE: Path


def cache_dir() -> Path:
    """rlasync's cache folder (`RLASYNC_CACHE` now): the converted models (rlasync.model.registry) and inductor's
    cache (rlasync.model.compilation)."""
    return read("RLASYNC_CACHE")


def read(name: str) -> Any:
    """The typed value of the declared variable `name` in this process's environment now."""
    variable = VARIABLES.get(name)
    if variable is None:
        raise KeyError(f"{name} is not a declared rlasync variable (rlasync/envs.py declares {', '.join(VARIABLES)})")
    return variable.parse(os.environ.get(name))


def __getattr__(name: str) -> Any:
    if name in VARIABLES:
        return read(name)
    raise AttributeError(f"module 'rlasync.envs' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *VARIABLES])


__all__ = ["VARIABLES", "Variable", "cache_dir", "read", *VARIABLES]
