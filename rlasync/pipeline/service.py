"""What the named StalenessQueue actor hosts: prompt dispatcher, sample queue and token allowance, kept consistent.

The Ray actor only forwards calls to one `QueueService`; every call below keeps the three parts in step.

    rollout side                                    learner side
    next_group(G) ─► NextGroup(lease, waited_s)     wait_take(token_target) / take(...) ─► TakeResult
       (allowance gate, then a lease)                  (fresh entries; stale ones dropped and accounted)
    put_group(entries)   queued: group's samples    finish_step(tokens_per_step)   allowance follows
    drop_group(id, why)  consumed, nothing queued   set_policy_version(v)          after each weight sync
      (+ cause, detail: counted per cause, the last detail kept: the watchdog's reason, docs/algorithms.md §2.1)
    release(lease)       leased again               rollout_state() ─► RolloutState for rollout_state.json

Who waits for what, and what wakes it (one shared notifier; waiters re-check after every wake-up):

    | waiter          | waits for                                          | woken by                         |
    |-----------------|----------------------------------------------------|----------------------------------|
    | next_group      | allowance open and a leasable prompt, or done      | take, finish_step, put/drop/     |
    |                 |                                                    | release (in-flight count drops)  |
    | wait_take       | a fresh entry in the queue                         | put_group                        |

With a `StepPlan` (`QueueSettings.step_plan`, max_staleness >= 1) a take composes the step (docs/algorithms.md
§4.5.1): it runs the learner's planner over the queued entries and takes those that fill the step's micro-batches,
whatever the token target; the entry that would open the next step stays queued, and the take says the step is
full (`TakeResult.step_full`). `finish_step` starts the next step's composition.

A take counts as training for the epoch, as in TRL (the trainer records a group when it reads its sample):
`mark_trained` for taken entries, `mark_stale` for dropped ones (a group whose samples were all stale is
leased again). The learner plans every taken sample into a row of its step, a short tail included (docs/
algorithms.md §4.5.2); one it could place nowhere is reported back with the step (`finish_step(tokens,
unplanned)`) and counted, `unplanned_samples` beside `taken_samples`: a sample is trained or counted as not,
never lost silently. Pure Python: no torch, no ray.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field

from rlasync.packing.step_plan import StepComposer, StepPlan
from rlasync.pipeline._notify import Notifier
from rlasync.pipeline.allowance import KEEP_RATE_FLOOR, KEEP_RATE_METRIC, TokenAllowance
from rlasync.pipeline.dispatcher import DROP_REASONS, DropReason, GroupOutcome, PromptDispatcher, PromptLease
from rlasync.pipeline.resume import RolloutState
from rlasync.pipeline.settings import QueueSettings
from rlasync.pipeline.staleness_queue import QueueEntry, StalenessQueue, TakeResult, check_group_entries, empty_take


def owner_name(owner: str) -> str:
    """The rollout actor's name of an owner "NAME#TOKEN" (the token tells its incarnations apart)."""
    return owner.split("#", 1)[0]


@dataclass(frozen=True, slots=True)
class NextGroup:
    """Answer to `next_group`.

    lease:           the prompt to generate, or None (timed out, or `done`)
    waited_s:        seconds the token allowance held the caller back: log as `rollout/backpressure_s`
    done:            every prompt of the epoch budget is consumed: stop generating
    policy_version:  the version current at admission (stamp it on the group)
    """

    lease: PromptLease | None
    waited_s: float
    done: bool
    policy_version: int


