"""The protocols the task scheduler talks to: the prompt source, the admission gate, the sink and the rollout
policy (`TaskPolicy`, with what it hands over: `Collected`). Any method may be sync or return an awaitable (Ray
ObjectRefs are awaitable). No torch, no ray."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from rlasync.records import GroupOutcome, MetricItem, PromptLease

G = TypeVar("G")


class PromptSource(Protocol):
    def lease(self) -> PromptLease | tuple[Any, ...] | None | Awaitable[Any]:
        """The next prompt, or None when the stream is exhausted (the scheduler then finishes its groups and ends)."""
        ...

    def release(self, lease: PromptLease, reason: GroupOutcome) -> None | Awaitable[None]:
        """`lease` will produce no handed-over group, for `reason` (one of `RELEASE_REASONS`)."""
        ...


class Admission(Protocol):
    """The gate in front of every new group: the token allowance of docs/algorithms.md §2.3.3 (`rlasync.pipeline.TokenAllowance`
    has this shape). Every successful `acquire` is followed by exactly one `finish_group` or `cancel_group`."""

    def acquire(self, num_rollouts: int) -> Any:
        """Wait until a group of `num_rollouts` rollouts may start and count it in flight; return the seconds
        waited (a float, or an object with `waited_s`), possibly as an awaitable."""
        ...

    def finish_group(self, num_rollouts: int, num_tokens: int, queued: bool = True) -> None | Awaitable[None]:
        """The group was handed over: `num_tokens` raw tokens of its samples were queued (`queued=False`: it was
        dropped, and `num_tokens` are its rollouts' tokens, for the per-rollout estimate only)."""
        ...

    def cancel_group(self, num_rollouts: int) -> None | Awaitable[None]:
        """The group ended without a result (failed, cancelled, or no prompt was left)."""
        ...


class OpenAdmission:
    """Admits every group at once (no token allowance here: e.g. the queue actor's `next_group` gates instead)."""

    async def acquire(self, num_rollouts: int) -> float:
        return 0.0

    def finish_group(self, num_rollouts: int, num_tokens: int, queued: bool = True) -> None:
        return None

    def cancel_group(self, num_rollouts: int) -> None:
        return None


class Sink(Protocol):
    def put(self, item: Any) -> None | Awaitable[None]: ...


@dataclass(frozen=True, slots=True)
class Collected:
    """What `policy.collect` hands over: the `item` for the sink, and for the admission whether it queues samples
    and how many raw tokens (of its samples when queued, of its rollouts when dropped)."""

    item: Any
    queued: bool
    num_tokens: int


class TaskPolicy(Protocol[G]):
    """What the scheduler asks of a rollout policy; `G` is the policy's own record of one admitted lease."""

    hand_over_holds_slots: bool
    failure_metric: str

    async def setup(self) -> None: ...

    async def close(self) -> None: ...

    def after_close(self) -> None: ...

    async def admit(self, lease: PromptLease, waited_s: float) -> G | None:
        """The group to generate for `lease` (None: filtered, released as "filtered"); `waited_s`: admission and
        lease wait. An error releases the lease ("cancelled") and stops the scheduler."""
        ...

    async def run_task(self, group: G, index: int, policy_version: int) -> Any:
        """Task `index` of the group (one rollout; one distillation sample)."""
        ...

    def record(self, group: G, index: int, result: Any) -> None:
        """Task `index` finished with `result` (per-task metrics)."""
        ...

    async def collect(self, group: G, results: list[Any], policy_version: int) -> Collected:
        """The group's results turned into what the sink takes (scoring, advantages, samples)."""
        ...

    def handed_over(self, group: G, collected: Collected, put_s: float, num_inflight: int) -> None:
        """The sink took the group after `put_s` seconds (per-group metrics)."""
        ...

    def is_group_failure(self, error: BaseException) -> bool:
        """Whether `error` of a task fails only its group (else it stops the scheduler)."""
        ...

    def emit(self, items: list[MetricItem]) -> None: ...


class PolicyBase:
    """What every rollout policy has: metric emission to the loop's callback and the `setup` / `close` hooks a user's
    subclass overrides (run by the scheduler before the first lease and on the way out)."""

    _metrics_callback: Callable[[list[MetricItem]], Any]

    def emit(self, items: list[MetricItem]) -> None:
        """Report metric items (to `metrics_callback`); nothing for an empty list."""
        if items:
            self._metrics_callback(items)

    _emit = emit

    # ---- hooks --------------------------------------------------------------------------------------------

    async def setup(self) -> None:
        """Create resources on the loop's event loop (called by `run()` before anything else)."""

    async def close(self) -> None:
        """Release what `setup` created (called by `run()` on the way out, also after an error)."""


__all__ = ["Admission", "Collected", "OpenAdmission", "PolicyBase", "PromptSource", "Sink", "TaskPolicy"]
