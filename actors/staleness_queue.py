"""The named StalenessQueue actor: forwards to one `rlasync.pipeline.QueueService`.

Holds references to scored samples (`QueueEntry.payload`) plus their metadata; never fetches them. The rollout
actors send a group's samples pickled as one bytes object and this actor `ray.put`s it (`actors.group_payload`), so it
owns them: they outlive a rollout actor that dies (Ray 2.56 removed `ray.put(_owner=...)`; an object owned by a dead
worker is lost). Async actor: `next_group` and `wait_take` wait on the service's notifier without blocking other
calls.

Leases carry their owner (the rollout actor's name); `release_owner(owner)` gives back every lease a dead (and
restarted) rollout actor still held, so those prompts are generated again and the epoch stays exactly once.
"""

from __future__ import annotations

import logging
from typing import Any

import ray

from actors.group_payload import own_group
from rlasync.metrics.loop_lag import LoopLagMonitor
from rlasync.metrics.process_cpu import ProcessCpu
from rlasync.pipeline import QueueService, RolloutState
from rlasync.pipeline.settings import QueueSettings

logger = logging.getLogger(__name__)


@ray.remote
class QueueActor:
    def __init__(self, *, settings: QueueSettings, resume: dict[str, Any] | None = None) -> None:
        state = RolloutState.from_dict(resume) if resume else None
        self.service = QueueService.create(settings, resume=state)
        self.dataset_refs: list[Any] = []  # `hold_dataset`
        # how busy this actor is (every rollout actor's leases and groups pass here): reported with each take
        self.cpu, self.loop_lag = ProcessCpu(), LoopLagMonitor(interval_s=0.05)

    # the training rows (held for the rollout actors, which fetch them when they start or restart)
    def hold_dataset(self, refs: list[Any]) -> None:
        """Keep `[ref]`, the driver's ObjectRef of the training rows (in a list, so Ray passes the ref itself)."""
        self.dataset_refs = list(refs)

    def dataset(self) -> list[Any]:
        """`[ref]` of the training rows (`hold_dataset`); the caller `ray.get`s it."""
        if not self.dataset_refs:
            raise RuntimeError("the queue actor holds no training rows (hold_dataset was not called)")
        return self.dataset_refs

    # rollout side
    async def next_group(
        self,
        num_rollouts: int,
        timeout_s: float | None = None,
        owner: str | None = None,
        drops: list[Any] = (),
        groups: list[Any] = (),
    ) -> Any:
        """The next lease; the caller's groups finished since its last call are applied first (`hand_over`: one
        call where a lease and a group's hand-over would take two, `QueuePromptSource`)."""
        self.hand_over(drops, groups)
        return await self.service.next_group(num_rollouts, timeout_s, owner)

    def put_group(self, entries: list[Any], packed: bytes | None = None) -> None:
        """A kept group's entries; `packed`: its samples pickled by the rollout actor (`pack_group`), stored as
        they are (actors/group_payload.py: one object a group either way)."""
        self.service.put_group(own_group(entries, packed))

    def drop_group(
        self, group_id: int, reason: str, num_tokens: int = 0, cause: str | None = None, detail: str | None = None
    ) -> None:
        self.service.drop_group(group_id, reason, num_tokens, cause, detail)  # type: ignore[arg-type]

    def hand_over(self, drops: list[Any] = (), groups: list[Any] = ()) -> None:
        """Finished groups: `groups` kept (`put_group`'s arguments) are queued, then `drops` (`drop_group`'s) applied."""
        for entries, packed in groups:
            self.put_group(entries, packed)
        for drop in drops:
            self.service.drop_group(*drop)

    def release(self, lease: Any) -> None:
        self.service.release(lease)

    def release_owner(self, owner: str) -> int:
        """Release every live, not yet queued lease of `owner` (a rollout actor incarnation that died or is
        removed) and lease it nothing more; returns how many."""
        released = self.service.release_owner(owner)
        if released:
            logger.warning("released %d leases of %s: their prompts are leased again", released, owner)
        return released

    def register_owner(self, owner: str) -> int:
        """A rollout actor incarnation starts: its earlier incarnations' leases are released and they are leased
        nothing more (`QueueService.register_owner`); returns how many leases were released."""
        released = self.service.register_owner(owner)
        if released:
            logger.warning("released %d leases of %s's earlier incarnation: leased again", released, owner)
        return released

    # learner side
    async def wait_take(self, token_target: int, timeout_s: float | None) -> Any:
        """The service's take, its metrics with this actor's `perf/queue_cpu_frac` (CPU seconds per second since the
        previous take) and `perf/queue_loop_lag_max_s` (its event loop's worst lag since then)."""
        self.loop_lag.start()
        result = await self.service.wait_take(token_target, timeout_s)
        result.metrics["perf/queue_cpu_frac"] = self.cpu.take()
        result.metrics["perf/queue_loop_lag_max_s"] = self.loop_lag.take_max()
        return result

    def finish_step(self, tokens_per_step: int, unplanned: int = 0) -> None:
        self.service.finish_step(tokens_per_step, unplanned)

    def set_policy_version(self, version: int) -> None:
        self.service.set_policy_version(version)

    def rollout_state(self) -> dict[str, Any]:
        return self.service.rollout_state().to_dict()

    def state(self) -> dict[str, Any]:
        return self.service.state().to_dict()
