"""One optimisation step of asynchronous GRPO on tree-packed micro-batches (docs/algorithms.md §4.6, §5, §8).

    micro-batches of this rank ([PackedRow] x GA, one row per micro-batch)
      -> per row: tree forward + chunked head (rlasync.model) -> TokenScores [M]
      -> grpo_loss (rlasync.algorithms.grpo.loss), normalised by the micro-batch's loss terms over all ranks and averaged over
         the GA micro-batches -> backward
      -> clip grad norm -> optimizer.step -> scheduler.step -> zero_grad

The step knows nothing of Ray or of how rows were planned: the learner actor (or a test) hands it this rank's rows
and the global loss-term counts. Distributed gradient averaging (FSDP2/DDP over P ranks) happens in backward;
`num_ranks` only enters the normaliser. Every metric is a float or a (numerator, denominator) pair reduced by
`rlasync.metrics` (docs/algorithms.md §8.1).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from rlasync.algorithms.grpo.loss import LossConfig, grpo_loss
from rlasync.algorithms.grpo.loss_metrics import PendingMetrics, resolve_metrics
from rlasync.learner.step import RowTimer, apply_update, partial_metrics, step_metrics
from rlasync.metrics import MetricSink, MetricValue
from rlasync.model import packed_row_to_tensors, packed_token_scores
from rlasync.model.row_shapes import pad_row_tensors, padded_length
from rlasync.model.tree_mask import resolve_backend


class GrpoLearnerStep:
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
        self.clip_grad_norm = clip_grad_norm or (
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
            out = partial_metrics(records)
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

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


__all__ = ["GrpoLearnerStep"]
