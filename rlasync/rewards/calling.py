"""The reward-function calling convention (TRL's, docs/algorithms.md §2.6.1) and the table of per-source rewards it fills.

Every reward function is called once per group, on the whole group, with keyword arguments:

    prompts         [G] the prompt of each rollout (the same prompt repeated)
    completions     [G] each rollout's completion (a list of messages)
    completion_ids  [G] each rollout's generated token ids (all turns concatenated)
    <column>        [G] every dataset column except prompt/completion/completion_ids, repeated G times

and returns `G` rewards, each an `int`, a `float` or `None` (not scored by this function). Functions should
accept `**kwargs` so that unused dataset columns do not break them. Sync functions run in a worker thread
(`asyncio.to_thread`), coroutine functions are awaited, and all of them run concurrently. With `timeout_s`
(`reward_timeout_s`), a function that has not returned in time fails the group with a `RewardTimeoutError`
naming it (a sync function's thread cannot be killed: it finishes in the background, its result unused; the error
says how many calls of that function are still running so, since a hung function keeps its thread and the pool's
threads are few, later calls that only waited for a thread are not mistaken for slow ones).

`bool` is not accepted as a reward (convert with `float(...)`): a list of booleans usually means a check
was returned where a score was meant. Infinite values are rejected; NaN counts as `None`. A function that
raises, returns the wrong number of values or a value of another type fails the group with a
`RewardFunctionError` naming the function (its column name and where it is defined, `hook_name`).

Each function gets its own copies of the argument lists (`completions` copied deeply: its messages are dicts), so
a function that modifies its inputs changes neither the group nor what the other functions see; the modification
is warned once per function, naming the argument, and said in its error when its rewards do not fit.

A reward function object may also define `drain_metrics() -> [(key, value), ...]`: the items it recorded since the
last call are drained after each group's calls into `RewardTable.metrics` and logged with the group's metrics.

Each function becomes one column of a `RewardTable`; other sources (an environment's `get_reward`, a
loop-provided rollout reward) are added as further named columns. A rollout's reward is the weighted sum of its
columns ignoring NaN (TRL's `(rewards_per_func * reward_weights).nansum(dim=1)`: each column's weight is its
function's `reward_weights` entry, 1 for the other sources); a rollout that no column scored gets NaN
(unscorable), not 0, whatever the weights (a rollout scored only by columns of weight 0 gets 0, as in TRL).
"""

from __future__ import annotations

import asyncio
import collections
import copy
import dataclasses
import functools
import inspect
import logging
import math
import numbers
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

RewardFunc = Callable[..., Any]
"""A reward function: `f(*, prompts, completions, completion_ids, **columns) -> list[float | int | None]`
(or a coroutine function returning that list)."""

RewardColumns = Mapping[str, Sequence[float | None]] | Iterable[tuple[str, Sequence[float | None]]]
"""Extra named reward columns, `G` values each (`None` = not scored)."""

RESERVED_ARGUMENTS = ("prompts", "completions", "completion_ids")
logger = logging.getLogger(__name__)


class RewardFunctionError(ValueError):
    """A reward function (or an extra reward column) broke the calling convention; the message names it."""


class RewardTimeoutError(RewardFunctionError):
    """A reward function did not return within `reward_timeout_s`; the message names it. Only its group fails."""


class ProcessLocal:
    """A reward-function object that travels (pickled to the actors that call it) while some of its attributes stay
    in their process (a loaded model, an HTTP session, locks, counters): `_reset_process_state()` makes them, the
    names in `_process_state` are left out when it is pickled and made afresh when it is unpickled."""

    _process_state: tuple[str, ...] = ()

    def _reset_process_state(self) -> None:
        raise NotImplementedError

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        for key in self._process_state:
            state.pop(key)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reset_process_state()


