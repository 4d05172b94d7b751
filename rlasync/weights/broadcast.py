"""Weight broadcast over a dedicated process group (learner rank 0 -> every generation engine).

    learner rank 0 (rank 0 of the group)                    GenerationActor k (rank k of the group)
    WeightGroup.open(host, port, 0, 1 + E, backend=b)       WeightGroup.open(host, port, k, 1 + E, backend=b)
    send(stream_parameters(model), manifest)                engine.load_weights(receive(manifest))
       one broadcast per bucket (`bucket_manifest(manifest, bucket_bytes)`): every rank walks the same manifest with
       the same `bucket_bytes`, so both sides cut the same buckets

A bucket of several tensors travels as one flat byte buffer (`bucket_layout`: aligned offsets, any mix of dtypes);
a bucket of one tensor (one larger than `bucket_bytes`) is broadcast in place, without a copy. The receiver yields
views into the received buffer, which the engine copies into its parameters.

Backends: "gloo" moves CPU tensors (a GPU sender copies each bucket to the host); "nccl" broadcasts GPU tensors
directly from learner rank 0's GPU into the engines' GPUs. NCCL needs one distinct GPU per rank: when learner rank 0
and an engine share a GPU (fractional `num_gpus`) `rlasync.weights.transport.choose_transport` picks gloo (through
the CPU) and says why.

The group is its own `ProcessGroupGloo` / `ProcessGroupNCCL` on its own TCPStore, separate from the learners'
training group, so engines can join without touching the trainers' world. Every wait has a timeout: a stalled
peer becomes a `TimeoutError` naming the group and what was being sent, never a hang. No ray here: the actor
shells and the driver wire it.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterable, Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch

from rlasync.weights.plan import ManifestEntry, bucket_layout, bucket_manifest, next_matching

BACKENDS = ("gloo", "nccl")
DEFAULT_BUCKET_BYTES = 256 << 20
NCCL_WATCHDOG_MARGIN_S = 60.0
"""NCCL's own watchdog (which ends the process) waits this much longer than our timeout, so ours speaks first."""


def free_port() -> int:
    """A TCP port free on this host right now (for the group's store)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


def wait_work(work: Any, timeout_s: float, what: str, *, poll: bool = False) -> None:
    """Wait for an async collective (`async_op=True`); `TimeoutError` naming `what` if it fails or stalls.

    `poll=True` (NCCL): `work.wait()` only orders the CUDA streams and the watchdog would end the process on a
    stall, so the host polls `is_completed()` against the deadline first. Gloo's `wait(timeout)` blocks and raises.
    """
    try:
        if poll:
            deadline = time.monotonic() + timeout_s
            delay = 1e-4
            while not work.is_completed():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"not completed after {timeout_s:.0f} s")
                time.sleep(delay)
                delay = min(delay * 2, 0.01)
            work.wait()
        elif work.wait(timedelta(seconds=timeout_s)) is False:
            raise TimeoutError(f"not completed after {timeout_s:.0f} s")
    except Exception as exc:  # torch raises RuntimeError / DistBackendError with terse messages
        raise TimeoutError(
            f"{what} failed or stalled (timeout {timeout_s:.0f} s): {type(exc).__name__}: {exc}"
        ) from exc


def device_identity(device: torch.device | str, node: str, gpu_ids: Sequence[Any] = ()) -> dict[str, Any]:
    """What `choose_transport` compares for one rank: device type, node, and the physical GPU (its UUID when CUDA
    reports one, else the ids the scheduler assigned, e.g. `ray.get_gpu_ids()`)."""
    device = torch.device(device)
    gpu = None
    if device.type == "cuda":
        try:
            gpu = str(torch.cuda.get_device_properties(device).uuid)
        except Exception:  # older drivers / mocked devices: fall back to the scheduler's ids
            gpu = None
        if not gpu:
            gpu = "ids:" + ",".join(str(i) for i in gpu_ids)
    return {"device": device.type, "node": node, "gpu": gpu}


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor (no copy)."""
    return tensor.reshape(-1).view(torch.uint8)


