"""`AsyncDistillationConfig`: TRL 1.16's field names and defaults for on-policy distillation (SPEC §10.3, §11).

A plain dataclass like `AsyncGRPOConfig`, loaded the same way (`load_config(path, overrides,
config_class=AsyncDistillationConfig)`), with validation in `__post_init__` naming the field and the fix.

Sharing with GRPO: `AsyncGRPOConfig` has no common base class (and GRPO-only fields such as `num_generations`,
`epsilon` or its `top_p`-needs-`top_k` rule do not apply here), so this config reuses `rlasync.config.grpo`'s
pieces by import instead: `ClusterConfig`, the dtype / scheduler choices, the JSON-dict parsing and the numeric
checks. The run/optimisation fields repeat GRPO's names and defaults except where SPEC §10.3 differs
(`lr_scheduler_type` stays transformers' "linear"; `vllm_server_timeout` is 240 s). If a shared base is ever
factored out of `grpo.py`, the run/model fields below are the part to move there.

Dict-valued fields also accept a JSON object string, from Python and through the YAML/`--set` loader alike (their
annotations include `str` so the loader passes the string on to `__post_init__`, which parses it).

Imports neither torch nor ray.
"""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, field
from typing import Any

from rlasync.config.grpo import (
    DTYPES,
    JSON_DICT_FIELDS,
    LR_SCHEDULERS,
    ClusterConfig,
    _at_least,
    _parse_json_dict,
    _positive_int,
)

logger = logging.getLogger(__name__)

DEFAULT_TEACHER_SERVER_URLS = {"default": "http://localhost:8001"}


