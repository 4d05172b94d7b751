"""The one weight transport: chosen once from the cluster's layout, then used through paired sender/receiver classes
so that neither the actors nor the driver know which transport runs.

    plan, why_not_nccl = choose_transport(learner_info, engine_infos, cluster.weight_sync_backend, host=, port=,
                                          timeout_s=, bucket_bytes=, staging_bytes=)
    learner rank r:  sender = make_sender(plan, device, manifest=manifest, rank=r)
                     ticket = sender.prepare(stream_parameters(model))   # IPC: pack into persistent buckets, IpcTicket out
                     sender.send(stream_parameters(model))              # broadcast: gather + send
                     sender.finish()                                    # (IPC: the buckets persist until close)
    engine k:        receiver = await make_receiver(plan, k, manifest, engine, device)
                     phases = await receiver.load_into(engine, ticket)  # while learner rank 0 sends

Kinds (`TransportPlan.kind`, an `rlasync.config.vocab.WeightTransport`; its traits say how they differ):
  * "nccl": a broadcast group from learner rank 0's GPU into each engine's GPU (every rank on its own GPU);
  * "gloo": the same broadcast through the CPU (a GPU sender copies each bucket to the host);
  * "ipc": no group; rank 0 packs the weights into persistent buckets on its device (one batched copy) and hands
    out their handles (`rlasync.weights.ipc`: CUDA IPC on a shared GPU, shared memory on the CPU) as the ticket;
    an engine maps them once and replays one batched copy per sync (`rlasync.engine.weights.CopyPlan`).
A broadcast receiver stages up to `staging_bytes` while its engine still generates (`load_while_pausing`); an
engine with its own receiver (vLLM: its workers join the group and receive in place) gets `EngineNativeReceiver`.

Every learner rank holds a sender (gathers are collectives under FSDP2: each rank iterates the stream in the phase
where rank 0 consumes it); only rank 0's sends. No ray here: the actor shells call these.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from rlasync.config.vocab import AUTO, WeightTransport, parse_weight_sync_backend
from rlasync.weights.adapter import is_adapter_manifest
from rlasync.weights.apply import load_between_steps, load_while_pausing, paused_for_update
from rlasync.weights.broadcast import DEFAULT_BUCKET_BYTES, WeightGroup, device_identity, free_port
from rlasync.weights.plan import ManifestEntry

NamedTensors = Iterable[tuple[str, torch.Tensor]]


class WeightTransportNotOpen(RuntimeError):
    """A weight sync reached an engine whose receiver is not open (`sync_weights` before `open_weight_transport`):
    a restarted GenerationActor. Raised by the engine's actor and recognised by type on the driver (across Ray the
    error is also an instance of this class: `RayTaskError.as_instanceof_cause`)."""


@dataclass(frozen=True)
class TransportPlan:
    """How one run's weight syncs travel, decided once (`choose_transport`) and handed to every member."""

    kind: WeightTransport
    host: str  # learner rank 0's address: the broadcast group's store
    port: int
    world_size: int  # 1 (learner rank 0) + the number of engines
    timeout_s: float
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    staging_bytes: int = 0  # a broadcast receiver's bytes received before its engine has paused
    copy_events: bool = True  # IPC on CUDA: engines record an event behind their copies instead of waiting for them

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", WeightTransport(self.kind))
        if self.bucket_bytes < 1:
            raise ValueError(f"weight transport bucket_bytes must be >= 1, got {self.bucket_bytes}")


def _place(info: Mapping[str, Any]) -> tuple[Any, Any, Any]:
    return info["node"], info["device"], info.get("gpu")


def group_device(plan: TransportPlan, device: torch.device | str) -> torch.device:
    """Where a broadcast member's buckets sit: its own device over NCCL, the host over gloo."""
    return torch.device(device) if plan.kind.traits.device == "cuda" else torch.device("cpu")


