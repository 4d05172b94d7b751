"""`rlasync train CONFIG --dry-run`: the plan of a run and whether it fits its GPUs, without Ray or any actor.

    plan_run(spec, ...)     a trainer's own `build_spec(None)` (the RunSpec a real run launches: its actor
                            requests, model, teachers) -> one `ActorPlan` per actor in the Cluster's spawn order (engines,
                            teachers, learner ranks, queue, reward actors, rollout actors), each GPU actor placed
                            on GPUs as Ray packs them (a fraction shares a GPU with other fractions, first fit; a
                            whole number takes whole GPUs) with its memory:
                              engine   built-in: weights + the KV cache `TorchEngine` would allocate
                                       (`rlasync.engine.kv_cache.kv_cache_tokens`: kv_cache_tokens, else
                                       gpu_memory_utilization x GPU - memory in use, at most max_num_seqs x
                                       max_model_len) x layers x KV heads x head dim x 2 x dtype bytes;
                                       vLLM: gpu_memory_utilization x GPU (what vLLM reserves)
                              learner  one rank's peak: measured (a GPU here and a GRPO run:
                                       `rlasync.learner.dry_run.measure_in_subprocess`, one rank under torch's
                                       fake process group) or estimated (`estimate_rank_memory`, its formula,
                                       for rows of the measured step's shape: `step_shape`, `terms_per_row`)
                            + CUDA_CONTEXT_GIB per process on a GPU
    DryRunPlan.problems()   each GPU whose actors need more than it has, each fractional actor that needs more
                            than its share (Ray packs other actors into the rest), each measurement that failed
    dry_run(path, ...)      the CLI: print the plan (or one JSON line) and exit 0 when it fits, 1 when not

The model is read from its config only (built on the meta device): a local folder, a prepared alias or a hub id
in the local cache; nothing is downloaded. GPU memory comes from torch.cuda when a GPU is here, else
`--gpu-memory-gib` (default DEFAULT_GPU_MEMORY_GIB: an H200 as torch reports it).
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlasync.config.vocab import EngineKind
from rlasync.driver.spec import RunSpec, engine_dtype, step_budget

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from rlasync.learner.settings import LearnerSettings

GIB = 2**30
DEFAULT_GPU_MEMORY_GIB = 139.8  # an H200 (torch.cuda.get_device_properties(0).total_memory)
CUDA_CONTEXT_GIB = 0.5  # the CUDA context and kernels of one process on a GPU (not in torch's allocator counts)
MEASURE_MARGIN = 0.1  # a rank whose estimate is this much over its GPU share is refused without running its step
WEIGHT_SUFFIXES = ("safetensors", "bin", "pt", "pth", "gguf")  # a model folder's weight files
ENGINE_ELEMENT_SIZE = {"bfloat16": 2, "float16": 2, "float32": 4}
DEFAULT_ENGINE_SETTINGS = {"gpu_memory_utilization": 0.9, "max_num_seqs": 256}  # TorchEngine's and VLLMEngine's


@dataclass
class ActorPlan:
    """One actor of the plan: what it asks Ray for, where it lands, and the GPU memory it needs."""

    label: str  # "learner rank 0", "generation actor 1", ...
    role: str  # the requests' role ("generation", "learner", "rollout", ...)
    cpus: float
    gpus: float
    gpu_ids: tuple[int, ...] = ()
    memory_bytes: int = 0  # on its (first) GPU, the CUDA context included; 0 for a CPU actor
    note: str = ""  # how the memory was obtained


@dataclass
class DryRunPlan:
    """The whole plan: actors, GPU memory, the learner rank's figures and any measurement failure."""

    config_path: str
    algorithm: str
    model: str
    num_parameters: int
    actors: list[ActorPlan]
    gpu_bytes: float
    gpu_memory_source: str
    learner: dict[str, Any] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    @property
    def num_gpus(self) -> int:
        return 1 + max((i for actor in self.actors for i in actor.gpu_ids), default=-1)

    def gpu_usage(self) -> list[float]:
        used = [0.0] * self.num_gpus
        for actor in self.actors:
            if actor.gpu_ids:
                used[actor.gpu_ids[0]] += actor.memory_bytes
        return used

    def problems(self) -> list[str]:
        """Why the layout does not fit (empty: it fits)."""
        out = list(self.failures)
        for index, used in enumerate(self.gpu_usage()):
            if used > self.gpu_bytes:
                names = ", ".join(
                    f"{a.label} {a.memory_bytes / GIB:.1f}" for a in self.actors if a.gpu_ids[:1] == (index,)
                )
                out.append(
                    f"GPU {index}: the actors on it need {used / GIB:.1f} GiB ({names}) but it has "
                    f"{self.gpu_bytes / GIB:.1f} GiB"
                )
        for actor in self.actors:
            share = actor.gpus * self.gpu_bytes
            if 0 < actor.gpus < 1 and actor.memory_bytes > share:
                out.append(
                    f"{actor.label} needs {actor.memory_bytes / GIB:.1f} GiB but asks Ray for {actor.gpus:g} of a "
                    f"GPU ({share / GIB:.1f} GiB of {self.gpu_bytes / GIB:.1f}; Ray places other actors in the rest): "
                    f"raise cluster.{actor.role}_num_gpus, or use a smaller model / token_budget / engine_kwargs"
                )
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            **{k: v for k, v in asdict(self).items() if k != "actors"},
            "actors": [asdict(a) for a in self.actors],
            "num_gpus": self.num_gpus,
            "gpu_used_gib": [round(u / GIB, 3) for u in self.gpu_usage()],
            "fits": not self.problems(),
            "problems": self.problems(),
        }

    def describe(self) -> str:
        lines = [
            f"dry run of {self.config_path} ({self.algorithm}): model {self.model}, "
            f"{self.num_parameters / 1e6:.1f}M parameters; no Ray, no actors",
            "placement (the actors a run creates, in order; GPUs packed as Ray packs them):",
        ]
        for actor in self.actors:
            where = f"GPU {','.join(map(str, actor.gpu_ids))}" if actor.gpu_ids else "CPU"
            memory = f"{actor.memory_bytes / GIB:7.2f} GiB  {actor.note}" if actor.gpu_ids else actor.note
            lines.append(f"  {actor.label:<30} {actor.cpus:g} CPU  {actor.gpus:g} GPU  -> {where:<8} {memory}".rstrip())
        if self.learner:
            lines.append(f"learner rank 0 of {self.learner['world_size']}: {self.learner['summary']}")
        cpus = sum(a.cpus for a in self.actors)
        lines.append(f"GPU memory: {self.gpu_bytes / GIB:.1f} GiB per GPU ({self.gpu_memory_source})")
        for index, used in enumerate(self.gpu_usage()):
            verdict = "ok" if used <= self.gpu_bytes else "DOES NOT FIT"
            lines.append(f"  GPU {index}: {used / GIB:.1f} / {self.gpu_bytes / GIB:.1f} GiB  {verdict}")
        problems = self.problems()
        if problems:
            lines.append("does not fit:")
            lines.extend(f"  - {p}" for p in problems)
        else:
            lines.append(f"fits: {self.num_gpus} GPU(s), {cpus:g} CPUs")
        return "\n".join(lines)


