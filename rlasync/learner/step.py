"""What every learner step core shares (docs/algorithms.md §8): the optimizer settings and their construction, the
rows' forward/backward timer, the end of an optimizer step (clip, step, schedule, zero), the per-step scalars, and
the reduction of the micro-batches' partial metrics. The step cores themselves live with their algorithms
(`rlasync.algorithms.grpo.learner_step.GrpoLearnerStep`, `rlasync.algorithms.distill.learner_step`).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from rlasync.config import AsyncGRPOConfig
from rlasync.config.base import TrainerConfig
from rlasync.metrics import MetricValue, reduce_values

_DEFAULTS = {f.name: f.default for f in dataclasses.fields(AsyncGRPOConfig)}  # one place for the defaults


@dataclass(frozen=True)
class OptimizerSettings:
    """AdamW and the learning-rate schedule: the optimizer's slice of `AsyncGRPOConfig` (same names, same defaults)."""

    learning_rate: float = _DEFAULTS["learning_rate"]
    weight_decay: float = _DEFAULTS["weight_decay"]
    adam_beta1: float = _DEFAULTS["adam_beta1"]
    adam_beta2: float = _DEFAULTS["adam_beta2"]
    adam_epsilon: float = _DEFAULTS["adam_epsilon"]
    max_grad_norm: float = _DEFAULTS["max_grad_norm"]
    lr_scheduler_type: str = _DEFAULTS["lr_scheduler_type"]
    lr_scheduler_kwargs: dict[str, Any] | None = _DEFAULTS["lr_scheduler_kwargs"]
    warmup_steps: float = _DEFAULTS["warmup_steps"]
    max_steps: int = _DEFAULTS["max_steps"]
    optim: str = _DEFAULTS["optim"]
    """transformers' optimizer name (`rlasync.config.base.OPTIMIZERS`)."""
    optim_args: dict[str, Any] | None = None
    optimizer_cls: type | None = None
    """The trainer's `optimizers=(cls, ...)`: this torch optimizer class instead of `optim`."""
    optimizer_kwargs: dict[str, Any] | None = None
    """Its keyword arguments (else lr / weight_decay from the config)."""
    scheduler_factory: Callable[[Any], Any] | None = None
    """The trainer's `optimizers=(..., fn)`: `fn(optimizer)` builds the scheduler instead of `lr_scheduler_type`."""

    @classmethod
    def from_config(cls, config: TrainerConfig) -> OptimizerSettings:
        """The optimizer fields of an `AsyncGRPOConfig` / `AsyncDistillationConfig` (same names; the config has
        already parsed `lr_scheduler_kwargs` from JSON)."""
        return cls(
            learning_rate=config.learning_rate,
            weight_decay=config.weight_decay,
            adam_beta1=config.adam_beta1,
            adam_beta2=config.adam_beta2,
            adam_epsilon=config.adam_epsilon,
            max_grad_norm=config.max_grad_norm,
            lr_scheduler_type=config.lr_scheduler_type,
            lr_scheduler_kwargs=config.lr_scheduler_kwargs,  # type: ignore[arg-type]
            warmup_steps=config.warmup_steps,
            max_steps=config.max_steps,
            optim=config.optim,
            optim_args=config.optimizer_kwargs() or None,
        )


def build_optimizer(model: torch.nn.Module, settings: OptimizerSettings) -> tuple[torch.optim.Optimizer, Any]:
    """AdamW over trainable parameters and the transformers scheduler named by `lr_scheduler_type`."""
    from transformers import get_scheduler

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = _make_optimizer(params, settings)
    if settings.scheduler_factory is not None:
        return optimizer, settings.scheduler_factory(optimizer)
    total = settings.max_steps if settings.max_steps > 0 else None
    if total is None and settings.lr_scheduler_type not in ("constant", "constant_with_warmup"):
        raise ValueError(
            f"lr_scheduler_type={settings.lr_scheduler_type!r} decays over max_steps, but max_steps=-1 (the sample "
            "stream has no known length): set max_steps, or use lr_scheduler_type='constant'"
        )
    warmup = settings.warmup_steps
    if 0 < warmup < 1:
        if total is None:
            raise ValueError("warmup_steps in (0, 1) is a fraction of max_steps: set max_steps or give whole steps")
        warmup = math.ceil(warmup * total)
    scheduler = get_scheduler(
        settings.lr_scheduler_type,
        optimizer,
        num_warmup_steps=int(warmup),
        num_training_steps=total,
        scheduler_specific_kwargs=settings.lr_scheduler_kwargs or {},
    )
    return optimizer, scheduler


