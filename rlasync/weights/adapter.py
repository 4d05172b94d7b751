"""LoRA (peft) on both sides of a weight sync: the checks of the user's `LoraConfig`, the learner's adapter payload,
the merged fallback payload, the engine-side merge, and the peft-format adapter directory a vLLM engine loads.

    check_peft_config(config)                       # at trainer construction: refuses LM head / embedding adapters
    adapter_stream(model, dtype)                    # learner, lora_sync="adapter": ("<module>.lora_A.weight", A),
                                                    #   ("<module>.lora_B.weight", s * B) per LoRA module
    merged_stream(model, dtype)                     # learner, lora_sync="merged": every base weight, W0 + s * B @ A
    AdapterMerger().load(engine_model, stream)      # built-in engine: W = W0 + B' @ A (W0 kept: no accumulation)
    write_adapter(directory, tensors, base_model)   # vLLM: a peft directory, scaling folded (lora_alpha = r)

The scaling `s = lora_alpha / r` (or rsLoRA's) is folded into B on the wire, so an engine needs no adapter config: one
sync is pairs of tensors under the engine's own module names. Pure torch (no ray); gathers of FSDP2 shards happen in
`full_tensor()` on every rank, as for the full weight stream (`rlasync.weights.plan`).
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from rlasync.config.vocab import EngineKind, LoraMode, LoraSync, parse_lora_sync
from rlasync.weights.plan import ManifestEntry, TensorStream, foreach_copy, transfer_name

if TYPE_CHECKING:
    from peft import PeftConfig

LORA_A, LORA_B = ".lora_A.weight", ".lora_B.weight"
ADAPTER_NAME_PREFIX = "rlasync-v"  # vLLM adapters are named rlasync-v{k}: the k-th adapter sync of this engine
REFUSED_TARGETS = ("lm_head", "embed_tokens", "wte", "wpe", "embed_out", "word_embeddings")


ADAPTER_CONFIG = "adapter_config.json"


def adapter_base(path: str) -> str:
    """The base model of a LoRA checkpoint (its `adapter_config.json`'s `base_model_name_or_path`), else `path`:
    a resumed LoRA run loads the base there (learner and engines) and the checkpoint's adapter on top."""
    config_file = Path(path) / ADAPTER_CONFIG
    if not config_file.is_file():
        return path
    base = json.loads(config_file.read_text()).get("base_model_name_or_path")
    if not base:
        raise ValueError(f"{config_file} names no base_model_name_or_path: cannot load the base model")
    return str(base)


def is_adapter_checkpoint(path: str | None) -> bool:
    return path is not None and (Path(path) / ADAPTER_CONFIG).is_file()


# ---- the user's config ----------------------------------------------------------------------------------------


def check_peft_config(peft_config: object, field: str = "peft_config") -> PeftConfig | None:
    """`peft_config` checked for what rlasync supports (a `peft.LoraConfig`, adapters on linear layers of the
    decoder only); returns it. `ValueError` names the field and the fix otherwise."""
    if peft_config is None:
        return None
    try:
        from peft import LoraConfig
    except ImportError as exc:  # pragma: no cover - peft is a dependency
        raise ImportError(f"{field} needs peft: pip install peft") from exc
    if not isinstance(peft_config, LoraConfig):
        raise ValueError(f"{field}: only peft.LoraConfig is supported, got {type(peft_config).__name__}")
    if peft_config.modules_to_save:
        raise ValueError(
            f"{field}.modules_to_save={peft_config.modules_to_save!r}: fully trained modules (LM head, embeddings) "
            "are not supported with LoRA sync; set modules_to_save=None (train adapters only)"
        )
    if getattr(peft_config, "trainable_token_indices", None):
        raise ValueError(f"{field}.trainable_token_indices: trainable embedding rows are not supported; set it to None")
    if getattr(peft_config, "use_dora", False):
        raise ValueError(f"{field}.use_dora=True: DoRA cannot be merged as W0 + s*B@A; set use_dora=False")
    targets = peft_config.target_modules
    if isinstance(targets, str):  # "all-linear" (peft leaves the output layer out) or a regex
        named = [] if targets == "all-linear" else [targets]
    else:
        named = list(targets or [])
    refused = [t for t in named if any(word in t for word in REFUSED_TARGETS)]
    if refused:
        raise ValueError(
            f"{field}.target_modules={targets!r} names {refused}: adapters on the LM head or the embeddings are not "
            "supported (the chunked head reads the head weight directly); target the decoder's linear layers, e.g. "
            "target_modules='all-linear'"
        )
    return peft_config


def check_lora_sync(value: str, field: str = "cluster.lora_sync") -> LoraSync:
    return parse_lora_sync(value, field)


def lora_engine_kwargs(peft_config: PeftConfig, engine: str, *, max_loras: int, lora_dir: str) -> dict[str, Any]:
    """What an engine of kind `engine` needs to receive adapters of `peft_config` (merged into `engine_kwargs`), by
    its traits (`rlasync.config.vocab.EngineTraits`): vLLM in-process is started with `enable_lora`, `max_loras`,
    `max_lora_rank`; an engine of runtime adapters writes them under `lora_dir` (a folder a `vllm serve` must be
    able to read); one that merges them into its base weights (the built-in engine) needs nothing."""
    traits = EngineKind(engine).traits
    if peft_config is None or traits.lora is LoraMode.MERGED:
        return {}
    ranks = [int(peft_config.r), *(int(r) for r in (peft_config.rank_pattern or {}).values())]
    kwargs: dict[str, Any] = {"lora_dir": lora_dir, "max_loras": int(max_loras)}
    if traits.vllm_in_process:
        kwargs.update(enable_lora=True, max_lora_rank=_vllm_rank(max(ranks)))
    return kwargs


def _vllm_rank(rank: int) -> int:
    """vLLM's `max_lora_rank` accepts a fixed set of values: the smallest one >= `rank`."""
    for allowed in (1, 8, 16, 32, 64, 128, 256, 320, 512):
        if rank <= allowed:
            return allowed
    raise ValueError(f"peft_config.r={rank}: vLLM supports LoRA ranks up to 512")


# ---- learner side -----------------------------------------------------------------------------------------------


def lora_layers(model: torch.nn.Module) -> list[tuple[str, Any]]:
    """`(module name, peft LoRA Linear)` of every adapted layer of the (wrapped) HF model, in module order; a
    non-Linear LoRA layer (embedding, conv) raises `ValueError`."""
    from peft.tuners.lora import Linear, LoraLayer

    found = []
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer):
            if not isinstance(module, Linear):
                raise ValueError(f"LoRA on {name} ({type(module).__name__}): only linear layers are supported")
            found.append((name, module))
    return found


