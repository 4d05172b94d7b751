"""The trainer's `optimizers=(optimizer, scheduler)` argument (transformers' / TRL's), for learners that run in
other processes: an optimizer object cannot cross to a learner actor (its parameters are the driver's), so it is
turned into what the learner builds the same optimizer from (OptimizerSettings fields):

    (None, None)                              the config's `optim` and `lr_scheduler_type` (default)
    (torch.optim.SGD, None)                   this class, with lr / weight_decay from the config
    ((torch.optim.SGD, {"lr": 0.1}), None)    this class with these keyword arguments
    (an instantiated optimizer, None)         reconstructed: its class and its param_groups' hyper-parameters (all
                                              groups must share them), said in a log line
    (..., fn)                                 `fn(optimizer) -> scheduler` builds the scheduler on the learner
    (..., a scheduler object)                 refused: pass a function of the optimizer, or lr_scheduler_type
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)


def optimizer_overrides(optimizers: Any) -> dict[str, Any]:
    """OptimizerSettings fields (`optimizer_cls`, `optimizer_kwargs`, `scheduler_factory`) for `optimizers`; {} for
    the default. `ValueError` naming `optimizers` and the fix for what cannot be sent to the learners."""
    if optimizers is None:
        optimizers = (None, None)
    if not isinstance(optimizers, tuple | list) or len(optimizers) != 2:
        raise ValueError(f"optimizers={optimizers!r}: give a pair (optimizer, scheduler), e.g. (None, None)")
    optimizer, scheduler = optimizers
    out: dict[str, Any] = {}
    if optimizer is not None:
        out.update(_optimizer(optimizer))
    if scheduler is not None:
        out["scheduler_factory"] = _scheduler(scheduler)
    return out


def _optimizer(optimizer: Any) -> dict[str, Any]:
    import torch

    if isinstance(optimizer, type):
        _check_class(optimizer)
        return {"optimizer_cls": optimizer}
    if isinstance(optimizer, tuple | list) and len(optimizer) == 2 and isinstance(optimizer[0], type):
        _check_class(optimizer[0])
        if not isinstance(optimizer[1], dict):
            raise ValueError(f"optimizers: the keyword arguments of {optimizer[0].__name__} must be a dict")
        return {"optimizer_cls": optimizer[0], "optimizer_kwargs": dict(optimizer[1])}
    if isinstance(optimizer, torch.optim.Optimizer):
        groups = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
        if any(group != groups[0] for group in groups[1:]):
            raise ValueError(
                f"optimizers: the {type(optimizer).__name__} has {len(groups)} parameter groups with different "
                "hyper-parameters, which cannot be rebuilt on the learner (its parameters live there); pass "
                "(OptimizerClass, {kwargs}) for one group"
            )
        kwargs = {k: v for k, v in groups[0].items() if not k.startswith("initial_")}  # schedulers add initial_lr
        logger.info(
            "optimizers: the %s is rebuilt on each learner rank from its class and hyper-parameters %s "
            "(an optimizer object cannot cross to the learner actors)",
            type(optimizer).__name__,
            kwargs,
        )
        return {"optimizer_cls": type(optimizer), "optimizer_kwargs": kwargs}
    raise ValueError(
        f"optimizers[0]={optimizer!r}: give None, a torch optimizer class, (class, kwargs) or a torch.optim.Optimizer"
    )


def _check_class(cls: type) -> None:
    import torch

    if not issubclass(cls, torch.optim.Optimizer):
        raise ValueError(f"optimizers: {cls.__name__} is not a torch.optim.Optimizer subclass")


def _scheduler(scheduler: Any) -> Any:
    import torch

    if isinstance(scheduler, torch.optim.lr_scheduler.LRScheduler) or hasattr(scheduler, "get_last_lr"):
        raise ValueError(
            f"optimizers[1]: a {type(scheduler).__name__} object cannot cross to the learner actors (it holds the "
            "driver's optimizer); pass a function optimizer -> scheduler (e.g. lambda opt: LambdaLR(opt, f)), or "
            "set lr_scheduler_type / lr_scheduler_kwargs"
        )
    if not callable(scheduler):
        raise ValueError(f"optimizers[1]={scheduler!r}: give None or a function optimizer -> scheduler")
    return scheduler


__all__ = ["optimizer_overrides"]
