"""One optimisation step of on-policy distillation on plain padding-free rows (docs/algorithms.md §9.3, §9.5, §8.4).

    micro-batches of this rank (one collated row each: `rlasync.algorithms.distill.collate_rows(...)`, row `rank`)
      -> distill_row_tensors: padding stripped; each sample is a chain, so the row is a forest and the tree attention
         of the GRPO path masks it block-diagonally (subtree_end = the end of the token's sample)
      -> DistillScorer: decoder -> hidden [L, H] -> `distillation_row_loss` with the LM head weight (chunked,
         checkpointed), normalised by the micro-batch's completion tokens over all ranks / GA -> backward
      -> clip grad norm -> optimizer.step -> scheduler.step -> zero_grad
      -> the statistics tensor summed over micro-batches, reduced over ranks (`reduce_stats`, a SUM all-reduce from
         the caller), turned into `jsd`, `entropy`, `teacher_entropy` (+ MOPD `teacher_*/<id>`)

`DistillScorer` is a `TreeScorer` (same `model.` attribute, so checkpoints and optimizer keys are the GRPO ones and
`shard_for_training(model, scorer_cls=DistillScorer)` makes it the FSDP2 root: one root forward gathers the
embedding, final norm and head weight the loss reads). No Ray.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rlasync.algorithms.distill.loss import DistillLossConfig, distillation_metrics, distillation_row_loss, num_stats
from rlasync.learner.step import RowTimer, apply_update, partial_metrics, step_metrics
from rlasync.metrics import MetricSink, MetricValue
from rlasync.model.attention import build_tree_attention, sliding_windows
from rlasync.model.devices import to_device
from rlasync.model.forward import TreeScorer
from rlasync.model.head import LogitTransform
from rlasync.model.segment_attention import SegmentPlan, segment_plan

ReduceStats = Callable[[torch.Tensor], torch.Tensor]
"""`stats -> stats summed over ranks` (float64, any device in, same shape out)."""


@dataclass(frozen=True)
class DistillRowTensors:
    """One rank's row of a collated micro-batch, padding stripped, on one device (L raw tokens, W = K+1)."""

    input_ids: torch.Tensor  # [L] int64
    position_ids: torch.Tensor  # [L] int64, restart at 0 per sample
    subtree_end: torch.Tensor  # [L] int64, one past the last token of the token's sample
    completion_mask: torch.Tensor  # [L] int8
    teacher_topk_ids: torch.Tensor  # [L, W] int64, -1 padded
    teacher_topk_logprobs: torch.Tensor  # [L, W] float32, -inf padded
    global_n_tokens: float  # Σ completion tokens of the micro-batch over every rank
    teacher_id_idx: torch.Tensor | None = None  # [L] int64 (MOPD only)
    segments: SegmentPlan | None = None  # the varlen tree attention's plan, made on the host

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_trained_tokens(self) -> int:
        return int(self.completion_mask.sum())


def distill_row_tensors(
    batch: Mapping[str, np.ndarray], rank: int = 0, device: torch.device | str = "cpu", *, segments: bool = False
) -> DistillRowTensors:
    """Row `rank` of `collate_rows`' output as tensors on `device`, padding (attention_mask 0, at the end) removed.
    `segments`: plan the varlen tree attention on the host (the learner: when its kernels run varlen)."""
    length = int(np.asarray(batch["attention_mask"][rank]).sum())
    if length == 0:
        raise ValueError(f"row {rank} of the micro-batch is empty: every rank needs at least one sample")
    positions = np.asarray(batch["position_ids"][rank][:length], dtype=np.int64)
    starts = np.flatnonzero(positions == 0)
    if starts.size == 0 or starts[0] != 0:
        raise ValueError("position_ids of a packed row must restart at 0 at the start of every sample")
    ends = np.append(starts[1:], length)
    subtree_end = np.repeat(ends, ends - starts)

    def tensor(name: str, dtype: Any = None) -> torch.Tensor:
        value = np.asarray(batch[name][rank][:length])
        return to_device(torch.as_tensor(value if dtype is None else value.astype(dtype)), device)

    teacher_id_idx = tensor("teacher_id_idx") if "teacher_id_idx" in batch else None
    plan = segment_plan(subtree_end, positions).to(device) if segments else None
    return DistillRowTensors(
        input_ids=tensor("input_ids", np.int64),
        position_ids=to_device(torch.as_tensor(positions), device),
        subtree_end=to_device(torch.as_tensor(subtree_end), device),
        completion_mask=tensor("completion_mask"),
        teacher_topk_ids=tensor("teacher_topk_ids", np.int64),
        teacher_topk_logprobs=tensor("teacher_topk_logprobs", np.float32),
        global_n_tokens=float(np.asarray(batch["global_n_tokens"][rank])),
        teacher_id_idx=teacher_id_idx,
        segments=plan,
    )