def choose_kind(
    sender: Mapping[str, Any], receivers: Sequence[Mapping[str, Any]], requested: str = AUTO
) -> tuple[WeightTransport, str | None]:
    """The transport kind from every rank's `device_identity`: `(kind, why_not_nccl)`.

    "auto": NCCL when every rank is on a GPU and no two ranks share one (same node and GPU); CUDA IPC when every
    engine shares learner rank 0's GPU (NCCL cannot pair a GPU with itself; on one H200 an IPC sync of the 0.6B shape
    took 0.14 s inside GRPO against 1.7 s through the CPU); gloo otherwise, with a reason when a GPU was involved
    (for a one-time warning). "nccl" and "ipc" (every engine on the sender's node and
    device) raise `ValueError` where they cannot work; "gloo" is always honoured.
    """
    requested = parse_weight_sync_backend(requested)
    if requested == WeightTransport.GLOO:
        return WeightTransport.GLOO, None
    if requested != AUTO and requested.traits.same_device:
        place = _place(sender)
        away = [i for i, info in enumerate(receivers) if _place(info) != place]
        if away:
            raise ValueError(
                f"cluster.weight_sync_backend={requested.value!r} needs every engine on learner rank 0's node and "
                f"device ({place[1]}{'' if place[2] is None else ' ' + str(place[2])}); engine(s) {away} are elsewhere"
            )
        return requested, None
    ranks = [sender, *receivers]
    on_gpu = [info["device"] == "cuda" for info in ranks]
    if all(on_gpu):
        keys = [(info["node"], info["gpu"]) for info in ranks]
        if len(set(keys)) == len(keys):
            return WeightTransport.NCCL, None
        one_gpu = all(_place(info) == _place(sender) for info in receivers)
        if one_gpu and requested == AUTO:
            return WeightTransport.IPC, None  # one GPU for all: share the weights by CUDA IPC handle
        reason = (
            "learner rank 0 and every generation engine share one GPU, and NCCL needs a distinct GPU per rank"
            if one_gpu
            else "some generation engines share a GPU with learner rank 0 or with each other (fractional num_gpus) and "
            "others do not: NCCL needs a distinct GPU per rank and CUDA IPC one GPU for all, so weights go through "
            "the CPU over gloo (put every engine on learner rank 0's GPU, or each on its own GPU)"
        )
    elif any(on_gpu):
        reason = "some weight-sync ranks have no GPU: weights go through the CPU over gloo"
    else:
        reason = "no weight-sync rank has a GPU"
    if requested == WeightTransport.NCCL:
        raise ValueError(f"cluster.weight_sync_backend='nccl' is not possible here: {reason}")
    return WeightTransport.GLOO, reason if any(on_gpu) else None


def choose_transport(
    sender_info: Mapping[str, Any],
    receiver_infos: Sequence[Mapping[str, Any]],
    requested: str = AUTO,
    *,
    host: str,
    port: int,
    timeout_s: float,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    staging_bytes: int = 0,
    copy_events: bool = True,
) -> tuple[TransportPlan, str | None]:
    """The run's `TransportPlan` from learner rank 0's and every engine's device identity (pure: dicts in, plan
    out), and why NCCL was not chosen when a GPU was involved (None otherwise)."""
    kind, why_not_nccl = choose_kind(sender_info, receiver_infos, requested)
    plan = TransportPlan(
        kind=kind,
        host=host,
        port=int(port),
        world_size=1 + len(receiver_infos),
        timeout_s=float(timeout_s),
        bucket_bytes=max(1, int(bucket_bytes)),
        staging_bytes=max(0, int(staging_bytes)) if kind.traits.stages else 0,
        copy_events=bool(copy_events),
    )
    return plan, why_not_nccl


# ---- senders (learner side) -------------------------------------------------------------------------------------


class WeightSender(Protocol):
    """Learner side of a sync; `prepare`, `send` and `finish` run on every learner rank, in that order."""

    def prepare(self, stream: NamedTensors) -> Any: ...  # the ticket every engine gets (None: nothing to hand out)

    def send(self, stream: NamedTensors) -> None: ...

    def finish(self) -> None: ...

    def close(self) -> None: ...


