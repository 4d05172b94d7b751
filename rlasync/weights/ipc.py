"""Same-device weight sync without a process group: learner rank 0 packs the weights into flat buckets and shares
them by handle (CUDA IPC when learner and engine share one GPU; a file in shared memory, /dev/shm, on the CPU);
each engine maps the buckets and copies from them. For the case NCCL cannot serve (one GPU for both), instead of a trip through the CPU.

    learner rank 0:  shared = SharedWeights.pack(stream_parameters(model, dtype=wire), manifest, device)
                     handles = shared.handles()          # small and picklable: travels to the engines through Ray
    each engine:     await load_while_pausing(engine, open_shared(handles), 0)
    learner rank 0:  shared.release()                    # once every engine has returned

The buffers stay alive on the learner until `release`: an engine must be done copying before then.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from rlasync.weights.plan import ManifestEntry, bucket_layout, bucket_manifest, next_matching

DEFAULT_BUCKET_BYTES = 1 << 30

# one bucket's entries: (name, dtype, shape, byte offset, bytes)
BucketEntries = list[tuple[str, str, tuple[int, ...], int, int]]


class SharedWeights:
    """Flat buckets holding one copy of the weights, shareable with other processes on the same device."""

    def __init__(self, buffers: list[torch.Tensor], entries: list[BucketEntries], files: list[Path]) -> None:
        self.buffers = buffers
        self.entries = entries
        self.files = files  # CPU buckets' shared-memory files (removed on release)

    @classmethod
    def pack(
        cls,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        manifest: Sequence[ManifestEntry],
        device: torch.device | str,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> SharedWeights:
        """Copy the stream (which must match the manifest: names, shapes, dtypes, order) into buckets on `device`."""
        stream = iter(named_tensors)
        buffers, entries, files = [], [], []
        device = torch.device(device)
        for bucket in bucket_manifest(list(manifest), bucket_bytes):
            offsets, size = bucket_layout(bucket)
            if device.type == "cpu":
                files.append(_shm_dir() / f"rlasync-weights-{os.getpid()}-{uuid.uuid4().hex}")
                flat = _map_file(files[-1], size, create=True)
            else:
                flat = torch.empty(size, dtype=torch.uint8, device=device)
            for entry, offset in zip(bucket, offsets):
                data = next_matching(stream, entry).contiguous()
                flat[offset : offset + entry.num_bytes].copy_(data.reshape(-1).view(torch.uint8))
            buffers.append(flat)
            entries.append([(e.name, e.dtype, tuple(e.shape), o, e.num_bytes) for e, o in zip(bucket, offsets)])
        extra = next(stream, None)
        if extra is not None:
            raise ValueError(f"weight stream has {extra[0]!r} after the last manifest entry: stream and manifest differ")
        return cls(buffers, entries, files)

    def handles(self) -> list[tuple[BucketEntries, Any]]:
        """Per bucket: its entries and what another process of this host maps it from (a CUDA IPC handle, or the
        shared-memory file's path and size)."""
        from torch.multiprocessing.reductions import reduce_tensor

        out = []
        for index, (entries, buffer) in enumerate(zip(self.entries, self.buffers)):
            if buffer.device.type == "cpu":
                out.append((entries, ("file", str(self.files[index]), int(buffer.numel()))))
            else:
                out.append((entries, ("cuda", reduce_tensor(buffer))))
        return out

    def release(self) -> None:
        """Drop the buffers (and remove the CPU buckets' files: mappings already open stay valid)."""
        self.buffers = []
        for path in self.files:
            path.unlink(missing_ok=True)
        self.files = []

    @property
    def num_bytes(self) -> int:
        return sum(int(buffer.numel()) for buffer in self.buffers)


def open_shared(handles: Sequence[tuple[BucketEntries, Any]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(name, tensor)` views into the shared buckets (mapped from `SharedWeights.handles()`)."""
    for entries, handle in handles:
        if handle[0] == "file":
            flat = _map_file(Path(handle[1]), handle[2], create=False)
        else:
            rebuild, args = handle[1]
            flat = rebuild(*args)
        for name, dtype, shape, offset, num_bytes in entries:
            yield name, flat[offset : offset + num_bytes].view(getattr(torch, dtype)).view(shape)


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
