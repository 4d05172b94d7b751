"""In-place weight loading by Hugging Face parameter names (the engine side of a weight sync), and the replayed
copy plans of syncs from persistent buffers (`CopyPlan`, `PlannedLoader`: the TorchEngine's and vLLM workers')."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch

logger = logging.getLogger(__name__)


def load_named_weights(model: torch.nn.Module, named_tensors: Iterable[tuple[str, Any]]) -> int:
    """Copy each `(name, tensor)` into the model's parameter of that name, in place; returns how many were copied.

    Names are the model's own (`model.layers.0.self_attn.q_proj.weight`, `lm_head.weight`, ...). Tied parameters
    answer to every name they have, so `lm_head.weight` and `model.embed_tokens.weight` both load a tied embedding.
    Values may be tensors on any device and in any dtype, or numpy arrays; they are converted on copy.

    The iterable is consumed as a stream (one tensor held at a time, so a sender may free each after it is
    taken). An unknown name or a shape mismatch does not stop the stream: every matching entry is loaded, then a
    `ValueError` names all the others. Check a sender's manifest up front with `check_weight_manifest`.
    """
    targets = dict(model.named_parameters(remove_duplicate=False))
    unknown: list[str] = []
    mismatched: list[str] = []
    num_loaded = 0
    with torch.no_grad():
        for name, value in named_tensors:
            target = targets.get(name)
            if target is None:
                unknown.append(name)
                continue
            value = torch.as_tensor(value)
            if value.shape != target.shape:
                mismatched.append(f"{name} {tuple(value.shape)} (model: {tuple(target.shape)})")
                continue
            target.copy_(value)
            num_loaded += 1
    _raise_if_bad(unknown, mismatched)
    return num_loaded


def check_weight_manifest(model: torch.nn.Module, entries: Iterable[tuple[str, tuple[int, ...]]]) -> None:
    """Raise `ValueError` unless every `(name, shape)` names a parameter of `model` with that shape."""
    targets = dict(model.named_parameters(remove_duplicate=False))
    unknown, mismatched = [], []
    for name, shape in entries:
        if name not in targets:
            unknown.append(name)
        elif tuple(shape) != tuple(targets[name].shape):
            mismatched.append(f"{name} {tuple(shape)} (model: {tuple(targets[name].shape)})")
    _raise_if_bad(unknown, mismatched)


def _raise_if_bad(unknown: list[str], mismatched: list[str]) -> None:
    problems = []
    if unknown:
        problems.append(f"the model has no parameter named {_listed(unknown)}")
    if mismatched:
        problems.append(f"shape mismatch for {_listed(mismatched)}")
    if problems:
        raise ValueError("load_weights: " + "; ".join(problems))


def _listed(items: list[str]) -> str:
    return ", ".join(items[:5]) + (f", ... ({len(items)} in all)" if len(items) > 5 else "")


# ---- replayed copy plans (persistent sources: an IPC sync's mapped buckets) -------------------------------------


class CopyPlan:
    """The copies one load made from persistent source views into persistent parameters, replayed as batched
    copies (`rlasync.weights.plan.foreach_copy`: one multi-tensor kernel per dtype pair instead of Python per tensor).

    `CopyPlan.record(load, pairs, params)` runs `load(pairs)` (any loader: `load_named_weights`, vLLM's
    `model.load_weights` with its fused qkv_proj / gate_up_proj shards) under a dispatch mode that records each
    `copy_` whose source aliases a source view and whose target aliases a parameter. The plan is replayable only if
    that was all the loader did to the parameters: a source transformed first (a cast, a concatenation) or any other
    write into a parameter makes `replayable` False (the caller keeps calling its loader; `reason` says why), and
    so does a source that was never copied. Two writes are harmless and allowed: one of no elements (vLLM's
    embedding loader zeroes the padded vocabulary rows, `param[vocab:].fill_(0)`, an empty slice when nothing is
    padded), and a constant fill of a part of a parameter that no copy writes (those padded rows): it is replayed
    too, before the copies, so the plan does what the loader did."""

    def __init__(
        self,
        targets: list[torch.Tensor],
        sources: list[torch.Tensor],
        reason: str | None,
        fills: list[tuple[torch.Tensor, Any]] | None = None,
    ) -> None:
        self.targets, self.sources, self.reason = targets, sources, reason
        self.fills = fills or []

    @property
    def replayable(self) -> bool:
        return self.reason is None

    def replay(self) -> int:
        from rlasync.weights.plan import foreach_copy

        if self.reason is not None:
            raise RuntimeError(f"this copy plan cannot be replayed: {self.reason}")
        for target, value in self.fills:
            target.fill_(value)
        foreach_copy(self.targets, self.sources)
        return len(self.targets)

    @classmethod
    def record(cls, load: Any, pairs: list[tuple[str, torch.Tensor]], params: Iterable[torch.Tensor]) -> CopyPlan:
        from torch.utils._python_dispatch import TorchDispatchMode

        sources = {_storage(t) for _, t in pairs}
        owners = {_storage(p) for p in params}
        targets: list[torch.Tensor] = []
        copied: list[torch.Tensor] = []
        fills: list[tuple[torch.Tensor, Any]] = []
        problems: list[str] = []

        class Recorder(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args: tuple = (), kwargs=None):  # noqa: ANN001
                kwargs = kwargs or {}
                out = func(*args, **kwargs)
                written = [a for a in _mutated(func, args, kwargs) if _storage(a) in owners and a.numel() > 0]
                if not written:
                    return out
                if func is torch.ops.aten.copy_.default and _storage(args[1]) in sources:
                    targets.append(args[0].detach())
                    copied.append(args[1].detach())
                elif func in (torch.ops.aten.fill_.Scalar, torch.ops.aten.zero_.default):
                    fills.append((args[0].detach(), args[1] if func is torch.ops.aten.fill_.Scalar else 0))
                elif len(problems) < 3:
                    problems.append(f"{func} writes a parameter from something other than a source view")
                return out

        with torch.no_grad(), Recorder():
            load(pairs)
        overwritten = [f for f, _ in fills if any(_overlaps(f, t) for t in targets)]
        if overwritten and len(problems) < 3:
            problems.append("a constant fill of a parameter overlaps a copy into it (their order would matter)")
        reason = "; ".join(problems) or None
        missing = [name for name, t in pairs if not any(_overlaps(t, c) for c in copied)]
        if reason is None and missing:
            reason = f"the loader copied nothing from {missing[:3]}"
        return cls(targets, copied, reason, fills)


def _storage(tensor: Any) -> int:
    return tensor.untyped_storage().data_ptr() if isinstance(tensor, torch.Tensor) else -1


def _overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether view `b` reads part of view `a` (same storage, byte ranges intersect)."""
    if _storage(a) != _storage(b):
        return False
    a0, b0 = a.storage_offset() * a.element_size(), b.storage_offset() * b.element_size()
    return a0 < b0 + max(b.numel(), 1) * b.element_size() and b0 < a0 + max(a.numel(), 1) * a.element_size()


