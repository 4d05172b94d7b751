"""`RunSpec`: everything a trainer hands to the Cluster, built before any actor starts.

    AsyncGRPOTrainer / AsyncDistillationTrainer  --RunSpec-->  actors.cluster.launch  --StepLoop-->  the run

It names the algorithm (an `rlasync.algorithms.spec.Algorithm`: which actors, loop, objective and group size),
the rollout loop's arguments (loop class, reward functions, tools, environments, ...), the learner's options, the
teachers, the queue settings, the horizon and the hang limit, and where the run starts (a fresh run, or a
checkpoint's step, policy version and prompt position).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rlasync.console import ProgressCallback
from rlasync.driver.checkpoint import Checkpointer, resumed_trainer_state
from rlasync.driver.elastic import (
    ElasticBounds,
    ElasticController,
    ElasticPolicy,
    ElasticPolicySettings,
    Resizable,
    ResizeRequests,
)
from rlasync.driver.evaluation import BackgroundEvaluations, EvalSchedule
from rlasync.driver.protocols import Fleet, LearnerGroup, SampleQueue, WeightTransport
from rlasync.driver.resources import ActorRequests
from rlasync.driver.step_loop import StepLoop, StepSettings
from rlasync.metrics.perf import StepPerf, peak_flops
from rlasync.metrics.sinks import build_sinks
from rlasync.pipeline import RolloutState, initial_tokens_per_step
from rlasync.pipeline.settings import QueueSettings

if TYPE_CHECKING:
    from peft import PeftConfig

    from rlasync.algorithms.spec import Algorithm
    from rlasync.config.base import TrainerConfig
    from rlasync.packing.step_plan import StepPlan


@dataclass(frozen=True)
class TeacherSpec:
    """One teacher (an algorithm whose spec asks for teachers): a local model hosted by a TeacherScorer (`model`, on `engine`), or a `vllm serve`
    teacher reached at `base_url`."""

    teacher_id: str
    model: str | None
    engine: str
    base_url: str | None = None

    @property
    def is_local(self) -> bool:
        return self.base_url is None


@dataclass
class RolloutSpec:
    """The rollout actors' loop: `loop_cls` and its own keyword arguments (`loop_kwargs`: e.g. `reward_funcs`,
    `tools`, `environment_factory`, or `max_inflight_tasks` per actor); `reward_funcs` also go to the RewardActor
    pool when the algorithm scores through one. Which parts the loop gets is the algorithm's (RunSpec.algorithm)."""

    loop_cls: type
    loop_kwargs: dict[str, Any] = field(default_factory=dict)
    reward_funcs: list[Any] = field(default_factory=list)


@dataclass(frozen=True)
class LearnerSpec:
    """The learners' options (the LR schedule's horizon, teacher ids, the LoRA config); the objective is the
    algorithm's."""

    max_steps: int | None = None
    teacher_ids: list[str] | None = None
    peft_config: PeftConfig | None = (
        None  # a peft.LoraConfig (checked by the trainer): LoRA training with adapter syncs
    )
    optimizer_overrides: dict[str, Any] | None = None
    """The trainer's `optimizers=`: OptimizerSettings fields (optimizer_cls, optimizer_kwargs, scheduler_factory)."""


