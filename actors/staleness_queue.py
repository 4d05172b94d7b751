"""The named StalenessQueue actor: forwards to one `rlasync.pipeline.QueueService`.

Holds ObjectRefs of scored samples (`QueueEntry.payload`) plus their metadata; never fetches them. Async actor:
`next_group` and `wait_take` wait on the service's notifier without blocking other calls.
"""

from __future__ import annotations

from typing import Any

import ray

from rlasync.pipeline import QueueService, RolloutState
from rlasync.pipeline.settings import QueueSettings


@ray.remote
class QueueActor:
    def __init__(self, *, settings: QueueSettings, resume: dict[str, int] | None = None) -> None:
        state = RolloutState.from_dict(resume) if resume else None
        self.service = QueueService.create(
            num_rows=settings.num_rows, num_epochs=settings.num_epochs, max_staleness=settings.max_staleness,
            tokens_per_step=settings.tokens_per_step, resume=state,
        )  # fmt: skip

    # rollout side
    async def next_group(self, num_rollouts: int, timeout_s: float | None = None) -> Any:
        return await self.service.next_group(num_rollouts, timeout_s)

    def put_group(self, entries: list[Any]) -> None:
        self.service.put_group(entries)

    def drop_group(self, group_id: int, reason: str, num_tokens: int = 0, cause: str | None = None,
                   detail: str | None = None) -> None:  # fmt: skip
        self.service.drop_group(group_id, reason, num_tokens, cause, detail)  # type: ignore[arg-type]

    def release(self, lease: Any) -> None:
        self.service.release(lease)

    # learner side
    async def wait_take(self, token_target: int, timeout_s: float | None) -> Any:
        return await self.service.wait_take(token_target, timeout_s)

    def finish_step(self, tokens_per_step: int) -> None:
        self.service.finish_step(tokens_per_step)

    def set_policy_version(self, version: int) -> None:
        self.service.set_policy_version(version)

    def rollout_state(self) -> dict[str, int]:
        return self.service.rollout_state().to_dict()

    def state(self) -> dict[str, Any]:
        return self.service.state().to_dict()
