"""The named choices of a run, each defined once, with what differs between its members (capability tables):

    EngineKind       cluster.engine               torch | vllm | vllm_server             ENGINE_TRAITS
    WeightTransport  cluster.weight_sync_backend  nccl | gloo | ipc (request: or auto)    TRANSPORT_TRAITS
    Tracker          report_to                    tensorboard | wandb | trackio | mlflow TRACKER_TRAITS
                                                  (or "all" installed, "none")
    LoraSync         cluster.lora_sync            adapter | merged

Each is a `StrEnum` (a member is its string: YAML, JSON and `==` with a plain string all work). Code asks a member's
traits (`EngineKind(kind).traits.remote`) instead of testing a name; a test checks that the names are spelled only
here. The `parse_*` functions are the one check of each field (the config calls them; an error names the field and
the allowed values). A leaf: imports nothing of rlasync, neither torch nor ray.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Literal

# ---- generation engines ----------------------------------------------------------------------------------------


class LoraMode(StrEnum):
    """How an engine takes a LoRA adapter sync (`cluster.lora_sync="adapter"`)."""

    MERGED = "merged"
    """Merges the adapter into its own base weights at each sync (needs no engine options)."""
    RUNTIME = "runtime"
    """Loads it as a runtime adapter from a folder (`lora_dir`, at most `max_loras` at once)."""


@dataclass(frozen=True)
class EngineTraits:
    remote: bool
    """Generation runs in a server outside the actor (`vllm serve`): the actor holds no GPU for it, its request and
    weight calls have HTTP timeouts, and its `max_model_len` is known only once the server answers."""
    needs_url: bool
    """Needs `cluster.vllm_server_url` (other kinds refuse one)."""
    lora: LoraMode
    vllm_in_process: bool
    """vLLM's AsyncLLM inside the actor: LoRA is enabled at start-up (`enable_lora`, `max_lora_rank`)."""


class EngineKind(StrEnum):
    """`cluster.engine`: what each GenerationActor (and a local teacher) runs."""

    TORCH = "torch"
    VLLM = "vllm"
    VLLM_SERVER = "vllm_server"

    @property
    def traits(self) -> EngineTraits:
        return ENGINE_TRAITS[self]


ENGINE_TRAITS: dict[EngineKind, EngineTraits] = {
    # the built-in engine, CPU or GPU
    EngineKind.TORCH: EngineTraits(remote=False, needs_url=False, lora=LoraMode.MERGED, vllm_in_process=False),
    # vLLM's AsyncLLM in the actor, on its GPU
    EngineKind.VLLM: EngineTraits(remote=False, needs_url=False, lora=LoraMode.RUNTIME, vllm_in_process=True),
    # a client of `vllm serve` at cluster.vllm_server_url
    EngineKind.VLLM_SERVER: EngineTraits(remote=True, needs_url=True, lora=LoraMode.RUNTIME, vllm_in_process=False),
}

# ---- weight transports -----------------------------------------------------------------------------------------

AUTO: Literal["auto"] = "auto"
"""`cluster.weight_sync_backend="auto"`: chosen from the layout (rlasync.weights.transport.choose_kind)."""


@dataclass(frozen=True)
class TransportTraits:
    process_group: str | None
    """The torch.distributed backend of the broadcast group every member joins (None: no group). A group is
    re-opened on every member when one joins or restarts; without one only that engine opens its receiver."""
    device: Literal["cuda", "cpu", "sender"]
    """Where the received buckets sit: the engine's GPU, the host, or learner rank 0's own buckets (mapped)."""
    same_device: bool
    """Every engine must share learner rank 0's node and device."""
    stages: bool
    """Received while the engine still generates (up to `weight_sync_staging_mb`); otherwise nothing to stage."""


class WeightTransport(StrEnum):
    """How the weights travel from learner rank 0 to the engines (`TransportPlan.kind`)."""

    NCCL = "nccl"
    GLOO = "gloo"
    IPC = "ipc"

    @property
    def traits(self) -> TransportTraits:
        return TRANSPORT_TRAITS[self]