@dataclass
class RunSpec:
    """What one training run is made of. `algorithm` is the registry's spec; `config` the user's flat config (of
    the algorithm's `config_cls`); `model` the resolved path the actors load (a checkpoint's when resuming)."""

    algorithm: Algorithm
    config: TrainerConfig
    model: str
    tokenizer: Any
    train_dataset: Any
    rollout: RolloutSpec
    learner: LearnerSpec
    queue: QueueSettings
    horizon: int | None
    hang_timeout_s: float
    requests: ActorRequests
    teachers: dict[str, TeacherSpec] = field(default_factory=dict)
    callbacks: list[Any] = field(default_factory=list)
    resume_dir: str | None = None
    resume_state: RolloutState | None = None
    start_step: int = 0
    version: int = 0
    trainer_state: Any = None
    """transformers' `TrainerState` the callbacks get (the trainer's `state`); None: the StepLoop makes one."""
    log_inbox: list[dict[str, float]] | None = None
    """`trainer.log(logs)` during the run: the StepLoop records these into the next window."""
    resize_requests: ResizeRequests | None = None
    """`trainer.resize(...)` during the run: pool sizes the StepLoop's elastic hook applies after the next step."""
    eval_dataset: Any = None
    """Held-out prompts evaluated during training (`eval_strategy`), by the rollout actors (rlasync.driver.evaluation)."""
    eval_steps_per_epoch: int = 0
    """An epoch's steps, estimated (`eval_strategy="epoch"`); 0: unknown (a streaming dataset: only at the end)."""

    @property
    def hang_setting(self) -> str:
        """The config field a hung rollout loop's error names."""
        return self.algorithm.hang_setting

    @property
    def queue_name(self) -> str:
        return self.algorithm.queue_name

    def step_settings(self, tokens_per_step: int, samples_per_step: int | None, composed: bool = False) -> StepSettings:
        return StepSettings.from_config(
            self.config,
            horizon=self.horizon,
            tokens_per_step=tokens_per_step,
            samples_per_step=samples_per_step,
            hang_timeout_s=self.hang_timeout_s,
            hang_setting=self.hang_setting,
            composed=composed,
            min_samples=self.config.cluster.num_learners,
        )

    def step_loop(
        self,
        *,
        queue: SampleQueue,
        learners: LearnerGroup,
        weights: WeightTransport,
        fleet: Fleet,
        tokens_per_step: int,
        samples_per_step: int | None,
        state: dict[str, Any],
        pools: Resizable | None = None,
        evaluate: Callable[[int], Awaitable[dict[str, float]]] | None = None,
        composed: bool = False,
    ) -> StepLoop:
        """The run's StepLoop over the Cluster's adapters: the config's sinks (the records after the starting step,
        of an interrupted or an earlier run, are replaced: one record per step), its checkpointer, the callbacks (called with the config as TRL's `args`);
        with `pools` (the Cluster's resizable pools) the elastic hook: `resize_requests`, and the policy when
        `cluster.elastic`; with `evaluate` (the Cluster's evaluation over the rollout actors) and an eval strategy,
        evaluations in the background (rlasync.driver.evaluation); `composed`: the queue composes the steps (it was
        given a `step_plan`)."""
        config = self.config
        elastic = None
        if pools is not None:
            bounds = ElasticBounds.from_cluster(config.cluster)
            policy = ElasticPolicy(bounds, ElasticPolicySettings(interval_steps=config.cluster.elastic_interval_steps))
            elastic = ElasticController(
                pools, self.resize_requests or ResizeRequests(bounds), policy if config.cluster.elastic else None
            )
        sinks = build_sinks(
            config.output_dir,
            config.report_to,
            max_steps=config.max_steps,
            run_name=config.run_name,
            config=config.to_dict(),
            resume_step=self.start_step,
            console=False,
        )
        progress = ProgressCallback(disable_tqdm=bool(config.disable_tqdm))  # the console: a bar, or a line per window
        perf = step_perf(self.model, config)
        resumed = resumed_trainer_state(self.resume_dir)  # num_tokens and the log history continue across a resume
        perf.num_tokens = resumed.get("num_tokens", 0.0)
        if self.trainer_state is not None and not self.trainer_state.log_history:
            self.trainer_state.log_history.extend(
                record for record in resumed.get("log_history", []) if record.get("step", 0) <= self.start_step
            )
        return StepLoop(
            self.step_settings(tokens_per_step, samples_per_step, composed),
            queue=queue,
            learners=learners,
            weights=weights,
            fleet=fleet,
            checkpointer=Checkpointer(config.output_dir, config.save_total_limit),
            sinks=sinks,
            callbacks=[progress, *self.callbacks],
            callback_args=config,
            state=state,
            tokenizer=self.tokenizer,
            trainer_state=self.trainer_state,
            perf=perf,
            log_inbox=self.log_inbox,
            elastic=elastic,
            initial_model=self.model,
            evaluations=self._evaluations(evaluate),
            completions=self._completions(fleet),
        )

    def _completions(self, fleet: Fleet) -> Any:
        """`log_completions` (GRPO): one table per logged window, drained from the fleet's rollout actors."""
        drain = getattr(fleet, "drain_completions", None)
        if not getattr(self.config, "log_completions", False) or drain is None or not self.algorithm.reward_actors:
            return None
        from rlasync.rollout.completions_log import StepCompletionsPrinter

        return StepCompletionsPrinter(drain, self.config.num_completions_to_print)

    def _evaluations(self, evaluate: Callable[[int], Awaitable[dict[str, float]]] | None) -> Any:
        schedule = EvalSchedule.from_config(self.config, self.horizon, self.eval_steps_per_epoch)
        if evaluate is None or (schedule.every is None and not schedule.at_end):
            return None
        return BackgroundEvaluations(evaluate, schedule)