class BroadcastSender:
    """Learner rank 0 of the broadcast group (NCCL from its GPU, gloo through the CPU): `send` gathers and
    broadcasts bucket by bucket while the engines receive."""

    streams_in = "send"

    def __init__(self, plan: TransportPlan, device: torch.device | str, manifest: Sequence[ManifestEntry]) -> None:
        self.manifest = list(manifest)
        self.group = WeightGroup.open(
            plan.host,
            plan.port,
            0,
            plan.world_size,
            plan.timeout_s,
            backend=plan.kind.traits.process_group,
            device=group_device(plan, device),
            bucket_bytes=plan.bucket_bytes,
        )

    def prepare(self, stream: NamedTensors) -> None:
        return None

    def send(self, stream: NamedTensors) -> None:
        self.group.send(stream, self.manifest)

    def finish(self) -> None:
        pass

    def close(self) -> None:
        self.group.close()


class IpcSender:
    """Learner rank 0 without a group: `prepare` fills persistent shareable buckets on its device (allocated at the
    first sync, reused by every later one: same handles, which each engine maps once) and returns an `IpcTicket`
    once the copies are done; the buckets live until `close`. An engine copies out of them inside its sync call,
    which returns once its copies are done or, on CUDA, once they are queued with the ticket's event for it recorded
    behind them (`IpcTicket.done_events`): the next `prepare` puts its refill behind every engine's event, so it
    never overwrites what is being read."""

    streams_in = "prepare"

    def __init__(self, plan: TransportPlan, device: torch.device | str, manifest: Sequence[ManifestEntry]) -> None:
        from rlasync.weights.ipc import CopyEvents

        self.manifest, self.device, self.bucket_bytes = list(manifest), torch.device(device), plan.bucket_bytes
        self.shared: Any = None
        # None (CPU, plan.copy_events off, or none to be had): each engine waits for its copies inside the sync
        self.copies = CopyEvents.make(plan.world_size - 1, self.device) if plan.copy_events else None

    def prepare(self, stream: NamedTensors) -> Any:
        from rlasync.weights.ipc import IpcTicket, SharedWeights

        start = time.perf_counter()
        if self.shared is None:
            self.shared = SharedWeights.allocate(self.manifest, self.device, self.bucket_bytes)
        if self.copies is not None:
            self.copies.wait()  # the engines' copies of the previous sync (long done, as a rule) come first
        self.shared.fill(stream, self.manifest)
        self.shared.synchronize()  # the engines read these bytes from another process
        done_events = self.copies.handles if self.copies is not None else ()
        return IpcTicket(self.shared.key, self.shared.handles(), time.perf_counter() - start, done_events)

    def send(self, stream: NamedTensors) -> None:
        pass

    def finish(self) -> None:
        pass  # the buckets persist: the next sync refills them

    def close(self) -> None:
        if self.shared is not None:
            self.shared.release()
            self.shared = None


class GatherOnlySender:
    """A learner rank other than 0: iterates the stream (each `full_tensor()` is a collective under FSDP2) in the
    phase where rank 0's sender consumes it, and sends nothing."""

    def __init__(self, streams_in: str) -> None:
        self.streams_in = streams_in

    def _drain(self, stream: NamedTensors, phase: str) -> None:
        if phase == self.streams_in:
            for _ in stream:
                pass

    def prepare(self, stream: NamedTensors) -> None:
        self._drain(stream, "prepare")

    def send(self, stream: NamedTensors) -> None:
        self._drain(stream, "send")

    def finish(self) -> None:
        pass

    def close(self) -> None:
        pass


SENDERS: dict[WeightTransport, type[BroadcastSender] | type[IpcSender]] = {
    WeightTransport.NCCL: BroadcastSender,
    WeightTransport.GLOO: BroadcastSender,
    WeightTransport.IPC: IpcSender,
}


