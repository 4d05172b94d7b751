"""The registry of algorithms: name -> `Algorithm` spec (in the spirit of prime-rl's `ALGORITHM_CLASSES`).

    BUILTIN          one line per algorithm shipped here ("module:name" of its spec, imported on first use)
    register(spec)   one more, e.g. from a test or a user package
    get(name)        the spec a trainer or a run file's `trainer:` names (its `name` or one of its `trainer_names`)
    for_config(cfg)  the spec whose config class `cfg` is (the most derived one first)

Adding an algorithm touches its folder and one line here (or one `register` call). Nothing here imports torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from rlasync.algorithms.spec import Algorithm

if TYPE_CHECKING:
    from rlasync.config.base import TrainerConfig

BUILTIN = (
    "rlasync.algorithms.grpo.spec:GRPO",
    "rlasync.algorithms.distill.spec:DISTILL",
)

_REGISTRY: dict[str, Algorithm] = {}
_loaded = False


def _load_builtin() -> None:
    global _loaded
    if _loaded:
        return
    _loaded = True
    for entry in BUILTIN:
        module, _, name = entry.partition(":")
        spec = getattr(importlib.import_module(module), name)
        _REGISTRY.setdefault(spec.name, spec)


def register(spec: Algorithm) -> Algorithm:
    """Add `spec` under its name (an existing name is replaced: re-registering in a test session is harmless)."""
    if not isinstance(spec, Algorithm):
        raise TypeError(f"register: expected an rlasync.algorithms.spec.Algorithm, got {type(spec).__name__}")
    _load_builtin()
    _REGISTRY[spec.name] = spec
    return spec


def specs() -> list[Algorithm]:
    """Every registered spec, in registration order."""
    _load_builtin()
    return list(_REGISTRY.values())


def names() -> list[str]:
    """Every name a run file's `trainer:` may use."""
    _load_builtin()
    return [name for spec in _REGISTRY.values() for name in (spec.name, *spec.trainer_names)]


def get(name: str) -> Algorithm:
    """The spec registered as `name` (or with `name` among its `trainer_names`)."""
    _load_builtin()
    for spec in _REGISTRY.values():
        if name == spec.name or name in spec.trainer_names:
            return spec
    raise ValueError(f"unknown algorithm {name!r}: use one of {names()} (or register one: rlasync.algorithms.registry)")


def for_config(config: TrainerConfig) -> Algorithm:
    """The spec whose `config_cls` `config` is an instance of (a user subclass included; the closest class wins)."""
    _load_builtin()
    matches = [spec for spec in _REGISTRY.values() if isinstance(config, spec.config_cls)]
    if not matches:
        raise ValueError(f"no algorithm takes a {type(config).__name__}: use one of {names()}")
    return max(matches, key=lambda spec: len(spec.config_cls.__mro__))


__all__ = ["BUILTIN", "for_config", "get", "names", "register", "specs"]