def _full(tensor: torch.Tensor) -> torch.Tensor:
    data = tensor.detach()
    full_tensor = getattr(data, "full_tensor", None)
    return full_tensor() if full_tensor is not None else data


def _adapter_of(layer: Any) -> str:
    names = list(layer.lora_A.keys())
    if len(names) != 1:
        raise ValueError(f"expected one LoRA adapter per layer, found {names}")
    return names[0]


def _pair(layer: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """(A [r, in], s * B [out, r]) of one layer, gathered, in float32 (the scaling folded into B)."""
    adapter = _adapter_of(layer)
    a = _full(layer.lora_A[adapter].weight).float()
    b = _full(layer.lora_B[adapter].weight).float() * float(layer.scaling[adapter])
    return a, b


def _cast(tensor: torch.Tensor, dtype: torch.dtype | None, reference: torch.dtype) -> torch.Tensor:
    return tensor.to(dtype if dtype is not None else reference)


def adapter_manifest(model: torch.nn.Module, dtype: torch.dtype | None = None) -> list[ManifestEntry]:
    """What an adapter sync sends, in stream order: A then B of each LoRA module (global shapes, no gathering)."""
    entries = []
    for name, layer in lora_layers(model):
        adapter = _adapter_of(layer)
        for suffix, weight in ((LORA_A, layer.lora_A[adapter].weight), (LORA_B, layer.lora_B[adapter].weight)):
            wire = dtype if dtype is not None else weight.dtype
            entries.append(
                ManifestEntry(transfer_name(name) + suffix, str(wire).removeprefix("torch."), tuple(weight.shape))
            )
    return entries


_LAYERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its LoRA layers and manifests


def _cached_layers(model: torch.nn.Module) -> dict[str, Any]:
    """The model's LoRA layers, read once per model (walking a 0.6B model's ~2,400 modules costs milliseconds per
    sync; adapters are not added to a model during a run), with its manifests per wire dtype."""
    cached = _LAYERS.get(model)
    if cached is None:
        cached = _LAYERS[model] = {"layers": lora_layers(model), "manifests": {}}
    return cached


class AdapterStream(TensorStream):
    """What `adapter_stream` returns: the pairs one at a time, or (`copy_into`, unsharded adapters) every A and
    s * B written into preallocated views in a few multi-tensor ops (an s * B is computed in float32 and rounded
    once, as the one-at-a-time path does)."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype | None, device: torch.device | str | None) -> None:
        self._model, self._dtype, self._device = model, dtype, device
        self._cache = _cached_layers(model)
        super().__init__(self._generate())

    def _generate(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, layer in self._cache["layers"]:
            reference = layer.lora_A[_adapter_of(layer)].weight.dtype
            a, b = _pair(layer)
            target = transfer_name(name)
            yield target + LORA_A, _cast(a, self._dtype, reference).to(self._device)
            yield target + LORA_B, _cast(b, self._dtype, reference).to(self._device)

    def entries(self) -> list[ManifestEntry] | None:
        manifests = self._cache["manifests"]
        if self._dtype not in manifests:
            manifests[self._dtype] = adapter_manifest(self._model, self._dtype)
        return manifests[self._dtype]

    def copy_into(self, views: list[torch.Tensor]) -> bool:
        if "weights" not in self._cache:
            a_list, b_list, scales = [], [], []
            for _, layer in self._cache["layers"]:
                adapter = _adapter_of(layer)
                a_list.append(layer.lora_A[adapter].weight)
                b_list.append(layer.lora_B[adapter].weight)
                scales.append(float(layer.scaling[adapter]))
            self._cache["weights"] = (a_list, b_list, scales)
        a_list, b_list, scales = self._cache["weights"]
        if self._started or any(hasattr(t, "full_tensor") for t in a_list + b_list):
            return False
        if len(views) != 2 * len(a_list):
            raise ValueError(f"adapter stream has {2 * len(a_list)} tensors, the buffer {len(views)}: they differ")
        with torch.no_grad():
            scaled = torch._foreach_mul([b.detach().float() for b in b_list], scales)
            foreach_copy(list(views[0::2]) + list(views[1::2]), [a.detach() for a in a_list] + list(scaled))
        self._started = True
        return True


def adapter_stream(
    model: torch.nn.Module, dtype: torch.dtype | None = None, device: torch.device | str | None = None
) -> AdapterStream:
    """`(engine module name + ".lora_A.weight", A)`, `(... ".lora_B.weight", s * B)` per LoRA module, in manifest
    order; every rank of a sharded model iterates it (each gather is a collective). `copy_into(views)` writes them
    all in a few batched ops instead (an unsharded adapter: one process)."""
    return AdapterStream(model, dtype, device)


def _merged_parameters(model: torch.nn.Module) -> Iterator[tuple[str, torch.nn.Parameter, Any]]:
    """`(engine name, base parameter, LoRA layer or None)` of every base parameter, adapters excluded."""
    layers = {f"{name}.base_layer.weight": layer for name, layer in lora_layers(model)}
    for name, param in model.named_parameters():
        if ".lora_" in name:
            continue
        yield transfer_name(name), param, layers.get(name)


def merged_manifest(model: torch.nn.Module, dtype: torch.dtype | None = None) -> list[ManifestEntry]:
    """What a merged sync sends: every base parameter under its HF name (adapted ones merged), in stream order."""
    return [
        ManifestEntry(
            name,
            str(dtype if dtype is not None and p.dtype.is_floating_point else p.dtype).removeprefix("torch."),
            tuple(p.shape),
        )
        for name, p, _ in _merged_parameters(model)
    ]


def merged_stream(
    model: torch.nn.Module, dtype: torch.dtype | None = None, device: torch.device | str | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every base parameter, the adapted ones as W0 + s * B @ A (computed per layer in float32, the model's own
    weights untouched): the full weights of the merged model, for engines that take no adapter."""
    for name, param, layer in _merged_parameters(model):
        data = _full(param)
        if layer is not None:
            a, b = _pair(layer)
            delta = b @ a
            data = data.float() + (delta.T if layer.fan_in_fan_out else delta)
        wire = dtype if dtype is not None and param.dtype.is_floating_point else param.dtype
        yield name, data.to(device=device, dtype=wire)


def is_adapter_manifest(manifest: Iterable[Any]) -> bool:
    """Whether a sync's manifest is an adapter payload (LoRA A/B pairs) rather than full weights."""
    names = [entry.name for entry in manifest]
    return bool(names) and all(name.endswith((LORA_A, LORA_B)) for name in names)


def peek_adapter(named_tensors: Iterable[tuple[str, Any]]) -> tuple[Iterator[tuple[str, Any]], bool]:
    """`(the same stream, whether it is an adapter sync)` from its first name (the stream is not consumed)."""
    import itertools

    stream = iter(named_tensors)
    first = next(stream, None)
    if first is None:
        return iter(()), False
    return itertools.chain([first], stream), first[0].endswith(LORA_A)


def adapter_pairs(named_tensors: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    """`(module name, A, B')` from an adapter stream (A then B' per module, as `adapter_stream` sends them)."""
    pending: dict[str, torch.Tensor] = {}
    for name, value in named_tensors:
        tensor = torch.as_tensor(value)
        if name.endswith(LORA_A):
            pending[name.removesuffix(LORA_A)] = tensor
        elif name.endswith(LORA_B):
            module = name.removesuffix(LORA_B)
            if module not in pending:
                raise ValueError(f"adapter stream: {name} arrived before its {module}{LORA_A}")
            yield module, pending.pop(module), tensor
        else:
            raise ValueError(f"adapter stream: {name!r} is not a LoRA A/B weight")
    if pending:
        raise ValueError(f"adapter stream ended without the B weights of {sorted(pending)[:3]}")


# ---- engine side ------------------------------------------------------------------------------------------------


class AdapterMerger:
    """The built-in engine's adapter sync: the first sync keeps a copy of each adapted base weight (W0); every sync
    sets W = W0 + B' @ A, so repeated syncs never accumulate. Modules of one shape (out, in, r, dtype) form a group:
    its W0 are kept stacked, and a sync is per group one stack of the A's and of the B's, one `baddbmm` (float32
    accumulation) and one batched copy into the engine's weights (`foreach_copy`), instead of a product, casts and
    a copy per module."""

    def __init__(self) -> None:
        self.base: dict[str, torch.Tensor] = {}  # module -> its W0 (a view into its group's stack)
        self._groups: list[tuple[list[str], list[torch.Tensor], torch.Tensor]] = []  # (modules, weights, W0 stack)
        self._signature: tuple[str, ...] = ()

    def load(self, model: torch.nn.Module, named_tensors: Iterable[tuple[str, Any]]) -> int:
        """Merge every `(module, A, B')` pair of the stream into `model`'s `<module>.weight`; returns the count."""
        from rlasync.weights.plan import foreach_copy

        pairs = {module: (a, b) for module, a, b in adapter_pairs(named_tensors)}
        if tuple(pairs) != self._signature:
            self._group(model, pairs)
        with torch.no_grad():
            for modules, weights, base in self._groups:
                a = torch.stack([pairs[m][0] for m in modules]).to(base.device, base.dtype)
                b = torch.stack([pairs[m][1] for m in modules]).to(base.device, base.dtype)
                foreach_copy(weights, list(torch.baddbmm(base, b, a).unbind(0)))
        return len(pairs)

    def _group(self, model: torch.nn.Module, pairs: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Group the adapted modules by shape and keep their W0 stacked (W0 of modules seen before: as kept)."""
        params = dict(model.named_parameters(remove_duplicate=False))
        groups: dict[tuple, list[str]] = {}
        for module, (a, b) in pairs.items():
            target = params.get(module + ".weight")
            if target is None:
                raise ValueError(f"adapter sync: the engine's model has no parameter {module}.weight")
            delta_shape = (b.shape[0], a.shape[1])
            if tuple(target.shape) != delta_shape:
                raise ValueError(f"adapter sync: {module} B@A is {delta_shape}, the weight {tuple(target.shape)}")
            key = (target.device, target.dtype, *target.shape, a.shape[0])
            groups.setdefault(key, []).append(module)
        built = []
        with torch.no_grad():
            for modules in groups.values():
                weights = [params[m + ".weight"].detach() for m in modules]
                base = torch.stack([self.base.get(m, w) for m, w in zip(modules, weights)])
                built.append((modules, weights, base))
        self.base = {m: base[i] for modules, _, base in built for i, m in enumerate(modules)}
        self._groups, self._signature = built, tuple(pairs)


def write_adapter(
    directory: str | Path, pairs: Iterable[tuple[str, torch.Tensor, torch.Tensor]], base_model: str | None = None
) -> Path:
    """A peft adapter directory (`adapter_config.json`, `adapter_model.safetensors`) from `(module, A, B')` pairs
    whose scaling is folded into B' (so `lora_alpha = r`, scaling 1), which vLLM's `LoRARequest` (and
    `PeftModel.from_pretrained`) loads. Written to a temporary name, then renamed (a reader never sees half)."""
    from safetensors.torch import save_file

    path = Path(directory)
    tmp = path.with_name(path.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    ranks: dict[str, int] = {}
    for module, a, b in pairs:
        tensors[f"base_model.model.{module}.lora_A.weight"] = a.detach().contiguous().cpu()
        tensors[f"base_model.model.{module}.lora_B.weight"] = b.detach().contiguous().cpu()
        ranks[module] = int(a.shape[0])
    if not tensors:
        raise ValueError("write_adapter: no LoRA weights to write")
    rank = max(ranks.values())
    others = {module: r for module, r in ranks.items() if r != rank}
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": rank,
        "lora_alpha": rank,
        "rank_pattern": others,
        "alpha_pattern": dict(others),
        "use_rslora": False,
        "use_dora": False,
        "bias": "none",
        "fan_in_fan_out": False,
        "lora_dropout": 0.0,
        "target_modules": sorted({module.rsplit(".", 1)[-1] for module in ranks}),
        "modules_to_save": None,
    }
    save_file(tensors, str(tmp / "adapter_model.safetensors"))
    (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2))
    if path.exists():
        import shutil

        shutil.rmtree(path)
    tmp.rename(path)
    return path


__all__ = [
    "ADAPTER_NAME_PREFIX",
    "AdapterMerger",
    "LoraSync",
    "adapter_base",
    "adapter_manifest",
    "adapter_pairs",
    "adapter_stream",
    "check_lora_sync",
    "check_peft_config",
    "is_adapter_checkpoint",
    "is_adapter_manifest",
    "lora_engine_kwargs",
    "lora_layers",
    "merged_manifest",
    "merged_stream",
    "peek_adapter",
    "write_adapter",
]
