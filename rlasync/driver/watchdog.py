"""`Watchdog`: progress or a reason, always (docs/algorithms.md §2.1).

The step loop asks the watchdog each time a poll of the queue comes back empty. When no training step has completed
within the bound, the watchdog builds the reason from what the queue counted since the last step (groups per
outcome and per cause: zero reward spread, no reward at all, prompt too long, failures with their last message) and
from the rollout actors' health (the oldest tool call still running, the oldest unanswered generation request, the
heartbeat), then raises `NoProgressError` with it, or, with `watchdog_action="warn"`, logs it once per bound and
keeps going.

    bound = watchdog_timeout_s                                        when set
          = max(floor, min(RATE_FACTOR × the median step so far,      else (floor: rollout_worker_timeout /
                           BOUND_CAP × floor))                              heartbeat_stale_after_s)

The derived bound follows the typical step, not the slowest one, and is capped, so a run whose steps keep slowing
cannot push it out of reach; such a run is reported as it slows (a warning with the recent step times, when a step
takes SLOWDOWN_FACTOR × the median of the earlier ones).

Conclusive evidence stops the run before the bound: NO_SIGNAL_GROUPS groups in a row (since the last step, none
trained) with zero reward spread mean the rewards give GRPO nothing to learn from (a constant reward function, an
environment whose reward never varies), so the run stops at once with the same reason (warned once with "warn").

Pure Python: no ray, no torch; time comes from an injectable clock.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

RATE_FACTOR = 5.0
"""The derived bound is this many times the median step measured so far (never below the floor)."""
BOUND_CAP = 4.0
"""... and never above this many times the floor (set watchdog_timeout_s for runs with longer steps)."""
SLOWDOWN_FACTOR = 3.0
"""A step this many times the median of the earlier ones (with at least MIN_STEPS_FOR_SLOWDOWN of them) is warned."""
MIN_STEPS_FOR_SLOWDOWN = 3
WATCHDOG_ACTIONS = ("error", "warn")
NO_SIGNAL_GROUPS = 64
"""This many groups in a row with zero reward spread (and none trained) stop the run before the bound: a task whose
groups carry signal at rate p gives 64 in a row with probability (1 - p)^64 (under 4% for p = 5%)."""
SLOW_CALL_FRACTION = 0.5
"""A tool call or a generation request older than this fraction of the bound is named in the reason."""


class NoProgressError(RuntimeError):
    """No training step completed within the watchdog's bound; the message says why (see the module docstring)."""


@dataclass(frozen=True)
class WatchdogSettings:
    """timeout_s: a fixed bound (None: derived); floor_s / floor_setting: the derived bound's floor and the config
    field it comes from (named in the message); action: "error" (raise) or "warn" (log, keep going)."""

    timeout_s: float | None = None
    floor_s: float = 300.0
    floor_setting: str = "rollout_worker_timeout"
    action: str = "error"

    def __post_init__(self) -> None:
        if self.action not in WATCHDOG_ACTIONS:
            raise ValueError(f"watchdog_action={self.action!r}: choose one of {', '.join(WATCHDOG_ACTIONS)}")
        if self.timeout_s is not None and not self.timeout_s > 0:
            raise ValueError(f"watchdog_timeout_s={self.timeout_s}: must be > 0 seconds, or None to derive it")


