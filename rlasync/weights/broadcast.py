"""Weight broadcast over a dedicated process group (learner rank 0 -> every generation engine).

    learner rank 0 (rank 0 of the group)             GenerationActor k (rank k of the group)
    WeightGroup.open(host, port, 0, 1 + E)           WeightGroup.open(host, port, k, 1 + E)
    send(stream_parameters(model))                   engine.load_weights(receive(manifest))
       one broadcast per parameter, in manifest order: every rank must walk the same manifest

The group is its own `ProcessGroupGloo` (or NCCL later) on its own TCPStore, separate from the learners'
training group, so engines can join without touching the trainers' world. Every wait has a timeout: a stalled
peer becomes a `TimeoutError` naming the parameter and the group, never a hang. No ray here: the actor shells and
the driver wire it.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable, Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch

from rlasync.weights.plan import ManifestEntry


def free_port() -> int:
    """A TCP port free on this host right now (for the group's store)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


class WeightGroup:
    """One rank of the weight-sync group. Rank 0 sends; every other rank receives."""

    def __init__(self, group: Any, store: Any, rank: int, world_size: int, timeout_s: float, address: str) -> None:
        self._group = group
        self._store = store  # keep the store alive as long as the group
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.address = address

    @classmethod
    def open(cls, host: str, port: int, rank: int, world_size: int, timeout_s: float = 300.0) -> WeightGroup:
        """Join the group at `host:port` (rank 0 hosts the store); returns when every rank has joined."""
        import torch.distributed as dist

        timeout = timedelta(seconds=timeout_s)
        address = f"{host}:{port}"
        try:
            store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout, wait_for_workers=True)
            group = dist.ProcessGroupGloo(dist.PrefixStore("rlasync_weights", store), rank, world_size, timeout)
        except Exception as exc:  # torch raises RuntimeError / DistStoreError with terse messages
            raise TimeoutError(
                f"weight-sync group {address}: rank {rank} of {world_size} could not join within {timeout_s:.0f} s "
                f"({type(exc).__name__}: {exc})"
            ) from exc
        return cls(group, store, rank, world_size, timeout_s, address)

    def _broadcast(self, tensor: torch.Tensor, what: str) -> None:
        import torch.distributed as dist

        options = dist.BroadcastOptions()
        options.rootRank = 0
        options.timeout = timedelta(seconds=self.timeout_s)
        try:
            self._group.broadcast([tensor], options).wait(timedelta(seconds=self.timeout_s))
        except Exception as exc:
            raise TimeoutError(
                f"weight-sync group {self.address}: broadcast of {what} failed or stalled on rank {self.rank} "
                f"(timeout {self.timeout_s:.0f} s): {type(exc).__name__}: {exc}"
            ) from exc

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Rank 0: broadcast every tensor in order (CPU, contiguous); returns the bytes sent."""
        if self.rank != 0:
            raise RuntimeError("WeightGroup.send runs on rank 0 only")
        sent = 0
        for name, tensor in named_tensors:
            data = tensor.detach().to("cpu").contiguous()
            self._broadcast(data, name)
            sent += data.numel() * data.element_size()
        return sent

    def receive(self, manifest: Sequence[ManifestEntry]) -> Iterator[tuple[str, torch.Tensor]]:
        """Ranks > 0: yield `(name, tensor)` for each manifest entry as it arrives (lazy: consume it all)."""
        for entry in manifest:
            buffer = torch.empty(tuple(entry.shape), dtype=getattr(torch, entry.dtype))
            self._broadcast(buffer, entry.name)
            yield entry.name, buffer

    def close(self) -> None:
        self._group = None
        self._store = None
