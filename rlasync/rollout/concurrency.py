"""The adaptive concurrency cap (docs/algorithms.md §2.3.2): how many rollouts may run, following the engines' load.

    cap_0 = clamp(floor(kv_capacity_tokens / max_model_len), 1, max_concurrent_rollouts)
            (= max_concurrent_rollouts when the engines report no KV capacity)
    on each observation of the engines' gauges:
      KV usage > 80 %                                  -> cap = max(1, floor(0.7 * cap))
      KV usage < 60 %, nothing waiting, and at least
      `cap` rollouts completed since the last increase -> cap = min(max, max(cap + 1, floor(1.25 * cap)))

KV usage is the maximum over engines, running and waiting requests are summed, preemptions are summed and
reported as the increase since the previous observation. Running rollouts are never cut: a lower cap only
holds back new ones. Pure Python; the rollout loop feeds it `EngineStats` every few seconds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rlasync.engine.base import EngineStats

INCREASE_BELOW_KV_FRAC = 0.6
DECREASE_ABOVE_KV_FRAC = 0.8
INCREASE_FACTOR = (5, 4)  # x 1.25, in integers so that floor() is exact
DECREASE_FACTOR = (7, 10)  # x 0.7


class ConcurrencyController:
    """Tracks `cap`, the adaptive limit on rollouts in flight.

    `completed_rollouts` passed to `observe` is the loop's running count of completed rollouts (cumulative,
    never reset); the controller remembers the count at its last increase.
    """

    def __init__(
        self, max_concurrent_rollouts: int, kv_capacity_tokens: int | None = None, max_model_len: int | None = None
    ) -> None:
        if max_concurrent_rollouts < 1:
            raise ValueError(f"max_concurrent_rollouts={max_concurrent_rollouts}: must be >= 1")
        self.max_concurrent_rollouts = max_concurrent_rollouts
        if kv_capacity_tokens and max_model_len:
            self._cap = min(max_concurrent_rollouts, max(1, kv_capacity_tokens // max_model_len))
        else:
            self._cap = max_concurrent_rollouts
        self._completed_at_last_increase = 0
        self._last_counts: dict[str, float] = {}  # the engines' cumulative counters at the previous observation

    @classmethod
    def from_stats(
        cls, max_concurrent_rollouts: int, stats: EngineStats | Sequence[EngineStats]
    ) -> ConcurrencyController:
        """Initial cap from the engines' KV capacity (summed) and model length (the smallest)."""
        stats = _as_list(stats)
        capacity = sum(s.kv_capacity_tokens for s in stats)
        max_model_len = min((s.max_model_len for s in stats if s.max_model_len > 0), default=0)
        return cls(max_concurrent_rollouts, capacity, max_model_len)

    @property
    def cap(self) -> int:
        return self._cap

    def observe(self, stats: EngineStats | Sequence[EngineStats], completed_rollouts: int) -> list[tuple[str, float]]:
        """Apply one observation of the engines' gauges; return the metric items of this observation."""
        stats = _as_list(stats)
        if not stats:
            return [("rollout/concurrency_cap", float(self._cap))]
        kv_usage = max(s.kv_cache_usage_frac for s in stats)
        num_running = sum(s.num_running for s in stats)
        num_waiting = sum(s.num_waiting for s in stats)
        if kv_usage > DECREASE_ABOVE_KV_FRAC:
            self._cap = max(1, _scale(self._cap, DECREASE_FACTOR))
        elif (
            kv_usage < INCREASE_BELOW_KV_FRAC
            and num_waiting == 0
            and completed_rollouts - self._completed_at_last_increase >= self._cap
            and self._cap < self.max_concurrent_rollouts
        ):
            self._cap = min(self.max_concurrent_rollouts, max(self._cap + 1, _scale(self._cap, INCREASE_FACTOR)))
            self._completed_at_last_increase = completed_rollouts
        return [
            ("rollout/concurrency_cap", float(self._cap)),
            ("rollout/vllm_kv_cache_usage_frac", float(kv_usage)),
            ("rollout/vllm_running_requests", float(num_running)),
            ("rollout/vllm_queued_requests", float(num_waiting)),
            ("rollout/vllm_preemption_count", float(self._preemption_delta(stats))),
            *self._eager_step_frac(stats),
            *_fused_layers_frac(stats),
            *_launch_max(stats),
        ]

    def _eager_step_frac(self, stats: list[EngineStats]) -> list[tuple[str, float]]:
        """`rollout/engine_eager_step_frac`: of the engines' steps since the previous observation, the share that ran
        the decoder eagerly (no CUDA graph held the step); only for engines that count them (the built-in engine
        with CUDA graphs), and nothing until a step ran since a first look."""
        counted = [s.extra for s in stats if "num_eager_steps" in s.extra and "num_steps" in s.extra]
        if not counted:
            return []
        steps = self._increase("steps", sum(e["num_steps"] for e in counted))
        eager = self._increase("eager_steps", sum(e["num_eager_steps"] for e in counted))
        if not steps or eager is None:  # first look, a restart, or no step since
            return []
        return [("rollout/engine_eager_step_frac", eager / steps)]

    def _preemption_delta(self, stats: list[EngineStats]) -> int:
        """Preemptions since the previous observation (`_increase`: the first only sets the baseline, so a rollout
        actor restarted mid-run does not report the engines' whole history at once)."""
        return int(self._increase("preemptions", sum(s.num_preemptions for s in stats)) or 0)

    def _increase(self, name: str, total: float) -> float | None:
        """How much the engines' cumulative counter `name` grew since the previous observation; None at the first
        (the baseline) and when it went down (a restarted engine: the baseline starts again)."""
        previous, self._last_counts[name] = self._last_counts.get(name), total
        return None if previous is None or total < previous else total - previous


def _fused_layers_frac(stats: list[EngineStats]) -> list[tuple[str, float]]:
    """`rollout/engine_fused_layers_frac`: the share of the engines that report it (the built-in engine) whose decoder
    runs fused layers; nothing when none reports it."""
    flags = [s.extra["fused_layers"] for s in stats if "fused_layers" in s.extra]
    return [("rollout/engine_fused_layers_frac", sum(flags) / len(flags))] if flags else []


def _launch_max(stats: list[EngineStats]) -> list[tuple[str, float]]:
    """`rollout/engine_launch_max_s`: the longest step launch any engine has made so far (the built-in engine's
    `launch_max_s`; 0.1 s or more is a kernel compiled mid-run, which a weight sync waits for, and the engine logs
    each such launch with the step's shape). Nothing for engines that do not report it."""
    launches = [s.extra["launch_max_s"] for s in stats if "launch_max_s" in s.extra]
    return [("rollout/engine_launch_max_s", max(launches))] if launches else []


def _scale(value: int, factor: tuple[int, int]) -> int:
    numerator, denominator = factor
    return value * numerator // denominator


def _as_list(stats: EngineStats | Sequence[EngineStats]) -> list[EngineStats]:
    return list(stats) if isinstance(stats, Sequence) else [stats]