class DistillScorer(TreeScorer):
    """`DistillScorer(model)(row, config, ...) -> (normalised loss, statistics)`: the whole distillation forward of
    one packed row as one module call (what FSDP2 needs of its root)."""

    def forward(  # type: ignore[override]
        self,
        row: DistillRowTensors,
        config: DistillLossConfig,
        num_processes: int = 1,
        grad_accum_steps: int = 1,
        num_teachers: int = 1,
        autocast_dtype: torch.dtype | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = row_hidden_states(self.model, row, self.backend, autocast_dtype, self.kernels.flex_kernel_options)
        head = self.model.get_output_embeddings()
        transform = LogitTransform.from_config(self.model.config)
        return distillation_row_loss(
            hidden.to(head.weight.dtype),
            head.weight,
            getattr(head, "bias", None),
            row.input_ids,
            row.completion_mask,
            row.teacher_topk_ids,
            row.teacher_topk_logprobs,
            config=config,
            global_n_tokens=row.global_n_tokens,
            num_processes=num_processes,
            grad_accum_steps=grad_accum_steps,
            teacher_id_idx=row.teacher_id_idx,
            num_teachers=num_teachers,
            logit_scale=transform.scale,
            softcap=transform.softcap,
        )


def row_hidden_states(
    model: torch.nn.Module,
    row: DistillRowTensors,
    backend: Any = "auto",
    autocast_dtype: torch.dtype | None = None,
    kernel_options: dict[str, Any] | None = None,
) -> torch.Tensor:
    """The decoder's last hidden states [L, H] of a packed row, each sample attending only to itself
    (`kernel_options`: FlexAttention's, `KernelSettings.flex_kernel_options`)."""
    tree = build_tree_attention(
        row.subtree_end,
        row.position_ids,
        backend,
        sliding_windows(model),
        segments=row.segments,
        kernel_options=kernel_options,
    )
    device_type = row.input_ids.device.type
    with torch.autocast(device_type, dtype=autocast_dtype or torch.bfloat16, enabled=autocast_dtype is not None):
        outputs = model.get_decoder()(
            input_ids=row.input_ids[None],
            position_ids=row.position_ids[None],
            attention_mask=tree.full_mask,
            use_cache=False,
            tree_attention=tree,
        )
    return outputs.last_hidden_state[0]


class DistillLearnerStep:
    """Runs distillation optimisation steps of one rank: `step(rows) -> metrics`.

    `model` is a `DistillScorer` (or a causal LM with tree attention, wrapped here). `rows[i]` is this rank's
    `DistillRowTensors` of micro-batch i (GA = len(rows)). `teacher_ids` (stable order) name the MOPD metrics.
    `reduce_stats` sums the statistics tensor over ranks (None: one rank).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: Any,
        loss_config: DistillLossConfig,
        *,
        max_grad_norm: float = 1.0,
        num_ranks: int = 1,
        device: torch.device | str = "cpu",
        teacher_ids: Sequence[str] = ("default",),
        clip_grad_norm: Callable[[float], torch.Tensor] | None = None,
        autocast_dtype: torch.dtype | None = None,
        reduce_stats: ReduceStats | None = None,
    ) -> None:
        self.model = model if isinstance(model, DistillScorer) else DistillScorer(model)
        self.optimizer, self.scheduler, self.loss_config = optimizer, scheduler, loss_config
        self.max_grad_norm, self.num_ranks = max_grad_norm, num_ranks
        self.device = torch.device(device)
        self.teacher_ids = list(teacher_ids)
        self.autocast_dtype = autocast_dtype
        self.reduce_stats = reduce_stats
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.clip_grad_norm = clip_grad_norm or (lambda max_norm: torch.nn.utils.clip_grad_norm_(params, max_norm))
        self.global_step = 0

    def loss(self, row: DistillRowTensors, grad_accum_steps: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's normalised loss of one row and its statistics (no backward)."""
        return self.model(
            row,
            self.loss_config,
            num_processes=self.num_ranks,
            grad_accum_steps=grad_accum_steps,
            num_teachers=max(len(self.teacher_ids), 1),
            autocast_dtype=self.autocast_dtype,
        )

    def step(self, rows: Sequence[DistillRowTensors], *, rate_pairs: bool = False) -> dict[str, MetricValue]:
        """One optimizer step over this rank's rows. `rate_pairs=True`: rates stay `(num, den)` pairs and NaN stays
        NaN (the partial statistics `rlasync.learner.reduce_across_ranks` combines)."""
        if not rows:
            raise ValueError("step needs at least one row (one per micro-batch)")
        self.model.train()
        stats = torch.zeros(num_stats(max(len(self.teacher_ids), 1)), dtype=torch.float64, device=self.device)
        timer = RowTimer(self.device)
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for row in rows:  # nothing here waits for the device: rows queue back to back
            timer.start()
            loss, row_stats = self.loss(row, len(rows))
            timer.forward_done()
            loss.backward()
            timer.backward_done()
            total += loss.detach().to(total.device, torch.float64)
            stats += row_stats.detach().to(stats.device, torch.float64)
        values = torch.cat([total[None], stats]).tolist()  # the step's one read of its statistics
        total_loss, stats = values[0], torch.tensor(values[1:], dtype=torch.float64)
        fwd_s, fwd_bwd_s = timer.totals()
        grad_norm, optimizer_s = apply_update(self)
        if self.reduce_stats is not None:
            stats = self.reduce_stats(stats).to("cpu", torch.float64)
        names = self.teacher_ids if len(self.teacher_ids) > 1 else ()
        loss_metrics = distillation_metrics(stats, names)
        if rate_pairs:
            out = partial_metrics([loss_metrics])
        else:
            sink = MetricSink()
            sink.update(loss_metrics)
            out = {k: v for k, v in sink.reduce().items() if v is not None}
        out.update(step_metrics(self, total_loss, grad_norm, fwd_s, fwd_bwd_s, optimizer_s, len(rows)))
        return out

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)


@torch.no_grad()
def evaluate_jsd(model: torch.nn.Module, rows: Sequence[DistillRowTensors], config: DistillLossConfig) -> float:
    """`jsd` of `model` on fixed rows (no update): Σ divergence / Σ positions with teacher signal."""
    scorer = model if isinstance(model, DistillScorer) else DistillScorer(model)
    stats = sum((scorer(row, config)[1].cpu() for row in rows), torch.zeros(num_stats(1), dtype=torch.float64))
    return float(distillation_metrics(stats)["jsd"])


__all__ = [
    "DistillLearnerStep",
    "DistillRowTensors",
    "DistillScorer",
    "distill_row_tensors",
    "evaluate_jsd",
    "row_hidden_states",
]