class Watchdog:
    """Tracks the time since the last completed step and explains a run that makes none (module docstring)."""

    def __init__(self, settings: WatchdogSettings, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self._clock = clock
        self._last_progress = clock()
        self._step_times: list[float] = []
        self._warned_slow_s = 0.0
        self._baseline: dict[str, Counter[str]] | None = {"outcomes": Counter(), "causes": Counter()}
        self._warned_no_signal = False
        self.steps = 0

    def bound_s(self) -> float:
        s = self.settings
        if s.timeout_s is not None:
            return s.timeout_s
        return max(s.floor_s, min(RATE_FACTOR * self.median_step_s(), BOUND_CAP * s.floor_s))

    def median_step_s(self) -> float:
        """The median duration of the steps so far (0 before the first)."""
        times = sorted(self._step_times)
        if not times:
            return 0.0
        middle = len(times) // 2
        return times[middle] if len(times) % 2 else (times[middle - 1] + times[middle]) / 2

    def _bound_text(self) -> str:
        s = self.settings
        if s.timeout_s is not None:
            return f"watchdog_timeout_s={s.timeout_s:g}"
        if RATE_FACTOR * self.median_step_s() >= BOUND_CAP * s.floor_s:
            return f"the cap, {BOUND_CAP:g} x {s.floor_setting}={s.floor_s:g}; set watchdog_timeout_s for longer steps"
        if RATE_FACTOR * self.median_step_s() > s.floor_s:
            return f"{RATE_FACTOR:g} x the median step so far ({self.median_step_s():.0f} s)"
        return f"{s.floor_setting}={s.floor_s:g}"

    def step_done(self) -> None:
        """A step completed: restart the clock, measure the step, forget the counts (taken again at the next wait);
        a step much slower than the earlier ones is warned (with the recent step times)."""
        now = self._clock()
        step_s = now - self._last_progress
        earlier = self.median_step_s()
        if (
            len(self._step_times) >= MIN_STEPS_FOR_SLOWDOWN
            and step_s >= SLOWDOWN_FACTOR * earlier > 0
            and step_s >= 2 * self._warned_slow_s
        ):
            recent = ", ".join(_secs(t) for t in [*self._step_times[-5:], step_s])
            logger.warning(
                "step %d took %s s, %.0f x the median of the earlier steps (%s s): the run is slowing down "
                "(recent step times, s: %s); the watchdog's bound stays at %s s",
                self.steps + 1,
                _secs(step_s),
                step_s / earlier,
                _secs(earlier),
                recent,
                _secs(self.bound_s()),
            )
            self._warned_slow_s = step_s
        self._step_times.append(step_s)
        self._last_progress = now
        self._baseline = None
        self._warned_no_signal = False
        self.steps += 1

    def check(self, queue_state: Mapping[str, Any], healths: Sequence[tuple[str, Mapping[str, Any]]] = ()) -> None:
        """One empty poll: raise `NoProgressError` (or warn) when the bound has passed. `queue_state` is the queue's
        `state()` dict, `healths` the rollout actors' `(name, health dict)` pairs."""
        if self._baseline is None:
            self._baseline = _counts(queue_state)
        waited = self._clock() - self._last_progress
        bound = self.bound_s()
        if waited <= bound:
            no_signal = self.no_signal_groups(queue_state)
            if no_signal < NO_SIGNAL_GROUPS or self._warned_no_signal:
                return
            self._warned_no_signal = True  # "warn": once per wait; the bound still applies
            opening = (
                f"no training step completed in {_secs(waited)} s and the last {no_signal} groups in a row had no "
                f"learning signal ({NO_SIGNAL_GROUPS} in a row are conclusive: stopped before the bound, "
                f"{_secs(bound)} s: {self._bound_text()}): "
            )
        else:
            opening = (
                f"no training step completed in {_secs(waited)} s (bound {_secs(bound)} s: {self._bound_text()}): "
            )
            self._last_progress = self._clock()  # "warn": one warning per bound
        message = (
            opening
            + self.reason(queue_state, healths, bound)
            + ". Set watchdog_timeout_s to change the bound, or watchdog_action='warn' to keep going."
        )
        if self.settings.action == "error":
            raise NoProgressError(message)
        logger.warning("%s", message)

    def no_signal_groups(self, queue_state: Mapping[str, Any]) -> int:
        """Groups with zero reward spread since the last step, when no group trained since (else 0)."""
        outcomes = _counts(queue_state)["outcomes"] - (self._baseline or {}).get("outcomes", Counter())
        return 0 if outcomes.get("trained", 0) else int(outcomes.get("zero_std", 0))

    def reason(
        self,
        queue_state: Mapping[str, Any],
        healths: Sequence[tuple[str, Mapping[str, Any]]] = (),
        bound_s: float | None = None,
    ) -> str:
        """Why nothing trains, from the counts since the baseline and the actors' health (see `explain`)."""
        baseline = self._baseline or {"outcomes": Counter(), "causes": Counter()}
        now = _counts(queue_state)
        outcomes = now["outcomes"] - baseline["outcomes"]
        causes = now["causes"] - baseline["causes"]
        bound = self.bound_s() if bound_s is None else bound_s
        return explain(outcomes, causes, queue_state, healths, bound)


def _secs(seconds: float) -> str:
    return f"{seconds:.0f}" if seconds >= 10 else f"{seconds:.1f}"


def _counts(queue_state: Mapping[str, Any]) -> dict[str, Counter[str]]:
    return {
        "outcomes": Counter(dict(queue_state.get("outcomes") or {})),
        "causes": Counter(dict(queue_state.get("causes") or {})),
    }


def explain(
    outcomes: Mapping[str, int],
    causes: Mapping[str, int],
    queue_state: Mapping[str, Any],
    healths: Sequence[tuple[str, Mapping[str, Any]]],
    bound_s: float,
) -> str:
    """The reasons, most telling first, joined by "; ". `outcomes` / `causes` are the groups counted since the
    last step; `queue_state["last_failures"]` holds the last message per cause."""
    last = dict(queue_state.get("last_failures") or {})
    reasons: list[str] = []
    trained = int(outcomes.get("trained", 0))
    no_reward = int(causes.get("zero_std/no_reward", 0))
    zero_std = int(outcomes.get("zero_std", 0)) - no_reward
    too_long = int(causes.get("failed/too_long", 0))
    failed = int(outcomes.get("failed", 0)) - too_long
    ended = sum(int(v) for v in outcomes.values())
    if no_reward:
        reasons.append(
            f"the reward functions returned None for every sample of {no_reward} groups (TRL's 'not applicable': "
            "NaN reward, group dropped): make at least one reward function score these prompts"
            + _last(last, "zero_std/no_reward")
        )
    if zero_std:
        in_a_row = " in a row" if trained == 0 else ""
        reasons.append(
            f"{zero_std} groups{in_a_row} had zero reward spread (every reward of a group equal): nothing to train — "
            "check the reward functions (a constant reward, or an environment whose reward never varies, gives "
            "GRPO no signal), or raise num_generations / temperature" + _last(last, "zero_std/constant")
        )
    if too_long:
        every = "every prompt so far" if too_long == ended else f"{too_long} prompts"
        reasons.append(
            f"{every} ({too_long} groups) was longer than the engine accepts: shorten or filter the prompts, or "
            "raise max_model_len" + _last(last, "failed/too_long")
        )
    if failed:
        detail = next((last[k] for k in sorted(last) if k.startswith("failed/") and k != "failed/too_long"), None)
        reasons.append(f"{failed} groups failed" + (f" (last: {detail})" if detail else ""))
    if outcomes.get("filtered"):
        reasons.append(f"filter_prompt rejected {outcomes['filtered']} prompts")
    if outcomes.get("stale"):
        reasons.append(f"{outcomes['stale']} groups were dropped as stale (every sample older than max_staleness)")
    if trained and not reasons:
        reasons.append(f"{trained} groups were trained, but not enough tokens for one step arrived")
    reasons += _health_reasons(healths, bound_s)
    if not reasons:
        reasons.append(
            f"no group finished: {queue_state.get('inflight_groups', 0)} groups in flight, "
            f"{queue_state.get('queue_size', 0)} samples queued" + _heartbeats(healths)
        )
    return "; ".join(reasons)


def _last(last: Mapping[str, str], cause: str) -> str:
    return f" (last: {last[cause]})" if last.get(cause) else ""


def _health_reasons(healths: Sequence[tuple[str, Mapping[str, Any]]], bound_s: float) -> list[str]:
    reasons = []
    slow = SLOW_CALL_FRACTION * bound_s
    for name, health in healths:
        tool = health.get("oldest_tool_call") or None
        if tool and float(tool.get("age_s", 0.0)) > slow:
            reasons.append(
                f"{name}: tool `{tool.get('name')}` has not returned in {float(tool['age_s']):.0f} s "
                "(set tool_timeout_s to bound every tool call)"
            )
        request = health.get("oldest_request") or None
        if request and float(request.get("age_s", 0.0)) > slow:
            engine = request.get("name") or f"generation engine {request.get('engine')}"
            reasons.append(
                f"{name}: {engine} has not answered a request in {float(request['age_s']):.0f} s "
                "(the generation actor may be frozen or overloaded)"
            )
    return reasons


def engine_silence(healths: Sequence[tuple[str, Mapping[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per engine name, across the rollout actors' health reports (`engines`, from `EnginePool.answer_report`):
    `answered_age_s` (seconds since it last answered any of them; None: none has had an answer from it),
    `silent_s` (that age, or while it never answered, how long the youngest pool has had it) and `inflight`
    (requests waiting on it, summed)."""
    merged: dict[str, dict[str, Any]] = {}
    for _, health in healths:
        for entry in health.get("engines") or ():
            name = str(entry.get("name"))
            answered = entry.get("answered_age_s")
            silent = float(answered if answered is not None else entry.get("joined_age_s") or 0.0)
            known = merged.setdefault(name, {"answered_age_s": None, "silent_s": silent, "inflight": 0})
            known["inflight"] += int(entry.get("inflight") or 0)
            known["silent_s"] = min(known["silent_s"], silent)
            if answered is not None:
                previous = known["answered_age_s"]
                known["answered_age_s"] = float(answered) if previous is None else min(previous, float(answered))
    return merged


def silent_engines(healths: Sequence[tuple[str, Mapping[str, Any]]], bound_s: float) -> list[str]:
    """The engines with requests waiting on them that answered none of the rollout actors for longer than `bound_s`
    (frozen, or far slower than the hang bound): the driver probes them and names a frozen one."""
    return sorted(
        name for name, seen in engine_silence(healths).items() if seen["inflight"] > 0 and seen["silent_s"] > bound_s
    )


def _heartbeats(healths: Sequence[tuple[str, Mapping[str, Any]]]) -> str:
    if not healths:
        return ""
    parts = [
        f"{name} heartbeat {float(h.get('heartbeat_age_s', 0.0)):.1f} s ago, {h.get('num_inflight', '?')} tasks in flight"
        for name, h in healths
    ]
    return "; " + ", ".join(parts)


__all__ = [
    "RATE_FACTOR",
    "WATCHDOG_ACTIONS",
    "NO_SIGNAL_GROUPS",
    "NoProgressError",
    "Watchdog",
    "WatchdogSettings",
    "engine_silence",
    "explain",
    "silent_engines",
]