# ---- the model, from its config ----------------------------------------------------------------------------------


def load_model_config(model: str, *, field_name: str = "model", trust_remote_code: bool = False) -> PretrainedConfig:
    """The transformers config of `model` (an alias's prepared folder, a local folder, or a hub id already in the
    local cache), read without downloading; a ValueError naming `field_name` and the fix otherwise."""
    from transformers import AutoConfig

    from rlasync.model.registry import resolve_model

    source = resolve_model(model)
    try:
        return AutoConfig.from_pretrained(source, local_files_only=True, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"{field_name}={model!r}: the dry run reads the model's config.json without downloading, and it is not "
            f"at hand ({type(exc).__name__}: {str(exc).splitlines()[0]}): give a local model folder (config.json is "
            "enough), a prepared alias (`rlasync models prepare ...`) or a hub id already downloaded"
        ) from None


_PARAMS: dict[str, int] = {}  # config JSON -> parameter count (a plan asks once per engine and teacher)


def _params(model_config: PretrainedConfig) -> int:
    """The model's parameter count (built once per distinct config, on the meta device)."""
    from rlasync.learner.dry_run import meta_model

    key = model_config.to_json_string()
    if key not in _PARAMS:
        _PARAMS[key] = sum(p.numel() for p in meta_model(model_config, "float32").parameters())
    return _PARAMS[key]