@dataclass(frozen=True, slots=True)
class QueueState:
    """A snapshot for stats and logs: queue depth, generation in flight, the allowance, epoch progress."""

    policy_version: int
    queue_size: int  # samples waiting
    queue_tokens: int  # raw tokens waiting
    inflight_groups: int
    inflight_rollouts: int
    inflight_tokens: float  # estimate: in-flight rollouts × mean tokens per completed rollout
    allowance_tokens: int
    tokens_per_step: int
    leased_groups: int
    consumed_groups: int
    regenerated_groups: int  # groups leased again because every sample was stale
    first_untrained_index: int
    done: bool
    outcomes: dict[str, int] = field(default_factory=dict)  # groups per outcome: trained, zero_std, filtered, stale
    causes: dict[str, int] = field(default_factory=dict)  # dropped groups per "outcome/cause" (zero_std/no_reward, ...)
    last_failures: dict[str, str] = field(default_factory=dict)  # "outcome/cause" -> the last drop's detail
    released_by_owner: dict[str, int] = field(default_factory=dict)  # leases given back for a dead (restarted) owner
    keep_rate: float = 1.0  # the allowance's keep rate: generated tokens expected to reach the queue (floored)
    counted_inflight_tokens: float = 0.0  # in-flight tokens as the gate counts them (× keep_rate when S >= 1)
    taken_samples: int = 0  # samples handed to the learner (counted as trained for their groups at take time)
    unplanned_samples: int = 0  # of those, in no row of their step: trained by no rank (docs/algorithms.md §4.5.2)

    def to_dict(self) -> dict[str, int | float | bool]:
        return asdict(self)


