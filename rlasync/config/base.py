"""The fields, normalisation and checks every rlasync trainer config shares (`AsyncGRPOConfig`,
`AsyncDistillationConfig`): TrainingArguments' run and optimisation fields, the model and sampling fields, the
asynchrony knobs and the actor system (`ClusterConfig`). Subclasses add their own fields and extend the `_check_*`
methods; each error names the field and the fix. Imports neither torch nor ray.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import Any

from rlasync.config.kernels import KernelSettings
from rlasync.config.trl_fields import TrainingArgumentsFields, check_training_arguments, parse_optim_args
from rlasync.config.vocab import (
    AUTO,
    EngineKind,
    parse_engine,
    parse_lora_sync,
    parse_report_to,
    parse_weight_sync_backend,
)

logger = logging.getLogger(__name__)

DTYPES = ("auto", "bfloat16", "float16", "float32")
# Sampling limits (the built-in engine's sampler scales float32 logits: `x / repetition_penalty / temperature`).
# Below MIN_TEMPERATURE every sampled log-prob is exactly 0 in float32 for logit gaps above ~2e-3 nats (the draw is
# the argmax and the policy gradient vanishes); near 1e-38 `x / T` overflows to inf and the sampler drops the top
# token. The repetition penalty divides or multiplies the logits: its range keeps `x / penalty / T` finite.
MIN_TEMPERATURE = 1e-4
REPETITION_PENALTY_RANGE = (1e-2, 1e2)
LR_SCHEDULERS = (
    "constant",
    "constant_with_warmup",
    "linear",
    "cosine",
    "cosine_with_restarts",
    "cosine_with_min_lr",
    "polynomial",
    "inverse_sqrt",
    "warmup_stable_decay",
)
OPTIMIZERS = ("adamw_torch_fused", "adamw_torch", "adafactor", "sgd", "adagrad", "rmsprop")
"""`optim` names the learner builds (transformers' names; torch optimizers, `adafactor` is transformers')."""
GRADIENT_CHECKPOINTING_KWARGS = ("use_reentrant",)
JSON_DICT_FIELDS = ("model_init_kwargs", "chat_template_kwargs", "lr_scheduler_kwargs", "gradient_checkpointing_kwargs")


BUILTIN_ENGINE_KWARGS = frozenset(
    {
        "kv_cache_tokens",
        "eos_token_ids",
        "kv_on_weight_update",
        "attention_backend",
        "cuda_graphs",
        "mixed_cuda_graphs",
        "compiled_sampler",
        "compiled_layers",
        "launch_on_loop",
        "fused_layers",
        "loads_between_steps",
    }
)
"""`cluster.engine_kwargs` only the built-in engine (`TorchEngine`) takes: another engine is refused them at load."""
RESOURCE_ROLES = ("learner", "generation", "rollout", "reward", "queue", "teacher")
"""The actor roles `ClusterConfig.resources` names (the kinds the Cluster spawns)."""


@dataclass
class ClusterConfig:
    """How many of each actor the trainer starts and what each asks Ray for (the `cluster` section).

    The defaults fit a 2-core CPU machine: fractional `num_cpus` so every actor schedules at once.
    """

    num_rollout_actors: int | None = None
    """None: 1 when the engines run on the CPU, 4 per generation actor when they have GPUs (a GPU engine serves
    more requests than one rollout actor's event loop makes: on one H200 the system needed four)."""
    num_generation_actors: int = 1
    num_learners: int = 1
    num_reward_actors: int = 0
    """RewardActors running the reward functions; 0 = each rollout actor runs them itself."""
    reward_num_cpus: float = 0.1
    reward_num_gpus: float = 0.0
    """GPUs of each RewardActor: 0 = the CPU; a fraction shares a GPU with other actors (e.g. 0.2 beside a generation
    actor's 0.8), so a reward model (`reward_funcs="path"`, docs/rewards.md §2) runs there in bf16."""
    rollout_num_cpus: float = 0.25
    generation_num_cpus: float = 0.5
    generation_num_gpus: float = 0.0
    learner_num_cpus: float = 0.5
    learner_num_gpus: float = 0.0
    queue_num_cpus: float = 0.1
    teacher_num_cpus: float = 0.25
    """CPUs of each TeacherScorer (distillation: a local teacher, whose GPUs are `generation_num_gpus`, or a
    `vllm serve` client); the default lets a student engine and two local teachers (MOPD) fit a 2-core machine."""
    collective_timeout_s: float = 300.0
    """Every collective (training group, weight broadcast) fails with an error after this long instead of hanging."""
    weight_sync_backend: str = AUTO
    """Weight transport (`rlasync.config.vocab.WeightTransport`, or "auto"): "auto" (NCCL when learner rank 0 and
    every engine hold distinct GPUs, CUDA IPC when they all share one GPU, else gloo through the CPU, with a warning
    when a GPU is involved), "nccl" (an error where it cannot work), "gloo", or "ipc" (learner rank 0 and every
    engine on one host and one device: the weights are shared by CUDA IPC handle, or through shared memory on the
    CPU, instead of through a process group)."""
    weight_sync_bucket_mb: float = 256.0
    """Parameters are broadcast in flat buckets of at most this many MiB (a larger parameter goes alone)."""
    weight_sync_staging_mb: float = 2048.0
    """Up to this many MiB of a weight sync are received while the engine still generates (held in the receive
    buffers until it has paused), so the transfer overlaps the wait for its step in flight; 0 = pause first."""
    weight_sync_copy_events: bool = True
    """CUDA IPC into the built-in engine: each engine records an interprocess event behind its queued copies and
    returns at once; learner rank 0's next pack waits for it on the GPU (docs/algorithms.md §6.3). False: each
    engine waits for its copies inside the sync, as before (an A/B)."""
    engine_placement: str = "home"
    """Which engines a rollout actor sends to: "home" (rollout actor i of N to its home engines when one count divides
    the other, e.g. two rollout actors an engine: each engine answers fewer actors, which costs its process less of
    Ray's work; `rlasync.rollout.engine_pool`), "any" (every actor to every engine, the least loaded first: for
    engines of unequal speed)."""
    generation_stall_s: float | None = None
    """A diagnostic: a GenerationActor whose event loop runs more than this many seconds late samples where it is (a
    watchdog thread, `rlasync.metrics.loop_lag`) and logs the most sampled stack at most once a minute. None (the
    default): off, as the watchdog's own wakes take the GIL the engine's host side needs."""
    gil_switch_interval_s: float | None = None
    """The GIL's switch interval in each GenerationActor's and RolloutActor's process (`sys.setswitchinterval`;
    None: Python's 5 ms). A thread that gives the GIL up (a torch call that releases it, Ray's C++ calls, the event
    loop's poll) waits up to this long to get it back while another thread runs Python: a GenerationActor's host
    side runs on its event loop and in a worker thread, so each release on the loop can cost it a whole interval
    and a weight sync's call waits behind them; a busy rollout loop holds back Ray's threads that deliver its
    results (`bench/gil_convoy.py`). The SmolLM2 sums run on an H100 was no faster at 0.5 ms than at 5 ms
    (`bench/results/sums_gil_h100.json`)."""
    lora_sync: str = "adapter"
    """With a trainer's `peft_config` (LoRA; `rlasync.config.vocab.LoraSync`): "adapter" sends only the adapter (the
    built-in engine merges it into its base weights; vLLM loads it as a runtime LoRA adapter), "merged" sends the
    full merged weights (any engine)."""
    max_loras: int = 2
    """vLLM with LoRA: adapters live at once (the newest serves new requests; older ones finish theirs, then go)."""
    lora_dir: str | None = None
    """vLLM with LoRA: where adapters are written for the engine to load (default `<output_dir>/lora_adapters`; with
    `vllm serve` a folder the server can read)."""
    engine: str = EngineKind.TORCH
    """Generation engine of each GenerationActor (`rlasync.config.vocab.EngineKind`): "torch" (built-in), "vllm"
    (vLLM's AsyncLLM inside the actor, on its GPU; `pip install 'rlasync[vllm]'`) or "vllm_server" (a client of an
    external `vllm serve` at `vllm_server_url`)."""
    engine_kwargs: dict[str, Any] | None = None
    """Extra keyword arguments of the engine (TorchEngine: e.g. `{max_num_seqs: 64, kv_cache_tokens: 8192}`;
    vllm: `VLLMEngine`'s, e.g. `{gpu_memory_utilization: 0.3}`; vllm_server: `VLLMServerEngine`'s)."""
    vllm_server_url: str | None = None
    """Base URL of `vllm serve` (e.g. http://10.0.0.5:8000) when `engine` is "vllm_server"."""
    ray_address: str | None = None
    """Join this Ray cluster (else `RAY_ADDRESS`, else an existing `ray.init`, else the cluster the last `ray start`
    on this machine left running, else a new local cluster); "local" starts a cluster of the run's own."""
    elastic: bool = False
    """Resize the generation and rollout pools while the run goes (rlasync.driver.elastic.ElasticPolicy): every
    `elastic_interval_steps` steps the driver adds a GenerationActor when the learner waits for samples and the
    engines are saturated, a rollout actor when it waits and the engines have room, and removes one when the
    learner does not wait; always within the min/max fields below. `trainer.resize(...)` works without it."""
    min_generation_actors: int = 1
    max_generation_actors: int | None = None
    """Upper bound of the generation pool when resized (None: `num_generation_actors`, no growth)."""
    min_rollout_actors: int = 1
    max_rollout_actors: int | None = None
    """Upper bound of the rollout pool when resized (None: `num_rollout_actors`, no growth)."""
    elastic_interval_steps: int = 5
    """With `elastic`: steps between two decisions of the policy (and after each change)."""
    resources: dict[str, dict[str, float]] | None = None
    """Custom Ray resources each actor of a role asks for, besides its CPUs/GPUs: `{role: {resource: amount}}` with
    roles learner, generation, rollout, reward, queue, teacher. A node started with that resource
    (`ray start --resources='{"learner_node": 1}'`, a KubeRay group's `rayStartParams.resources`) is the only kind
    of node the role's actors are placed on, also when Ray re-places them after a node is lost, and the resource
    an autoscaler adds a node of that group for: e.g. `{learner: {learner_node: 1}, generation: {generation_node:
    1}}` puts the learner ranks and the engines on their own groups of nodes (deploy/README.md)."""

    def __post_init__(self) -> None:
        if self.num_rollout_actors is None:
            gpu_engines = isinstance(self.generation_num_gpus, (int, float)) and self.generation_num_gpus > 0
            generation = self.num_generation_actors if isinstance(self.num_generation_actors, int) else 1
            self.num_rollout_actors = 4 * max(1, generation) if gpu_engines else 1
        for name in ("num_rollout_actors", "num_generation_actors", "num_learners"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"cluster.{name}={value!r}: must be a positive integer")
        self._check_elastic()
        self._check_resources()
        reward_actors = self.num_reward_actors
        if isinstance(reward_actors, bool) or not isinstance(reward_actors, int) or reward_actors < 0:
            raise ValueError(f"cluster.num_reward_actors={self.num_reward_actors!r}: must be an integer >= 0")
        for name in (
            "reward_num_gpus",
            "rollout_num_cpus",
            "generation_num_cpus",
            "generation_num_gpus",
            "learner_num_cpus",
            "learner_num_gpus",
            "queue_num_cpus",
            "reward_num_cpus",
            "teacher_num_cpus",
        ):
            if not getattr(self, name) >= 0:
                raise ValueError(f"cluster.{name}={getattr(self, name)!r}: must be >= 0")
        gpus = self.reward_num_gpus
        if isinstance(gpus, bool) or (gpus > 1 and gpus != int(gpus)):
            raise ValueError(
                f"cluster.reward_num_gpus={gpus!r}: a fraction below 1 shares a GPU, above 1 it must be a whole "
                "number of GPUs (Ray cannot give 1.5)"
            )
        if not self.collective_timeout_s > 0:
            raise ValueError(f"cluster.collective_timeout_s={self.collective_timeout_s}: must be > 0 seconds")
        self.weight_sync_backend = parse_weight_sync_backend(self.weight_sync_backend)
        if isinstance(self.weight_sync_bucket_mb, bool) or not self.weight_sync_bucket_mb > 0:
            raise ValueError(f"cluster.weight_sync_bucket_mb={self.weight_sync_bucket_mb!r}: must be > 0 MiB")
        if isinstance(self.weight_sync_staging_mb, bool) or not self.weight_sync_staging_mb >= 0:
            raise ValueError(f"cluster.weight_sync_staging_mb={self.weight_sync_staging_mb!r}: must be >= 0 MiB")
        if not isinstance(self.weight_sync_copy_events, bool):
            raise ValueError(f"cluster.weight_sync_copy_events={self.weight_sync_copy_events!r}: must be true or false")
        if self.engine_placement not in ("home", "any"):
            raise ValueError(f'cluster.engine_placement={self.engine_placement!r}: use "home" or "any"')
        stall_s = self.generation_stall_s
        if stall_s is not None and (isinstance(stall_s, bool) or not stall_s > 0):
            raise ValueError(f"cluster.generation_stall_s={stall_s!r}: must be > 0 seconds (e.g. 0.1), or null for off")
        switch_s = self.gil_switch_interval_s
        if switch_s is not None and (isinstance(switch_s, bool) or not 0 < switch_s <= 0.1):
            raise ValueError(
                f"cluster.gil_switch_interval_s={switch_s!r}: must be in (0, 0.1] seconds (e.g. 0.0005), or "
                "null for Python's default"
            )
        self.lora_sync = parse_lora_sync(self.lora_sync)
        if isinstance(self.max_loras, bool) or not isinstance(self.max_loras, int) or self.max_loras < 1:
            raise ValueError(f"cluster.max_loras={self.max_loras!r}: must be a positive integer")
        if isinstance(self.engine_kwargs, str):
            self.engine_kwargs = _parse_json_dict("cluster.engine_kwargs", self.engine_kwargs)
        self.engine = parse_engine(self.engine)
        foreign = (
            sorted(set(self.engine_kwargs or ()) & BUILTIN_ENGINE_KWARGS) if self.engine != EngineKind.TORCH else []
        )
        if foreign:
            raise ValueError(
                f"cluster.engine_kwargs has {', '.join(foreign)}: the built-in engine's, which cluster.engine="
                f"{self.engine.value!r} does not take; replace cluster.engine_kwargs with that engine's (vLLM sizes "
                "its KV cache by gpu_memory_utilization or kv_cache_memory_bytes), e.g. --set "
                """'cluster.engine_kwargs={"max_model_len": 512, "gpu_memory_utilization": 0.2}'"""
            )
        if self.engine.traits.needs_url:
            if not self.vllm_server_url:
                raise ValueError(
                    f"cluster.vllm_server_url is required with cluster.engine={self.engine.value!r} "
                    "(e.g. http://host:8000)"
                )
            if not str(self.vllm_server_url).startswith(("http://", "https://")):
                raise ValueError(
                    f"cluster.vllm_server_url={self.vllm_server_url!r}: must start with http:// or https://"
                )
        elif self.vllm_server_url is not None:
            needs = ", ".join(repr(k.value) for k in EngineKind if k.traits.needs_url)
            raise ValueError(
                f"cluster.vllm_server_url is set but cluster.engine={self.engine.value!r}: set cluster.engine={needs}"
            )

    def _check_elastic(self) -> None:
        """min <= num <= max for both pools; `elastic=True` needs a pool that can change size."""
        if not isinstance(self.elastic, bool):
            raise ValueError(f"cluster.elastic={self.elastic!r}: must be true or false")
        for pool in ("generation", "rollout"):
            num = getattr(self, f"num_{pool}_actors")
            low, high = getattr(self, f"min_{pool}_actors"), getattr(self, f"max_{pool}_actors")
            if isinstance(low, bool) or not isinstance(low, int) or low < 1:
                raise ValueError(f"cluster.min_{pool}_actors={low!r}: must be a positive integer")
            if high is not None and (isinstance(high, bool) or not isinstance(high, int) or high < 1):
                raise ValueError(
                    f"cluster.max_{pool}_actors={high!r}: must be a positive integer (or null: num_{pool}_actors)"
                )
            if low > num:
                raise ValueError(
                    f"cluster.min_{pool}_actors={low} > cluster.num_{pool}_actors={num}: the run starts "
                    f"with num_{pool}_actors; set min_{pool}_actors <= {num}"
                )
            if high is not None and high < num:
                raise ValueError(
                    f"cluster.max_{pool}_actors={high} < cluster.num_{pool}_actors={num}: set "
                    f"max_{pool}_actors >= {num} (or null)"
                )
        interval = self.elastic_interval_steps
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ValueError(f"cluster.elastic_interval_steps={interval!r}: must be a positive integer")
        if self.elastic and all(
            self.pool_bounds(pool) == (n, n)
            for pool, n in (("generation", self.num_generation_actors), ("rollout", self.num_rollout_actors))
        ):
            raise ValueError(
                "cluster.elastic=True but neither pool can change size: set cluster.max_generation_actors "
                "or cluster.max_rollout_actors above num_*_actors (or min_*_actors below it)"
            )

    def _check_resources(self) -> None:
        """`resources`: a dict (or its JSON text) of known roles, each a dict of resource names to amounts >= 0."""
        if self.resources is None:
            return
        if isinstance(self.resources, str):
            self.resources = _parse_json_dict("cluster.resources", self.resources)
        if not isinstance(self.resources, dict):
            raise ValueError(f"cluster.resources={self.resources!r}: must be a dict {{role: {{resource: amount}}}}")
        for role, wanted in self.resources.items():
            if role not in RESOURCE_ROLES:
                raise ValueError(f"cluster.resources.{role}: unknown role; the roles are {', '.join(RESOURCE_ROLES)}")
            if not isinstance(wanted, dict):
                raise ValueError(f"cluster.resources.{role}={wanted!r}: must be a dict {{resource: amount}}")
            for name, amount in wanted.items():
                if name in ("CPU", "GPU"):
                    where = f"cluster.{role}_num_{name.lower()}s"
                    raise ValueError(f"cluster.resources.{role}.{name}: CPUs and GPUs are {where}, not a resource")
                if not isinstance(name, str) or not name:
                    raise ValueError(f"cluster.resources.{role}: resource name {name!r} must be a non-empty string")
                if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not amount >= 0:
                    raise ValueError(f"cluster.resources.{role}.{name}={amount!r}: must be a number >= 0")
            self.resources[role] = {name: float(amount) for name, amount in wanted.items()}

    def role_resources(self, role: str) -> dict[str, float]:
        """The custom Ray resources one actor of `role` asks for (`resources`; empty when none)."""
        return dict((self.resources or {}).get(role, {}))

    def pool_bounds(self, pool: str) -> tuple[int, int]:
        """`(min, max)` actors of the "generation" or "rollout" pool (max None: the starting count)."""
        high = getattr(self, f"max_{pool}_actors")
        return getattr(self, f"min_{pool}_actors"), getattr(self, f"num_{pool}_actors") if high is None else high


@dataclass
class TrainerConfig(TrainingArgumentsFields):
    """Fields and checks shared by the trainer configs (TRL / TrainingArguments names and defaults). The
    TrainingArguments fields rlasync does not use otherwise come from `TrainingArgumentsFields`
    (rlasync.config.trl_fields): accepted with TRL's defaults, honoured or refused."""

    # ---- run and optimisation (TrainingArguments names; TRL's defaults where they differ) ----
    output_dir: str | None = None
    """Where checkpoints and `metrics.jsonl` go. `None` -> `trainer_output` (as transformers)."""
    run_name: str | None = None
    seed: int = 42
    per_device_train_batch_size: int = 8
    """Samples per rank per micro-batch (B). With a token budget the planner fills rows by tokens instead."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step (GA). With a token budget a step is GA micro-batches of one row per learner
    rank, each row filled to `token_budget` unique tokens (TRL's step; docs/algorithms.md §4.5.1)."""
    learning_rate: float = 1e-6
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0
    optim: str = "adamw_torch_fused"
    """The learner's optimizer (transformers' names): adamw_torch_fused (TRL's default), adamw_torch, adafactor, sgd,
    adagrad, rmsprop; `optim_args` adds keyword arguments. `optimizers=` on the trainer overrides it."""
    lr_scheduler_type: str = "constant"
    """The step count is unknown up front (infinite stream), so decay only with an explicit `max_steps`."""
    lr_scheduler_kwargs: dict[str, Any] | str | None = None
    warmup_steps: float = 0
    """Warmup optimizer steps; a value in (0, 1) is a fraction of `max_steps` (as transformers 5)."""
    num_train_epochs: float = 3.0
    max_steps: int = -1
    """Stop after this many optimizer steps; `-1` = stop after `num_train_epochs` over the dataset."""
    logging_steps: float = 1
    """Log a window every this many steps; a value in (0, 1) is a fraction of `max_steps` (as transformers)."""
    save_steps: float = 500
    """Checkpoint every this many steps; a value in (0, 1) is a fraction of `max_steps` (as transformers)."""
    save_total_limit: int | None = None
    report_to: str | list[str] = "none"
    """Metric sinks besides `<output_dir>/metrics.jsonl`: "tensorboard", "wandb", "trackio", "mlflow", "all" (those
    installed) or "none"."""
    strict_dataset: bool = False
    """rlasync: a dataset row whose prompt is unusable (missing, empty, not conversational) stops the run; by
    default it is dropped when leased, counted as "filtered" and named in a warning (docs/design.md §4)."""
    bf16: bool | None = None
    """Mixed precision in bf16; `None` -> True unless `fp16` (TRL's default). On a GPU with float32 trainer weights
    the learner computes in bf16 over float32 master weights, and the engines run in bf16."""
    fp16: bool = False
    """TRL's field; True is refused (fp16 mixed precision needs loss scaling, which rlasync does not implement):
    use `bf16=True` (the default)."""
    gradient_checkpointing: bool = True
    gradient_checkpointing_kwargs: dict[str, Any] | str | None = None
    """Only `use_reentrant` (default False: non-reentrant checkpointing) is supported."""
    gradient_checkpointing_layers: str | int = "auto"
    """rlasync: which decoder layers `gradient_checkpointing` covers: "auto" (on a GPU the fewest layers whose
    activations fit its memory at `token_budget`-token rows, spread evenly; every layer on the CPU), "all", or a
    number of layers, spread evenly (docs/algorithms.md §5.5)."""
    ignore_data_skip: bool = True
    """Forced True: resume continues at the first untrained prompt, not by skipping batches."""
    use_liger_kernel: bool = False

    # ---- model ----
    model_init_kwargs: dict[str, Any] | str | None = None
    """Keyword arguments for `from_pretrained` (dict or JSON string); its `dtype` wins over `dtype`."""
    dtype: str = "float32"
    """Trainer dtype: one of auto, bfloat16, float16, float32 (float32: the sampler/trainer mismatch is
    sensitive to trainer precision)."""
    trust_remote_code: bool = False

    # ---- generation ----
    max_completion_length: int = 2048
    """`max_tokens` of each generation request (per turn)."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    """0 disables top-k."""
    min_p: float | None = None
    repetition_penalty: float = 1.0
    chat_template_kwargs: dict[str, Any] | str | None = None
    vllm_server_base_url: str = "http://localhost:8000"
    """TRL's name for the `vllm serve` address: used when `cluster.engine="vllm_server"` and `cluster.vllm_server_url`
    is not set."""
    vllm_server_timeout: float = 1800.0
    """Seconds to wait for a `vllm serve` server to become ready (GRPO: also each request and weight-sync call,
    unless `request_timeout` / `weight_sync_timeout` are set)."""
    request_timeout: float = 600
    """Seconds per HTTP request to a `vllm serve` server (retried on timeout)."""
    weight_sync_timeout: float = 1800
    """Seconds per weight-sync call to a `vllm serve` server."""
    remove_unused_columns: bool = True
    """Accepted either way: as in TRL's async trainers, every dataset column reaches the reward functions (the
    prompts go to the rollouts, not through a model signature)."""
    queue_maxsize: int = 1024
    """TRL's rollout-buffer bound: refused unless left at the default, since the StalenessQueue is bounded by the
    token allowance (max_staleness steps of tokens; synchronous at 0); set max_staleness."""

    # ---- batching and asynchrony ----
    token_budget: int | None = None
    """Tokens per packed row (one learner rank's forward), a prompt shared by the row's samples counted once; a
    step is `gradient_accumulation_steps` × (learner ranks) such rows, filled sample by sample until the next one
    fits in no row (which then opens the next step), as TRL's TokenBudgetBatcher (docs/algorithms.md §4.5.1).
    `None` -> the engine's `max_model_len`; `<= 0` -> a fixed count of `per_device_train_batch_size` samples per
    rank."""
    max_staleness: int = 4
    """Drop samples produced more than this many weight versions ago; generation is held to it. 0 runs
    synchronously without waste: each version generates its step's samples, then the learner trains on them."""
    weight_sync_steps: int = 1
    log_completions: bool = False
    num_completions_to_print: int | None = None

    # ---- progress watchdog and user-code timeouts (rlasync; docs/algorithms.md §2.1, §3.2) ----
    watchdog_timeout_s: float | None = None
    """No training step for this long stops the run with the reason (zero reward spread, prompts too long, a tool
    that never returns, ...); None derives it: max(rollout_worker_timeout / heartbeat_stale_after_s, 5 x the median
    step so far), at most 4 x that floor."""
    watchdog_action: str = "error"
    """"error": the watchdog stops the run; "warn": it logs the reason once per bound and the run goes on."""
    reward_timeout_s: float | None = 300.0
    """Per-call limit of each reward function (sync and async) on one group; past it the group is dropped as failed,
    the function named. None: no limit."""
    tool_timeout_s: float | None = 120.0
    """Per-call limit of each tool call; past it the model gets a tool error message and the call counts as a
    failure (`tools/timeout_count`). None: no limit."""

    overwrite_output_dir: bool = False
    """transformers' field: a fresh run (no resume) into an `output_dir` holding another run's checkpoints is
    refused unless this is set; then the old checkpoint folders are removed when the run starts."""
    shutdown_grace_s: float = 25.0
    """SIGINT / SIGTERM / SIGHUP of the driver: the run stops admitting, trains what it took, writes a final
    checkpoint and tears the actors down within this many seconds, else exits at once (a second signal exits at
    once). The default fits Kubernetes' 30-s terminationGracePeriodSeconds (deploy/ sets it)."""

    # ---- actor system (rlasync) ----
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    """Actor counts and resources (see `ClusterConfig`); `--set cluster.num_learners=2`."""
    kernels: KernelSettings = field(default_factory=KernelSettings)
    """The learner's kernel switches (see `rlasync.config.kernels.KernelSettings`): tree attention backend,
    FlexAttention kernel options, the LM head's compile and keep settings; `--set kernels.tree_attention=varlen`."""

    def __post_init__(self) -> None:
        self._normalize()
        self._validate()

    def _normalize(self) -> None:
        for name in JSON_DICT_FIELDS:
            setattr(self, name, _parse_json_dict(name, getattr(self, name)))
        self.report_to = parse_report_to(self.report_to)
        if self.bf16 is None:
            self.bf16 = not self.fp16
        if isinstance(self.cluster, dict):
            self.cluster = ClusterConfig(**self.cluster)
        self.kernels = KernelSettings.of(self.kernels)
        if self.output_dir is None:
            self.output_dir = "trainer_output"

    def _validate(self) -> None:
        check_training_arguments(self)
        self._check_run()
        self._check_sampling()
        self._check_async()

    # One rule group per method; subclasses extend them. Each error names the field and the fix.
    def _check_run(self) -> None:
        for name in ("per_device_train_batch_size", "gradient_accumulation_steps"):
            _positive_int(self, name)
        for name in ("logging_steps", "save_steps"):
            _steps_or_ratio(self, name)
        if self.optim not in OPTIMIZERS:
            raise ValueError(
                f"optim={self.optim!r} is not supported: choose one of {', '.join(OPTIMIZERS)}, or pass "
                "optimizers=(torch.optim.SomeOptimizer, None) to the trainer"
            )
        unknown_gc = sorted(set(self.gradient_checkpointing_kwargs or {}) - set(GRADIENT_CHECKPOINTING_KWARGS))
        if unknown_gc:
            raise ValueError(
                f"gradient_checkpointing_kwargs: {unknown_gc} not supported; only "
                f"{list(GRADIENT_CHECKPOINTING_KWARGS)} (e.g. {{'use_reentrant': False}})"
            )
        self.gradient_checkpointing_layers = check_checkpointing_layers(
            self.gradient_checkpointing_layers, self.gradient_checkpointing
        )
        for name in ("learning_rate", "weight_decay", "max_grad_norm", "warmup_steps"):
            _at_least(self, name, 0.0)
        if self.max_steps == 0 or self.max_steps < -1:
            raise ValueError(f"max_steps={self.max_steps}: use a positive step count, or -1 to run num_train_epochs")
        if self.max_steps == -1 and not self.num_train_epochs > 0:
            raise ValueError(f"num_train_epochs={self.num_train_epochs} with max_steps=-1: set one of them positive")
        if self.lr_scheduler_type not in LR_SCHEDULERS:
            raise ValueError(f"lr_scheduler_type={self.lr_scheduler_type!r}: choose one of {', '.join(LR_SCHEDULERS)}")
        if self.bf16 and self.fp16:
            raise ValueError("bf16=True and fp16=True: choose one mixed-precision mode")
        if self.fp16:
            raise ValueError(
                "fp16=True is not supported: fp16 mixed precision needs loss scaling, which rlasync does not "
                "implement; use bf16=True (the default, on GPUs with bf16) or leave fp16=False to train in `dtype`"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r}: choose one of {', '.join(DTYPES)}")
        if self.use_liger_kernel:
            raise NotImplementedError(
                "use_liger_kernel=True: Liger kernels are not supported; set use_liger_kernel=False"
            )
        if not self.ignore_data_skip:
            logger.warning("ignore_data_skip=False is ignored: resume continues at the first untrained prompt")
            self.ignore_data_skip = True

    def _check_sampling(self) -> None:
        for name in ("vllm_server_timeout", "request_timeout", "weight_sync_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name}={getattr(self, name)}: must be > 0 seconds")
        if self.queue_maxsize != 1024:
            raise ValueError(
                f"queue_maxsize={self.queue_maxsize} is not supported: the StalenessQueue is bounded by the token "
                "allowance (max_staleness steps of tokens; synchronous at 0), not a sample count; set max_staleness instead"
            )
        _positive_int(self, "max_completion_length")
        if not self.temperature >= MIN_TEMPERATURE:
            raise ValueError(
                f"temperature={self.temperature}: the smallest supported is {MIN_TEMPERATURE:g} (below it float32 "
                "sampling is exactly greedy, every sampled log-prob is 0 and nothing can be learnt from it)"
            )
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p}: must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k}: must be >= 0 (0 disables top-k)")
        if self.min_p is not None and not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p={self.min_p}: must be in [0, 1]")
        low, high = REPETITION_PENALTY_RANGE
        if not low <= self.repetition_penalty <= high:
            raise ValueError(
                f"repetition_penalty={self.repetition_penalty}: must be in [{low:g}, {high:g}] (1.0 disables it; "
                "beyond that range the penalised logits overflow float32)"
            )
        if not self.vllm_server_timeout > 0:
            raise ValueError(f"vllm_server_timeout={self.vllm_server_timeout}: must be > 0 seconds")

    def _check_async(self) -> None:
        if self.max_staleness < 0:
            raise ValueError(f"max_staleness={self.max_staleness}: must be >= 0 (0 = fully on-policy)")
        _positive_int(self, "weight_sync_steps")
        if self.num_completions_to_print is not None and self.num_completions_to_print < 0:
            raise ValueError(f"num_completions_to_print={self.num_completions_to_print}: must be >= 0 or None")
        grace = self.shutdown_grace_s
        if isinstance(grace, bool) or not isinstance(grace, int | float) or not grace > 0:
            raise ValueError(f"shutdown_grace_s={grace!r}: must be a number of seconds > 0 (default 25)")
        for name in ("watchdog_timeout_s", "reward_timeout_s", "tool_timeout_s"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int | float) or not value > 0):
                raise ValueError(f"{name}={value!r}: must be a number of seconds > 0, or None for no limit")
        if self.watchdog_action not in ("error", "warn"):
            raise ValueError(f"watchdog_action={self.watchdog_action!r}: choose 'error' (stop the run) or 'warn'")

    # ---- derived values ----
    def steps_of(self, name: str, horizon: int | None) -> int:
        """`logging_steps` / `save_steps` as a step count: a ratio in (0, 1) is ceil(ratio x horizon)
        (transformers' rule), where `horizon` is the run's step count (max_steps, or distillation's epoch ceiling)."""
        value = getattr(self, name)
        if value >= 1:
            return int(value)
        if horizon is None:
            raise ValueError(
                f"{name}={value} is a fraction of max_steps, but the run has no step horizon: set max_steps"
            )
        return max(1, math.ceil(value * horizon))

    def optimizer_kwargs(self) -> dict[str, Any]:
        """`optim_args` parsed ("k=v,k2=v2" -> a dict)."""
        return parse_optim_args(self.optim_args) if self.optim_args else {}

    @property
    def use_reentrant(self) -> bool:
        """Gradient checkpointing's `use_reentrant` (`gradient_checkpointing_kwargs`; False by default)."""
        return bool((self.gradient_checkpointing_kwargs or {}).get("use_reentrant", False))

    def samples_per_step(self, num_processes: int = 1) -> int:
        """B x GA x P: samples per optimizer step."""
        return self.per_device_train_batch_size * self.gradient_accumulation_steps * num_processes

    def to_dict(self) -> dict[str, Any]:
        """The fields as plain data (a vocabulary member becomes its string: YAML-safe)."""
        return asdict(self, dict_factory=lambda items: {key: _plain(value) for key, value in items})


