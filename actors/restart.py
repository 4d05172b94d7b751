"""What a restartable rollout-side actor adds to `LoopHost` (not an actor itself).

The Cluster creates the rollout actors with Ray's `max_restarts`: when one dies (kill -9, out of memory), Ray
starts a new incarnation with the same constructor arguments. That incarnation's loop is not running; the driver
calls `ensure_running()` on every rollout actor at each step and health check, and a loop that is not running yet
is started. `start()` first registers this incarnation with the queue (its owner name carries a token per
incarnation): every lease an earlier incarnation still holds is released, so those prompts are leased again, and the
earlier incarnation is leased nothing more (a `next_group` it asked before dying may be answered later): every prompt
is still consumed exactly once.

A GenerationActor's death is handled on the rollout side by `actors.engine_channel.EngineChannel`: the requests it
failed become retryable `EngineError`s.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)


class RestartableLoop:
    """Mixed in before `LoopHost`: `class RolloutActor(RestartableLoop, LoopHost)`."""

    queue: Any
    source: Any
    task: Any
    released_at_start: int = 0

    async def start(self) -> None:
        """Release the leases a dead predecessor of this actor held (none on the first start), then run the loop."""
        self.released_at_start = await self.queue.register_owner.remote(self.source.owner)
        if self.released_at_start:
            logger.warning(
                "%s restarted: %d leases of its previous incarnation released",
                self.source.owner,
                self.released_at_start,
            )
        await super().start()  # type: ignore[misc]

    async def ensure_running(self) -> int | None:
        """Start the loop if this incarnation has not (Ray restarted the actor): the number of leases released, or
        None when the loop was started already."""
        if self.task is not None:
            return None
        await self.start()
        return self.released_at_start
