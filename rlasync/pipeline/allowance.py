"""Token allowance (docs/algorithms.md §2.3.3): generation may run at most `S` optimizer steps ahead of training.

    allowance      = max_staleness × tokens_per_step                       (S >= 1)
    queued_tokens  = raw tokens of scored samples in the queue
    inflight_tokens = (#rollouts in flight) × mean raw tokens per completed rollout (decayed mean, below)
    keep_rate      = estimated fraction of completed rollout tokens that entered the queue (below)
    counted        = inflight_tokens × keep_rate + 2 standard deviations of that (below), at most inflight_tokens
    expected(G)    = G's rollouts × mean raw tokens per completed rollout × keep_rate   (the new group's own)
    a new group G may start  ⇔  queued_tokens + counted + expected(G) <= allowance

The keep rate. A group dropped after scoring (zero reward spread, `finish_group(..., queued=False)`) generated
tokens that never enter the queue; when the task is nearly solved most groups are. Counting the rollouts in flight
at their full expected tokens holds the queue short of the allowance by (1 − k) × inflight_tokens (k the true keep
rate), so the gate admits too little and the learner waits. The gate counts them at what they are expected to queue
instead, as DAPO's dynamic sampling over-provisions its batches. The estimate is an exponentially weighted,
token-weighted mean over scored groups (token-weighted because the gate counts tokens: in-flight tokens × k̂ is then
the expected queued tokens even when dropped groups are shorter or longer than kept ones):

    kept ← β·kept + (tokens the group queued);  done ← β·done + (tokens the group generated);  β = 1 − 1/128
    keep_rate = max(1/16, kept / done),  1.0 before the first group is scored

At the first scored group `kept` and `done` start as 16 groups of its size, all kept: a prior of 1.0 that weighs
16 groups, so a cold start behaves as before and the first few drops do not swing it; the prior decays like any
observation. The window, 128 groups: the estimate's relative standard error is about √((1 − k) / (k·255)), 13% at
k = 0.2 (36% with 16 groups), and the rollouts in flight scale as 1 / k̂, so a noisy estimate over-admits
(`bench/keep_rate_sim.py` at k = 0.2: 21–24% of the queued samples went stale with a 16-group window, 2–4% with
128). 128 groups are a few steps (the SmolLM2 sums run trains ~18 groups a step: 1.66k trained tokens of ~11.5-token
completions), so the estimate still follows a keep rate that falls over tens of steps as the task is solved. Only
scored groups count: a failed, filtered, released or cancelled group left flight without saying anything about the
keep rate.

The margin. Each group in flight is kept or dropped whole, independently: n groups of g tokens queue
g × Binomial(n, k), whose standard deviation is g·√(n·k·(1 − k)). Whenever generation outpaces training the gate runs
at its threshold, so counting the mean alone lets about half the marginal admissions find more than the allowance
ahead of them, and their samples go stale. Two standard deviations on top make that rare (the simulation: 2–4% of the
queued samples dropped as stale at k = 0.2, as many as at k = 1, against 16–17% with the mean alone; 2–3% at k = 0.2
and 0.1% at k = 1 since the gate counts the new group's own tokens, below), and cost
nothing when nothing is dropped (k = 1: the spread is 0, the gate is the one before the keep rate). The count never
exceeds the in-flight tokens themselves: the gate admits at least what it admitted before.

The floor (1/16) bounds the over-provisioning: counted ≥ inflight_tokens / 16, so the rollouts in flight never hold
more than 16 × the allowance, which is also the most a sudden rise of the keep rate to 1 can overshoot (what
overshoots goes stale and is dropped at take, below). Below a keep rate of 1/16 (fewer than one group in 16 kept;
the watchdog stops a run after 64 zero-spread groups in a row) the gate holds generation back again and the learner
may wait: the task is all but solved. The floor is a constant, not a setting: what it bounds is in units of the
allowance, which `max_staleness` already sets.

Staleness. A group admitted while queued + k̂ × inflight + k̂ × own <= allowance finds ahead of it, in expectation,
queued + k × inflight tokens that reach the learner before its own samples (the queue is FIFO), and its own samples
are trained once those and its own have been taken. With k̂ ≈ k that is within the allowance, S steps of tokens, so
its samples are trained within S versions of its admission, as with k = 1: the expected queued tokens plus the
in-flight tokens that will be queued stay below the allowance, not the allowance / k (the more rollouts in flight,
the more of them are dropped). The group's own tokens count: without them the group admitted at the threshold
(queued + counted just below the allowance) had up to a whole group past it, and its last samples went one step
past S (`bench/keep_rate_sim.py` at k = 1: 3.1% of the queued samples dropped as stale, 0.1% counting them). They
count at k̂ × their expected tokens, as what is in flight does; a kept group queues all of them, so counting them at
full would bound its own staleness exactly, but admits a group less at the threshold: at k = 0.2 the simulation's
stale share went from 2.4% to 1.3% and the learner's wait from 9.4% to 10.9% of the step (S = 1: 55% to 60%),
and what still goes stale there is the keep rate's estimation noise, not the marginal group. A keep rate under-estimated for a while (it rose faster
than the window follows), or more groups kept than the margin covers, overshoots; samples that end up older than S
versions are dropped at take time (§2.7), so the trained staleness never exceeds `max_staleness`: that bound is the
queue's, the keep rate only moves how close to it the queue runs.

`max_staleness=0` is synchronous (docs/algorithms.md §2.3.4): each policy version generates the samples of the steps
it serves (`steps_per_version` = weight_sync_steps) and no more, so nothing is generated while the learner trains
and nothing goes stale. What was already taken under the current version counts against it until `new_version()`:

    a new group may start  ⇔  taken + queued + in flight < steps_per_version × step size   (the new group not counted)

in raw tokens (step size: the first step's token target, fixed, since a synchronous step takes everything its
version generated and would otherwise grow step after step), or in samples when steps are a sample count
(`samples_per_step`). Once a version's budget is taken, a group starts only while the learner still waits for
samples of its step, one at a time (its samples ran longer than planned): the gate cannot deadlock.

The mean tokens per rollout. The same window, weighted by rollouts: after each completed group of n rollouts and t
raw tokens, rollouts ← β·rollouts + n, tokens ← β·tokens + t, mean = tokens / rollouts (the first group starts
both). Completion lengths move during a run (a solved sums task's replies shrink from ~31 to ~11 tokens in 20 steps;
a reasoning task's grow several-fold): a whole-run mean lags them, over-counting what is in flight when they shrink
(the gate admits too little) and under-counting it when they grow (samples go stale and are dropped at take).

The synchronous gate counts in-flight rollouts at full, not at the keep rate (the estimate is still kept and
published). A version's budget is what its steps train, and nothing generated under it may outlive it: a group
over-provisioned for the expected drops that is kept after all either grows the version's last step (it takes
everything queued, so the step size drifts up, which the fixed step size prevents) or, in steps of samples, sits in
the queue past the weight sync and is dropped as stale: generation spent for nothing. Dropped groups cost time, not
samples: the version generates until its steps are full (dropped groups do not count against the budget), and the
learner waiting for it is what the synchronous mode is (no generation overlaps training). So exactly-once and the
no-deadlock argument above are unchanged.

Nor does the synchronous gate count the new group's own tokens. Its bound is not staleness: in steps of tokens the
version's last step takes everything queued, so a last group that overshoots the budget is trained under its own
version, a step slightly larger, never stale. Counting the new group would stop the version up to a group short of
its budget while the learner waits for the whole of it: nothing is then in flight to fill it, and it would start
only through the one-at-a-time rule for a learner still waiting once the budget is taken (which reads `taken`, so
it would not even open: a deadlock, or, patched, one more group generated alone after the rest, every version). In
steps of samples the gate counts the rollouts in flight exactly, so with `samples_per_step` a multiple of the
group size (whole groups queued) the version does not overshoot.

`tokens_per_step` is what the learner consumed in its last step (Σ raw sample lengths), published after every
step; before the first step it is an assumption (`initial_tokens_per_step`: every row full of unique tokens, a
group's prompt shared by its samples). Until the first
group completes there is no per-rollout estimate, so groups start one at a time (cold start). With nothing
queued and nothing in flight a group can always start, even one expected to queue more than the whole
allowance, so the gate cannot deadlock.

Resume. What the allowance learned (`AllowanceState`: the last step's tokens, the completed rollouts and their
tokens, the keep rate's two weights) is saved in `rollout_state.json` and restored by a resumed run, which then
continues as the run would have: the gate counts in flight at the saved keep rate and mean from the first group (no
cold start: the per-rollout estimate exists), instead of at the prior 1.0, which at k = 0.2 holds the gate to about a
fifth of what it admitted until ~a window of groups is scored again. Checkpoints written before it existed resume
from the priors. The saved state is the same run's: a resumed run that changes the completion length or the task
follows the change as the estimates follow any change (the keep rate over its window; the mean over all rollouts).

    try_acquire(G) ──► G rollouts in flight ──finish_group(G, tokens, queued)──► queued tokens ──consumed()──►
                                   │     (queued or dropped after scoring: both feed the keep rate)
                                   └──────────cancel_group(G)──────────► gone (nothing generated is counted)

Groups are counted, not named: the gate is admitted before a prompt is leased, so there is no group id yet
(the caller that owns the leases, `QueueService`, checks that each group leaves flight once).

`acquire` is the asyncio variant: it waits until the gate opens and returns the waited seconds, which the
rollout side logs as `rollout/backpressure_s` (one value per admission, 0 when it did not wait). Not thread-safe:
the actor serialises calls. Pure Python: no torch, no ray.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any

from rlasync.pipeline._notify import Notifier

BACKPRESSURE_METRIC = "rollout/backpressure_s"
KEEP_RATE_METRIC = "rollout/keep_rate"
KEEP_RATE_FLOOR = 1 / 16
"""The keep rate's floor: in-flight rollouts never hold more than allowance / floor tokens (module docstring)."""
KEEP_RATE_WINDOW = 128
"""Groups the keep rate's exponentially weighted mean remembers (β = 1 − 1/window)."""
KEEP_RATE_PRIOR_GROUPS = 16
"""The prior keep rate 1.0 weighs as much as this many groups of the first completed group's size."""
KEEP_RATE_MARGIN_SD = 2.0
"""The in-flight tokens are counted at their expected queued tokens plus this many standard deviations."""


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
class AllowanceState:
    """What the allowance learned, saved in `rollout_state.json` so that a resumed run's gate starts where the run
    stopped instead of from its priors (module docstring, "Resume").

    tokens_per_step:    the raw tokens of the last step (before the resumed run's first step, the allowance's base)
    completed_rollouts: the decayed count of completed rollouts (the mean tokens per rollout's denominator; a
                        file written before the decay holds the plain count, read as a weight)
    completed_tokens:   their decayed raw tokens (its numerator)
    keep_kept_weight:   the keep rate's decayed kept tokens (numerator)
    keep_scored_weight: the keep rate's decayed scored tokens (denominator; 0: the prior 1.0)
    """

    tokens_per_step: int
    completed_rollouts: float = 0
    completed_tokens: float = 0
    keep_kept_weight: float = 0.0
    keep_scored_weight: float = 0.0

    def __post_init__(self) -> None:
        fix = "remove the 'allowance' entry from rollout_state.json to start the allowance from its priors"
        value = self.tokens_per_step
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"allowance state: tokens_per_step must be an integer >= 1, got {value!r}; {fix}")
        for name in ("completed_rollouts", "completed_tokens", "keep_kept_weight", "keep_scored_weight"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < math.inf:
                raise ValueError(f"allowance state: {name} must be a finite number >= 0, got {value!r}; {fix}")
        if self.keep_kept_weight > self.keep_scored_weight * (1 + 1e-9):
            raise ValueError(
                f"allowance state: keep_kept_weight={self.keep_kept_weight} exceeds keep_scored_weight="
                f"{self.keep_scored_weight} (a keep rate above 1); {fix}"
            )
        if self.completed_rollouts == 0 and self.completed_tokens > 0:
            raise ValueError(
                f"allowance state: completed_tokens={self.completed_tokens} with completed_rollouts=0; {fix}"
            )

    def to_dict(self) -> dict[str, int | float]:
        return {
            "tokens_per_step": self.tokens_per_step,
            "completed_rollouts": self.completed_rollouts,
            "completed_tokens": self.completed_tokens,
            "keep_kept_weight": self.keep_kept_weight,
            "keep_scored_weight": self.keep_scored_weight,
        }

    @classmethod
    def from_dict(cls, data: Any) -> AllowanceState:
        """Read the JSON object; every field but `tokens_per_step` defaults to the prior (nothing learned)."""
        if not isinstance(data, Mapping):
            raise ValueError(f"allowance state must be a JSON object, got {data!r}")
        unknown = sorted(set(data) - {field.name for field in fields(cls)})
        if unknown:
            raise ValueError(f"allowance state: unknown fields {unknown}")
        if "tokens_per_step" not in data:
            raise ValueError(f"allowance state has no 'tokens_per_step': {dict(data)!r}")
        return cls(**data)


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
    keep_rate_floor:   the keep rate's floor, in (0, 1]; 1.0 counts in-flight rollouts at full (no keep rate)
    keep_rate_window:  groups the keep rate remembers (module docstring)
    keep_rate_margin_sd: standard deviations of the in-flight groups' kept tokens counted on top of their mean
    """

    def __init__(
        self,
        max_staleness: int,
        tokens_per_step: int,
        clock: Callable[[], float] = time.monotonic,
        notifier: Notifier | None = None,
        steps_per_version: int = 1,
        samples_per_step: int | None = None,
        keep_rate_floor: float = KEEP_RATE_FLOOR,
        keep_rate_window: int = KEEP_RATE_WINDOW,
        keep_rate_margin_sd: float = KEEP_RATE_MARGIN_SD,
    ) -> None:
        if max_staleness < 0:
            raise ValueError(f"max_staleness={max_staleness}: must be >= 0")
        if steps_per_version < 1:
            raise ValueError(f"steps_per_version={steps_per_version}: must be >= 1 (weight_sync_steps)")
        if not 0 < keep_rate_floor <= 1:
            raise ValueError(f"keep_rate_floor={keep_rate_floor}: must be in (0, 1] (1 counts in-flight work at full)")
        if keep_rate_window < 1:
            raise ValueError(f"keep_rate_window={keep_rate_window}: must be >= 1 (groups the keep rate remembers)")
        self.keep_rate_floor = keep_rate_floor
        self.keep_rate_window = keep_rate_window
        if keep_rate_margin_sd < 0:
            raise ValueError(f"keep_rate_margin_sd={keep_rate_margin_sd}: must be >= 0 (standard deviations)")
        self.keep_rate_margin_sd = keep_rate_margin_sd
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
        self._completed_rollouts = 0.0  # decayed rollouts of completed groups (the mean tokens per rollout's weight)
        self._completed_tokens = 0.0  # their decayed raw tokens
        self.completed_groups = 0
        self._kept_weight = 0.0  # decayed tokens that scored groups queued (the keep rate's numerator)
        self._scored_weight = 0.0  # decayed tokens that scored groups generated (its denominator)

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
        return self.taken + self.queued_tokens + self.counted_inflight_tokens

    def _sync_open(self) -> bool:
        if self.taken >= self.allowance_tokens:
            # served: wait for the next weight sync, unless the learner still waits for samples of its step
            return self.learner_waiting and self._inflight_groups == 0 and self.queued_tokens == 0
        if self._completed_rollouts == 0:
            return self._inflight_groups == 0
        return self._sync_used() < self.allowance_tokens

    @property
    def _window_decay(self) -> float:
        """β = 1 − 1/window: how much of the past each completed group leaves (the keep rate and the mean tokens
        per rollout alike)."""
        return 1.0 - 1.0 / self.keep_rate_window

    @property
    def mean_tokens_per_rollout(self) -> float | None:
        """Decayed mean of raw tokens per completed rollout (module docstring); None before the first group
        completes."""
        if self._completed_rollouts <= 0:
            return None
        # rounded to a millionth of a token: the decayed sums' rounding must not move a constant length off itself
        return round(self._completed_tokens / self._completed_rollouts, 6)

    @property
    def inflight_tokens(self) -> float:
        """Estimated raw tokens the rollouts in flight generate (0 before any estimate exists)."""
        mean = self.mean_tokens_per_rollout
        return 0.0 if mean is None else self._inflight_rollouts * mean

    @property
    def keep_rate_estimate(self) -> float:
        """The exponentially weighted fraction of scored groups' tokens that entered the queue, unfloored; the prior
        1.0 before the first group is scored (module docstring)."""
        return 1.0 if self._scored_weight <= 0 else self._kept_weight / self._scored_weight

    @property
    def keep_rate(self) -> float:
        """The keep rate the gate uses: the estimate, floored at `keep_rate_floor` (`rollout/keep_rate`)."""
        return max(self.keep_rate_floor, min(1.0, self.keep_rate_estimate))

    @property
    def counted_inflight_tokens(self) -> float:
        """The in-flight tokens as the gate counts them (S >= 1): what they are expected to queue, `keep_rate` of
        them, plus `keep_rate_margin_sd` standard deviations of that (each group in flight is kept or dropped
        whole, independently: n groups of g tokens queue g·Binomial(n, k)), never more than all of them; at full
        when S = 0 (module docstring)."""
        full = self.inflight_tokens
        keep = self.keep_rate
        if self.synchronous or keep >= 1.0 or self._inflight_groups == 0:
            return full
        group_tokens = full / self._inflight_groups
        spread = group_tokens * math.sqrt(self._inflight_groups * keep * (1.0 - keep))
        return min(full, full * keep + self.keep_rate_margin_sd * spread)

    @property
    def inflight_groups(self) -> int:
        return self._inflight_groups

    @property
    def inflight_rollouts(self) -> int:
        return self._inflight_rollouts

    def expected_group_tokens(self, num_rollouts: int) -> float:
        """The tokens a new group of `num_rollouts` is expected to queue: its rollouts at the mean raw tokens per
        rollout, times the keep rate (0 before any estimate exists)."""
        mean = self.mean_tokens_per_rollout
        return 0.0 if mean is None else num_rollouts * mean * self.keep_rate

    def can_start(self, num_rollouts: int) -> bool:
        """Whether a new group of `num_rollouts` may start now: S >= 1, what is queued, what is in flight (counted)
        and the group's own expected tokens fit the allowance; one group at a time until the first group completes;
        always with nothing queued and nothing in flight. S = 0: the version's budget (module docstring)."""
        if self.synchronous:
            return self._sync_open()
        if self._completed_rollouts == 0:
            return self._inflight_groups == 0
        if self._inflight_groups == 0 and self.queued_tokens == 0:
            return True  # no deadlock, even for a group larger than the allowance
        needed = self.queued_tokens + self.counted_inflight_tokens + self.expected_group_tokens(num_rollouts)
        return needed <= self.allowance_tokens

    def start_group(self, num_rollouts: int) -> None:
        """Count a group of `num_rollouts` as in flight, without checking the gate (`try_acquire` checks)."""
        if num_rollouts < 1:
            raise ValueError(f"start_group: a group needs at least one rollout, got {num_rollouts}")
        self._inflight_groups += 1
        self._inflight_rollouts += num_rollouts

    def try_acquire(self, num_rollouts: int) -> bool:
        """Start a group of `num_rollouts` if the gate is open; False (nothing changed) otherwise."""
        if not self.can_start(num_rollouts):
            return False
        self.start_group(num_rollouts)
        return True

    async def acquire(self, num_rollouts: int, timeout_s: float | None = None) -> AcquireResult:
        """Wait (up to `timeout_s`, None = forever) for the gate to open, then start the group."""
        waited = await self.wait_until_open(num_rollouts, timeout_s)
        if waited.acquired:
            self.start_group(num_rollouts)
        return waited

    async def wait_until_open(self, num_rollouts: int, timeout_s: float | None = None) -> AcquireResult:
        """Wait until `can_start(num_rollouts)`; `acquired` says whether it opened before the timeout.

        Nothing is started: a caller that acts on an open gate must do so before its next `await`.
        """
        started = self._clock()
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        while not self.can_start(num_rollouts):
            remaining = None if deadline is None else deadline - loop.time()
            if not await self._notifier.wait(remaining):
                return AcquireResult(acquired=False, waited_s=self._clock() - started)
        return AcquireResult(acquired=True, waited_s=self._clock() - started)

    # ---- what moves tokens ---------------------------------------------------------------------------------

    def finish_group(
        self,
        num_rollouts: int,
        num_tokens: int,
        queued: bool = True,
        num_samples: int | None = None,
        scored: bool = True,
    ) -> None:
        """A group of `num_rollouts` completed with `num_tokens` raw tokens of samples in all.

        `queued=False` for a group dropped after scoring (zero std): its tokens update the per-rollout estimate
        and count as dropped in the keep rate, but never enter the queue. `scored=False` (with `queued=False`) for
        a group that generated tokens and then failed: the per-rollout estimate only, not the keep rate.
        """
        if num_tokens < 0:
            raise ValueError(f"finish_group: a group cannot produce {num_tokens} tokens")
        if queued and not scored:
            raise ValueError(
                "finish_group: queued=True with scored=False; a queued group was scored "
                "(scored=False is for a group that failed after generating: pass queued=False)"
            )
        self._leave_flight(num_rollouts, "finish_group")
        decay = self._window_decay
        self._completed_rollouts = decay * self._completed_rollouts + num_rollouts
        self._completed_tokens = decay * self._completed_tokens + num_tokens
        self.completed_groups += 1
        if scored:
            self._observe_keep(num_tokens if queued else 0, num_tokens)
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

    # ---- resume --------------------------------------------------------------------------------------------

    def learned_state(self) -> AllowanceState:
        """What the allowance learned so far, for `rollout_state.json`."""
        return AllowanceState(
            tokens_per_step=self.tokens_per_step,
            completed_rollouts=self._completed_rollouts,
            completed_tokens=self._completed_tokens,
            keep_kept_weight=self._kept_weight,
            keep_scored_weight=self._scored_weight,
        )

    def restore(self, state: AllowanceState) -> None:
        """Continue from a saved `learned_state()` (a resumed run, before anything starts): the step's tokens, the
        mean tokens per rollout (so the cold start is over when there is one) and the keep rate with its weight.
        With S = 0 the version's step size stays the configured one (fixed, module docstring)."""
        if self._inflight_groups or self.queued_tokens or self._completed_rollouts:
            raise ValueError("restore: the allowance has already started counting; restore it before the run starts")
        self.tokens_per_step = _positive_tokens(state.tokens_per_step)
        self._completed_rollouts = float(state.completed_rollouts)
        self._completed_tokens = float(state.completed_tokens)
        self._kept_weight = float(state.keep_kept_weight)
        self._scored_weight = float(state.keep_scored_weight)
        self._notifier.notify()

    def _observe_keep(self, kept_tokens: int, tokens: int) -> None:
        """One scored group into the keep rate's weighted mean (module docstring)."""
        if tokens <= 0:
            return  # nothing generated: no weight either way
        if self._scored_weight <= 0:  # the prior 1.0, worth KEEP_RATE_PRIOR_GROUPS groups of this size
            self._kept_weight = self._scored_weight = float(tokens * KEEP_RATE_PRIOR_GROUPS)
        decay = self._window_decay
        self._kept_weight = decay * self._kept_weight + kept_tokens
        self._scored_weight = decay * self._scored_weight + tokens

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