class QueueService:
    """The StalenessQueue actor's core (see the module docstring)."""

    def __init__(
        self,
        dispatcher: PromptDispatcher,
        *,
        max_staleness: int,
        tokens_per_step: int,
        policy_version: int = 0,
        clock: Callable[[], float] = time.monotonic,
        steps_per_version: int = 1,
        samples_per_step: int | None = None,
        step_plan: StepPlan | None = None,
        keep_rate_floor: float = KEEP_RATE_FLOOR,
    ) -> None:
        """`step_plan`: compose each step as the learner plans it (see the module docstring; not with
        max_staleness=0, whose steps take what their version generated). `keep_rate_floor`: the allowance's (1.0
        counts in-flight rollouts at full, as before the keep rate: `bench/keep_rate_sim.py` compares)."""
        self.dispatcher = dispatcher
        self.max_staleness = max_staleness
        self.policy_version = policy_version
        self._clock = clock
        self._notifier = Notifier()
        self.queue = StalenessQueue(clock=clock, notifier=self._notifier)
        self.allowance = TokenAllowance(
            max_staleness,
            tokens_per_step,
            clock=clock,
            notifier=self._notifier,
            steps_per_version=steps_per_version,
            samples_per_step=samples_per_step,
            keep_rate_floor=keep_rate_floor,
        )
        self.composer = StepComposer(step_plan) if step_plan is not None and max_staleness > 0 else None
        self._generating: dict[int, int] = {}  # group_id -> rollouts, for groups admitted and not yet back
        self.causes: Counter[str] = Counter()
        self.last_failures: dict[str, str] = {}
        self.released_by_owner: Counter[str] = Counter()
        self._retired_owners: set[str] = set()  # dead or removed rollout actor incarnations: leased nothing more
        self._incarnations: dict[str, str] = {}  # a rollout actor's name -> its live incarnation's owner name
        self.taken_samples = 0
        self.unplanned_samples = 0

    @classmethod
    def create(
        cls,
        settings: QueueSettings,
        *,
        resume: RolloutState | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> QueueService:
        """A service built from its `QueueSettings`, for a fresh run or one resumed from a `rollout_state.json`
        (prompt position, version and the allowance's learned state); a streaming dataset (`settings.stream`) is leased by a
        `StreamingDispatcher` instead of by row index."""
        start = resume or RolloutState(prompt_index=0)
        if settings.stream is not None:
            from rlasync.pipeline.dispatcher_stream import StreamingDispatcher

            dispatcher: PromptDispatcher = StreamingDispatcher(
                settings.stream, repeat=settings.num_epochs is None, start_index=start.prompt_index
            )
        else:
            dispatcher = PromptDispatcher(settings.num_rows, settings.num_epochs, start_index=start.prompt_index)
        service = cls(
            dispatcher,
            max_staleness=settings.max_staleness,
            tokens_per_step=settings.tokens_per_step,
            policy_version=start.model_version,
            clock=clock,
            steps_per_version=settings.steps_per_version,
            samples_per_step=settings.samples_per_step,
            step_plan=settings.step_plan,
        )
        if start.allowance is not None:  # older checkpoints have none: the allowance starts from its priors
            service.allowance.restore(start.allowance)
        return service

    # ---- rollout side --------------------------------------------------------------------------------------

    def try_next_group(self, num_rollouts: int, owner: str | None = None) -> PromptLease | None:
        """A lease whose group of `num_rollouts` is admitted now, or None (gate closed or nothing leasable);
        `owner` (the rollout actor generating it) is recorded for `release_owner`."""
        if owner is not None and self.retired(owner):
            return None  # a dead incarnation's call answered late: leasing to it would hold a group in flight forever
        if not (self.allowance.can_start(num_rollouts) and self.dispatcher.has_leasable()):
            return None
        lease = self.dispatcher.lease()
        assert lease is not None
        if owner is not None:
            self.dispatcher.assign_owner(lease.group_id, owner)
        self.allowance.start_group(num_rollouts)
        self._generating[lease.group_id] = num_rollouts
        return lease

    async def next_group(
        self, num_rollouts: int, timeout_s: float | None = None, owner: str | None = None
    ) -> NextGroup:
        """Wait (up to `timeout_s`, None = forever) for the allowance and a prompt; see `NextGroup`."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        blocked_s, last = 0.0, self._clock()
        while True:
            if self.dispatcher.done:
                return self._admission(None, blocked_s)
            lease = self.try_next_group(num_rollouts, owner)
            if lease is not None:
                return self._admission(lease, blocked_s)
            held_by_allowance = not self.allowance.can_start(num_rollouts)
            remaining = None if deadline is None else deadline - loop.time()
            woke = await self._notifier.wait(remaining)
            now = self._clock()
            blocked_s += (now - last) if held_by_allowance else 0.0
            last = now
            if not woke:
                return self._admission(None, blocked_s)

    def put_group(self, entries: Iterable[QueueEntry], now: float | None = None) -> None:
        """Queue one group's scored samples (its whole result; the group leaves the in-flight count)."""
        entries = list(entries)
        check_group_entries(entries)
        group_id = entries[0].group_id
        num_rollouts = self._generating_rollouts(group_id, "put_group")
        self.dispatcher.mark_queued(group_id, len(entries))
        del self._generating[group_id]
        self.queue.put(entries, now=now)
        self.allowance.finish_group(num_rollouts, sum(entry.num_tokens for entry in entries), num_samples=len(entries))

    def drop_group(
        self,
        group_id: int,
        reason: DropReason,
        num_tokens: int = 0,
        cause: str | None = None,
        detail: str | None = None,
    ) -> None:
        """The group produced nothing to train (zero reward std, `filter_prompt` rejected its prompt, or its prompt
        can never be generated: "failed", counted as consumed instead of being leased again forever).

        `num_tokens`: raw tokens its rollouts generated (0 for a filtered prompt), for the per-rollout estimate.
        `cause` (e.g. "no_reward", "constant", "too_long", "reward_timeout") is counted in `state().causes` as
        "reason/cause"; `detail`, a one-line message, is kept as that cause's last in `state().last_failures`.
        """
        if reason not in DROP_REASONS:
            raise ValueError(f"drop_group: unknown reason {reason!r}; expected one of {DROP_REASONS}")
        if cause is not None:
            key = f"{reason}/{cause}"
            self.causes[key] += 1
            if detail:
                self.last_failures[key] = str(detail)[:500]
        num_rollouts = self._generating_rollouts(group_id, "drop_group")
        del self._generating[group_id]
        if num_tokens > 0:  # only a scored group's drop feeds the keep rate; a failed one's tokens, the mean only
            self.allowance.finish_group(num_rollouts, num_tokens, queued=False, scored=reason == GroupOutcome.ZERO_STD)
        else:
            self.allowance.cancel_group(num_rollouts)
        self.dispatcher.mark_dropped(group_id, reason)  # last: it raises when a whole epoch was filtered

    def release(self, lease: PromptLease) -> None:
        """Give a lease back unconsumed (rollout failed for good, worker stopping); its prompt is leased again."""
        num_rollouts = self._generating_rollouts(lease.group_id, "release")
        self.dispatcher.release(lease)
        del self._generating[lease.group_id]
        self.allowance.cancel_group(num_rollouts)

    def release_owner(self, owner: str) -> int:
        """Release every live, not yet queued lease of `owner` (a rollout actor incarnation that died, or is removed)
        so their prompts are leased again, and lease it nothing more: a `next_group` it asked before it died may be
        answered after this (it waits up to its timeout on the gate), and a lease given then would stay in flight
        with no one to finish it. Returns how many leases were released."""
        self._retired_owners.add(owner)
        leases = self.dispatcher.leases_of(owner)
        for lease in leases:
            self.release(lease)
        if leases:
            self.released_by_owner[owner_name(owner)] += len(leases)
        return len(leases)

    def register_owner(self, owner: str) -> int:
        """A rollout actor incarnation starts (`owner` = "NAME#TOKEN", a token per incarnation): every earlier
        incarnation of NAME is released (`release_owner`) and retired; returns the leases released."""
        name = owner_name(owner)
        earlier = {o for o in self.dispatcher.owners() if o != owner and owner_name(o) == name}
        if self._incarnations.get(name) not in (None, owner):
            earlier.add(self._incarnations[name])
        self._incarnations[name] = owner
        return sum(self.release_owner(o) for o in sorted(earlier))

    def retired(self, owner: str) -> bool:
        """Whether `owner` is a dead or removed incarnation (released, or superseded by a later one of its name)."""
        live = self._incarnations.get(owner_name(owner))
        return owner in self._retired_owners or (live is not None and live != owner)

    # ---- learner side --------------------------------------------------------------------------------------

    def take(self, token_target: int, now: float | None = None) -> TakeResult:
        """Take up to `token_target` raw tokens of fresh samples now (never waits; may return nothing).

        With S = 0 (synchronous) nothing is taken while groups of this version are in flight, and the version's last
        step (steps of tokens) takes everything queued: all that is left of this version's samples. With a step plan
        the target is not read: the take composes the step (see the module docstring). Every take's metrics carry
        the allowance's keep rate (`rollout/keep_rate`, a gauge)."""
        result = self._take(token_target, now)
        result.metrics[KEEP_RATE_METRIC] = self.allowance.keep_rate
        return result

    def _take(self, token_target: int, now: float | None) -> TakeResult:
        if self.allowance.synchronous:
            if self.allowance.inflight_groups > 0 and not self.dispatcher.done:
                return empty_take()
            if self.allowance.last_step_of_version:
                token_target = max(token_target, self.queue.num_tokens)
        composer = self.composer
        admit = None if composer is None else composer.offer
        result = self.queue.take(token_target, self.policy_version, self.max_staleness, now=now, admit=admit)
        self._account(result)
        if composer is not None and composer.full:
            result = dataclasses.replace(result, step_full=True)
        return result

    async def wait_take(self, token_target: int, timeout_s: float | None) -> TakeResult:
        """`take`, waiting up to `timeout_s` for a fresh sample when there is none; stale drops are kept."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        dropped: list[QueueEntry] = []
        try:
            while True:
                result = self.take(token_target)
                dropped.extend(result.dropped_stale)
                if result.entries or result.step_full:
                    break
                if not self.allowance.learner_waiting:
                    self.allowance.learner_waiting = True  # S = 0: a served version may start a group for this step
                    self._notifier.notify()
                remaining = None if deadline is None else deadline - loop.time()
                if not await self._notifier.wait(remaining):
                    break
        finally:
            self.allowance.learner_waiting = False
        return _with_drops(result, dropped)

    def finish_step(self, tokens_per_step: int, unplanned: int = 0) -> None:
        """Publish the raw tokens the learner consumed in its last optimizer step; the next take composes the next
        step. `unplanned`: the step's taken samples that no rank trained (its `batch/unplanned_count`: a short
        tail that fit in no row, docs/algorithms.md §4.5.2), counted in `state().unplanned_samples`."""
        if unplanned < 0:
            raise ValueError(f"finish_step: unplanned={unplanned} must be >= 0 (the step's samples in no row)")
        if self.unplanned_samples + unplanned > self.taken_samples:
            raise ValueError(
                f"finish_step: unplanned={unplanned} samples, but only {self.taken_samples - self.unplanned_samples} "
                "taken samples are not counted unplanned yet"
            )
        self.unplanned_samples += unplanned
        self.allowance.set_tokens_per_step(tokens_per_step)
        if self.composer is not None:
            self.composer.reset()

    def set_policy_version(self, policy_version: int) -> None:
        """The version served after a weight sync; it never goes back."""
        if policy_version < self.policy_version:
            raise ValueError(f"set_policy_version: {policy_version} is older than the current {self.policy_version}")
        if policy_version > self.policy_version:
            self.allowance.new_version()
        self.policy_version = policy_version
        self._notifier.notify()

    # ---- state ---------------------------------------------------------------------------------------------

    @property
    def done(self) -> bool:
        return self.dispatcher.done

    def rollout_state(self) -> RolloutState:
        """What to write to `rollout_state.json` now."""
        return RolloutState(
            prompt_index=self.dispatcher.first_untrained_index(),
            model_version=self.policy_version,
            allowance=self.allowance.learned_state(),
        )

    def state(self) -> QueueState:
        return QueueState(
            policy_version=self.policy_version,
            queue_size=len(self.queue),
            queue_tokens=self.queue.num_tokens,
            inflight_groups=self.allowance.inflight_groups,
            inflight_rollouts=self.allowance.inflight_rollouts,
            inflight_tokens=self.allowance.inflight_tokens,
            allowance_tokens=self.allowance.allowance_tokens,
            tokens_per_step=self.allowance.tokens_per_step,
            leased_groups=self.dispatcher.num_leased,
            consumed_groups=self.dispatcher.consumed_groups,
            regenerated_groups=self.dispatcher.outcome_counts["stale"],
            first_untrained_index=self.dispatcher.first_untrained_index(),
            done=self.dispatcher.done,
            outcomes=dict(self.dispatcher.outcome_counts),
            causes=dict(self.causes),
            last_failures=dict(self.last_failures),
            released_by_owner=dict(self.released_by_owner),
            keep_rate=self.allowance.keep_rate,
            counted_inflight_tokens=self.allowance.counted_inflight_tokens,
            taken_samples=self.taken_samples,
            unplanned_samples=self.unplanned_samples,
        )

    # ---- internals -----------------------------------------------------------------------------------------

    def _admission(self, lease: PromptLease | None, waited_s: float) -> NextGroup:
        return NextGroup(lease=lease, waited_s=waited_s, done=self.dispatcher.done, policy_version=self.policy_version)

    def _generating_rollouts(self, group_id: int, action: str) -> int:
        """The rollouts of a group admitted by this service and not yet queued, dropped or released."""
        if group_id not in self._generating:
            raise ValueError(
                f"{action}: group {group_id} is not generating (never admitted, or already queued, dropped or released)"
            )
        return self._generating[group_id]

    def _account(self, result: TakeResult) -> None:
        """Tell the dispatcher and the allowance what left the queue."""
        self.taken_samples += len(result.entries)
        for group_id, count in Counter(entry.group_id for entry in result.entries).items():
            self.dispatcher.mark_trained(group_id, count)
        for group_id, count in Counter(entry.group_id for entry in result.dropped_stale).items():
            self.dispatcher.mark_stale(group_id, count)
        left = result.num_tokens + sum(entry.num_tokens for entry in result.dropped_stale)
        if result.entries or result.dropped_stale:
            self.allowance.consumed(
                left,
                taken_tokens=result.num_tokens,
                num_samples=len(result.entries) + len(result.dropped_stale),
                taken_samples=len(result.entries),
            )


def _with_drops(result: TakeResult, dropped: list[QueueEntry]) -> TakeResult:
    """`result` carrying every stale drop of a waiting take (earlier attempts took no entries)."""
    metrics = dict(result.metrics)
    metrics["sample/dropped_stale_count"] = float(len(dropped))
    return TakeResult(entries=result.entries, dropped_stale=tuple(dropped), metrics=metrics, step_full=result.step_full)
