"""Environments for the rollout loop (docs/algorithms.md §3.4; TRL's `environment_factory=`).

An environment is a class built by a zero-argument factory. Its **`reset(**row)`** starts an episode for one
rollout (the dataset row's columns as keyword arguments) and may return an observation that is appended to the
last prompt message; every other public method is a **tool** the model can call on that instance; an optional
**`get_reward()`** scores the episode after the rollout (one reward column named after the class):

    class Counter:
        def reset(self, start: int = 0, **row) -> str:
            self.value = start
            return f" The counter starts at {start}."

        def increment(self, by: int) -> int:
            \"\"\"Add to the counter.

            Args:
                by: how much to add
            \"\"\"
            self.value += by
            return self.value

        def get_reward(self) -> float:
            return float(self.value == 10)

`environment_factory` is one factory (every row uses it) or a dict `{name: factory}` (each row names its
environment in the `environment` column). Each factory is called once up front to probe its class (methods are
read from the class, so properties are never evaluated); the probe instance seeds a reuse pool, so instances are
built rarely and reset many times. Nothing here imports ray or torch.
"""

from __future__ import annotations

import inspect
import numbers
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

from rlasync.rewards.calling import hook_name
from rlasync.rollout.tools import call_tool

ENVIRONMENT_COLUMN = "environment"
"""The dataset column naming a row's environment when `environment_factory` is a dict."""
RESERVED_METHODS = frozenset({"reset", "get_reward"})

EnvironmentFactory = Callable[[], Any]


class EnvironmentHookError(ValueError):
    """An environment's factory, `reset` or `get_reward` raised; the message names it (`hook_name`), the row and
    the original error (chained). It stops the rollout loop like any error of user code."""


async def call_hook(hook: Callable[..., Any], arguments: Mapping[str, Any], executor: Executor, what: str) -> Any:
    """`call_tool(hook, arguments, executor)` with an error that names the hook: "environment my_module.MyEnv.reset
    (row 3) raised ValueError: ..."."""
    try:
        return await call_tool(hook, arguments, executor)
    except Exception as exc:
        raise EnvironmentHookError(
            f"environment {hook_name(hook)} ({what}) raised {type(exc).__name__}: {exc}"
        ) from exc


@dataclass(eq=False)
class EnvironmentSpec:
    """One environment kind: its factory, probed class, tool method names, and the pool of idle instances."""

    key: str | None
    factory: EnvironmentFactory
    cls: type
    tool_names: tuple[str, ...]
    owns_reward: bool
    pool: list[Any] = field(default_factory=list)

    @property
    def name(self) -> str:
        """The reward column of this environment: its class name."""
        return self.cls.__name__

    def acquire(self) -> Any:
        """An idle instance (built by the factory if none is idle)."""
        return self.pool.pop() if self.pool else self.factory()

    def release(self, instance: Any) -> None:
        """Give an instance back for reuse (it will be reset before its next rollout)."""
        self.pool.append(instance)

    def tools(self, instance: Any) -> list[Callable[..., Any]]:
        """The instance's bound tool methods."""
        return [getattr(instance, name) for name in self.tool_names]

    def class_tools(self) -> list[Callable[..., Any]]:
        """The tool functions as defined on the class (for name checks before any rollout)."""
        return [getattr(self.cls, name) for name in self.tool_names]


def probe_environments(
    environment_factory: EnvironmentFactory | Mapping[str, EnvironmentFactory] | None,
) -> dict[str | None, EnvironmentSpec]:
    """`{key: EnvironmentSpec}` (key `None` for a single factory); `{}` without environments.

    Raises `TypeError` when a factory is not callable and `ValueError` when a class has no `reset` method or a
    dict of factories is empty.
    """
    if environment_factory is None:
        return {}
    if isinstance(environment_factory, Mapping):
        if not environment_factory:
            raise ValueError("environment_factory is an empty dict: give at least one {name: factory} entry, or None")
        factories: dict[str | None, Any] = {str(name): factory for name, factory in environment_factory.items()}
    else:
        factories = {None: environment_factory}
    specs = {}
    for key, factory in factories.items():
        where = "environment_factory" if key is None else f"environment_factory[{key!r}]"
        if not callable(factory):
            raise TypeError(
                f"{where} is a {type(factory).__name__}; it must be a zero-argument callable that builds an "
                "environment (e.g. the environment class itself)"
            )
        try:
            instance = factory()
        except Exception as exc:
            raise EnvironmentHookError(
                f"{where} ({hook_name(factory)}) raised {type(exc).__name__} when called to build an environment: {exc}"
            ) from exc
        cls = type(instance)
        if not callable(getattr(cls, "reset", None)):
            raise ValueError(
                f"environment {cls.__name__} (from {where}) has no reset method: define "
                "`reset(self, **row)` (it starts an episode; its return value, if any, is appended to the prompt)"
            )
        specs[key] = EnvironmentSpec(
            key=key,
            factory=factory,
            cls=cls,
            tool_names=tuple(_public_methods(cls)),
            owns_reward=callable(getattr(cls, "get_reward", None)),
            pool=[instance],
        )
    return specs


