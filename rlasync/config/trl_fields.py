"""TrainingArguments' fields that TRL 1.16's `AsyncGRPOConfig` / `AsyncDistillationConfig` inherit and the core of
rlasync has no use for: each is accepted with TRL's default (so that a TRL config, a TRL YAML file or a
`TrlParser` command line builds unchanged) and is either honoured or refused, never silently ignored:

- honoured where it is cheap: `save_strategy` ("steps", or "no": no periodic checkpoints, the final one is still
  written), `logging_first_step`, `push_to_hub` / `hub_model_id` (`trainer.push_to_hub()` at the end, offline: a
  local folder), `resume_from_checkpoint` (`train()`'s default), `log_level` (the `rlasync` loggers), `do_train`
  (transformers' Trainer does not read it either), `disable_tqdm` (read by the console progress callbacks),
  `torch_compile` / `torch_compile_backend` / `torch_compile_mode` (the learner compiles each decoder layer;
  setting a backend or mode turns `torch_compile` on, as in transformers; unset, rlasync's default and the one
  default that differs from TRL's on purpose, means "auto": compiled on CUDA, eager on the CPU), `eval_strategy` /
  `eval_steps`
  (evaluation during training on the trainer's `eval_dataset`: rlasync.driver.evaluation);
- refused: any other value than the default raises `ValueError` at config time, naming the field, saying that it
  is not supported and what to use instead (`UNSUPPORTED`).

`tests/data/trl_1_16_config_fields.json` (written by `tools/trl_config_fields.py`) lists TRL's fields and defaults;
`tests/unit/config/test_trl_fields.py` checks that every one of them exists here with that default.
Imports nothing else from rlasync.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

_EVAL = (
    "rlasync evaluates held-out reward with eval_dataset= and eval_strategy / eval_steps (num_generations_eval); "
    "the other evaluation settings of transformers' Trainer have no counterpart"
)
_ACCEL = "rlasync places and distributes the model itself (actors, FSDP2 over `cluster.num_learners`)"
_DATA = "prompts reach the rollout actors through the StalenessQueue, not a DataLoader; leave it at the default"
_HUB = "push_to_hub writes to a local folder (no network); leave it at the default"

UNSUPPORTED: dict[str, str] = {
    "accelerator_config": _ACCEL,
    "activation_checkpointing": "use gradient_checkpointing (True by default)",
    "activation_checkpointing_kwargs": "use gradient_checkpointing_kwargs={'use_reentrant': ...}",
    "auto_find_batch_size": "the token_budget planner sizes the rows; set token_budget",
    "average_tokens_across_devices": "the GRPO loss is always normalised over the tokens of every rank",
    "batch_eval_metrics": _EVAL,
    "bf16_full_eval": _EVAL,
    "data_seed": "the prompt order follows `seed`; set seed",
    "dataloader_drop_last": _DATA,
    "dataloader_in_order": _DATA,
    "dataloader_multiprocessing_context": _DATA,
    "dataloader_num_workers": _DATA,
    "dataloader_persistent_workers": _DATA,
    "dataloader_pin_memory": _DATA,
    "dataloader_prefetch_factor": _DATA,
    "ddp_backend": _ACCEL + "; the training group uses NCCL on GPUs, gloo on the CPU",
    "ddp_broadcast_buffers": _ACCEL,
    "ddp_bucket_cap_mb": _ACCEL,
    "ddp_find_unused_parameters": _ACCEL,
    "ddp_static_graph": _ACCEL,
    "ddp_timeout": "set cluster.collective_timeout_s (every collective is bounded by it)",
    "debug": "not supported; leave debug=''",
    "deepspeed": _ACCEL + "; DeepSpeed is not supported",
    "do_eval": _EVAL,
    "do_predict": _EVAL,
    "enable_jit_checkpoint": "not supported; checkpoints are written every save_steps",
    "eval_accumulation_steps": _EVAL,
    "eval_delay": _EVAL,
    "eval_do_concat_batches": _EVAL,
    "eval_on_start": _EVAL,
    "eval_use_gather_object": _EVAL,
    "fp16_full_eval": _EVAL,
    "fsdp": _ACCEL + "; FSDP2 is used whenever cluster.num_learners > 1",
    "fsdp_config": _ACCEL,
    "full_determinism": "asynchronous rollouts are not deterministic; set seed for the seeded parts",
    "greater_is_better": _EVAL,
    "hub_always_push": _HUB,
    "hub_private_repo": _HUB,
    "hub_revision": _HUB,
    "hub_strategy": _HUB,
    "hub_token": _HUB,
    "include_for_metrics": _EVAL,
    "include_num_input_tokens_seen": "`num_tokens` (forwarded tokens so far) is always logged",
    "label_names": "not used by RL trainers; leave label_names=None",
    "label_smoothing_factor": "not used by RL trainers; leave it at 0.0",
    "length_column_name": "not used (no group_by_length); leave it at the default",
    "liger_kernel_config": "Liger kernels are not supported (the chunked LM head covers the memory side)",
    "load_best_model_at_end": _EVAL,
    "local_rank": "the learner ranks are Ray actors; set cluster.num_learners",
    "log_level_replica": "only the driver logs; use log_level",
    "log_on_each_node": "only the driver logs; use log_level",
    "logging_nan_inf_filter": "NaN values are always dropped from a logged window",
    "logging_strategy": "only 'steps' is supported; set logging_steps",
    "metric_for_best_model": _EVAL,
    "neftune_noise_alpha": "NEFTune is an SFT technique, not supported here",
    "optim_target_modules": "only for GaLore-style optimizers, which are not supported",
    "parallelism_config": _ACCEL,
    "per_device_eval_batch_size": _EVAL,
    "prediction_loss_only": _EVAL,
    "project": "trackio is not supported; use report_to='tensorboard' or 'wandb'",
    "restore_callback_states_from_checkpoint": "callback states are not checkpointed; leave it False",
    "save_on_each_node": "the learner rank 0 writes every checkpoint; leave it False",
    "save_only_model": "checkpoints always hold the optimizer and rollout state (needed to resume)",
    "skip_memory_metrics": "memory metrics are not collected; leave it True",
    "tf32": "TF32 matmuls cannot be switched from the config (the learner is another process); use bf16=True",
    "torch_empty_cache_steps": "not supported; the learner frees its step buffers itself",
    "trackio_bucket_id": "trackio is not supported; use report_to='tensorboard' or 'wandb'",
    "trackio_space_id": "trackio is not supported; use report_to='tensorboard' or 'wandb'",
    "trackio_static_space_id": "trackio is not supported; use report_to='tensorboard' or 'wandb'",
    "train_sampling_strategy": "prompts are dispatched in a seeded shuffled order per epoch; leave it 'random'",
    "use_cache": "the learner never uses a KV cache (the engines have their own); leave it False",
    "use_cpu": "set cluster.learner_num_gpus=0 and cluster.generation_num_gpus=0 to run on the CPU",
}

LOG_LEVELS = ("passive", "debug", "info", "warning", "error", "critical")
SAVE_STRATEGIES = ("steps", "no")
EVAL_STRATEGIES = ("no", "steps", "epoch")
COMPILE_MODES = (None, "default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
"""`torch_compile_mode` values (`torch.compile`'s modes; rlasync.model.loading.COMPILE_MODES)."""


@dataclass
class TrainingArgumentsFields:
    """transformers' `TrainingArguments` fields of TRL 1.16's async configs that rlasync does not list elsewhere,
    with TRL's defaults (see the module docstring for which are honoured)."""

    # ---- honoured ----
    do_train: bool = False
    """Not read (as in transformers' Trainer, which leaves it to scripts)."""
    save_strategy: str = "steps"
    """"steps": a checkpoint every `save_steps`; "no": only the final one (which `trainer.model` loads)."""
    logging_first_step: bool = False
    """Log a window after the first step as well."""
    push_to_hub: bool = False
    """At the end of `train()`, `trainer.push_to_hub()`: offline, the final model goes to a local folder."""
    hub_model_id: str | None = None
    """`push_to_hub`'s target: a local path, or a hub id (written under `<output_dir>/hub/<hub_model_id>`)."""
    resume_from_checkpoint: str | None = None
    eval_strategy: str = "no"
    """Evaluation during training on the trainer's `eval_dataset` (rlasync.driver.evaluation): "no", "steps" (every
    `eval_steps`) or "epoch" (after every epoch)."""
    eval_steps: float | None = None
    """Steps between evaluations with eval_strategy="steps"; None: `logging_steps`; a fraction in (0, 1): of
    `max_steps` (transformers' rules)."""
    torch_compile: bool | None = None
    """Compile each decoder layer of the learner (regional `torch.compile`; a compile failure falls back to eager
    layers with one warning). None (the default; TRL's is False, on purpose: the compiled learner is twice as fast
    on a GPU) means "auto": compiled on CUDA, eager on the CPU (rlasync.model.compilation); True / False as in TRL.
    Inductor's cache is kept across runs under `<RLASYNC_CACHE>/inductor`."""
    torch_compile_backend: str | None = None
    """`torch.compile`'s backend (None: inductor); setting it turns `torch_compile` on."""
    torch_compile_mode: str | None = None
    """`torch.compile`'s mode ("reduce-overhead": CUDA graphs over the compiled layers); setting it turns
    `torch_compile` on."""
    """`train()`'s default `resume_from_checkpoint`."""
    log_level: str = "passive"
    """Level of the `rlasync` loggers ("passive": leave them as they are)."""
    disable_tqdm: bool | None = None
    """Disables transformers' `ProgressCallback` (and rlasync's console progress) when True."""
    optim_args: str | None = None
    """Extra optimizer keyword arguments, "k1=v1,k2=v2" (as transformers)."""

    # ---- refused unless left at the default (UNSUPPORTED says what to use instead) ----
    accelerator_config: Any = None
    activation_checkpointing: Any = None
    activation_checkpointing_kwargs: Any = None
    auto_find_batch_size: bool = False
    average_tokens_across_devices: bool = True
    batch_eval_metrics: bool = False
    bf16_full_eval: bool = False
    data_seed: int | None = None
    dataloader_drop_last: bool = False
    dataloader_in_order: bool = True
    dataloader_multiprocessing_context: str | None = None
    dataloader_num_workers: int = 0
    dataloader_persistent_workers: bool = False
    dataloader_pin_memory: bool = True
    dataloader_prefetch_factor: int | None = None
    ddp_backend: str | None = None
    ddp_broadcast_buffers: bool | None = None
    ddp_bucket_cap_mb: int | None = None
    ddp_find_unused_parameters: bool | None = None
    ddp_static_graph: bool | None = None
    ddp_timeout: int = 1800
    debug: str | list[Any] = ""
    deepspeed: Any = None
    do_eval: bool = False
    do_predict: bool = False
    enable_jit_checkpoint: bool = False
    eval_accumulation_steps: int | None = None
    eval_delay: float = 0
    eval_do_concat_batches: bool = True
    eval_on_start: bool = False
    eval_use_gather_object: bool = False
    fp16_full_eval: bool = False
    fsdp: Any = None
    fsdp_config: Any = None
    full_determinism: bool = False
    greater_is_better: bool | None = None
    hub_always_push: bool = False
    hub_private_repo: bool | None = None
    hub_revision: str | None = None
    hub_strategy: str = "every_save"
    hub_token: str | None = None
    include_for_metrics: list[str] = field(default_factory=list)
    include_num_input_tokens_seen: str | bool = "no"
    label_names: list[str] | None = None
    label_smoothing_factor: float = 0.0
    length_column_name: str = "length"
    liger_kernel_config: dict[str, Any] | None = None
    load_best_model_at_end: bool = False
    local_rank: int = -1
    log_level_replica: str = "warning"
    log_on_each_node: bool = True
    logging_nan_inf_filter: bool = True
    logging_strategy: str = "steps"
    metric_for_best_model: str | None = None
    neftune_noise_alpha: float | None = None
    optim_target_modules: Any = None
    parallelism_config: Any = None
    per_device_eval_batch_size: int = 8
    prediction_loss_only: bool = False
    project: str = "huggingface"
    restore_callback_states_from_checkpoint: bool = False
    save_on_each_node: bool = False
    save_only_model: bool = False
    skip_memory_metrics: bool = True
    tf32: bool | None = None
    torch_empty_cache_steps: int | None = None
    trackio_bucket_id: str | None = None
    trackio_space_id: str | None = None
    trackio_static_space_id: str | None = None
    train_sampling_strategy: str = "random"
    use_cache: bool = False
    use_cpu: bool = False


def _unset(value: Any, default: Any) -> bool:
    """An "off" value where the default is unset (None, "" or []): e.g. TrainingArguments' `debug=[]`,
    `tf32=False`, `include_num_input_tokens_seen=False` mean what the default means."""
    if default in (None, "", []) or default == "no":
        return value in (None, "", [], False, "no")
    return False


def _enum_value(value: Any) -> Any:
    """transformers' enums (IntervalStrategy, SaveStrategy, ...) compare by their string value."""
    return getattr(value, "value", value)


def check_training_arguments(config: TrainingArgumentsFields) -> None:
    """Refuse a non-default value of every `UNSUPPORTED` field, check the honoured ones, apply `log_level`."""
    defaults = {
        name: f.default_factory() if callable(f.default_factory) else f.default  # type: ignore[misc]
        for name, f in TrainingArgumentsFields.__dataclass_fields__.items()
    }
    for name, fix in UNSUPPORTED.items():
        value = _enum_value(getattr(config, name))
        if value == defaults[name] or _unset(value, defaults[name]):
            continue
        raise ValueError(f"{name}={value!r} is not supported by rlasync: {fix} (default {defaults[name]!r})")
    if config.torch_compile_mode not in COMPILE_MODES:
        raise ValueError(
            f"torch_compile_mode={config.torch_compile_mode!r}: use one of {', '.join(map(str, COMPILE_MODES))}"
        )
    if config.torch_compile == "auto":  # a YAML / command-line spelling of the default
        config.torch_compile = None
    if config.torch_compile not in (None, True, False):
        raise ValueError(
            f"torch_compile={config.torch_compile!r}: use true (compile), false (eager) or leave it unset "
            "(auto: compiled on CUDA, eager on the CPU)"
        )
    if config.torch_compile_backend is not None or config.torch_compile_mode is not None:
        config.torch_compile = True  # transformers' rule: a backend or mode asks for compilation
    config.save_strategy = _enum_value(config.save_strategy)
    if config.save_strategy not in SAVE_STRATEGIES:
        raise ValueError(
            f"save_strategy={config.save_strategy!r} is not supported: use 'steps' (every save_steps) or 'no' "
            "(only the final checkpoint)"
        )
    config.eval_strategy = _enum_value(config.eval_strategy)
    if config.eval_strategy not in EVAL_STRATEGIES:
        raise ValueError(
            f"eval_strategy={config.eval_strategy!r}: use one of {', '.join(map(repr, EVAL_STRATEGIES))} "
            "(with eval_dataset= given to the trainer)"
        )
    if config.eval_steps is not None and not config.eval_steps > 0:
        raise ValueError(
            f"eval_steps={config.eval_steps}: use a step count >= 1, a fraction of max_steps in (0, 1), or None "
            "(then logging_steps)"
        )
    config.log_level = _enum_value(config.log_level)
    if config.log_level not in LOG_LEVELS:
        raise ValueError(f"log_level={config.log_level!r}: choose one of {', '.join(LOG_LEVELS)}")
    if config.log_level != "passive":
        logging.getLogger("rlasync").setLevel(config.log_level.upper())
    if config.optim_args is not None:
        parse_optim_args(config.optim_args)
    if config.hub_model_id is not None and not config.hub_model_id:
        raise ValueError("hub_model_id='': give a hub id (org/name) or a local path, or leave it None")


def parse_optim_args(text: str) -> dict[str, Any]:
    """transformers' `optim_args` string "k1=v1,k2=v2" -> keyword arguments (numbers and booleans converted)."""
    out: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in str(text).split(","))):
        key, sep, raw = part.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"optim_args={text!r}: write it as 'key=value,key2=value2' (got {part!r})")
        out[key.strip()] = _literal(raw.strip())
    return out


def _literal(raw: str) -> Any:
    if raw.lower() in ("true", "false"):
        return raw.lower() == "true"
    for cast in (int, float):
        try:
            return cast(raw)
        except ValueError:
            pass
    return raw


__all__ = [
    "EVAL_STRATEGIES",
    "LOG_LEVELS",
    "SAVE_STRATEGIES",
    "UNSUPPORTED",
    "TrainingArgumentsFields",
    "check_training_arguments",
    "parse_optim_args",
]