# ---- actors, GPUs, engines ----------------------------------------------------------------------------------------


def expand_actors(spec: RunSpec) -> list[ActorPlan]:
    """One ActorPlan per actor of `spec.requests`, in the Cluster's spawn order; distillation's requests hold its
    local teachers as the "teacher" role and its `vllm serve` teacher clients as "teacher client", in the order of
    `spec.teachers`."""
    requests = spec.requests
    order = ["generation", "teacher", "teacher client", "learner", "queue", "reward", "rollout"]
    roles = order + [role for role in requests if role not in order]
    teachers = {
        "teacher": [tid for tid, t in (spec.teachers or {}).items() if t.is_local],
        "teacher client": [tid for tid, t in (spec.teachers or {}).items() if not t.is_local],
    }
    actors = []
    for role in roles:
        count, cpus, gpus = requests.get(role, (0, 0.0, 0.0))
        for i in range(count):
            if role in teachers:
                names = teachers[role]
                label = f"teacher {names[i]!r}" if i < len(names) else f"{role} {i}"
            elif role == "learner":
                label = f"learner rank {i}"
            elif role == "queue":
                label = "queue"
            else:
                label = f"{spec.algorithm.rollout_name if role == 'rollout' else role + ' actor'} {i}"
            actors.append(ActorPlan(label, role, float(cpus), float(gpus)))
    return actors


def place_on_gpus(actors: Sequence[ActorPlan]) -> None:
    """Give each GPU actor its GPUs, in order, as Ray's fractional-GPU packing does: a fraction goes to the first
    GPU with that much left, a whole number of GPUs to that many untouched GPUs (new ones as needed)."""
    free: list[float] = []
    for actor in actors:
        if actor.gpus <= 0:
            continue
        if actor.gpus < 1:
            index = next((i for i, left in enumerate(free) if left + 1e-9 >= actor.gpus), None)
            if index is None:
                free.append(1.0)
                index = len(free) - 1
            free[index] -= actor.gpus
            actor.gpu_ids = (index,)
            continue
        whole = math.ceil(actor.gpus - 1e-9)
        ids = [i for i, left in enumerate(free) if left >= 1 - 1e-9][:whole]
        while len(ids) < whole:
            free.append(1.0)
            ids.append(len(free) - 1)
        for i in ids:
            free[i] = 0.0
        actor.gpu_ids = tuple(ids)


