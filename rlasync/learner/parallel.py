"""FSDP2 for the learner, applied from outside the model (torchtitan's rule): each decoder layer is sharded, then
a `TreeScorer` holding the model becomes the root, so one root forward gathers the embedding, final norm and the
LM head weight that the chunked head reads unsharded.

    scorer = shard_for_training(model, mesh)      # model: tree attention on (load_model / prepare_for_training)
    step = GrpoLearnerStep(scorer, optimizer over scorer.parameters(), ...)

Parameters become DTensors: the weight stream gathers each with `full_tensor()` (rlasync.weights), gradient
clipping and the optimizer work on the shards. Needs an initialised process group (NCCL on GPUs; gloo on CPU).
"""

from __future__ import annotations

from typing import Any

import torch

from rlasync.config.kernels import KernelSettings
from rlasync.model import TreeScorer
from rlasync.model.checkpointing import decoder_layers


def shard_for_training(
    model: torch.nn.Module,
    mesh: Any | None = None,
    *,
    reshard_after_forward: bool = True,
    mp_policy: Any = None,
    scorer_cls: type[TreeScorer] = TreeScorer,
    kernels: KernelSettings | None = None,
) -> TreeScorer:
    """Wrap `model` in a `scorer_cls` (a `TreeScorer`; `rlasync.algorithms.distill.learner_step.DistillScorer` for
    distillation) running `kernels`, and apply FSDP2 (`fully_shard`) to every decoder layer, then to the scorer."""
    from torch.distributed.fsdp import fully_shard

    options: dict[str, Any] = {}
    if mesh is not None:
        options["mesh"] = mesh
    if mp_policy is not None:
        options["mp_policy"] = mp_policy
    scorer = scorer_cls(model, kernels)
    for layer in decoder_layers(model):
        fully_shard(layer, reshard_after_forward=reshard_after_forward, **options)
    # The root (embeddings, final norm, LM head) is left to FSDP2's root rule: not resharded after forward, since the
    # backward needs it at once. Resharding it would rely on a pre-backward hook on the forward's outputs, and the
    # scorer returns a `TokenScores` dataclass, whose tensors torch 2.11's FSDP2 does not find: the head's backward then
    # read a freed weight ("data is not allocated yet") on every multi-rank CUDA run.
    fully_shard(scorer, **options)
    return scorer


def init_training_group(
    rank: int, world_size: int, master: tuple[str, int] | None, timeout_s: float, device: torch.device
) -> None:
    """Join the learners' training group (NCCL on GPUs, gloo on CPU) at `master` = rank 0's (host, port); a no-op
    for one rank. Every rank must call it at once."""
    if world_size <= 1:
        return
    from datetime import timedelta

    import torch.distributed as dist

    if master is None:
        raise ValueError(f"learner rank {rank} of {world_size}: the training group needs rank 0's (host, port)")
    host, port = master
    on_gpu = device.type == "cuda"
    dist.init_process_group(
        "nccl" if on_gpu else "gloo",
        init_method=f"tcp://{host}:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
        **({"device_id": device} if on_gpu else {}),
    )


def close_training_group() -> None:
    """Leave the training group, if this process joined one."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


class GroupReducer:
    """The cross-rank reductions of one learner rank over the initialised training group, each wait bounded by
    `timeout_s` (a stalled rank becomes a `TimeoutError` naming what was being reduced):

    * `all_reduce(sums, maxes)`: the SUM and MAX all-reduces `rlasync.learner.reduce_across_ranks` needs;
    * `sum(stats)`: a SUM all-reduce of one tensor (the distillation statistics).
    """

    def __init__(self, rank: int, device: torch.device, timeout_s: float) -> None:
        self.rank, self.device, self.timeout_s = rank, device, timeout_s

    def _reduce(self, tensor: torch.Tensor, op: Any, what: str) -> torch.Tensor:
        import torch.distributed as dist

        from rlasync.weights.broadcast import wait_work

        tensor = tensor.to(self.device)
        work = dist.all_reduce(tensor, op=op, async_op=True)
        wait_work(work, self.timeout_s, f"learner rank {self.rank}: {what}", poll=self.device.type == "cuda")
        return tensor.cpu()

    def all_reduce(self, sums: torch.Tensor, maxes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        import torch.distributed as dist

        return (
            self._reduce(sums, dist.ReduceOp.SUM, "metric all-reduce (sum)"),
            self._reduce(maxes, dist.ReduceOp.MAX, "metric all-reduce (max)"),
        )

    def sum(self, stats: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        return self._reduce(stats, dist.ReduceOp.SUM, "distillation stats all-reduce")