def make_sender(
    plan: TransportPlan, device: torch.device | str, *, manifest: Sequence[ManifestEntry], rank: int = 0
) -> WeightSender:
    """Learner rank `rank`'s sender for `plan` (rank 0 joins the broadcast group here: every member at once)."""
    sender_cls = SENDERS[plan.kind]
    if rank != 0:
        return GatherOnlySender(sender_cls.streams_in)
    return sender_cls(plan, device, manifest)


# ---- receivers (engine side) ------------------------------------------------------------------------------------


class WeightReceiver(Protocol):
    async def load_into(self, engine: Any, ticket: Any) -> dict[str, float]: ...

    def close(self) -> None: ...


@runtime_checkable
class SelfReceivingEngine(Protocol):
    """An engine whose own workers join the weight-sync group and receive in place (vLLM's)."""

    async def join_weight_group(
        self,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        timeout_s: float,
        backend: str = "gloo",
        bucket_bytes: int | None = None,
    ) -> None: ...

    async def receive_weights(self, manifest: Iterable[Any]) -> Any: ...

    @property
    def is_paused(self) -> bool: ...


class BroadcastReceiver:
    """Rank `rank` of the broadcast group: receives one broadcast per sync, staging up to `staging_bytes` while
    the engine still generates, and loads it (`load_while_pausing`). NCCL buffers sit on the engine's GPU; gloo's
    on the CPU."""

    def __init__(
        self, plan: TransportPlan, rank: int, manifest: Sequence[ManifestEntry], device: torch.device | str
    ) -> None:
        self.manifest, self.staging_bytes = list(manifest), plan.staging_bytes
        self.group = WeightGroup.open(
            plan.host,
            plan.port,
            rank,
            plan.world_size,
            plan.timeout_s,
            backend=plan.kind.traits.process_group,
            device=group_device(plan, device),
            bucket_bytes=plan.bucket_bytes,
        )

    async def load_into(self, engine: Any, ticket: Any = None) -> dict[str, float]:
        return await load_while_pausing(engine, self.group.receive(self.manifest), self.staging_bytes)

    def close(self) -> None:
        self.group.close()


class IpcReceiver:
    """Maps learner rank 0's persistent buckets (the ticket's handles; once per bucket set, cached by its key),
    then pauses, loads (the engine may replay a copy plan cached for that key: one batched copy) and resumes.
    Pausing may start earlier (`begin`, while the learner packs): the step in flight drains meanwhile. An engine
    that `loads_between_steps` (the built-in one) is not paused: its copies queue behind its launched steps."""

    def __init__(
        self,
        manifest: Sequence[ManifestEntry],
        *,
        between_steps: bool = False,
        rank: int = 0,
        device: torch.device | str = "cpu",
    ) -> None:
        self.manifest = list(manifest)
        self.mapped: Any = None
        self.between_steps = between_steps
        self.rank, self.device = rank, torch.device(device)  # which of the ticket's `done_events` is this engine's

    @property
    def pauses_early(self) -> bool:
        """The actor's `begin_sync` starts a pause only for a paused load."""
        return not self.between_steps

    def stage(self, ticket: Any) -> Any:
        """The ticket's buckets as `MappedWeights` (mapped again only when the buckets changed)."""
        from rlasync.weights.ipc import IpcTicket, MappedWeights

        if ticket is None:
            raise RuntimeError("an ipc weight sync needs learner rank 0's handles as its ticket")
        if not isinstance(ticket, IpcTicket):  # bare handles (one-off buckets): mapped for this sync only
            return MappedWeights("", ticket)
        if self.mapped is None or self.mapped.key != ticket.key:
            self.mapped = MappedWeights(ticket.key, ticket.handles)
        return self.mapped

    async def load_into(
        self, engine: Any, ticket: Any, pausing: Any = None, *, inline: bool = False
    ) -> dict[str, float]:
        """`inline`: a load between steps blocks the calling thread (`load_between_steps`)."""
        start = time.perf_counter()
        mapped = self.stage(ticket)
        staged = time.perf_counter()
        if self.between_steps and pausing is None:
            done = self._done_event(engine, ticket)
            phases = await load_between_steps(engine, mapped, inline=inline, done_event=done)
        else:
            phases = await load_while_pausing(engine, iter(()), 0, load=mapped, pausing=pausing)
        return {**phases, "stage_s": staged - start, "pack_s": float(getattr(ticket, "pack_s", 0.0))}

    def _done_event(self, engine: Any, ticket: Any) -> Any:
        """This engine's copy event: opened here, or as its raw handle for an engine whose workers record it
        (`copy_event_handles`: vLLM's; this process then needs no CUDA context of its own)."""
        if not getattr(engine, "copy_event_handles", False):
            return ticket.done_event(self.rank, self.device) if hasattr(ticket, "done_event") else None
        events = getattr(ticket, "done_events", ())
        return bytes(events[self.rank - 1]) if self.device.type == "cuda" and 0 < self.rank <= len(events) else None

    def close(self) -> None:
        self.mapped = None


