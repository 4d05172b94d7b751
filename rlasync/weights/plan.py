"""Naming, manifest and streaming of parameters for a weight sync (the sender side, docs/algorithms.md §6.2).

The learner's parameter names carry wrappers (FSDP/DDP's `module.`, activation checkpointing's
`_checkpoint_wrapped_module.`, PEFT's `base_model.model.` and `.base_layer`); an engine knows the plain HF names.
`transfer_name` maps one to the other, `build_manifest` lists what a sync sends (name, dtype, global shape) from the
same generator as the stream so the two agree element for element, and `stream_parameters` yields full tensors one
parameter at a time (a DTensor shard is gathered with `full_tensor()`, never the whole model at once).
`bucket_manifest` groups consecutive entries into buckets of bounded bytes for transports that prefer fewer,
larger messages, and `bucket_layout` places a bucket's entries in one flat byte buffer (aligned offsets, so each
slice can be viewed back as its dtype).

Pure torch (no ray, no distributed setup of its own): the all-gathers happen inside `full_tensor()` on every rank.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import torch

ADAPTER_MARKER = "lora_"


@dataclass(frozen=True, slots=True)
class ManifestEntry:
    name: str  # HF name on the engine side
    dtype: str  # e.g. "bfloat16"
    shape: tuple[int, ...]  # global (unsharded) shape

    @property
    def num_bytes(self) -> int:
        numel = 1
        for dim in self.shape:
            numel *= dim
        return numel * torch.empty((), dtype=getattr(torch, self.dtype)).element_size()


def transfer_name(name: str) -> str:
    """The engine-side name of a learner parameter (docs/algorithms.md §6.2 rule 2-4 clean-ups)."""
    name = name.removeprefix("module.").replace("_checkpoint_wrapped_module.", "")
    name = name.removeprefix("base_model.model.").replace(".base_layer", "")
    return name.replace("modules_to_save.default.", "")


def is_sent(name: str, param: torch.nn.Parameter, is_peft: bool = False) -> bool:
    """Whether a sync sends this parameter: trainable ones (all of them under PEFT, whose frozen base weights are
    what merging changes), never adapter weights themselves or PEFT's frozen `original_module` copies."""
    if is_peft:
        return ADAPTER_MARKER not in name and "original_module" not in name
    return param.requires_grad


def _sent_parameters(model: torch.nn.Module, is_peft: bool) -> Iterator[tuple[str, torch.nn.Parameter]]:
    seen: set[str] = set()
    for name, param in model.named_parameters():  # tied weights appear once (remove_duplicate)
        if not is_sent(name, param, is_peft):
            continue
        target = transfer_name(name)
        if target in seen:
            raise ValueError(f"two learner parameters map to the engine name {target!r}; check the wrappers")
        seen.add(target)
        yield target, param


def _wire_dtype(param_dtype: torch.dtype, dtype: torch.dtype | None) -> torch.dtype:
    """What a parameter travels as: floating point ones in `dtype` when given (the engine's, e.g. bf16 from float32
    master weights), everything else as it is."""
    return dtype if dtype is not None and param_dtype.is_floating_point else param_dtype


def build_manifest(
    model: torch.nn.Module, is_peft: bool = False, dtype: torch.dtype | None = None
) -> list[ManifestEntry]:
    """Name, dtype and global shape of every parameter a sync sends, in stream order (no gathering needed);
    floating point parameters are sent in `dtype` when given."""
    return [
        ManifestEntry(name, str(_wire_dtype(param.dtype, dtype)).removeprefix("torch."), tuple(param.shape))
        for name, param in _sent_parameters(model, is_peft)
    ]


class TensorStream:
    """`(name, tensor)` pairs, one at a time (an iterator: `next()` and `for` work), that can also be written into
    preallocated views in one batched op (`copy_into`): a persistent flat buffer (`rlasync.weights.ipc`) is filled
    with one `torch._foreach_copy_` instead of a cast and a copy per tensor."""

    def __init__(self, pairs: Iterator[tuple[str, torch.Tensor]]) -> None:
        self._pairs = pairs
        self._started = False

    def __iter__(self) -> TensorStream:
        return self

    def __next__(self) -> tuple[str, torch.Tensor]:
        self._started = True
        return next(self._pairs)

    def entries(self) -> list[ManifestEntry] | None:
        """What `copy_into` writes, in order (None: no batched path); compared with the manifest first."""
        return None

    def copy_into(self, views: list[torch.Tensor]) -> bool:
        """Write every tensor into `views` (stream order, shapes and dtypes of the manifest) in batched ops; False
        (nothing written) when this stream has no batched path (already started, sharded parameters)."""
        return False


