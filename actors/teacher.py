"""TeacherScorer: hosts one teacher engine used only for teacher-forced scoring (docs/algorithms.md §9.1; docs/design.md §1).

    distillation rollout loop ──score(prompt + completion, prompt_length, top_k[, temperature])──► TeacherScorer
                              ◄── ScoreResult (top-k ids / log-probs per completion position, realised token's) ──

One actor per teacher id. The engine is `rlasync.engine.factory.make_engine(engine, model, ...)`: a local model
(the built-in torch engine on CPU or the GPU Ray gives it, or vLLM in this process) or a client of a `vllm serve`
teacher (`engine="vllm_server"`, `base_url` from `teacher_server_urls`). Teachers never receive weights, so this
actor joins no weight-sync group.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

import ray


@ray.remote
class TeacherScorer:
    def __init__(
        self,
        *,
        teacher_id: str,
        model: Any,
        engine: str = "torch",
        base_url: str | None = None,
        dtype: str | None = None,
        engine_kwargs: dict[str, Any] | None = None,
        num_threads: int | None = 1,
    ) -> None:
        import torch

        from rlasync.engine.factory import make_engine

        logging.basicConfig(level=logging.INFO)
        if num_threads and not torch.cuda.is_available():
            torch.set_num_threads(num_threads)
        self.teacher_id = teacher_id
        self.engine = make_engine(engine, model, base_url=base_url, dtype=dtype, **(engine_kwargs or {}))
        self.num_scored = 0
        self._incarnation = uuid.uuid4().hex  # a new one when Ray restarts this actor

    async def score(self, token_ids: list[int], prompt_length: int, top_k: int, temperature: float = 1.0) -> Any:
        """The engine's teacher-forced `score` at `temperature` (`teacher_temperature`)."""
        self.num_scored += 1
        return await self.engine.score(token_ids, prompt_length, top_k, temperature=temperature)

    def max_model_len(self) -> int:
        return int(self.engine.max_model_len)

    def incarnation(self) -> str:
        """The token this incarnation's constructor drew: the driver sees a Ray restart by it changing
        (actors/cluster_faults.py `RestartWatch`)."""
        return self._incarnation

    def stats(self) -> dict[str, Any]:
        return {"teacher_id": self.teacher_id, "scored": self.num_scored}

    async def close(self) -> None:
        await self.engine.close()