TRANSPORT_TRAITS: dict[WeightTransport, TransportTraits] = {
    WeightTransport.NCCL: TransportTraits(process_group="nccl", device="cuda", same_device=False, stages=True),
    WeightTransport.GLOO: TransportTraits(process_group="gloo", device="cpu", same_device=False, stages=True),
    WeightTransport.IPC: TransportTraits(process_group=None, device="sender", same_device=True, stages=False),
}

# ---- trackers ----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TrackerTraits:
    module: str
    """The package its sink imports."""
    extra: str
    """`pip install 'rlasync[<extra>]'` installs it."""


class Tracker(StrEnum):
    """A `report_to` metric sink besides `<output_dir>/metrics.jsonl` (always written)."""

    TENSORBOARD = "tensorboard"
    WANDB = "wandb"
    TRACKIO = "trackio"
    MLFLOW = "mlflow"

    @property
    def traits(self) -> TrackerTraits:
        return TRACKER_TRAITS[self]


TRACKER_TRAITS: dict[Tracker, TrackerTraits] = {t: TrackerTraits(module=t.value, extra=t.value) for t in Tracker}
REPORT_ALL, REPORT_NONE = "all", "none"
"""`report_to="all"`: every tracker whose package is installed (as transformers); "none": metrics.jsonl only."""
REPORT_TO: tuple[str, ...] = (*Tracker, REPORT_ALL, REPORT_NONE)

# ---- LoRA syncs ----------------------------------------------------------------------------------------------------


class LoraSync(StrEnum):
    """`cluster.lora_sync`: what a LoRA run sends at each weight sync."""

    ADAPTER = "adapter"
    MERGED = "merged"


# ---- the checks ----------------------------------------------------------------------------------------------------


def _choices(values: Sequence[str]) -> str:
    """'a', 'b' or 'c'."""
    names = [repr(str(v)) for v in values]
    return ", ".join(names[:-1]) + f" or {names[-1]}" if len(names) > 1 else "".join(names)


def parse_engine(value: object, field: str = "cluster.engine") -> EngineKind:
    try:
        return EngineKind(value)
    except ValueError:
        raise ValueError(f"{field}={value!r}: must be one of {_choices(list(EngineKind))}") from None


def parse_weight_sync_backend(
    value: object, field: str = "cluster.weight_sync_backend"
) -> WeightTransport | Literal["auto"]:
    if value == AUTO:
        return AUTO
    try:
        return WeightTransport(value)
    except ValueError:
        raise ValueError(f"{field}={value!r}: choose one of {_choices([AUTO, *WeightTransport])}") from None


def parse_report_to(value: object, field: str = "report_to") -> list[str]:
    """`report_to` as a list of `Tracker`s (or ["all"]): "none", "" and None are the empty list."""
    if value in (None, "", REPORT_NONE):
        return []
    names = [value] if isinstance(value, str) else list(value)  # type: ignore[call-overload]
    unknown = sorted(str(n) for n in set(names) - set(REPORT_TO))
    if unknown:
        raise ValueError(
            f"{field}={[str(n) for n in names]}: unsupported sink(s) {unknown} (rlasync has no sink for them; "
            f"metrics.jsonl is always written); use {_choices(REPORT_TO)}"
        )
    return list(dict.fromkeys(n if n in (REPORT_ALL, REPORT_NONE) else Tracker(n) for n in names if n != REPORT_NONE))


def parse_lora_sync(value: object, field: str = "cluster.lora_sync") -> LoraSync:
    try:
        return LoraSync(value)
    except ValueError:
        raise ValueError(
            f"{field}={value!r}: use 'adapter' (send the LoRA weights only) or 'merged' (full weights)"
        ) from None


__all__ = [
    "AUTO",
    "ENGINE_TRAITS",
    "REPORT_ALL",
    "REPORT_NONE",
    "REPORT_TO",
    "TRACKER_TRAITS",
    "TRANSPORT_TRAITS",
    "EngineKind",
    "EngineTraits",
    "LoraMode",
    "LoraSync",
    "Tracker",
    "TrackerTraits",
    "TransportTraits",
    "WeightTransport",
    "parse_engine",
    "parse_lora_sync",
    "parse_report_to",
    "parse_weight_sync_backend",
]
