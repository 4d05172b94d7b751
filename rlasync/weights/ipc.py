"""Same-device weight sync without a process group: learner rank 0 packs the weights into flat buckets and shares
them by handle (CUDA IPC when learner and engine share one GPU; a file in shared memory, /dev/shm, on the CPU);
each engine maps the buckets and copies from them. For the case NCCL cannot serve (one GPU for both), instead of a trip through the CPU.

    learner rank 0:  shared = SharedWeights.allocate(manifest, device)      # once: persistent buckets
                     shared.fill(stream_parameters(model, dtype=wire), manifest); shared.synchronize()  # every sync
                     handles = shared.handles()          # small, picklable, the same every sync
    each engine:     mapped = MappedWeights(shared.key, handles)             # mapped once, cached by key
                     await engine.load_weights(mapped)   # (name, view) pairs; an engine may cache a copy plan
    learner rank 0:  shared.release()                    # at close

The buffers stay alive on the learner until `release`, and are overwritten by the next `fill`: an engine must be
done copying (its copies synchronized) before its sync call returns.
"""

from __future__ import annotations

import functools
import logging
import os
import tempfile
import uuid
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlasync.weights.plan import ManifestEntry, bucket_layout, bucket_manifest, next_matching

logger = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 1 << 30

# one bucket's entries: (name, dtype, shape, byte offset, bytes)
BucketEntries = list[tuple[str, str, tuple[int, ...], int, int]]