def engine_memory(
    model_config: PretrainedConfig,
    engine: str,
    engine_kwargs: dict[str, Any] | None,
    *,
    gpu_bytes: float,
    used_bytes: float,
    element_size: int = 2,
) -> tuple[int, str]:
    """(bytes, how) of one engine on a GPU of `gpu_bytes` where `used_bytes` are taken before it starts; its
    weights and KV cache in `element_size`-byte elements (bf16, the engines' default on a GPU)."""
    from rlasync.engine.kv_cache import kv_bytes_per_token, kv_cache_tokens, kv_shape

    kwargs = {**DEFAULT_ENGINE_SETTINGS, **(engine_kwargs or {})}
    utilization = float(kwargs["gpu_memory_utilization"])
    weights = _params(model_config) * element_size
    if engine == EngineKind.VLLM_SERVER:  # a client of an external server: the model is not here
        return int(CUDA_CONTEXT_GIB * GIB), "a vllm serve client (the server's memory is not on this GPU)"
    if engine == EngineKind.VLLM:
        total = int(utilization * gpu_bytes)
        return total, f"vLLM reserves gpu_memory_utilization {utilization:g} x GPU (weights {weights / GIB:.2f} GiB)"
    layers, _, kv_heads, head_dim = kv_shape(model_config)
    per_token = kv_bytes_per_token(layers, kv_heads, head_dim, element_size)
    max_model_len = int(kwargs.get("max_model_len") or model_config.max_position_embeddings)
    context = CUDA_CONTEXT_GIB * GIB
    tokens = kv_cache_tokens(
        kwargs.get("kv_cache_tokens"),
        max_model_len=max_model_len,
        max_num_seqs=int(kwargs["max_num_seqs"]),
        bytes_per_token=per_token,
        budget_bytes=int(utilization * gpu_bytes - (used_bytes + weights + context)),
    )
    kv = tokens * per_token
    how = (
        f"weights {weights / GIB:.2f} + KV cache {kv / GIB:.2f} GiB ({tokens} tokens x {layers} layers x {kv_heads} "
        f"KV heads x {head_dim} head dim x 2 x {element_size} bytes)"
    )
    return int(weights + kv + context), how


# ---- the learner rank ---------------------------------------------------------------------------------------------


def learner_memory(
    spec: RunSpec,
    model_config: PretrainedConfig,
    settings: LearnerSettings,
    *,
    gpu_bytes: float,
    measure: bool,
    verbose: bool = False,
) -> tuple[dict[str, Any], str | None]:
    """The learner rank's figures ({"world_size", "peak_bytes", "summary", ...}) and a failure, if measuring failed."""
    from rlasync.learner.dry_run import estimate_rank_memory, meta_model, step_shape

    config, world_size = spec.config, spec.config.cluster.num_learners
    on_gpu = spec.config.cluster.learner_num_gpus > 0
    figures: dict[str, Any] = {"world_size": world_size}
    grpo_rows = spec.algorithm.sink == "groups" and settings.token_budget > 0
    terms = None  # the row's loss terms: GRPO rows as the measured step fills them, else every token of the row
    if grpo_rows:
        from rlasync.learner.dry_run import terms_per_row

        group = spec.algorithm.group_size(config)
        prompt, completion = step_shape(settings.token_budget, group, config.max_completion_length)
        terms = terms_per_row(settings.token_budget, group, prompt, completion)
    estimate = estimate_rank_memory(
        meta_model(model_config, settings.dtype),
        settings,
        world_size,
        gpu_bytes=gpu_bytes if on_gpu else None,
        terms_per_row=terms,
    )
    # the rank's share of its GPU: a fraction asks Ray for that much; one or more GPUs give a rank one GPU
    share = min(float(spec.config.cluster.learner_num_gpus), 1.0) * gpu_bytes
    over = estimate.total_bytes + CUDA_CONTEXT_GIB * GIB > (1.0 + MEASURE_MARGIN) * share
    weightless = weights_missing(spec.model)
    if measure and on_gpu and grpo_rows and not over and weightless is None:
        return measure_learner(spec, model_config, settings, figures, verbose=verbose)
    if not on_gpu:
        why = "the learner runs on the CPU (cluster.learner_num_gpus=0): host memory estimated"
    elif not measure:
        why = "no GPU: learner memory estimated, not measured"
    elif over:  # the estimate is within a few percent of a measured peak; a step that cannot fit is not run
        why = (
            f"estimated, not measured (the estimate is more than the {share / GIB:.1f} GiB the rank asks for: "
            "the step would run out of memory)"
        )
    elif weightless is not None:
        why = f"estimated, not measured ({weightless})"
    else:
        why = f"estimated ({spec.algorithm.name}: the measured step runs GRPO samples only)"
    figures.update(peak_bytes=estimate.total_bytes, measured=False, summary=f"{why}: {estimate.describe()}")
    return figures, None