def check_checkpointing_layers(value: Any, enabled: bool = True) -> str | int:
    """`gradient_checkpointing_layers` normalised ("auto", "all" or a layer count >= 0; "4" from a command line
    becomes 4), or a `ValueError` naming the field."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if value not in ("auto", "all") and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(
            f"gradient_checkpointing_layers={value!r}: use 'auto' (by memory on a GPU), 'all', or a number of decoder "
            "layers to checkpoint (0 or more, spread evenly)"
        )
    if not enabled and value != "auto":
        raise ValueError(
            f"gradient_checkpointing_layers={value!r} needs gradient_checkpointing=True (it is False: no layer is "
            "checkpointed); set gradient_checkpointing=True or leave gradient_checkpointing_layers='auto'"
        )
    return value


def _plain(value: Any) -> Any:
    if isinstance(value, StrEnum):
        return value.value
    return [_plain(v) for v in value] if isinstance(value, list) else value


def _parse_json_dict(name: str, value: Any) -> dict[str, Any] | None:
    if value is None or isinstance(value, dict):
        return value
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{name}: {value!r} is not valid JSON; give a dict or a JSON object string") from exc
        if isinstance(parsed, dict):
            return parsed
    raise ValueError(f"{name}: expected a dict or a JSON object string, got {type(value).__name__}")


def _positive_int(config: TrainerConfig, name: str) -> None:
    value = getattr(config, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r}: must be a positive integer")


def _steps_or_ratio(config: TrainerConfig, name: str) -> None:
    value = getattr(config, name)
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value) or value <= 0:
        raise ValueError(f"{name}={value!r}: must be a positive step count, or a fraction of max_steps in (0, 1)")
    if value > 1 and value != int(value):
        raise ValueError(f"{name}={value!r}: a value above 1 is a step count, give an integer")
    if value >= 1:
        setattr(config, name, int(value))


def _at_least(config: TrainerConfig, name: str, low: float) -> None:
    value = getattr(config, name)
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value) or value < low:
        raise ValueError(f"{name}={value!r}: must be a number >= {low}")


__all__ = [
    "DTYPES",
    "GRADIENT_CHECKPOINTING_KWARGS",
    "JSON_DICT_FIELDS",
    "LR_SCHEDULERS",
    "OPTIMIZERS",
    "ClusterConfig",
    "TrainerConfig",
]
