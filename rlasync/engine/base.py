"""The one interface every generation engine implements (built-in torch engine, vLLM in-process, vLLM server).

    engine.generate(prompt_ids, sampling)  -> TurnRecord      (async; one sampling request)
    engine.score(token_ids, prompt_length, top_k) -> ScoreResult   (async; teacher-forced, docs/algorithms.md §9.1)
    engine.pause() / engine.resume()       pause keeps in-flight requests and runs no forward until resumed
    engine.load_weights(named_tensors)     in place, HF parameter names, while paused
    engine.stats() -> EngineStats          what the rollout side's concurrency controller reads (docs/algorithms.md §2.3.2)

The GenerationActor and the TeacherScorer hold an `Engine`; nothing else of an engine is public. This module
imports neither torch nor ray: sampling parameters and results are plain data.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from rlasync.records import TurnRecord

if TYPE_CHECKING:  # annotations only: rlasync.config is the user-facing surface and never imports rlasync.engine
    from rlasync.config.base import TrainerConfig
    from rlasync.config.grpo import AsyncGRPOConfig


class EngineError(RuntimeError):
    """A generation request failed inside the engine (transient: the caller may retry)."""


class RequestRejectedError(ValueError):
    """The request can never succeed (e.g. a prompt longer than max_model_len): never retry it."""


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Sampling settings of one request (vLLM's names).

    temperature 0 means greedy. top_k 0 (or -1) disables top-k; top_p 1 disables top-p; min_p 0 or None disables
    min-p. `seed` makes a request reproducible whatever else runs in the batch. `num_logprobs = N` asks for the
    top-N processed log-probs of every generated position. Processing order (as vLLM): repetition penalty on the
    raw logits, then temperature, then top-k, top-p, min-p; log-probs are of the processed distribution.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float | None = None
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    num_logprobs: int = 0
    return_sampling_mask: bool = True
    """Report each sampled token's candidate set when top-k/top-p/min-p filter (`TurnRecord.output_sampling_mask`)."""

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"SamplingParams.max_tokens={self.max_tokens}: must be >= 1")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"SamplingParams.temperature={self.temperature}: must be >= 0 (0 = greedy)")
        if self.top_k < -1:
            raise ValueError(f"SamplingParams.top_k={self.top_k}: must be >= 0 (0 or -1 disables it)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p={self.top_p}: must be in (0, 1]")
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            raise ValueError(f"SamplingParams.min_p={self.min_p}: must be in [0, 1]")
        if not self.repetition_penalty > 0:
            raise ValueError(f"SamplingParams.repetition_penalty={self.repetition_penalty}: must be > 0")
        if self.num_logprobs < 0:
            raise ValueError(f"SamplingParams.num_logprobs={self.num_logprobs}: must be >= 0")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @property
    def filters(self) -> bool:
        """Whether top-k, top-p or min-p restrict the candidate set."""
        return self.top_k > 0 or self.top_p < 1 or bool(self.min_p)

    @classmethod
    def from_config(cls, config: AsyncGRPOConfig, seed: int | None = None) -> SamplingParams:
        """A GRPO rollout's sampling, from an `AsyncGRPOConfig`: its generation fields, the top
        `num_sampler_logprobs` log-probs of every position and the sampling mask (the learner's importance ratios
        read both). Derive it once and give each request its seed with `with_seed`."""
        return cls.from_generation_fields(config, seed, num_logprobs=config.num_sampler_logprobs)

    @classmethod
    def for_student(cls, config: TrainerConfig, seed: int | None = None) -> SamplingParams:
        """A distillation student's sampling, from an `AsyncDistillationConfig` (any `TrainerConfig`): the
        generation fields, no log-probs and no sampling mask (the learner recomputes the student side)."""
        return cls.from_generation_fields(config, seed, num_logprobs=0, return_sampling_mask=False)

    @classmethod
    def from_generation_fields(
        cls, config: TrainerConfig, seed: int | None = None, *, num_logprobs: int = 0, return_sampling_mask: bool = True
    ) -> SamplingParams:
        """The generation fields every trainer config has (TRL's names: `max_completion_length`, `temperature`,
        `top_k`, `top_p`, `min_p`, `repetition_penalty`), with the given seed and log-prob request."""
        return cls(
            max_tokens=config.max_completion_length,
            temperature=config.temperature,
            top_k=config.top_k,
            top_p=config.top_p,
            min_p=config.min_p,
            repetition_penalty=config.repetition_penalty,
            seed=seed,
            num_logprobs=num_logprobs,
            return_sampling_mask=return_sampling_mask,
        )

    def with_seed(self, seed: int | None) -> SamplingParams:
        """These settings for one request with its own seed (a per-request seed makes it reproducible)."""
        return dataclasses.replace(self, seed=seed)


@dataclass(frozen=True, slots=True)
class ScoreResult:
    """Teacher-forced scores of `token_ids[prompt_length:]`: per completion position, the top-k (id, log-prob)
    pairs sorted by rank and the realised token's log-prob."""

    topk_ids: list[list[int]]
    topk_logprobs: list[list[float]]
    token_logprobs: list[float]


@dataclass(frozen=True, slots=True)
class EngineStats:
    """Load gauges read by the rollout side's concurrency controller (docs/algorithms.md §2.3.2)."""

    kv_cache_usage_frac: float
    num_running: int
    num_waiting: int
    num_preemptions: int  # cumulative
    kv_capacity_tokens: int
    max_model_len: int
    extra: dict[str, float] = field(default_factory=dict)


@runtime_checkable
class Engine(Protocol):
    async def generate(self, prompt_ids: list[int], sampling: SamplingParams) -> TurnRecord: ...

    async def score(
        self, token_ids: list[int], prompt_length: int, top_k: int, temperature: float = 1.0
    ) -> ScoreResult: ...

    async def pause(self) -> None: ...

    async def resume(self) -> None: ...

    async def load_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None: ...

    def stats(self) -> EngineStats: ...