def _make_optimizer(params: list[torch.nn.Parameter], settings: OptimizerSettings) -> torch.optim.Optimizer:
    """The trainer's optimizer class, else transformers' `optim` name as TrainingArguments builds it."""
    extra = dict(settings.optim_args or {})
    if settings.optimizer_cls is not None:
        kwargs = (
            settings.optimizer_kwargs
            if settings.optimizer_kwargs is not None
            else {"lr": settings.learning_rate, "weight_decay": settings.weight_decay}
        )
        return settings.optimizer_cls(params, **{**kwargs, **extra})
    lr, wd = settings.learning_rate, settings.weight_decay
    if settings.optim in ("adamw_torch", "adamw_torch_fused"):
        adam = {
            "lr": lr,
            "betas": (settings.adam_beta1, settings.adam_beta2),
            "eps": settings.adam_epsilon,
            "weight_decay": wd,
        }
        if settings.optim == "adamw_torch_fused":
            adam["fused"] = True
        return torch.optim.AdamW(params, **{**adam, **extra})
    if settings.optim == "adafactor":
        from transformers.optimization import Adafactor

        kwargs = {"lr": lr, "weight_decay": wd, "scale_parameter": False, "relative_step": False}
        return Adafactor(params, **{**kwargs, **extra})
    classes = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad, "rmsprop": torch.optim.RMSprop}
    if settings.optim not in classes:
        raise ValueError(f"optim={settings.optim!r}: not an optimizer the learner builds")
    return classes[settings.optim](params, **{"lr": lr, "weight_decay": wd, **extra})


class RowTimer:
    """The rows' forward and forward+backward seconds without waiting for the device between rows: CUDA events
    on a GPU (read in `totals()`, after the step's metrics were read), the host clock elsewhere."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.starts: list[Any] = []
        self.forwards: list[Any] = []
        self.backwards: list[Any] = []

    def _now(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def start(self) -> None:
        self.starts.append(self._now())

    def forward_done(self) -> None:
        self.forwards.append(self._now())

    def backward_done(self) -> None:
        self.backwards.append(self._now())

    def totals(self) -> tuple[float, float]:
        if self.cuda and self.backwards:
            self.backwards[-1].synchronize()
        return self._seconds(self.forwards), self._seconds(self.backwards)

    def _seconds(self, ends: list[Any]) -> float:
        if self.cuda:
            return sum(start.elapsed_time(end) for start, end in zip(self.starts, ends)) / 1e3
        return sum(end - start for start, end in zip(self.starts, ends))


def apply_update(step: Any) -> tuple[float, float]:
    """The end of an optimizer step shared by the learner steps (`step` has `optimizer`, `scheduler`,
    `clip_grad_norm`, `max_grad_norm`, `sync`, `global_step`): clip, optimizer step, scheduler step, zero the gradients. Returns
    (grad norm before clipping, seconds of clip + optimizer step)."""
    start = time.perf_counter()
    grad_norm = float(step.clip_grad_norm(step.max_grad_norm))
    step.optimizer.step()
    step.sync()
    optimizer_s = time.perf_counter() - start
    step.scheduler.step()
    step.optimizer.zero_grad(set_to_none=True)
    step.global_step += 1
    return grad_norm, optimizer_s


def step_metrics(
    step: Any, total_loss: float, grad_norm: float, fwd_s: float, fwd_bwd_s: float, optimizer_s: float, num_rows: int
) -> dict[str, MetricValue]:
    """The per-step scalars every learner step logs (TRL's names and docs/algorithms.md §8's perf keys)."""
    return {
        "loss": total_loss,
        "grad_norm": grad_norm,
        "learning_rate": float(step.scheduler.get_last_lr()[0]),
        "perf/fwd_s": fwd_s,
        "perf/fwd_bwd_s": fwd_bwd_s,
        "perf/optimizer_s": optimizer_s,
        "batch/microbatches_per_step": float(num_rows),
    }


def partial_metrics(records: Sequence[dict[str, MetricValue]]) -> dict[str, MetricValue]:
    """Micro-batch metrics of one step: rate pairs summed, floats reduced by their rule, all-NaN kept as NaN."""
    values: dict[str, list[MetricValue]] = {}
    for record in records:
        for key, value in record.items():
            values.setdefault(key, []).append(value)
    out: dict[str, MetricValue] = {}
    for key, seen in values.items():
        if isinstance(seen[0], tuple):
            out[key] = (sum(float(v[0]) for v in seen), sum(float(v[1]) for v in seen))  # type: ignore[index]
        else:
            reduced = reduce_values(key, seen)
            out[key] = math.nan if reduced is None else reduced
    return out