@dataclass(frozen=True, slots=True)
class RewardTable:
    """Per-source rewards of one group.

    names:   one unique name per column (function name, environment class name, ...)
    values:  [C, G] float64; `values[k, i]` is column `k`'s reward for rollout `i`, NaN where not scored
    metrics: metric items `(key, value)` the reward functions reported while scoring (`drain_metrics`), logged
             with the group's metrics
    weights: [C] float64, each column's weight in `totals()`; None: every column weighs 1
    """

    names: tuple[str, ...]
    values: np.ndarray
    metrics: tuple[tuple[str, Any], ...] = ()
    weights: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.weights is not None and np.shape(self.weights) != (len(self.names),):
            raise ValueError(
                f"RewardTable: {np.size(self.weights)} weight(s) for {len(self.names)} column(s) {list(self.names)}; "
                "give one weight per column"
            )

    @property
    def num_rollouts(self) -> int:
        return int(self.values.shape[1])

    def column(self, name: str) -> np.ndarray:
        """The `[G]` rewards of the column called `name`."""
        return self.values[self.names.index(name)]

    def with_weights(self, weights: Sequence[float] | np.ndarray | None) -> RewardTable:
        """This table with `weights` (one per column; None: all 1)."""
        weights = None if weights is None else np.asarray(weights, dtype=np.float64)
        return dataclasses.replace(self, weights=weights)

    def totals(self) -> np.ndarray:
        """`[G]` weighted sum per rollout over the columns, NaN ignored; NaN where no column scored it (TRL's
        `nansum` of `rewards_per_func * reward_weights`, the unscorable rows set back to NaN)."""
        values = np.asarray(self.values, dtype=np.float64)
        unscored = np.isnan(values).all(axis=0)
        weighted = values if self.weights is None else values * np.asarray(self.weights, dtype=np.float64)[:, None]
        totals = np.nansum(weighted, axis=0)
        totals[unscored] = np.nan
        return totals


def reward_func_name(func: RewardFunc) -> str:
    """The column name of a reward function.

    A function's `__name__`; the wrapped function's name for a `functools.partial`; for a callable object,
    its `__name__` attribute if it has one, else its class name.
    """
    while isinstance(func, functools.partial):
        func = func.func
    name = getattr(func, "__name__", None)
    return name if isinstance(name, str) and name else type(func).__name__


def hook_name(hook: Any) -> str:
    """Where a user's hook (a reward function, a tool, an environment method) is defined, for its errors:
    "my_module.my_reward", "my_module.MyEnv.reset", "my_module.Scorer.__call__" for a callable object (a
    `functools.partial`: the function it wraps)."""
    while isinstance(hook, functools.partial):
        hook = hook.func
    target = hook if inspect.isfunction(hook) or inspect.ismethod(hook) or inspect.isclass(hook) else None
    if target is None and callable(hook) and not inspect.isbuiltin(hook):
        cls = type(hook)
        return f"{cls.__module__}.{cls.__qualname__}.__call__"
    target = target if target is not None else hook
    module = getattr(target, "__module__", None)
    qualname = getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or type(target).__name__
    return f"{module}.{qualname}" if module else str(qualname)


def unique_names(names: Iterable[str]) -> list[str]:
    """Make names unique in order: the first `x` stays `x`, later ones become `x_2`, `x_3`, ..."""
    taken: set[str] = set()
    unique = []
    for name in names:
        candidate, suffix = name, 2
        while candidate in taken:
            candidate, suffix = f"{name}_{suffix}", suffix + 1
        taken.add(candidate)
        unique.append(candidate)
    return unique