def foreach_copy(targets: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """`targets[i].copy_(sources[i])` for all i, batched: one `torch._foreach_copy_` per (device, dtype) pair (it
    casts; a multi-tensor kernel on CUDA instead of a launch per tensor)."""
    groups: dict[tuple, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for target, source in zip(targets, sources, strict=True):
        key = (target.device, target.dtype, source.device, source.dtype)
        dst, src = groups.setdefault(key, ([], []))
        dst.append(target)
        src.append(source)
    with torch.no_grad():
        for dst, src in groups.values():
            torch._foreach_copy_(dst, src)


class ParameterStream(TensorStream):
    """What `stream_parameters` returns: per-parameter full tensors, or (`copy_into`) a batched cast-and-copy of
    every parameter into the given views when none is sharded."""

    def __init__(
        self, model: torch.nn.Module, device: torch.device | str | None, is_peft: bool, dtype: torch.dtype | None
    ) -> None:
        self._model, self._device, self._is_peft, self._dtype = model, device, is_peft, dtype
        super().__init__(self._generate())

    def _generate(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, param in _sent_parameters(self._model, self._is_peft):
            data = param.detach()
            full_tensor = getattr(data, "full_tensor", None)
            if full_tensor is not None:  # a DTensor (FSDP2 shard): gather the global tensor
                data = full_tensor()
            yield name, data.to(device=self._device, dtype=_wire_dtype(data.dtype, self._dtype))

    def entries(self) -> list[ManifestEntry] | None:
        return build_manifest(self._model, self._is_peft, self._dtype)

    def copy_into(self, views: list[torch.Tensor]) -> bool:
        params = [param.detach() for _, param in _sent_parameters(self._model, self._is_peft)]
        if self._started or any(hasattr(p, "full_tensor") for p in params):
            return False
        if len(params) != len(views):
            raise ValueError(f"weight stream has {len(params)} tensors, the buffer {len(views)}: they differ")
        foreach_copy(views, params)
        self._started = True
        return True


def stream_parameters(
    model: torch.nn.Module,
    device: torch.device | str | None = None,
    is_peft: bool = False,
    dtype: torch.dtype | None = None,
) -> ParameterStream:
    """Yield `(engine name, full tensor)` in manifest order (floating point ones cast to `dtype` when given); each
    tensor is released when the stream advances. `copy_into(views)` writes them all in one batched op instead.

    Every rank of a sharded model must iterate the stream (each `full_tensor()` is a collective); only the sending
    rank uses the values.
    """
    return ParameterStream(model, device, is_peft, dtype)


def bucket_manifest(manifest: list[ManifestEntry], bucket_bytes: int) -> list[list[ManifestEntry]]:
    """Consecutive entries grouped into buckets of at most `bucket_bytes` (a larger entry gets a bucket alone)."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    buckets: list[list[ManifestEntry]] = []
    size = 0
    for entry in manifest:
        if not buckets or size + entry.num_bytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(entry)
        size += entry.num_bytes
    return buckets


BUCKET_ALIGN = 16  # bytes: every entry starts at a multiple of this in a flat bucket (any dtype can view it)


def bucket_layout(bucket: list[ManifestEntry]) -> tuple[list[int], int]:
    """Byte offsets of a bucket's entries in one flat buffer (each aligned to `BUCKET_ALIGN`) and its total size."""
    offsets: list[int] = []
    size = 0
    for entry in bucket:
        size = -(-size // BUCKET_ALIGN) * BUCKET_ALIGN
        offsets.append(size)
        size += entry.num_bytes
    return offsets, size


def next_matching(stream: Iterator[tuple[str, torch.Tensor]], entry: ManifestEntry) -> torch.Tensor:
    """The stream's next tensor, which must be the manifest `entry` (name, shape, dtype): else `ValueError`."""
    item = next(stream, None)
    if item is None:
        raise ValueError(f"weight stream ended before manifest entry {entry.name!r}: stream and manifest differ")
    name, tensor = item
    dtype = str(tensor.dtype).removeprefix("torch.")
    if name != entry.name or tuple(tensor.shape) != tuple(entry.shape) or dtype != entry.dtype:
        raise ValueError(
            f"weight stream yielded {name!r} {tuple(tensor.shape)} {dtype} where the manifest expects "
            f"{entry.name!r} {tuple(entry.shape)} {entry.dtype}: stream and manifest differ"
        )
    return tensor


def most_common_dtype(manifest: list[ManifestEntry]) -> str | None:
    """The dtype most parameters are sent in (compared with the engine's dtype at init, docs/algorithms.md §5.4)."""
    counts = Counter(entry.dtype for entry in manifest)
    return counts.most_common(1)[0][0] if counts else None