class WeightGroup:
    """One rank of the weight-sync group. Rank 0 sends; every other rank receives."""

    def __init__(
        self,
        group: Any,
        store: Any,
        rank: int,
        world_size: int,
        timeout_s: float,
        address: str,
        backend: str = "gloo",
        device: torch.device | str = "cpu",
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> None:
        self._group = group
        self._store = store  # keep the store alive as long as the group
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.address = address
        self.backend = backend
        self.device = torch.device(device)
        self.bucket_bytes = bucket_bytes

    @classmethod
    def open(
        cls,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        timeout_s: float = 300.0,
        *,
        backend: str = "gloo",
        device: torch.device | str | None = None,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> WeightGroup:
        """Join the group at `host:port` (rank 0 hosts the store); returns when every rank has joined.

        `backend`: "gloo" (CPU tensors; `device` must be the CPU) or "nccl" (`device` = this rank's GPU, default
        the current one). Every rank must pass the same `backend` and `bucket_bytes`.
        """
        import torch.distributed as dist

        if backend not in BACKENDS:
            raise ValueError(f"WeightGroup backend {backend!r}: use one of {BACKENDS}")
        if bucket_bytes < 1:
            raise ValueError(f"WeightGroup bucket_bytes must be >= 1, got {bucket_bytes}")
        device = torch.device(device if device is not None else ("cuda" if backend == "nccl" else "cpu"))
        if backend == "nccl":
            if device.type != "cuda":
                raise ValueError(f"WeightGroup backend 'nccl' needs a CUDA device, got {device}")
            if device.index is None:
                device = torch.device("cuda", torch.cuda.current_device())
        elif device.type != "cpu":
            raise ValueError(f"WeightGroup backend 'gloo' moves CPU tensors; got device {device}")
        timeout = timedelta(seconds=timeout_s)
        address = f"{host}:{port}"
        try:
            store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout, wait_for_workers=True)
            prefix = dist.PrefixStore("rlasync_weights", store)
            if backend == "gloo":
                group = dist.ProcessGroupGloo(prefix, rank, world_size, timeout)
            else:
                torch.cuda.set_device(device)
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = timedelta(seconds=timeout_s + NCCL_WATCHDOG_MARGIN_S)
                group = dist.ProcessGroupNCCL(prefix, rank, world_size, options)
        except Exception as exc:  # torch raises RuntimeError / DistStoreError with terse messages
            raise TimeoutError(
                f"weight-sync group {address}: rank {rank} of {world_size} could not join within {timeout_s:.0f} s "
                f"({type(exc).__name__}: {exc})"
            ) from exc
        joined = cls(group, store, rank, world_size, timeout_s, address, backend, device, bucket_bytes)
        if backend == "nccl":  # NCCL connects lazily: make every rank build the communicator now, under the timeout
            joined._broadcast(torch.zeros(1, device=device), "the connection handshake")
        return joined

    def _broadcast(self, tensor: torch.Tensor, what: str) -> None:
        import torch.distributed as dist

        options = dist.BroadcastOptions()
        options.rootRank = 0
        options.timeout = timedelta(seconds=self.timeout_s)
        description = f"weight-sync group {self.address} ({self.backend}): broadcast of {what} on rank {self.rank}"
        try:
            work = self._group.broadcast([tensor], options)
        except Exception as exc:
            raise TimeoutError(f"{description} failed: {type(exc).__name__}: {exc}") from exc
        wait_work(work, self.timeout_s, description, poll=self.backend == "nccl")

    def buckets(self, manifest: Sequence[ManifestEntry]) -> list[list[ManifestEntry]]:
        """The buckets both sides cut from `manifest` (consecutive entries, at most `bucket_bytes` each)."""
        return bucket_manifest(list(manifest), self.bucket_bytes)

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], manifest: Sequence[ManifestEntry]) -> int:
        """Rank 0: broadcast the stream bucket by bucket; returns the bytes sent.

        `named_tensors` must yield exactly the manifest's entries in order (name, shape, dtype), as
        `stream_parameters` does for the model `build_manifest` described. Each tensor is copied into its bucket as
        it arrives, so a streaming sender holds one gathered parameter and one bucket at a time.
        """
        if self.rank != 0:
            raise RuntimeError("WeightGroup.send runs on rank 0 only")
        stream = iter(named_tensors)
        sent = 0
        for bucket in self.buckets(manifest):
            if len(bucket) == 1:
                entry = bucket[0]
                data = self._next(stream, entry).to(self.device).contiguous()
                self._broadcast(_as_bytes(data), entry.name)
                sent += entry.num_bytes
                continue
            offsets, size = bucket_layout(bucket)
            flat = torch.empty(size, dtype=torch.uint8, device=self.device)
            for entry, offset in zip(bucket, offsets):
                data = self._next(stream, entry).contiguous()
                flat[offset : offset + entry.num_bytes].copy_(_as_bytes(data))
            self._broadcast(flat, _bucket_name(bucket))
            sent += size
        extra = next(stream, None)
        if extra is not None:
            raise ValueError(
                f"weight stream has {extra[0]!r} after the last manifest entry: stream and manifest differ"
            )
        return sent

    def receive(self, manifest: Sequence[ManifestEntry]) -> Iterator[tuple[str, torch.Tensor]]:
        """Ranks > 0: yield `(name, tensor)` on this rank's device for each manifest entry as its bucket arrives
        (lazy: consume it all). Tensors of a shared bucket are views into that bucket's buffer."""
        for bucket in self.buckets(manifest):
            if len(bucket) == 1:
                entry = bucket[0]
                buffer = torch.empty(tuple(entry.shape), dtype=getattr(torch, entry.dtype), device=self.device)
                self._broadcast(_as_bytes(buffer), entry.name)
                yield entry.name, buffer
                continue
            offsets, size = bucket_layout(bucket)
            flat = torch.empty(size, dtype=torch.uint8, device=self.device)
            self._broadcast(flat, _bucket_name(bucket))
            for entry, offset in zip(bucket, offsets):
                view = flat[offset : offset + entry.num_bytes].view(getattr(torch, entry.dtype))
                yield entry.name, view.view(tuple(entry.shape))
        if self.device.type == "cuda":  # the consumer's copies out of the buffers are done before we return
            torch.cuda.synchronize(self.device)

    @staticmethod
    def _next(stream: Iterator[tuple[str, torch.Tensor]], entry: ManifestEntry) -> torch.Tensor:
        return next_matching(stream, entry).detach()

    def close(self) -> None:
        self._group = None
        self._store = None


def _bucket_name(bucket: list[ManifestEntry]) -> str:
    return f"a bucket of {len(bucket)} tensors ({bucket[0].name} .. {bucket[-1].name})"