def weights_missing(model: str) -> str | None:
    """Why `model` (a local folder or a cached alias) has no weights to measure a step with, or None: a folder holding
    only config.json plans fine (the model is built on the meta device) but cannot run a step."""
    from rlasync.model.registry import resolve_model

    try:
        path = Path(resolve_model(model))
    except Exception:  # a hub id the loader resolves itself: measured as it loads
        return None
    if not path.is_dir():
        return None
    if any(f.suffix.lstrip(".") in WEIGHT_SUFFIXES for f in path.iterdir() if f.is_file()):
        return None
    return f"no weights in {path}: a config-only folder"


def measure_learner(
    spec: RunSpec, model_config: PretrainedConfig, settings: LearnerSettings, figures: dict[str, Any], *, verbose: bool
) -> tuple[dict[str, Any], str | None]:
    """Rank 0's peak measured on this GPU (a fresh process, the fake process group for N > 1 ranks) on synthetic GRPO
    samples that fill the whole step's rows."""
    from rlasync.learner.dry_run import measure_in_subprocess, step_shape, synthetic_samples

    config, world_size = spec.config, spec.config.cluster.num_learners
    group = spec.algorithm.group_size(config)
    prompt, completion = step_shape(settings.token_budget, group, config.max_completion_length)
    # the whole step, every rank's rows: each rank plans them all and trains its own (as a real rank does)
    per_step = settings.token_budget * config.gradient_accumulation_steps * world_size
    samples = synthetic_samples(
        int(model_config.vocab_size),
        groups=max(1, -(-per_step // (prompt + group * completion))),
        group_size=group,
        prompt_len=prompt,
        completion_len=completion,
        top_k=int(getattr(config, "num_sampler_logprobs", 0) or 0),
    )
    try:
        result = measure_in_subprocess(spec.model, settings, world_size, samples, steps=2)
    except Exception as exc:  # out of memory, or a failure of the step itself: its last error line
        if verbose:
            print(exc, file=sys.stderr)
        errors = [line.strip() for line in str(exc).splitlines() if "Error" in line or "error" in line]
        figures.update(peak_bytes=0, measured=False, summary="the measured step failed")
        why = errors[-1] if errors else str(exc)
        return figures, f"learner rank 0: the measured step failed: {why} (--verbose prints its whole output)"
    figures.update(result, peak_bytes=int(result["peak_gib"] * GIB), measured=True)
    figures["summary"] = (
        f"peak {result['peak_gib']:.2f} GiB measured (2 steps of {len(samples)} synthetic samples in "
        f"{settings.token_budget}-token rows{', fake process group' if world_size > 1 else ''})"
    )
    return figures, None


# ---- the plan -----------------------------------------------------------------------------------------------------


def plan_run(
    spec: RunSpec,
    config_path: str,
    *,
    gpu_memory_gib: float | None = None,
    measure: bool = True,
    verbose: bool = False,
) -> DryRunPlan:
    """The plan of `spec` (a trainer's `build_spec(None)`): actors placed, their memory, the learner rank's peak.
    `measure`: run one learner rank on this machine's GPU when there is one (else the estimate); `verbose`: print
    the whole output of a measured step that failed."""
    import torch

    config, cluster = spec.config, spec.config.cluster
    has_gpu = torch.cuda.is_available()
    if has_gpu and gpu_memory_gib is None:
        gpu_bytes = float(torch.cuda.get_device_properties(0).total_memory)
        source = f"torch.cuda: {torch.cuda.get_device_name(0)}"
    else:
        gpu_bytes = float(gpu_memory_gib if gpu_memory_gib is not None else DEFAULT_GPU_MEMORY_GIB) * GIB
        source = "--gpu-memory-gib" if gpu_memory_gib is not None else "default: an H200; set --gpu-memory-gib"
    if not gpu_bytes > 0:
        raise ValueError(f"--gpu-memory-gib={gpu_memory_gib}: must be > 0")
    model_config = load_model_config(spec.model, trust_remote_code=config.trust_remote_code)
    actors = expand_actors(spec)
    place_on_gpus(actors)
    max_model_len = int((cluster.engine_kwargs or {}).get("max_model_len") or model_config.max_position_embeddings)
    budget, _, _ = step_budget(config, cluster.num_learners, None if config.token_budget is not None else max_model_len)
    settings = spec.algorithm.learner_settings(  # as the Cluster's create_learners builds them
        config,
        token_budget=budget,
        max_steps=spec.learner.max_steps,
        teacher_ids=spec.learner.teacher_ids,
        peft_config=spec.learner.peft_config,
        optimizer_overrides=spec.learner.optimizer_overrides,
    )
    plan = DryRunPlan(config_path, spec.algorithm.name, spec.model, _params(model_config), actors, gpu_bytes, source)
    used = [0.0] * plan.num_gpus
    plan.learner, failure = learner_memory(
        spec, model_config, settings, gpu_bytes=gpu_bytes, measure=has_gpu and measure, verbose=verbose
    )
    if failure:
        plan.failures.append(failure)
    teachers = {f"teacher {tid!r}": t for tid, t in (spec.teachers or {}).items()}
    for actor in actors:
        if not actor.gpu_ids:
            actor.note = "" if actor.role != "learner" else "on the CPU"
            continue
        index = actor.gpu_ids[0]
        if actor.role == "learner":
            actor.memory_bytes = int(plan.learner["peak_bytes"] + CUDA_CONTEXT_GIB * GIB)
            actor.note = "measured" if plan.learner.get("measured") else "estimated"
            actor.note += f" peak + {CUDA_CONTEXT_GIB:g} GiB CUDA context"
        else:
            teacher = teachers.get(actor.label)
            engine_config = (
                load_model_config(teacher.model, field_name="teacher_model") if teacher is not None else model_config
            )
            engine = str(teacher.engine if teacher is not None and teacher.engine else cluster.engine)
            actor.memory_bytes, actor.note = engine_memory(
                engine_config,
                engine,
                cluster.engine_kwargs,
                gpu_bytes=gpu_bytes,
                used_bytes=used[index],
                element_size=ENGINE_ELEMENT_SIZE.get(engine_dtype(config) or "bfloat16", 2),
            )
        used[index] += actor.memory_bytes
    return plan


def dry_run(
    path: str,
    overrides: Sequence[str],
    *,
    gpu_memory_gib: float | None = None,
    as_json: bool = False,
    verbose: bool = False,
) -> int:
    """`rlasync train PATH --dry-run`: build the trainer as a run does, plan it, print; 0 fits, 1 does not."""
    from rlasync.data import build_dataset
    from rlasync.runfile import load_run

    run = load_run(path, overrides)
    trainer = run.build_trainer(build_dataset(run.dataset))
    spec = trainer.build_spec(None)
    plan = plan_run(spec, path, gpu_memory_gib=gpu_memory_gib, verbose=verbose)
    print(json.dumps(plan.to_dict(), default=str) if as_json else plan.describe())
    return 1 if plan.problems() else 0


__all__ = [
    "CUDA_CONTEXT_GIB",
    "DEFAULT_GPU_MEMORY_GIB",
    "ActorPlan",
    "DryRunPlan",
    "dry_run",
    "engine_memory",
    "expand_actors",
    "learner_memory",
    "load_model_config",
    "place_on_gpus",
    "plan_run",
]
