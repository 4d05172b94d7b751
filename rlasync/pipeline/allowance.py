"""Token allowance (docs/algorithms.md §2.3.3): generation may run at most `S` optimizer steps ahead of training.

    allowance      = max_staleness × tokens_per_step                       (S >= 1)
    queued_tokens  = raw tokens of scored samples in the queue
    inflight_tokens = (#rollouts in flight) × mean raw tokens per completed rollout (running mean)
    a new group may start  ⇔  queued_tokens + inflight_tokens < allowance

`max_staleness=0` is synchronous (docs/algorithms.md §2.3.4): each policy version generates the samples of the steps
it serves (`steps_per_version` = weight_sync_steps) and no more, so nothing is generated while the learner trains
and nothing goes stale. What was already taken under the current version counts against it until `new_version()`:

    a new group may start  ⇔  taken + queued + in flight < steps_per_version × step size

in raw tokens (step size: the first step's token target, fixed, since a synchronous step takes everything its
version generated and would otherwise grow step after step), or in samples when steps are a sample count
(`samples_per_step`). Once a version's budget is taken, a group starts only while the learner still waits for
samples of its step, one at a time (its samples ran longer than planned): the gate cannot deadlock.

`tokens_per_step` is what the learner consumed in its last step (Σ raw sample lengths), published after every
step; before the first step it is an assumption (`initial_tokens_per_step`: every row full of unique tokens, a
group's prompt shared by its samples). Until the first
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


def initial_tokens_per_step(
    token_budget: int, num_learners: int, gradient_accumulation_steps: int, group_size: int = 1
) -> int:
    """The raw tokens of the first step, assumed: `GA × P` rows, each full of `token_budget` unique tokens (the
    step's composition, docs/algorithms.md §4.5.1), where a group of `group_size` samples shares its prompt. With
    the prompt as long as a completion, a group of G forwards G + 1 unique lengths for 2G raw ones, so a row holds
    2G / (G + 1) times its budget in raw tokens (1 for G = 1: distillation, or a model that shares nothing). After
    the first step the allowance follows the raw tokens the steps actually took."""
    for name, value in (
        ("token_budget", token_budget),
        ("num_learners", num_learners),
        ("gradient_accumulation_steps", gradient_accumulation_steps),
        ("group_size", group_size),
    ):
        if value < 1:
            raise ValueError(f"initial_tokens_per_step: {name}={value} must be >= 1")
    rows = num_learners * gradient_accumulation_steps
    return token_budget * rows * 2 * group_size // (group_size + 1)


@dataclass(frozen=True, slots=True)
class AcquireResult:
    """Outcome of a waiting admission: whether the group was admitted, and how long the caller waited (s)."""

    acquired: bool
    waited_s: float


class TokenAllowance:
    """The admission gate of docs/algorithms.md §2.3.3 (see the module docstring).

    max_staleness:     S, the configured `max_staleness` (0: synchronous, see the module docstring)
    tokens_per_step:   the initial assumption, replaced by `set_tokens_per_step` after each step
    clock:             seconds, for the waited time of `acquire`
    steps_per_version: optimizer steps between weight syncs (`weight_sync_steps`); read only when S = 0
    """

    def __init__(
        self,
        max_staleness: int,
        tokens_per_step: int,
        clock: Callable[[], float] = time.monotonic,
        notifier: Notifier | None = None,
        steps_per_version: int = 1,
        samples_per_step: int | None = None,
    ) -> None:
        if max_staleness < 0:
            raise ValueError(f"max_staleness={max_staleness}: must be >= 0")
        if steps_per_version < 1:
            raise ValueError(f"steps_per_version={steps_per_version}: must be >= 1 (weight_sync_steps)")
        self.max_staleness = max_staleness
        self.steps_per_version = steps_per_version
        self.samples_per_step = samples_per_step
        self.taken = 0  # S = 0: tokens (or samples) taken for training under the current policy version
        self.queued_samples = 0
        self.learner_waiting = False  # a take is waiting for samples (set by the queue service)
        self._clock = clock
        self._notifier = notifier or Notifier()
        self.tokens_per_step = _positive_tokens(tokens_per_step)
        self._sync_step_tokens = self.tokens_per_step  # S = 0: the first step's target, kept (module docstring)
        self.queued_tokens = 0
        self._inflight_groups = 0
        self._inflight_rollouts = 0
        self._completed_rollouts = 0
        self._completed_tokens = 0
        self.completed_groups = 0

    # ---- the gate ------------------------------------------------------------------------------------------

    @property
    def synchronous(self) -> bool:
        return self.max_staleness == 0

    @property
    def allowance_tokens(self) -> int:
        """S >= 1: S steps of tokens; S = 0: this version's budget (in samples when steps are a sample count)."""
        if self.synchronous:
            step = self._sync_step_tokens if self.samples_per_step is None else self.samples_per_step
            return self.steps_per_version * step
        return self.max_staleness * self.tokens_per_step

    @property
    def last_step_of_version(self) -> bool:
        """S = 0, steps of tokens: this version's budget is generated, nothing is in flight and the next step is the
        version's last, so it may take everything queued (nothing of this version is left to go stale)."""
        if not self.synchronous or self.samples_per_step is not None or self._inflight_groups or self._sync_open():
            return False
        return self.taken >= self.allowance_tokens - self._sync_step_tokens

    def _sync_used(self) -> float:
        if self.samples_per_step is not None:
            return self.taken + self.queued_samples + self._inflight_rollouts
        return self.taken + self.queued_tokens + self.inflight_tokens

    def _sync_open(self) -> bool:
        if self.taken >= self.allowance_tokens:
            # served: wait for the next weight sync, unless the learner still waits for samples of its step
            return self.learner_waiting and self._inflight_groups == 0 and self.queued_tokens == 0
        if self.completed_groups == 0:
            return self._inflight_groups == 0
        return self._sync_used() < self.allowance_tokens

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
        if self.synchronous:
            return self._sync_open()
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

    def finish_group(
        self, num_rollouts: int, num_tokens: int, queued: bool = True, num_samples: int | None = None
    ) -> None:
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
            self.queued_samples += num_rollouts if num_samples is None else num_samples
        self._notifier.notify()

    def cancel_group(self, num_rollouts: int) -> None:
        """A started group of `num_rollouts` stopped without a result (failed, filtered, cancelled)."""
        self._leave_flight(num_rollouts, "cancel_group")
        self._notifier.notify()

    def consumed(self, num_tokens: int, taken_tokens: int = 0, num_samples: int = 0, taken_samples: int = 0) -> None:
        """`num_tokens` raw tokens (`num_samples` samples) left the queue, taken by the learner or dropped as stale;
        `taken_tokens` (`taken_samples`) of them were taken for training: with S = 0 they count against the version."""
        if not 0 <= num_tokens <= self.queued_tokens:
            raise ValueError(f"consumed: {num_tokens} tokens taken but only {self.queued_tokens} are queued")
        if not 0 <= taken_tokens <= num_tokens:
            raise ValueError(f"consumed: taken_tokens={taken_tokens} must be in [0, {num_tokens}]")
        self.queued_tokens -= num_tokens
        self.queued_samples = max(0, self.queued_samples - num_samples)
        if self.synchronous:
            self.taken += taken_tokens if self.samples_per_step is None else taken_samples
        self._notifier.notify()

    def new_version(self) -> None:
        """A weight sync served a new policy version: with S = 0 its steps may be generated now."""
        self.taken = 0
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