@dataclass
class AsyncDistillationConfig:
    """Configuration of asynchronous on-policy distillation (TRL's `AsyncDistillationConfig`, SPEC §10.3)."""

    # ---- run and optimisation (TrainingArguments names) ----
    output_dir: str | None = None
    """Where checkpoints and `metrics.jsonl` go. `None` -> `trainer_output` (as transformers)."""
    run_name: str | None = None
    seed: int = 42
    per_device_train_batch_size: int = 8
    """Samples per rank per micro-batch (B) with a fixed-count batcher (`token_budget <= 0`)."""
    gradient_accumulation_steps: int = 1
    learning_rate: float = 1e-6
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0
    optim: str = "adamw_torch"
    lr_scheduler_type: str = "linear"
    """Not overridden (transformers' linear decay): its horizon is `max_steps`, or the epoch ceiling
    ⌈num_train_epochs × len(dataset) / samples_per_step⌉ when `max_steps = -1`."""
    lr_scheduler_kwargs: dict[str, Any] | str | None = None
    warmup_steps: float = 0
    num_train_epochs: float = 3.0
    max_steps: int = -1
    logging_steps: int = 1
    save_steps: int = 500
    save_total_limit: int | None = None
    report_to: str | list[str] = "none"
    bf16: bool | None = None
    """Mixed precision in bf16; `None` -> True unless `fp16` (TRL's default)."""
    fp16: bool = False
    gradient_checkpointing: bool = True
    gradient_checkpointing_kwargs: dict[str, Any] | str | None = None
    ignore_data_skip: bool = True
    """Forced True: resume continues at the first untrained prompt."""
    use_liger_kernel: bool = False

    # ---- student model ----
    model_init_kwargs: dict[str, Any] | str | None = None
    """Keyword arguments for the student's `from_pretrained` (dict or JSON string); its `dtype` wins over `dtype`."""
    dtype: str = "float32"
    """Student dtype: one of auto, bfloat16, float16, float32 (teachers are unaffected)."""
    trust_remote_code: bool = False

    # ---- student generation ----
    max_completion_length: int = 2048
    """`max_tokens` of each student request."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0 disables top-k."""
    min_p: float | None = None
    repetition_penalty: float = 1.0
    chat_template_kwargs: dict[str, Any] | str | None = None
    vllm_server_base_url: str = "http://localhost:8000"
    """Student server (generation and weight updates)."""
    vllm_server_timeout: float = 240.0
    """Seconds to wait for the student server to become ready."""

    # ---- teachers ----
    teacher_server_urls: dict[str, str] | str | None = None
    """Teacher id -> teacher vLLM server URL (dict or JSON string); `None` -> {"default": "http://localhost:8001"}.
    More than one entry = multi-teacher (MOPD): each row's `teacher_id` column picks its teacher."""
    request_timeout: float = 600
    """Seconds per HTTP request (student or teacher)."""
    weight_sync_timeout: float = 1800

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

    # ---- batching and asynchrony ----
    token_budget: int | None = None
    """Raw tokens per packed row; `None` -> the student server's `max_model_len`; `<= 0` -> a fixed count of
    `per_device_train_batch_size` samples per rank."""
    max_inflight_tasks: int = -1
    """Concurrent generate-and-score tasks; `< 0` -> max(max_staleness, 1) × B × GA × P."""
    max_staleness: int = 4
    queue_maxsize: int = 1024
    weight_sync_steps: int = 1
    heartbeat_stale_after_s: float = 300.0
    log_completions: bool = False
    log_completions_steps: int = 100
    """Scored samples between two printed completions."""
    num_completions_to_print: int | None = None

    # ---- actor system (rlasync) ----
    cluster: ClusterConfig = field(default_factory=ClusterConfig)

    def __post_init__(self) -> None:
        for name in JSON_DICT_FIELDS:
            setattr(self, name, _parse_json_dict(name, getattr(self, name)))
        self.teacher_server_urls = _parse_json_dict("teacher_server_urls", self.teacher_server_urls)
        if self.teacher_server_urls is None:
            self.teacher_server_urls = dict(DEFAULT_TEACHER_SERVER_URLS)
        if isinstance(self.report_to, str):
            self.report_to = [] if self.report_to in ("none", "") else [self.report_to]
        if self.bf16 is None:
            self.bf16 = not self.fp16
        if isinstance(self.cluster, dict):
            self.cluster = ClusterConfig(**self.cluster)
        if self.output_dir is None:
            self.output_dir = "trainer_output"
        self._check_run()
        self._check_sampling()
        self._check_teachers()
        self._check_loss()
        self._check_async()

    # One rule group per method; each error names the field and the fix.
    def _check_run(self) -> None:
        for name in ("per_device_train_batch_size", "gradient_accumulation_steps", "logging_steps", "save_steps"):
            _positive_int(self, name)
        for name in ("learning_rate", "weight_decay", "max_grad_norm", "warmup_steps"):
            _at_least(self, name, 0.0)
        if self.max_steps == 0 or self.max_steps < -1:
            raise ValueError(f"max_steps={self.max_steps}: use a positive step count, or -1 to run num_train_epochs")
        if self.max_steps == -1 and not self.num_train_epochs > 0:
            raise ValueError(f"num_train_epochs={self.num_train_epochs} with max_steps=-1: set one of them positive")
        if self.lr_scheduler_type not in LR_SCHEDULERS:
            raise ValueError(f"lr_scheduler_type={self.lr_scheduler_type!r}: choose one of {', '.join(LR_SCHEDULERS)}")
        if self.bf16 and self.fp16:
            raise ValueError("bf16=True and fp16=True: choose one mixed-precision mode")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}: choose one of {', '.join(DTYPES)}")
        if self.use_liger_kernel:
            raise NotImplementedError("use_liger_kernel=True: Liger kernels are not supported; set use_liger_kernel=False")
        if not self.ignore_data_skip:
            logger.warning("ignore_data_skip=False is ignored: resume continues at the first untrained prompt")
            self.ignore_data_skip = True

    def _check_sampling(self) -> None:
        _positive_int(self, "max_completion_length")
        if not self.temperature > 0:
            raise ValueError(f"temperature={self.temperature}: must be > 0 (use a small value such as 1e-3 for near-greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p}: must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k}: must be >= 0 (0 disables top-k)")
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p={self.min_p}: must be in [0, 1]")
        if not self.repetition_penalty > 0:
            raise ValueError(f"repetition_penalty={self.repetition_penalty}: must be > 0 (1.0 disables it)")
        for name in ("vllm_server_timeout", "request_timeout", "weight_sync_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)}: must be > 0 seconds")

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
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness={self.max_staleness}: must be >= 0 (0 = fully on-policy)")
        if self.max_inflight_tasks == 0:
            raise ValueError("max_inflight_tasks=0: use a positive task count, or -1 for max(max_staleness, 1) × B × GA × P")
        for name in ("queue_maxsize", "weight_sync_steps", "log_completions_steps"):
            _positive_int(self, name)
        if not self.heartbeat_stale_after_s > 0:
            raise ValueError(f"heartbeat_stale_after_s={self.heartbeat_stale_after_s}: must be > 0 seconds")
        if self.num_completions_to_print is not None and self.num_completions_to_print < 0:
            raise ValueError(f"num_completions_to_print={self.num_completions_to_print}: must be >= 0 or None")

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

    def samples_per_step(self, num_processes: int = 1) -> int:
        """B × GA × P: samples per optimizer step."""
        return self.per_device_train_batch_size * self.gradient_accumulation_steps * num_processes

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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


__all__ = ["DEFAULT_TEACHER_SERVER_URLS", "AsyncDistillationConfig"]
