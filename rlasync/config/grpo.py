"""`AsyncGRPOConfig`: TRL's field names and defaults (docs/algorithms.md §10.2) plus the training
arguments the trainer reads, as a plain dataclass so that users subclass it the way TRL's docs show:

    @dataclass
    class CurriculumConfig(AsyncGRPOConfig):
        pass_rate_cap: float = 0.9

Validation runs in `__post_init__` (so subclasses get it too) and every error names the field and the fix.
This module imports neither torch nor ray: a config can be checked on any machine.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Literal

from rlasync.config.base import (  # noqa: F401 - re-exported: these lived here first
    DTYPES,
    JSON_DICT_FIELDS,
    LR_SCHEDULERS,
    ClusterConfig,
    TrainerConfig,
    _at_least,
    _parse_json_dict,
    _positive_int,
)

logger = logging.getLogger(__name__)

# GRPO needs different completions within a group. Measured on CPU with a tiny random model (flat logits): at
# temperature 1e-3 all 8 completions of a group were identical, at 1e-2 six of 8 were distinct.
GRPO_MIN_TEMPERATURE = 1e-2
GRPO_MIN_TOP_P = 1e-2


@dataclass
class AsyncGRPOConfig(TrainerConfig):
    """Configuration of asynchronous GRPO. Field names and defaults follow TRL's `AsyncGRPOConfig`; the run,
    optimisation, model, sampling and actor-system fields come from `TrainerConfig`."""

    remove_unused_columns: bool = False
    """The document's default (TRL 1.16: True); either value is accepted and every dataset column reaches the
    reward functions."""
    router_aux_loss_coef: float | None = None
    """TRL's MoE load-balancing loss coefficient. rlasync trains without the router auxiliary loss: only None or 0.0
    is accepted (with a Mixture-of-Experts model TRL's None would add the model's own coefficient)."""
    fork_threshold_tokens: int = 1024
    """TRL's realign-or-fork threshold of multi-turn reconciliation. rlasync forks on any re-tokenization drift
    (TRL's behaviour with 0; docs/algorithms.md §3.3), so only TRL's default (accepted, with rlasync's rule) or 0."""

    # ---- generation ----
    num_generations: int = 8
    """G: rollouts per prompt (a group)."""
    num_generations_eval: int | None = None
    """Completions per prompt of an evaluation (`eval_dataset`; TRL's GRPOConfig field); None: `num_generations`.
    1 is allowed (an evaluation measures, it does not compare within a group)."""
    max_tool_calling_iterations: int | None = None

    # ---- rewards ----
    reward_weights: list[float] | None = None
    """TRL's GRPOConfig field: one weight per reward function (in `reward_funcs` order; a reward model or a
    `RemoteReward` is one function). A rollout's reward is the weighted sum of its functions' rewards with None
    (NaN) ignored, an environment's `get_reward` column weighing 1; a rollout no function scored stays unscorable
    (NaN reward, advantage 0), whatever the weights. None: every function weighs 1.0. The per-function metrics
    `rewards/<name>/mean` are unweighted; `reward` is the weighted sum."""
    multi_objective_aggregation: str = "sum_then_normalize"
    """TRL's GRPOConfig field. "sum_then_normalize" (TRL's default, the only one here): the weighted sum of the
    reward functions is normalised within its group. TRL's "normalize_then_sum" (GDPO) ends with a normalisation
    over the whole generation batch, which asynchronous scoring (each group as it finishes) does not have: refused;
    its per-group part is `rlasync.advantages.decoupled_group_advantages`, for a `compute_advantages` hook."""
    scale_rewards: str | bool = "group"
    """TRL's GRPOConfig field: "group" / True (default): advantages are divided by the group's reward std; "none" /
    False: only centred on the group mean (Dr. GRPO). TRL's "batch" (the whole batch's std) is refused: groups are
    scored one at a time, there is no batch at scoring time."""

    # ---- loss ----
    epsilon: float = 0.2
    epsilon_high: float | None = None
    """Upper clip; `None` -> `epsilon` (DAPO suggests 0.28)."""
    score_centering: bool = True
    vllm_importance_sampling_clip_min: float = 0.5
    vllm_importance_sampling_clip_max: float = 5.0
    num_sampler_logprobs: int = 8
    """Top-N sampler log-probs per generated token, the head of score centering's expectation."""
    masked_token_centering: Literal["keep", "drop"] = "keep"
    """rlasync's switch (docs/algorithms.md §5.3): a sampled token masked by the IS bounds keeps its
    centring term ("keep", the derivation) or is removed from the loss entirely ("drop")."""

    # ---- asynchrony ----
    max_concurrent_rollouts: int = 512
    """Concurrent rollouts of each rollout actor (the cap of its adaptive concurrency controller): `num_rollout_actors`
    x this in flight at most."""
    max_inflight_tasks: int = -1
    """TRL's name of the concurrency cap: a positive value sets `max_concurrent_rollouts`; -1 keeps it."""
    rollout_worker_timeout: float = 300.0
    """A rollout actor without a heartbeat for this long is hung: the run stops with its error."""
    heartbeat_stale_after_s: float = 300.0
    """TRL's name of `rollout_worker_timeout`: a value other than the default sets it."""

    def _normalize(self) -> None:
        super()._normalize()
        self._alias("max_inflight_tasks", -1, "max_concurrent_rollouts", 512)
        self._alias("heartbeat_stale_after_s", 300.0, "rollout_worker_timeout", 300.0)
        # The document's single `vllm_server_timeout` bounds requests and weight calls too, unless TRL 1.16's own
        # fields are given (their defaults then follow it).
        if self.request_timeout == 600:
            self.request_timeout = self.vllm_server_timeout
        if self.weight_sync_timeout == 1800:
            self.weight_sync_timeout = self.vllm_server_timeout

    def _alias(self, trl_name: str, trl_default: object, name: str, default: object) -> None:
        """TRL's field `trl_name` sets rlasync's `name` when given; both given with different values is an error."""
        value = getattr(self, trl_name)
        if value == trl_default:
            return
        if getattr(self, name) not in (default, value):
            raise ValueError(
                f"{trl_name}={value!r} and {name}={getattr(self, name)!r} name the same setting: give only one"
            )
        setattr(self, name, value)

    def _validate(self) -> None:
        super()._validate()
        self._check_rewards()
        self._check_reward_scaling()
        self._check_loss()

    def _check_rewards(self) -> None:
        """`reward_weights`: a list of finite numbers (its length is checked against `reward_funcs` by the trainer)."""
        weights = self.reward_weights
        if weights is None:
            return
        if isinstance(weights, str | bytes | dict) or not isinstance(weights, list | tuple):
            raise ValueError(
                f"reward_weights={weights!r}: give a list of numbers, one per reward function (e.g. [1.0, 0.5]), "
                "or None (every function 1.0)"
            )
        for weight in weights:
            if isinstance(weight, bool) or not isinstance(weight, int | float) or not math.isfinite(weight):
                raise ValueError(
                    f"reward_weights={list(weights)}: {weight!r} is not a finite number; give one finite weight per "
                    "reward function (e.g. [1.0, 0.5])"
                )
        self.reward_weights = [float(weight) for weight in weights]

    def _check_reward_scaling(self) -> None:
        """`multi_objective_aggregation` and `scale_rewards`: TRL's per-group values, the batch-wide ones refused."""
        if self.multi_objective_aggregation == "normalize_then_sum":
            raise ValueError(
                "multi_objective_aggregation='normalize_then_sum' is not supported by rlasync: TRL normalises each "
                "reward function within its group, then the weighted sum over the whole generation batch, and "
                "asynchronous scoring has no batch (each group is scored as it finishes); leave the default "
                "'sum_then_normalize', or override the loop's compute_advantages(group) with "
                "rlasync.advantages.decoupled_group_advantages(group.reward_table.values, group.reward_table.weights) "
                "(GDPO's per-group part)"
            )
        if self.multi_objective_aggregation != "sum_then_normalize":
            raise ValueError(
                f"multi_objective_aggregation={self.multi_objective_aggregation!r}: use 'sum_then_normalize' "
                "(the default; 'normalize_then_sum' is not supported)"
            )
        scale = self.scale_rewards
        if isinstance(scale, str) and scale.lower() in ("true", "false"):  # a command-line spelling of the bool
            scale = scale.lower() == "true"
        scale = {True: "group", False: "none"}.get(scale, scale) if isinstance(scale, bool) else scale
        if scale == "batch":
            raise ValueError(
                "scale_rewards='batch' is not supported by rlasync: it divides by the reward std of the whole "
                "generation batch, and asynchronous scoring has no batch (each group is scored as it finishes); use "
                "'group' (the default: the group's std) or 'none' (no scaling)"
            )
        if scale not in ("group", "none"):
            raise ValueError(
                f"scale_rewards={self.scale_rewards!r}: use 'group' (or True, the default) or 'none' (or False)"
            )
        self.scale_rewards = scale

    def _check_run(self) -> None:
        super()._check_run()
        if self.router_aux_loss_coef not in (None, 0, 0.0):
            raise ValueError(
                f"router_aux_loss_coef={self.router_aux_loss_coef} is not supported: rlasync trains without the MoE "
                "router auxiliary loss; leave router_aux_loss_coef=None"
            )
        if self.fork_threshold_tokens not in (1024, 0):
            raise ValueError(
                f"fork_threshold_tokens={self.fork_threshold_tokens} is not supported: rlasync forks a new training "
                "sequence on any re-tokenization drift (docs/algorithms.md §3.3); leave the default or set 0"
            )
        for name in ("logging_steps", "save_steps", "eval_steps"):
            if getattr(self, name) is not None and getattr(self, name) < 1 and self.max_steps <= 0:
                raise ValueError(
                    f"{name}={getattr(self, name)} is a fraction of max_steps, but max_steps=-1 (GRPO's prompt "
                    "stream has no known length): set max_steps, or give a step count"
                )

    def _check_sampling(self) -> None:
        _positive_int(self, "num_generations")
        if self.num_generations < 2:
            raise ValueError(
                f"num_generations={self.num_generations}: GRPO compares rollouts within a group, use at least 2"
            )
        if self.num_generations_eval is not None and self.num_generations_eval < 1:
            raise ValueError(
                f"num_generations_eval={self.num_generations_eval}: use at least 1, or None (then num_generations)"
            )
        self._check_group_diversity()  # first: GRPO's floors are above the sampler's (base.MIN_TEMPERATURE)
        super()._check_sampling()
        if self.max_tool_calling_iterations is not None and self.max_tool_calling_iterations < 0:
            raise ValueError(f"max_tool_calling_iterations={self.max_tool_calling_iterations}: must be >= 0 or None")

    def _check_group_diversity(self) -> None:
        """Settings that make (almost) every rollout of a group the same argmax completion are refused: such groups have
        no reward spread, are dropped, and the run would train nothing while looking busy."""
        why = "the completions of a group come out the same greedy one, no group has reward spread, nothing trains"
        if self.temperature < GRPO_MIN_TEMPERATURE:
            raise ValueError(
                f"temperature={self.temperature}: GRPO's smallest supported temperature is {GRPO_MIN_TEMPERATURE:g} "
                f"(below it {why}); use temperature >= {GRPO_MIN_TEMPERATURE:g}"
            )
        if self.top_k == 1:
            raise ValueError(f"top_k=1 keeps only the argmax: {why}; use top_k >= 2, or 0 (off)")
        if self.top_p < GRPO_MIN_TOP_P:
            raise ValueError(
                f"top_p={self.top_p}: GRPO's smallest supported top_p is {GRPO_MIN_TOP_P:g} (below it the nucleus "
                f"is the argmax alone at almost every position: {why})"
            )
        if self.min_p == 1:
            raise ValueError(f"min_p={self.min_p} keeps only the argmax: {why}; use min_p < 1 (e.g. 0.05)")

    def _check_loss(self) -> None:
        _at_least(self, "epsilon", 0.0)
        if self.epsilon_high is not None:
            _at_least(self, "epsilon_high", 0.0)
        _at_least(self, "vllm_importance_sampling_clip_min", 0.0)
        if not self.vllm_importance_sampling_clip_max > self.vllm_importance_sampling_clip_min:
            raise ValueError(
                f"vllm_importance_sampling_clip_max={self.vllm_importance_sampling_clip_max} must be greater than "
                f"vllm_importance_sampling_clip_min={self.vllm_importance_sampling_clip_min}"
            )
        if self.num_sampler_logprobs < 0:
            raise ValueError(f"num_sampler_logprobs={self.num_sampler_logprobs}: must be >= 0")
        if self.score_centering and self.num_sampler_logprobs == 0:
            raise ValueError(
                "score_centering=True needs the sampler's top log-probs: set num_sampler_logprobs >= 1 "
                "(default 8) or score_centering=False"
            )
        if self.masked_token_centering not in ("keep", "drop"):
            raise ValueError(f"masked_token_centering={self.masked_token_centering!r}: choose 'keep' or 'drop'")

    def _check_async(self) -> None:
        super()._check_async()
        _positive_int(self, "max_concurrent_rollouts")
        if not self.rollout_worker_timeout > 0:
            raise ValueError(f"rollout_worker_timeout={self.rollout_worker_timeout}: must be > 0 seconds")

    # ---- derived values ----
    @property
    def epsilon_low(self) -> float:
        return self.epsilon

    @property
    def effective_epsilon_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high


__all__ = ["AsyncGRPOConfig", "ClusterConfig", "DTYPES", "LR_SCHEDULERS"]
