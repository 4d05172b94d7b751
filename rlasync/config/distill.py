"""`AsyncDistillationConfig`: TRL 1.16's field names and defaults for on-policy distillation (docs/algorithms.md §10.3, §11).

The run, optimisation, model, sampling and actor-system fields and their checks come from `TrainerConfig`
(`rlasync.config.base`), shared with `AsyncGRPOConfig`; this class adds the teachers, the loss and the distillation
worker's knobs, and keeps docs/algorithms.md §10.3's defaults where they differ from GRPO's (`lr_scheduler_type` stays
transformers' "linear"). Loaded the same way (`load_config(path, overrides,
config_class=AsyncDistillationConfig)`); dict-valued fields also accept a JSON object string.

Imports neither torch nor ray.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

from rlasync.config.base import TrainerConfig, _parse_json_dict, _positive_int

logger = logging.getLogger(__name__)

DEFAULT_TEACHER_SERVER_URLS = {"default": "http://localhost:8001"}


@dataclass
class AsyncDistillationConfig(TrainerConfig):
    """Configuration of asynchronous on-policy distillation (TRL's `AsyncDistillationConfig`, docs/algorithms.md §10.3)."""

    lr_scheduler_type: str = "linear"
    """Not overridden (transformers' linear decay): its horizon is `max_steps`, or the epoch ceiling
    ⌈num_train_epochs × len(dataset) / samples_per_step⌉ when `max_steps = -1`."""

    vllm_server_timeout: float = 240.0
    """Seconds to wait for the student server to become ready."""

    # ---- teachers ----
    teacher_server_urls: dict[str, str] | str | None = None
    """Teacher id -> teacher vLLM server URL (dict or JSON string); `None` -> {"default": "http://localhost:8001"}.
    More than one entry = multi-teacher (MOPD): each row's `teacher_id` column picks its teacher."""

    # ---- loss ----
    beta: float = 0.0
    """Generalised JSD interpolation in [0, 1]: 0 forward KL(T‖S), 1 reverse KL(S‖T)."""
    teacher_temperature: float = 1.0
    """Softmax temperature of the divergence, on both sides (teachers need `--logprobs-mode processed_logprobs`)."""
    teacher_top_k: int = 8
    """Teacher candidates per position (`prompt_logprobs`); > 20 needs the teacher's `--max-logprobs -1`;
    16-64 suggested for real runs."""
    add_tail_bucket: bool = True
    """Append an element holding the mass outside the reported support (else renormalise over the support)."""

    # ---- the distillation worker ----
    max_inflight_tasks: int = -1
    """Concurrent generate-and-score tasks; `< 0` -> max(max_staleness, 1) × B × GA × P."""
    heartbeat_stale_after_s: float = 300.0
    log_completions_steps: int = 100
    """Scored samples between two printed completions."""

    def _normalize(self) -> None:
        super()._normalize()
        self.teacher_server_urls = _parse_json_dict("teacher_server_urls", self.teacher_server_urls)
        if self.teacher_server_urls is None:
            self.teacher_server_urls = dict(DEFAULT_TEACHER_SERVER_URLS)

    def _validate(self) -> None:
        super()._validate()
        if self.eval_strategy != "no":
            raise ValueError(
                f"eval_strategy={self.eval_strategy!r} is not supported by distillation (evaluation during training "
                "measures the reward of AsyncGRPOTrainer's eval_dataset); leave eval_strategy='no'"
            )
        self._check_teachers()
        self._check_loss()

    def _check_teachers(self) -> None:
        if not self.teacher_server_urls:
            raise ValueError("teacher_server_urls must have at least one entry.")
        for teacher_id, url in self.teacher_server_urls.items():
            if not isinstance(teacher_id, str) or not teacher_id:
                raise ValueError(f"teacher_server_urls: teacher id {teacher_id!r} must be a non-empty string")
            if not isinstance(url, str) or not url.startswith(("http://", "https://")):
                raise ValueError(
                    f"teacher_server_urls[{teacher_id!r}]={url!r}: give the teacher server's base URL, "
                    "starting with http:// or https:// (e.g. http://localhost:8001)"
                )

    def _check_loss(self) -> None:
        if isinstance(self.beta, bool) or not isinstance(self.beta, int | float) or not 0.0 <= self.beta <= 1.0:
            raise ValueError(f"beta must be in [0.0, 1.0], got {self.beta}.")
        if not self.teacher_temperature > 0:
            raise ValueError(f"teacher_temperature={self.teacher_temperature}: must be > 0 (1.0 = the raw softmax)")
        value = self.teacher_top_k
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"teacher_top_k={value!r}: must be an integer >= 0 (the teacher's prompt_logprobs count)")
        if value > 20:
            logger.info("teacher_top_k=%d > 20: the teacher servers need --max-logprobs -1", value)

    def _check_async(self) -> None:
        super()._check_async()
        if self.max_inflight_tasks == 0:
            raise ValueError(
                "max_inflight_tasks=0: use a positive task count, or -1 for max(max_staleness, 1) × B × GA × P"
            )
        _positive_int(self, "log_completions_steps")
        if not self.heartbeat_stale_after_s > 0:
            raise ValueError(f"heartbeat_stale_after_s={self.heartbeat_stale_after_s}: must be > 0 seconds")

    # ---- derived values ----
    @property
    def teacher_ids(self) -> list[str]:
        """Teacher ids in dict order; their positions are the stable `teacher_id_idx` indices."""
        return list(self.teacher_server_urls or {})

    @property
    def num_teachers(self) -> int:
        return len(self.teacher_server_urls or {})

    @property
    def is_multi_teacher(self) -> bool:
        """More than one teacher: MOPD routing by each row's `teacher_id`."""
        return self.num_teachers > 1

    def resolved_max_inflight_tasks(self, num_processes: int = 1) -> int:
        """`max_inflight_tasks`, or max(max_staleness, 1) × B × GA × P when it is negative."""
        if self.max_inflight_tasks > 0:
            return self.max_inflight_tasks
        return max(self.max_staleness, 1) * self.samples_per_step(num_processes)

    def resolved_max_steps(self, dataset_size: int, num_processes: int = 1) -> int:
        """`max_steps`, or the epoch ceiling ⌈num_train_epochs × len(dataset) / samples_per_step⌉ (not inflated:
        it is the linear scheduler's decay horizon)."""
        if self.max_steps > 0:
            return self.max_steps
        return max(1, math.ceil(self.num_train_epochs * dataset_size / self.samples_per_step(num_processes)))


__all__ = ["DEFAULT_TEACHER_SERVER_URLS", "AsyncDistillationConfig"]