async def call_reward_funcs(
    reward_funcs: Sequence[RewardFunc],
    *,
    prompts: Sequence[Any],
    completions: Sequence[Any],
    completion_ids: Sequence[Sequence[int]],
    reward_kwargs: Mapping[str, Sequence[Any]],
    extra_columns: RewardColumns | None = None,
    timeout_s: float | None = None,
) -> RewardTable:
    """Score one group: call every reward function concurrently, then append the extra columns.

    Columns come in the order: reward functions, then `extra_columns`; duplicate names get `_2`, `_3`, ...
    Raises `RewardFunctionError` when a function raises (chained), returns the wrong length or a non-number,
    `RewardTimeoutError` when one has not returned within `timeout_s` seconds (None: no limit).
    """
    num_rollouts = len(completions)
    kwargs = _reward_call_kwargs(prompts, completions, completion_ids, reward_kwargs)
    extra = reward_column_items(extra_columns)
    names = unique_names([reward_func_name(func) for func in reward_funcs] + [name for name, _ in extra])
    func_names, extra_names = names[: len(reward_funcs)], names[len(reward_funcs) :]
    own = [_own_copy(kwargs) for _ in reward_funcs]  # each function its own lists: a modification stays there
    calls = (
        _timed(_call_reward_func(func, given, name), name, timeout_s)
        for func, given, name in zip(reward_funcs, own, func_names)
    )
    outcomes = await asyncio.gather(*calls, return_exceptions=True)
    for outcome in outcomes:
        if isinstance(outcome, RewardTimeoutError):
            raise outcome
    rows = []
    for func, given, name, outcome in zip(reward_funcs, own, func_names, outcomes, strict=True):
        source = f"reward function '{name}' ({hook_name(func)})"
        changed = _modified(kwargs, given)
        try:
            rows.append(_to_column(outcome, source, num_rollouts))
        except RewardFunctionError as exc:
            if changed:
                raise RewardFunctionError(f"{exc}; it modified its argument {changed}") from exc.__cause__
            raise
        if changed:
            _warn_once(
                source,
                f"{source} modified its argument {changed}: it was given a copy, so the group is unchanged; "
                "reward functions should not modify their inputs",
            )
    rows += [
        _to_column(values, f"reward column '{name}'", num_rollouts)
        for name, (_, values) in zip(extra_names, extra, strict=True)
    ]
    values = np.stack(rows) if rows else np.empty((0, num_rollouts), dtype=np.float64)
    return RewardTable(names=tuple(names), values=values, metrics=drained_metrics(reward_funcs))


def drained_metrics(reward_funcs: Sequence[RewardFunc]) -> tuple[tuple[str, Any], ...]:
    """The metric items of the reward functions that report some (a `drain_metrics()` method returning
    `(key, value)` items recorded since its last call, e.g. `RewardModel`'s batch sizes), each object once."""
    seen: set[int] = set()
    items: list[tuple[str, Any]] = []
    for func in reward_funcs:
        drain = getattr(func, "drain_metrics", None)
        if callable(drain) and id(func) not in seen:
            seen.add(id(func))
            items += [(str(key), value) for key, value in drain()]
    return tuple(items)


def reward_column_items(columns: RewardColumns | None) -> list[tuple[str, Sequence[float | None]]]:
    """Reward columns, given as a mapping or as `(name, values)` pairs, as a list of pairs."""
    if columns is None:
        return []
    return list(columns.items() if isinstance(columns, Mapping) else columns)


def _reward_call_kwargs(
    prompts: Sequence[Any],
    completions: Sequence[Any],
    completion_ids: Sequence[Sequence[int]],
    reward_kwargs: Mapping[str, Sequence[Any]],
) -> dict[str, Any]:
    clashing = sorted(set(reward_kwargs) & set(RESERVED_ARGUMENTS))
    if clashing:
        raise ValueError(
            f"dataset column(s) {clashing} clash with the reward-function arguments {list(RESERVED_ARGUMENTS)}: "
            "rename the column(s)"
        )
    return {"prompts": prompts, "completions": completions, "completion_ids": completion_ids, **reward_kwargs}


def _own_copy(kwargs: dict[str, Any]) -> dict[str, Any]:
    """One function's arguments: every per-rollout list copied (`completions` deeply), so what it modifies stays
    in its copy."""
    return {
        name: copy.deepcopy(values) if name == "completions" else list(values) if isinstance(values, list) else values
        for name, values in kwargs.items()
    }