def _public_methods(cls: type) -> list[str]:
    """Names of the public functions defined on `cls` or its bases (static lookup: properties not evaluated)."""
    names = []
    for name, value in inspect.getmembers_static(cls):
        if name.startswith("_") or name in RESERVED_METHODS:
            continue
        if inspect.isfunction(value):
            names.append(name)
    return sorted(names)


def reset_kwargs(row: Mapping[str, Any], multi_environment: bool) -> dict[str, Any]:
    """The keyword arguments of `reset`: the whole row, or (multi-environment) the row without `environment`."""
    return {str(name): value for name, value in row.items() if not (multi_environment and name == ENVIRONMENT_COLUMN)}


def append_to_last_message(prompt: Sequence[Mapping[str, Any]], observation: Any) -> list[dict[str, Any]]:
    """A new message list whose last message's content has `observation` appended (the input is not mutated).

    String contents concatenate; if either side is a list of content blocks (multimodal), both become blocks
    (a string becomes one `{"type": "text", "text": ...}` block).
    """
    if not prompt:
        raise ValueError("cannot append an environment observation to an empty prompt")
    messages = [dict(message) for message in prompt]
    last = messages[-1]
    content = last.get("content")
    if isinstance(content, list) or isinstance(observation, list):
        last["content"] = _as_blocks(content) + _as_blocks(observation)
    else:
        last["content"] = ("" if content is None else str(content)) + str(observation)
    return messages


def _as_blocks(content: Any) -> list[Any]:
    if content is None or content == "":
        return []
    if isinstance(content, list):
        return list(content)
    return [{"type": "text", "text": str(content)}]


def environment_for(
    environments: Mapping[str | None, EnvironmentSpec], row: Mapping[str, Any], row_index: int = -1
) -> EnvironmentSpec | None:
    """The environment serving `row`: the only one, or (several) the one named by its `environment` column;
    `ValueError` when the row names none of them. None without environments."""
    if not environments:
        return None
    if list(environments) == [None]:
        return environments[None]
    name = row.get(ENVIRONMENT_COLUMN)
    spec = environments.get(name) if isinstance(name, str) else None
    if spec is None:
        where = f"row {row_index}" if row_index >= 0 else "a dataset row"
        raise ValueError(
            f"{where}: environment {name!r} is not among the environments {sorted(map(str, environments))} "
            f"of environment_factory; with a dict of factories every row needs an {ENVIRONMENT_COLUMN!r} column "
            "naming one of its keys"
        )
    return spec


GenerateInEnvironment = Callable[[list[dict[str, Any]], "list[Any] | None", Any], Awaitable[Any]]


async def run_in_environment(
    spec: EnvironmentSpec,
    row: Mapping[str, Any],
    prompt: list[dict[str, Any]],
    tools: Sequence[Callable[..., Any]] | None,
    generate: GenerateInEnvironment,
    executor: Executor,
    emit: Callable[[list[Any]], Any],
    clock: Callable[[], float],
    row_index: int = -1,
) -> tuple[Any, tuple[str, float | None] | None, list[dict[str, Any]]]:
    """One rollout inside an environment (docs/algorithms.md §3.4): an instance from the spec's pool is reset with the row (its
    observation appended to the last prompt message), serves its methods as tools next to the standalone ones
    (`generate(prompt, tools, instance)`), and after the rollout gives `get_reward()` before going back to the
    pool. An instance whose rollout failed or was cancelled is dropped (a tool thread may still be using it).
    Returns the rollout, `(class name, reward)` when the class owns a reward (else None) and the prompt used."""
    try:
        environment = spec.acquire()
    except Exception as exc:
        raise EnvironmentHookError(
            f"environment_factory {hook_name(spec.factory)} (building another {spec.name}) raised "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    reset_started = clock()
    kwargs = reset_kwargs(row, multi_environment=spec.key is not None)
    where = f"row {row_index}" if row_index >= 0 else "a dataset row"
    observation = await call_hook(environment.reset, kwargs, executor, f"reset(**row) with the columns of {where}")
    emit([("env/reset_s", (clock() - reset_started, 1.0))])
    if observation is not None:
        prompt = append_to_last_message(prompt, observation)
    rollout = await generate(prompt, [*(tools or []), *spec.tools(environment)] or None, environment)
    env_reward = None
    if spec.owns_reward:
        reward_started = clock()
        value = await call_hook(environment.get_reward, {}, executor, f"get_reward() after the rollout of {where}")
        emit([("env/reward_s", (clock() - reward_started, 1.0))])
        if value is not None and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
            raise EnvironmentHookError(
                f"environment {hook_name(environment.get_reward)} returned {value!r} ({type(value).__name__}) "
                f"after the rollout of {where}: return a number (int or float), or None to leave it unscored"
            )
        env_reward = (spec.name, None if value is None else float(value))
    spec.release(environment)
    return rollout, env_reward, prompt


__all__ = [
    "ENVIRONMENT_COLUMN",
    "EnvironmentHookError",
    "EnvironmentSpec",
    "call_hook",
    "append_to_last_message",
    "environment_for",
    "probe_environments",
    "reset_kwargs",
    "run_in_environment",
]
