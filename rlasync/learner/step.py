"""One optimisation step of asynchronous GRPO on tree-packed micro-batches (docs/algorithms.md §4.6, §5, §8).

    micro-batches of this rank ([PackedRow] x GA, one row per micro-batch)
      -> per row: tree forward + chunked head (rlasync.model) -> TokenScores [M]
      -> grpo_loss (rlasync.losses), normalised by the micro-batch's loss terms over all ranks and averaged over
         the GA micro-batches -> backward
      -> clip grad norm -> optimizer.step -> scheduler.step -> zero_grad

The step knows nothing of Ray or of how rows were planned: the learner actor (or a test) hands it this rank's rows
and the global loss-term counts. Distributed gradient averaging (FSDP2/DDP over P ranks) happens in backward;
`num_ranks` only enters the normaliser. Every metric is a float or a (numerator, denominator) pair reduced by
`rlasync.metrics` (docs/algorithms.md §8.1).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rlasync.config import AsyncGRPOConfig
from rlasync.config.base import TrainerConfig
from rlasync.losses import LossConfig, grpo_loss
from rlasync.losses.grpo_metrics import PendingMetrics, resolve_metrics
from rlasync.metrics import MetricSink, MetricValue, reduce_values
from rlasync.model import packed_row_to_tensors, packed_token_scores
from rlasync.model.row_shapes import pad_row_tensors, padded_length
from rlasync.model.tree_mask import resolve_backend

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


class LearnerStep:
    """Runs optimisation steps of one rank: `step(rows, global_terms) -> metrics`.

    `rows[i]` is this rank's PackedRow of micro-batch i; `global_terms[i]` is the number of loss terms of
    micro-batch i summed over all ranks (the docs/algorithms.md §5.2 normaliser). `temperature` divides the trainer's logits so the
    trainer's distribution matches the sampler's.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        loss_config: LossConfig,
        *,
        temperature: float = 1.0,
        max_grad_norm: float = 1.0,
        num_ranks: int = 1,
        device: torch.device | str = "cpu",
        clip_grad_norm: Callable[[float], torch.Tensor] | None = None,
        autocast_dtype: torch.dtype | None = None,
        row_bucket: int = 0,
    ) -> None:
        self.model = model
        self.row_bucket = row_bucket  # > 0: unique tokens padded to a multiple (static shapes, invisible padding)
        self.autocast_dtype = autocast_dtype  # mixed precision: float32 master weights, forward/backward in this
        self.optimizer = optimizer
        self.scheduler = scheduler
        self.loss_config = loss_config
        self.temperature = temperature
        self.max_grad_norm = max_grad_norm
        self.num_ranks = num_ranks
        self.device = torch.device(device)
        self._clip = clip_grad_norm or (
            lambda max_norm: torch.nn.utils.clip_grad_norm_(
                [p for p in model.parameters() if p.requires_grad], max_norm
            )
        )
        self.global_step = 0

    def step(
        self, rows: Sequence[Any], global_terms: Sequence[float], *, rate_pairs: bool = False
    ) -> dict[str, MetricValue]:
        """One optimizer step over this rank's rows. The loss metrics of the micro-batches are reduced by docs/algorithms.md §8.1;
        `rate_pairs=True` keeps rates as summed `(numerator, denominator)` pairs and all-NaN keys as NaN (the
        partial statistics `rlasync.learner.metrics.reduce_across_ranks` combines over ranks)."""
        if len(rows) != len(global_terms) or not rows:
            raise ValueError(f"step needs one global_terms entry per row, got {len(rows)} rows, {len(global_terms)}")
        self.model.train()
        sink = MetricSink()
        timer = RowTimer(self.device)
        pending, losses = [], []
        for row, terms in zip(rows, global_terms):  # nothing here waits for the device: rows queue back to back
            timer.start()
            loss, metrics = self._loss(row, terms, len(rows))
            timer.forward_done()
            loss.backward()
            timer.backward_done()
            pending.append(metrics)
            losses.append(loss.detach())
        records, loss_values = resolve_metrics(pending, *losses)  # the step's one read of its metrics
        fwd_s, fwd_bwd_s = timer.totals()
        total_loss = float(sum(loss_values))
        for metrics in records:
            sink.update(metrics)
        grad_norm, optimizer_s = apply_update(self)
        if rate_pairs:
            out = _partials(records)
        else:
            out = {k: v for k, v in sink.reduce().items() if v is not None}
        out.update(step_metrics(self, total_loss, grad_norm, fwd_s, fwd_bwd_s, optimizer_s, len(rows)))
        return out

    def _loss(self, row: Any, global_terms: float, grad_accum_steps: int) -> tuple[torch.Tensor, PendingMetrics]:
        backend = resolve_backend(getattr(self.model, "backend", "auto"), self.device)
        tensors = packed_row_to_tensors(row, self.device, segments=backend == "varlen")  # planned on the host
        num_samples = int(np.max(row.sample_index)) + 1 if len(row.sample_index) else 0  # host: no device read
        if self.row_bucket > 0:  # compiled layers see few shapes; the padding is invisible (docs/algorithms.md §5.5)
            tensors = pad_row_tensors(tensors, padded_length(tensors.num_tokens, self.row_bucket))
        dtype = self.autocast_dtype
        with torch.autocast(self.device.type, dtype=dtype or torch.bfloat16, enabled=dtype is not None):
            scores = packed_token_scores(self.model, tensors, temperature=self.temperature)
        return grpo_loss(
            scores.logprobs,
            tensors.sampler_logprobs,
            tensors.advantages,
            tensors.sample_index,
            config=self.loss_config,
            num_tokens_global=float(global_terms),
            num_ranks=self.num_ranks,
            grad_accum_steps=grad_accum_steps,
            entropy=scores.entropy.detach(),
            head_trainer_logprobs=scores.extra_logprobs,
            head_sampler_logprobs=tensors.sampler_topk_logprobs,
            num_samples=num_samples,
            defer_metrics=True,
        )

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


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
    """The end of an optimizer step shared by the learner steps (`step` has `optimizer`, `scheduler`, `_clip`,
    `max_grad_norm`, `_sync`, `global_step`): clip, optimizer step, scheduler step, zero the gradients. Returns
    (grad norm before clipping, seconds of clip + optimizer step)."""
    start = time.perf_counter()
    grad_norm = float(step._clip(step.max_grad_norm))
    step.optimizer.step()
    step._sync()
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


def _partials(records: Sequence[dict[str, MetricValue]]) -> dict[str, MetricValue]:
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