class EngineNativeReceiver:
    """An engine whose own workers are the group's ranks (`SelfReceivingEngine`): they receive in place while the
    engine is paused (`paused_for_update`: the pause is measured apart from the load)."""

    def __init__(self, manifest: Sequence[ManifestEntry]) -> None:
        self.manifest = list(manifest)

    @classmethod
    async def open(
        cls, plan: TransportPlan, rank: int, manifest: Sequence[ManifestEntry], engine: SelfReceivingEngine
    ) -> EngineNativeReceiver:
        await engine.join_weight_group(
            plan.host,
            plan.port,
            rank,
            plan.world_size,
            plan.timeout_s,
            plan.kind.traits.process_group,
            plan.bucket_bytes,
        )
        return cls(manifest)

    async def load_into(self, engine: Any, ticket: Any = None) -> dict[str, float]:
        start = time.perf_counter()
        async with paused_for_update(engine):
            paused = time.perf_counter()
            await engine.receive_weights(self.manifest)
            loaded = time.perf_counter()
        end = time.perf_counter()
        return {"pause_s": paused - start, "load_s": loaded - paused, "resume_s": end - loaded, "total_s": end - start}

    def close(self) -> None:
        pass


async def make_receiver(
    plan: TransportPlan, rank: int, manifest: Sequence[ManifestEntry], engine: Any, device: torch.device | str
) -> WeightReceiver:
    """Engine `rank`'s receiver for `plan` (1-based: learner rank 0 is rank 0 of the group); joins the broadcast
    group here (every member at once). "ipc" maps handles; an engine with its own receiver receives in place (full weights only: a LoRA
    adapter sync goes through the engine's `load_weights`, which loads it as a runtime adapter)."""
    if plan.kind.traits.process_group is None:
        opener = getattr(engine, "open_loads_between_steps", None)  # vLLM's sync door (`direct_sync`)
        if opener is not None:
            await opener()
        between = bool(getattr(engine, "loads_between_steps", False))
        return IpcReceiver(manifest, between_steps=between, rank=rank, device=device)
    if isinstance(engine, SelfReceivingEngine) and not is_adapter_manifest(manifest):  # adapters: load_weights
        return await EngineNativeReceiver.open(plan, rank, manifest, engine)
    return BroadcastReceiver(plan, rank, manifest, device)


__all__ = [
    "BroadcastReceiver",
    "BroadcastSender",
    "EngineNativeReceiver",
    "GatherOnlySender",
    "IpcReceiver",
    "IpcSender",
    "SelfReceivingEngine",
    "TransportPlan",
    "WeightReceiver",
    "WeightSender",
    "WeightTransportNotOpen",
    "choose_kind",
    "choose_transport",
    "device_identity",
    "free_port",
    "group_device",
    "make_receiver",
    "make_sender",
    "paused_for_update",
]
