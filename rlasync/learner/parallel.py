"""FSDP2 for the learner, applied from outside the model (torchtitan's rule): each decoder layer is sharded, then
a `TreeScorer` holding the model becomes the root, so one root forward gathers the embedding, final norm and the
LM head weight that the chunked head reads unsharded.

    scorer = shard_for_training(model, mesh)      # model: tree attention on (load_model / prepare_for_training)
    step = LearnerStep(scorer, optimizer over scorer.parameters(), ...)

Parameters become DTensors: the weight stream gathers each with `full_tensor()` (rlasync.weights), gradient
clipping and the optimizer work on the shards. Needs an initialised process group (NCCL on GPUs; gloo on CPU).
"""

from __future__ import annotations

from typing import Any

import torch

from rlasync.model import TreeScorer
from rlasync.model.loading import decoder_layers


def shard_for_training(
    model: torch.nn.Module,
    mesh: Any | None = None,
    *,
    reshard_after_forward: bool = True,
    mp_policy: Any = None,
    scorer_cls: type[TreeScorer] = TreeScorer,
) -> TreeScorer:
    """Wrap `model` in a `scorer_cls` (a `TreeScorer`; `rlasync.learner.distill.DistillScorer` for distillation)
    and apply FSDP2 (`fully_shard`) to every decoder layer, then to the scorer."""
    from torch.distributed.fsdp import fully_shard

    options: dict[str, Any] = {"reshard_after_forward": reshard_after_forward}
    if mesh is not None:
        options["mesh"] = mesh
    if mp_policy is not None:
        options["mp_policy"] = mp_policy
    scorer = scorer_cls(model)
    for layer in decoder_layers(model):
        fully_shard(layer, **options)
    fully_shard(scorer, **options)
    return scorer
