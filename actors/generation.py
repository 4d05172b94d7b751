"""GenerationActor: hosts one `TorchEngine` (CPU, or the one GPU Ray gives it) and receives weight broadcasts.

The driver pauses it, runs `receive_weights` here while learner rank 0 sends, then resumes it.
"""

from __future__ import annotations

from typing import Any

import ray


@ray.remote
class GenerationActor:
    def __init__(self, *, model: str, dtype: str | None = None, num_threads: int | None = 1,
                 engine_kwargs: dict[str, Any] | None = None) -> None:
        import torch

        from rlasync.engine.torch_engine import TorchEngine

        if num_threads and not torch.cuda.is_available():
            torch.set_num_threads(num_threads)
        self.engine = TorchEngine(model, dtype=dtype, **(engine_kwargs or {}))
        self.group: Any = None

    async def generate(self, prompt_ids: list[int], sampling: Any) -> Any:
        return await self.engine.generate(prompt_ids, sampling)

    def stats(self) -> Any:
        return self.engine.stats()

    def max_model_len(self) -> int:
        return self.engine.max_model_len

    async def pause(self) -> None:
        await self.engine.pause()

    async def resume(self) -> None:
        await self.engine.resume()

    def join_weight_group(self, host: str, port: int, rank: int, world_size: int, timeout_s: float) -> None:
        from rlasync.weights.broadcast import WeightGroup

        self.group = WeightGroup.open(host, port, rank, world_size, timeout_s)

    async def receive_weights(self, manifest: list[Any]) -> None:
        if self.group is None:
            raise RuntimeError("receive_weights before join_weight_group")
        await self.engine.load_weights(self.group.receive(manifest))

    async def close(self) -> None:
        await self.engine.close()