class SharedWeights:
    """Flat buckets holding one copy of the weights, shareable with other processes on the same device.

    Persistent (`allocate` once, `fill` every sync): the buckets, their handles and `key` stay the same across
    syncs, so an engine maps them once (`MappedWeights`, cached by `key`) and only the contents change."""

    def __init__(
        self, buffers: list[torch.Tensor], entries: list[BucketEntries], files: list[Path], key: str | None = None
    ) -> None:
        self.buffers = buffers
        self.entries = entries
        self.files = files  # CPU buckets' shared-memory files (removed on release)
        self.key = key or uuid.uuid4().hex
        self._handles: list[tuple[BucketEntries, Any]] | None = None
        self._views: list[torch.Tensor] | None = None

    @classmethod
    def allocate(
        cls, manifest: Sequence[ManifestEntry], device: torch.device | str, bucket_bytes: int = DEFAULT_BUCKET_BYTES
    ) -> SharedWeights:
        """Empty buckets laid out for `manifest` on `device` (CPU: files in shared memory)."""
        buffers, entries, files = [], [], []
        device = torch.device(device)
        for bucket in bucket_manifest(list(manifest), bucket_bytes):
            offsets, size = bucket_layout(bucket)
            if device.type == "cpu":
                path = _shm_dir() / f"rlasync-weights-{os.getpid()}-{uuid.uuid4().hex}"
                buffers.append(_map_file(path, size, create=True))
                files.append(_anonymous(path))
            else:
                buffers.append(torch.empty(size, dtype=torch.uint8, device=device))
            entries.append([(e.name, e.dtype, tuple(e.shape), o, e.num_bytes) for e, o in zip(bucket, offsets)])
        return cls(buffers, entries, files)

    @classmethod
    def pack(
        cls,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        manifest: Sequence[ManifestEntry],
        device: torch.device | str,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> SharedWeights:
        """Copy the stream (which must match the manifest: names, shapes, dtypes, order) into new buckets."""
        shared = cls.allocate(manifest, device, bucket_bytes)
        shared.fill(named_tensors, manifest)
        return shared

    def views(self) -> list[torch.Tensor]:
        """One typed view per manifest entry into the buckets (built once)."""
        if self._views is None:
            self._views = [view for _, view in _bucket_views(zip(self.entries, self.buffers))]
        return self._views

    def fill(self, named_tensors: Iterable[tuple[str, torch.Tensor]], manifest: Sequence[ManifestEntry]) -> None:
        """Overwrite the buckets with the stream (it must match `manifest`, the one allocated for): one batched
        copy when the stream offers it (`rlasync.weights.plan.TensorStream.copy_into`), else tensor by tensor."""
        manifest = list(manifest)
        names = [name for bucket in self.entries for name, *_ in bucket]
        if names != [entry.name for entry in manifest]:
            raise ValueError("SharedWeights.fill: the manifest differs from the one the buckets were laid out for")
        copy_into = getattr(named_tensors, "copy_into", None)
        entries = named_tensors.entries() if copy_into is not None else None  # type: ignore[union-attr]
        if entries is not None and entries != manifest:
            raise ValueError(f"weight stream has {_diff(entries, manifest)}: stream and manifest differ")
        if copy_into is not None and entries is not None and copy_into(self.views()):
            return
        stream = iter(named_tensors)
        for entry, view in zip(manifest, self.views()):
            view.copy_(next_matching(stream, entry))
        extra = next(stream, None)
        if extra is not None:
            raise ValueError(
                f"weight stream has {extra[0]!r} after the last manifest entry: stream and manifest differ"
            )

    def synchronize(self) -> None:
        """Wait until the copies into the buckets are done (before another process reads them)."""
        if any(buffer.is_cuda for buffer in self.buffers):
            torch.cuda.synchronize(self.buffers[0].device)

    def handles(self) -> list[tuple[BucketEntries, Any]]:
        """Per bucket: its entries and what another process of this host maps it from (a CUDA IPC handle, or the
        shared-memory file's path and size); computed once (the buckets are persistent)."""
        if self._handles is None:
            from torch.multiprocessing.reductions import reduce_tensor

            out = []
            for index, (entries, buffer) in enumerate(zip(self.entries, self.buffers)):
                if buffer.device.type == "cpu":
                    out.append((entries, ("file", str(self.files[index]), int(buffer.numel()))))
                else:  # the GPU's UUID: a process that numbers GPUs differently (a vLLM worker) checks and remaps
                    uuid_ = str(torch.cuda.get_device_properties(buffer.device).uuid)
                    out.append((entries, ("cuda", reduce_tensor(buffer), uuid_)))
            self._handles = out
        return self._handles

    def release(self) -> None:
        """Drop the buffers (and close or remove the CPU buckets' files: mappings already open stay valid)."""
        self.buffers, self._views, self._handles = [], None, None
        for path in self.files:
            if str(path).startswith(f"/proc/{os.getpid()}/fd/"):
                os.close(int(path.name))
            else:
                path.unlink(missing_ok=True)
        self.files = []

    @property
    def num_bytes(self) -> int:
        return sum(int(buffer.numel()) for buffer in self.buffers)


def _diff(got: list[ManifestEntry], want: list[ManifestEntry]) -> str:
    for index, (a, b) in enumerate(zip(got, want)):
        if a != b:
            return f"{a} where the manifest expects {b} (entry {index})"
    if len(got) > len(want):
        return f"{got[len(want)].name!r} after the last manifest entry"
    return f"no {want[len(got)].name!r}: it ended before that manifest entry"


def _bucket_views(buckets: Iterable[tuple[BucketEntries, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    for entries, flat in buckets:
        for name, dtype, shape, offset, num_bytes in entries:
            yield name, flat[offset : offset + num_bytes].view(getattr(torch, dtype)).view(shape)


def _open_bucket(handle: Any) -> torch.Tensor:
    if handle[0] == "file":
        return _map_file(Path(handle[1]), handle[2], create=False)
    rebuild, args = handle[1][:2]
    return rebuild(*args)


def open_shared(handles: Sequence[tuple[BucketEntries, Any]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(name, tensor)` views into the shared buckets (mapped from `SharedWeights.handles()`)."""
    for entries, handle in handles:
        yield from _bucket_views([(entries, _open_bucket(handle))])


@dataclass(frozen=True)
class IpcTicket:
    """What learner rank 0 hands every engine for one IPC sync: the persistent buckets' `key` and `handles` (the
    same every sync: an engine maps them once), how long the pack took and, on CUDA, `done_events`: per engine
    (rank r at index r - 1) the IPC handle of an interprocess event the engine may record after queueing its copies
    instead of waiting for them; learner rank 0's next pack waits for every one on its stream (`CopyEvents.wait`)."""

    key: str
    handles: list[tuple[BucketEntries, Any]]
    pack_s: float = 0.0
    done_events: tuple[bytes, ...] = ()

    def done_event(self, rank: int, device: torch.device) -> Any:
        """Engine `rank`'s event (opened once per process and handle), or None: none for it, not on CUDA, or it
        cannot be opened here (the engine then waits for its copies)."""
        if device.type != "cuda" or not 0 < rank <= len(self.done_events):
            return None
        try:
            return open_event(self.done_events[rank - 1], device.index or 0)
        except RuntimeError as exc:
            logger.warning("IPC weight sync: the copy event could not be opened (%s); waiting for the copies", exc)
            return None


@functools.lru_cache(maxsize=64)
def open_event(handle: bytes, device_index: int) -> Any:
    """An interprocess event from its IPC handle (`IpcTicket.done_events`), opened once per process and handle."""
    return torch.cuda.Event.from_ipc_handle(device_index, handle)


class CopyEvents:
    """Learner rank 0's side of `IpcTicket.done_events`: one interprocess event per engine (`make`). `wait` puts the
    current stream behind every engine's last recorded copies (nothing to wait for before an engine recorded one),
    before the buckets are refilled."""

    @classmethod
    def make(cls, num_engines: int, device: torch.device) -> CopyEvents | None:
        """The events, or None: not on CUDA, no engines, or no interprocess events here (the engines then wait for
        their copies inside the sync, a warning)."""
        if device.type != "cuda" or num_engines < 1:
            return None
        try:
            return cls(num_engines, device)
        except RuntimeError as exc:
            logger.warning("IPC weight sync without copy events (%s): each engine waits for its copies", exc)
            return None

    def __init__(self, num_engines: int, device: torch.device) -> None:
        self.events = [torch.cuda.Event(interprocess=True) for _ in range(num_engines)]
        with torch.cuda.device(device):
            self.handles = tuple(bytes(event.ipc_handle()) for event in self.events)
        self.device = device

    def wait(self) -> None:
        stream = torch.cuda.current_stream(self.device)
        for event in self.events:
            stream.wait_event(event)


class MappedWeights:
    """The engine side of persistent buckets: `(name, view)` pairs, iterable (any engine's `load_weights` takes
    it), mapped on first use and kept (`key` identifies the buckets, so an engine can cache a copy plan for them).
    `handles` are the raw handles, for an engine whose own workers map them (vLLM)."""

    def __init__(self, key: str, handles: Sequence[tuple[BucketEntries, Any]]) -> None:
        self.key, self.handles = key, list(handles)
        self._pairs: list[tuple[str, torch.Tensor]] | None = None

    def pairs(self) -> list[tuple[str, torch.Tensor]]:
        if self._pairs is None:
            self._pairs = list(open_shared(self.handles))
        return self._pairs

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return iter(self.pairs())

    def __len__(self) -> int:
        return sum(len(entries) for entries, _ in self.handles)


def _anonymous(path: Path) -> Path:
    """The path other processes open a just-created bucket file by: `/proc/<pid>/fd/<fd>` of a descriptor this
    process keeps, the file itself unlinked at once (its memory goes when this process does, even killed);
    the file's own path where /proc is not there."""
    proc = Path(f"/proc/{os.getpid()}/fd")
    if not proc.is_dir():
        return path
    fd = os.open(path, os.O_RDWR)
    path.unlink()
    return proc / str(fd)


def _shm_dir() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def _map_file(path: Path, size: int, *, create: bool) -> torch.Tensor:
    """A uint8 tensor of `size` bytes backed by the shared mapping of `path` (created and sized when `create`)."""
    if create:
        with open(path, "wb") as file:
            file.truncate(max(size, 1))
    storage = torch.UntypedStorage.from_file(str(path), shared=True, nbytes=max(size, 1))
    return torch.empty(0, dtype=torch.uint8).set_(storage)[:size]