def _mutated(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensor arguments an op writes (its schema's mutable arguments)."""
    out = []
    for index, argument in enumerate(func._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[index] if index < len(args) else kwargs.get(argument.name)
        values = value if isinstance(value, list | tuple) else [value]
        out.extend(v for v in values if isinstance(v, torch.Tensor))
    return out


class PlannedLoader:
    """An engine's loads: a stream with a `key` (persistent buckets: `rlasync.weights.ipc.MappedWeights`) is
    loaded once through `load` while its copies are recorded, then by replaying them (`CopyPlan`); anything else,
    or a plan that cannot be replayed, through `load` every time."""

    def __init__(self) -> None:
        self.plans: dict[str, CopyPlan] = {}

    def load(self, model: torch.nn.Module, named_tensors: Iterable[tuple[str, Any]], load: Any) -> str:
        """Load; returns how: "replayed", "recorded" or "loaded"."""
        key = getattr(named_tensors, "key", "")
        if not key:
            load(named_tensors)
            return "loaded"
        plan = self.plans.get(key)
        if plan is not None and plan.replayable:
            plan.replay()
            return "replayed"
        pairs = list(named_tensors)
        if plan is not None:
            load(pairs)
            return "loaded"
        try:
            plan = CopyPlan.record(load, pairs, model.parameters())
        except Exception as exc:  # noqa: BLE001 - an engine's loader the recorder cannot follow: load it plainly
            logger.warning(
                "weight sync: recording the loader's copies failed (%s: %s); loading tensor by tensor "
                "on every sync instead",
                type(exc).__name__,
                exc,
            )
            load(pairs)
            plan = CopyPlan([], [], f"recording failed: {type(exc).__name__}: {exc}")
            self.plans = {key: plan}
            return "loaded"
        self.plans = {key: plan}  # one bucket set at a time
        if not plan.replayable:
            logger.warning(
                "weight sync: the loader's copies cannot be replayed (%s); loading through it on every sync instead",
                plan.reason,
            )
        return "recorded"

    def reason(self, key: str) -> str | None:
        """Why the plan for `key` is not replayed (None: it is, or there is none yet)."""
        plan = self.plans.get(key)
        return None if plan is None else plan.reason


def load_sync(
    model: torch.nn.Module,
    named_tensors: Iterable[tuple[str, Any]],
    adapter: Any,
    loader: PlannedLoader,
    device: torch.device,
    *,
    wait: bool = True,
) -> str:
    """One weight sync into a built-in engine's model: a LoRA adapter stream (A, s*B pairs) through `adapter`
    (`rlasync.weights.adapter.AdapterMerger`), full weights through `loader` (replaying a copy plan for persistent
    buckets); on CUDA, returns once the copies are done (the sender may then overwrite its buckets), or with
    `wait=False` once they are queued on the current stream (the caller waits for them). How it loaded."""
    from rlasync.weights.adapter import LORA_A, peek_adapter

    if getattr(named_tensors, "key", ""):  # persistent buckets: peeking would map them again
        pairs, is_adapter = named_tensors, next(iter(named_tensors), ("",))[0].endswith(LORA_A)
    else:
        pairs, is_adapter = peek_adapter(named_tensors)
    if is_adapter:
        adapter.load(model, pairs)
        how = "adapter"
    else:
        how = loader.load(model, pairs, lambda stream: load_named_weights(model, stream))
    if wait and device.type == "cuda":
        torch.cuda.synchronize(device)
    return how
