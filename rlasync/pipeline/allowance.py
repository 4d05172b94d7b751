"""Token allowance (docs/algorithms.md §2.3.3): generation may run at most `max(S, 1)` optimizer steps ahead of training.

    allowance      = max(max_staleness, 1) × tokens_per_step
    queued_tokens  = raw tokens of scored samples in the queue
    inflight_tokens = (#rollouts in flight) × mean raw tokens per completed rollout (running mean)
    a new group may start  ⇔  queued_tokens + inflight_tokens < allowance

`tokens_per_step` is what the learner consumed in its last step (Σ raw sample lengths), published after every
step; before the first step it is an assumption (`initial_tokens_per_step`: every row full). Until the first
group completes there is no per-rollout estimate, so groups start one at a time (cold start). With nothing
queued and nothing in flight a group can always start, so the gate cannot deadlock.

    try_acquire(G) ──► G rollouts in flight ──finish_group(G, tokens, queued)──► queued tokens ──consumed()──►
                                   └──────────cancel_group(G)──────────► gone (nothing generated is counted)

Groups are counted, not named: the gate is admitted before a prompt is leased, so there is no group id yet
(the caller that owns the leases, `QueueService`, checks that each group leaves flight once).

`acquire` is the asyncio variant: it waits until the gate opens and returns the waited seconds, which the
rollout side logs as `rollout/backpressure_s` (one value per admission, 0 when it did not wait). Not thread-safe:
the actor serialises calls. Pure Python: no torch, no ray.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass

from rlasync.pipeline._notify import Notifier

BACKPRESSURE_METRIC = "rollout/backpressure_s"


def initial_tokens_per_step(token_budget: int, num_learners: int, gradient_accumulation_steps: int) -> int:
    """The assumption before the first step: every packed row is full, `token_budget × P × GA`."""
    for name, value in (
        ("token_budget", token_budget),
        ("num_learners", num_learners),
        ("gradient_accumulation_steps", gradient_accumulation_steps),
    ):
        if value < 1:
            raise ValueError(f"initial_tokens_per_step: {name}={value} must be >= 1")
    return token_budget * num_learners * gradient_accumulation_steps


@dataclass(frozen=True, slots=True)
class AcquireResult:
    """Outcome of a waiting admission: whether the group was admitted, and how long the caller waited (s)."""

    acquired: bool
    waited_s: float


class TokenAllowance:
    """The admission gate of docs/algorithms.md §2.3.3 (see the module docstring).

    max_staleness:    S, the configured `max_staleness` (0 is treated as 1 step of look-ahead)
    tokens_per_step:  the initial assumption, replaced by `set_tokens_per_step` after each step
    clock:            seconds, for the waited time of `acquire`
    """

    def __init__(
        self,
        max_staleness: int,
        tokens_per_step: int,
        clock: Callable[[], float] = time.monotonic,
        notifier: Notifier | None = None,
    ) -> None:
        if max_staleness < 0:
            raise ValueError(f"max_staleness={max_staleness}: must be >= 0")
        self.max_staleness = max_staleness
        self._clock = clock
        self._notifier = notifier or Notifier()
        self.tokens_per_step = _positive_tokens(tokens_per_step)
        self.queued_tokens = 0
        self._inflight_groups = 0
        self._inflight_rollouts = 0
        self._completed_rollouts = 0
        self._completed_tokens = 0
        self.completed_groups = 0

    # ---- the gate ------------------------------------------------------------------------------------------

    @property
    def allowance_tokens(self) -> int:
        return max(self.max_staleness, 1) * self.tokens_per_step

    @property
    def mean_tokens_per_rollout(self) -> float | None:
        """Running mean of raw tokens per completed rollout; None before the first group completes."""
        if self._completed_rollouts == 0:
            return None
        return self._completed_tokens / self._completed_rollouts

    @property
    def inflight_tokens(self) -> float:
        """Estimated raw tokens of the rollouts in flight (0 before any estimate exists)."""
        mean = self.mean_tokens_per_rollout
        return 0.0 if mean is None else self._inflight_rollouts * mean

    @property
    def inflight_groups(self) -> int:
        return self._inflight_groups

    @property
    def inflight_rollouts(self) -> int:
        return self._inflight_rollouts

    def can_start(self) -> bool:
        """Whether a new group may start now (one at a time until the first group completes)."""
        if self.completed_groups == 0:
            return self._inflight_groups == 0
        return self.queued_tokens + self.inflight_tokens < self.allowance_tokens

    def start_group(self, num_rollouts: int) -> None:
        """Count a group of `num_rollouts` as in flight, without checking the gate (`try_acquire` checks)."""
        if num_rollouts < 1:
            raise ValueError(f"start_group: a group needs at least one rollout, got {num_rollouts}")
        self._inflight_groups += 1
        self._inflight_rollouts += num_rollouts

    def try_acquire(self, num_rollouts: int) -> bool:
        """Start a group of `num_rollouts` if the gate is open; False (nothing changed) otherwise."""
        if not self.can_start():
            return False
        self.start_group(num_rollouts)
        return True

    async def acquire(self, num_rollouts: int, timeout_s: float | None = None) -> AcquireResult:
        """Wait (up to `timeout_s`, None = forever) for the gate to open, then start the group."""
        waited = await self.wait_until_open(timeout_s)
        if waited.acquired:
            self.start_group(num_rollouts)
        return waited

    async def wait_until_open(self, timeout_s: float | None = None) -> AcquireResult:
        """Wait until `can_start()`; `acquired` says whether it opened before the timeout.

        Nothing is started: a caller that acts on an open gate must do so before its next `await`.
        """
        started = self._clock()
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        while not self.can_start():
            remaining = None if deadline is None else deadline - loop.time()
            if not await self._notifier.wait(remaining):
                return AcquireResult(acquired=False, waited_s=self._clock() - started)
        return AcquireResult(acquired=True, waited_s=self._clock() - started)

    # ---- what moves tokens ---------------------------------------------------------------------------------

    def finish_group(self, num_rollouts: int, num_tokens: int, queued: bool = True) -> None:
        """A group of `num_rollouts` completed with `num_tokens` raw tokens of samples in all.

        `queued=False` for a group dropped after scoring (zero std): its tokens update the per-rollout estimate
        but never enter the queue.
        """
        if num_tokens < 0:
            raise ValueError(f"finish_group: a group cannot produce {num_tokens} tokens")
        self._leave_flight(num_rollouts, "finish_group")
        self._completed_rollouts += num_rollouts
        self._completed_tokens += num_tokens
        self.completed_groups += 1
        if queued:
            self.queued_tokens += num_tokens
        self._notifier.notify()

    def cancel_group(self, num_rollouts: int) -> None:
        """A started group of `num_rollouts` stopped without a result (failed, filtered, cancelled)."""
        self._leave_flight(num_rollouts, "cancel_group")
        self._notifier.notify()

    def consumed(self, num_tokens: int) -> None:
        """`num_tokens` raw tokens left the queue (taken by the learner or dropped as stale)."""
        if not 0 <= num_tokens <= self.queued_tokens:
            raise ValueError(f"consumed: {num_tokens} tokens taken but only {self.queued_tokens} are queued")
        self.queued_tokens -= num_tokens
        self._notifier.notify()

    def set_tokens_per_step(self, tokens_per_step: int) -> None:
        """Publish the raw tokens the learner consumed in its last step; the allowance follows."""
        self.tokens_per_step = _positive_tokens(tokens_per_step)
        self._notifier.notify()

    def _leave_flight(self, num_rollouts: int, action: str) -> None:
        if self._inflight_groups == 0 or not 1 <= num_rollouts <= self._inflight_rollouts:
            raise ValueError(
                f"{action}: a group of {num_rollouts} rollouts left flight, but {self._inflight_groups} groups / "
                f"{self._inflight_rollouts} rollouts are in flight (finished twice, or never started?)"
            )
        self._inflight_groups -= 1
        self._inflight_rollouts -= num_rollouts


def _positive_tokens(tokens_per_step: int) -> int:
    if tokens_per_step < 1:
        raise ValueError(f"tokens_per_step={tokens_per_step}: must be >= 1 (a step consumes at least one token)")
    return tokens_per_step