def _modified(original: Mapping[str, Any], given: Mapping[str, Any]) -> str | None:
    """How a function changed its copy of the arguments ("'completions' (4 entries -> 0)"), else None."""
    for name, values in original.items():
        mine = given[name]
        if not isinstance(values, list) or mine is values:
            continue
        if len(mine) != len(values):
            return f"'{name}' ({len(values)} entries -> {len(mine)})"
        if name == "completions":
            if mine != values:
                return f"'{name}' (its contents)"
        elif any(a is not b for a, b in zip(mine, values)):
            return f"'{name}' (entries replaced)"
    return None


_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        logger.warning("%s", message)


_threads_lock = threading.Lock()
_in_threads: collections.Counter[str] = collections.Counter()  # reward function name -> calls running in threads


def calls_in_threads(name: str) -> int:
    """How many calls of the sync reward function `name` are running in worker threads now (timed-out ones too)."""
    with _threads_lock:
        return _in_threads[name]


def _counted(func: RewardFunc, name: str, kwargs: dict[str, Any]) -> Any:
    with _threads_lock:
        _in_threads[name] += 1
    try:
        return func(**kwargs)
    finally:
        with _threads_lock:
            _in_threads[name] -= 1


async def _timed(call: Any, name: str, timeout_s: float | None) -> Any:
    try:
        async with asyncio.timeout(timeout_s):
            return await call
    except TimeoutError:
        running = calls_in_threads(name)
        background = (
            f"; {running} call(s) of it are still running in worker threads (a thread cannot be stopped: a hung "
            "function keeps its thread, and once the pool's min(32, CPUs + 4) threads are taken every later call "
            "only waits for one)"
            if running
            else ""
        )
        raise RewardTimeoutError(
            f"reward function '{name}' did not return within reward_timeout_s={timeout_s:g} s; its group is "
            f"dropped as failed (make it faster, or raise reward_timeout_s){background}"
        ) from None


async def _call_reward_func(func: RewardFunc, kwargs: dict[str, Any], name: str = "") -> Any:
    """Await a coroutine function or an object with an `async def __call__` (`RemoteReward`); run anything else in
    a thread (counted under `name` while it runs), awaiting its result if that is awaitable."""
    if inspect.iscoroutinefunction(func) or inspect.iscoroutinefunction(type(func).__call__):
        return await func(**kwargs)
    result = await asyncio.to_thread(_counted, func, name, kwargs)
    return await result if inspect.isawaitable(result) else result


def _to_column(outcome: Any, source: str, num_rollouts: int) -> np.ndarray:
    """Check one source's output (or the exception it raised) and turn it into a `[G]` float64 column."""
    if isinstance(outcome, BaseException):
        if not isinstance(outcome, Exception):
            raise outcome  # cancellation and interpreter exits are not reward errors
        raise RewardFunctionError(f"{source} raised {type(outcome).__name__}: {outcome}") from outcome
    if not isinstance(outcome, list | tuple | np.ndarray):
        raise RewardFunctionError(
            f"{source} returned {type(outcome).__name__}; expected a list of {num_rollouts} rewards "
            "(int, float or None), one per completion"
        )
    if len(outcome) != num_rollouts:
        raise RewardFunctionError(
            f"{source} returned {len(outcome)} rewards for {num_rollouts} completions; "
            "return exactly one reward (or None) per completion"
        )
    return np.array([_to_reward(value, source, index) for index, value in enumerate(outcome)], dtype=np.float64)


def _to_reward(value: Any, source: str, index: int) -> float:
    if value is None:
        return math.nan
    if isinstance(value, bool | np.bool_):
        raise RewardFunctionError(
            f"{source} returned the bool {value!r} for completion {index}; rewards must be int, float or None "
            "(convert with float(...))"
        )
    if not isinstance(value, numbers.Real):
        raise RewardFunctionError(
            f"{source} returned {value!r} ({type(value).__name__}) for completion {index}; "
            "rewards must be int, float or None"
        )
    if math.isinf(value):
        raise RewardFunctionError(
            f"{source} returned {value} for completion {index}; rewards must be finite (None leaves it unscored)"
        )
    return float(value)