def step_perf(model_path: str, config: TrainerConfig) -> StepPerf:
    """The MFU estimator of a run: the peak of the learners' GPU (by the name torch reports here, on the driver, so
    only when the driver sees the same kind of GPU the learners ask for) and N counted on the meta device; on the
    CPU, or an unknown GPU, MFU is omitted and only the throughputs are logged."""
    cluster = config.cluster
    if not cluster.learner_num_gpus:
        return StepPerf(num_devices=cluster.num_learners)
    import torch

    peak = peak_flops(torch.cuda.get_device_name(0)) if torch.cuda.is_available() else None
    if peak is None:
        return StepPerf(num_devices=cluster.num_learners)
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            AutoConfig.from_pretrained(model_path, trust_remote_code=config.trust_remote_code)
        )
    num_params = sum(p.numel() for p in model.parameters())
    return StepPerf(num_params=num_params, peak_flops_per_device=peak, num_devices=cluster.num_learners)


def step_budget(
    config: TrainerConfig, num_learners: int, max_model_len: int | None, group_size: int = 1
) -> tuple[int, int, int | None]:
    """(tokens per packed row, raw tokens of the first step, samples per step or None): the row budget is
    `token_budget`, else the engine's `max_model_len`; a budget <= 0 means a fixed count of samples per step.
    `group_size`: samples sharing a prompt (1 when rows share nothing), for the first step's estimate."""
    budget = config.token_budget if config.token_budget is not None else max_model_len
    if budget is None:
        raise ValueError("step_budget: token_budget is None and no max_model_len was given")
    if budget > 0:
        ga = config.gradient_accumulation_steps
        return budget, initial_tokens_per_step(budget, num_learners, ga, max(group_size, 1)), None
    samples_per_step = config.samples_per_step(num_learners)
    return budget, samples_per_step * 256, samples_per_step  # a first guess; finish_step corrects it


def step_plan(
    config: TrainerConfig, algorithm: Algorithm, num_learners: int, budget: int, share_prefixes: bool = True
) -> StepPlan | None:
    """How the queue composes a step (docs/algorithms.md §4.5.1): `gradient_accumulation_steps` micro-batches of
    one row per learner, each row filled by the algorithm's batcher up to `budget` unique tokens. None for a fixed
    sample count (`budget <= 0`) and for `max_staleness=0`, whose steps take what their version generated."""
    from rlasync.packing.step_plan import StepPlan

    if budget <= 0 or config.max_staleness < 1:
        return None
    return StepPlan(
        num_ranks=num_learners,
        token_budget=budget,
        micro_batches=config.gradient_accumulation_steps,
        batcher=algorithm.step_batcher,
        share_prefixes=share_prefixes,
    )


def model_shares_prefixes(model: str, trust_remote_code: bool = False) -> bool:
    """Whether the learner's rows share prefixes for this model: not for a model with linear-attention layers
    (trained padding-free, docs/algorithms.md §4.3). True when its config cannot be read here."""
    try:
        from transformers import AutoConfig

        from rlasync.model.attention import has_linear_attention

        return not has_linear_attention(AutoConfig.from_pretrained(model, trust_remote_code=trust_remote_code))
    except (OSError, ValueError, KeyError, ImportError):
        return True


def engine_dtype(config: TrainerConfig) -> str | None:
    """The engines' dtype: their default (bf16 on a GPU, float32 on the CPU) when the trainer is float32 under bf16
    mixed precision or "auto"; else the trainer's (e.g. pure bf16 training samples from bf16 engines)."""
    if config.dtype == "auto" or (config.dtype == "float32" and config.bf16):
        return None
    return config.dtype


def server_engine_kwargs(config: TrainerConfig, engine_kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """The keyword arguments of a `vllm serve` client engine (a `vllm_server` policy engine or a teacher): the
    config's timeouts (`vllm_server_timeout` bounds the readiness wait, so a teacher URL where no server runs fails
    after it, not after the client's own 600-s default; distillation's `request_timeout` / `weight_sync_timeout` bound
    each request / weight call, GRPO's `vllm_server_timeout` both), under what `cluster.engine_kwargs` sets."""
    request_s = getattr(config, "request_timeout", config.vllm_server_timeout)
    weight_s = getattr(config, "weight_sync_timeout", config.vllm_server_timeout)
    timeouts = {
        "startup_timeout_s": float(config.vllm_server_timeout),
        "request_timeout_s": float(request_s),
        "weight_sync_timeout_s": float(weight_s),
    }
    return {**timeouts, **(engine_kwargs or {})}


__all__ = [
    "LearnerSpec",
    "RolloutSpec",
    "RunSpec",
    "TeacherSpec",
    "engine_dtype",
    "model_shares_prefixes",
    "server_engine_kwargs",
    "step_budget",
    "step_plan",
]
