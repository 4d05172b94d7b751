"""`AsyncGRPOTrainer`: TRL's constructor, run on Ray actors (docs/design.md §1).

    trainer = AsyncGRPOTrainer(model="smollm2-135m-instruct", reward_funcs=last_number_reward,
                               args=AsyncGRPOConfig(...), train_dataset=dataset)
    trainer.train()                      # or train(resume_from_checkpoint=True / "out/checkpoint-20")

The trainer checks its arguments and builds a `RunSpec` (RolloutActors with the reward functions, tools and
environments; learners with the GRPO objective; the queue settings; the horizon `max_steps`, or none: the epochs'
prompts). `train()` hands it to `actors.cluster.launch`, which connects to Ray (the config's
`cluster.ray_address`, else `RAY_ADDRESS`, else an existing `ray.init()`, else a new local cluster), creates the
actors, runs the step loop (`rlasync.driver.StepLoop`)

    take (token target, from the StalenessQueue) -> learners train -> every weight_sync_steps: pause engines,
    broadcast from learner rank 0 (NCCL GPU to GPU, or gloo through the CPU), resume, publish the policy
    version -> log a window -> maybe checkpoint

and removes every actor it made on the way out, also on error. This module never imports Ray.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from rlasync.algorithms.grpo.loop import AsyncRolloutLoop
from rlasync.config import AsyncGRPOConfig
from rlasync.data import validate_prompt_dataset, with_environment_prompts
from rlasync.driver import LearnerSpec, RolloutSpec, RunSpec, actor_requests, check_resources, engine_dtype
from rlasync.driver.checkpoint import CHECKPOINT_PREFIX, TRAINER_STATE
from rlasync.driver.step_loop import TAKE_POLL_S
from rlasync.pipeline.settings import QueueSettings
from rlasync.rollout.environments import EnvironmentFactory
from rlasync.rollout.scoring import reward_weight_vector
from rlasync.trainers.base import AsyncTrainerBase
from rlasync.trainers.checks import (
    _check_picklable,
    _checked_environment_factory,
    _checked_tools,
    _may_own_reward,
    _refuse_trl_workers,
)
from rlasync.trainers.evaluation import EvaluationMixin, checked_eval_dataset, steps_per_epoch

if TYPE_CHECKING:
    from peft import PeftConfig

logger = logging.getLogger(__name__)


class AsyncGRPOTrainer(EvaluationMixin, AsyncTrainerBase):
    """Asynchronous GRPO (TRL's `AsyncGRPOTrainer` API). Subclass and set `loop_cls` to customise rollouts."""

    loop_cls: type[AsyncRolloutLoop] = AsyncRolloutLoop
    algorithm_name = "grpo"

    def __init__(
        self,
        model: Any,
        reward_funcs: Callable[..., Any] | Sequence[Callable[..., Any]] | None = None,
        args: AsyncGRPOConfig | None = None,
        train_dataset: Any = None,
        processing_class: Any = None,
        callbacks: Sequence[Any] | None = None,
        optimizers: tuple[Any, Any] = (None, None),
        peft_config: PeftConfig | None = None,
        tools: Sequence[Callable[..., Any]] | None = None,
        environment_factory: EnvironmentFactory | Mapping[str, EnvironmentFactory] | None = None,
        rollout_worker: Any = None,
        weight_transfer: Any = None,
        *,
        loop_cls: type[AsyncRolloutLoop] | None = None,
        eval_dataset: Any = None,
    ) -> None:
        # TRL 1.16's parameters in TRL's positional order; rlasync's additions are keyword-only
        _refuse_trl_workers(rollout_worker, weight_transfer)
        self._begin_init(args if args is not None else AsyncGRPOConfig(), loop_cls)
        self.peft_config = _checked_peft_config(peft_config)  # a peft.LoraConfig: adapters only (docs/design.md §3)
        train_dataset = self._check_inputs(reward_funcs, train_dataset, tools, environment_factory)
        self.eval_dataset = checked_eval_dataset(eval_dataset, self.args)
        self._end_init(model, train_dataset, processing_class, callbacks, optimizers)

    # ---- checks -------------------------------------------------------------------------------------------------

    def _check_inputs(self, reward_funcs: Any, train_dataset: Any, tools: Any, environment_factory: Any) -> Any:
        """Tools, environments, the dataset (or the environment's placeholder prompts) and a reward source;
        returns the dataset to train on."""
        self.tools = _checked_tools(tools)
        self.environment_factory = _checked_environment_factory(environment_factory)
        if train_dataset is None:
            train_dataset = self._placeholder_dataset(environment_factory)
        elif environment_factory is not None:  # an environment-only dataset: reset() writes the prompts
            train_dataset = with_environment_prompts(train_dataset)
        validate_prompt_dataset(train_dataset)
        if reward_funcs is None:
            reward_funcs = []
        single = callable(reward_funcs) or isinstance(reward_funcs, str | os.PathLike)  # a string is not split
        self.reward_funcs = [reward_funcs] if single else list(reward_funcs)
        if (
            not self.reward_funcs
            and not getattr(self.loop_cls, "provides_rollout_rewards", False)
            and not _may_own_reward(environment_factory)
        ):
            raise ValueError(
                "No reward source: pass reward_funcs (e.g. rlasync.rewards.last_number_reward), an "
                "environment_factory whose class defines get_reward, or a loop_cls whose generate_one sets "
                "Rollout.reward and provides_rollout_rewards = True"
            )
        reward_weight_vector(self.args.reward_weights, len(self.reward_funcs))
        self.reward_funcs = [_reward_model_or_func(func) for func in self.reward_funcs]
        self._reward_models_on_actors()
        return train_dataset

    def _reward_models_on_actors(self) -> None:
        """A reward model is scored in the RewardActor pool (its GPU share, batches across rollout actors): without
        `cluster.num_reward_actors` the run gets one RewardActor."""
        from rlasync.rewards.model import RewardModel

        models = [func.__name__ for func in self.reward_funcs if isinstance(func, RewardModel)]
        cluster = self.args.cluster
        if models and cluster.num_reward_actors == 0:
            cluster.num_reward_actors = 1
            logger.info(
                "reward model(s) %s: scored in a RewardActor (cluster.num_reward_actors=1; set it, and "
                "cluster.reward_num_gpus for a GPU share, to choose)",
                models,
            )

    def _placeholder_dataset(self, environment_factory: Any) -> list[dict[str, Any]]:
        """Without a dataset, a single environment supplies the prompts (docs/algorithms.md §3.4): B x GA rows with an empty
        user message, to which each rollout's `reset()` observation is appended."""
        if environment_factory is None:
            raise ValueError(
                "`train_dataset` is required: pass a dataset with a 'prompt' column (or, to let an environment "
                "write the prompts, a single environment_factory and max_steps > 0)"
            )
        if isinstance(environment_factory, Mapping):
            raise ValueError(
                "a dict environment_factory (several environments) requires a `train_dataset` whose "
                "'environment' column routes each row to one of them"
            )
        if self.args.max_steps <= 0:
            raise ValueError(
                f"max_steps={self.args.max_steps}: without a train_dataset the environment yields an endless "
                "stream of prompts, so set max_steps > 0"
            )
        num_rows = self.args.per_device_train_batch_size * self.args.gradient_accumulation_steps
        return [{"prompt": [{"role": "user", "content": ""}]} for _ in range(num_rows)]

    # ---- the run ------------------------------------------------------------------------------------------------

    def _loop_kwargs(self) -> dict[str, Any]:
        """The loop's own arguments: the reward functions, and tools / environments only when set (a `loop_cls`
        with a narrower `__init__` keeps working without them)."""
        from rlasync.rewards.model import RewardModel

        # the RewardActor pool scores a reward model: the rollout actors' copies travel without a loaded model's weights
        light = [f.without_weights() if isinstance(f, RewardModel) else f for f in self.reward_funcs]
        kwargs: dict[str, Any] = {"reward_funcs": light if self.args.cluster.num_reward_actors else self.reward_funcs}
        if self.tools:
            kwargs["tools"] = self.tools
        if self.environment_factory is not None:
            kwargs["environment_factory"] = self.environment_factory
        return kwargs

    def build_spec(self, resume_dir: str | None) -> RunSpec:
        """RolloutActors (reward functions, tools, environments; reward actors per `cluster.num_reward_actors`),
        GRPO learners, the queue over the dataset's rows, horizon `max_steps` (none with -1: the epochs end it)."""
        args = self.args
        return self._run_spec(
            resume_dir,
            rollout=RolloutSpec(
                loop_cls=self.loop_cls, loop_kwargs=self._loop_kwargs(), reward_funcs=self.reward_funcs
            ),
            learner=LearnerSpec(peft_config=self.peft_config),
            queue=QueueSettings.for_dataset(args, self.train_dataset),
            horizon=args.max_steps if args.max_steps > 0 else None,
            requests=actor_requests(args.cluster),
            eval_dataset=self.eval_dataset,
            eval_steps_per_epoch=steps_per_epoch(args, self.train_dataset),
        )


__all__ = [
    "CHECKPOINT_PREFIX",
    "TAKE_POLL_S",
    "TRAINER_STATE",
    "AsyncGRPOTrainer",
    "_check_picklable",
    "_checked_environment_factory",
    "_checked_tools",
    "check_resources",
    "engine_dtype",
]


def _reward_model_or_func(func: Any) -> Any:
    """A reward function as it is; a reward model (a folder / hub id string, a loaded classification model, a
    `RewardModel`) as a `RewardModel`; anything else is a `ValueError` naming it."""
    from rlasync.rewards.model import as_reward_model

    if isinstance(func, str) and re.fullmatch(r"[\w.]+:[\w.]+", func):
        raise ValueError(
            f"reward_funcs: {func!r} is an import string, and a string is not callable: pass the function itself "
            "(import strings are for run files' `reward_funcs:`); a string in reward_funcs names a reward model folder"
        )
    if isinstance(func, str | os.PathLike) or not callable(func) or hasattr(func, "state_dict"):  # not for functions
        model = as_reward_model(func)
        if model is not None:
            return model
    if not callable(func):
        raise ValueError(
            f"reward_funcs: {func!r} is not callable; pass functions, a reward model's folder (a string), a loaded "
            "AutoModelForSequenceClassification or rlasync.rewards.RewardModel(...)"
        )
    return func


def _checked_peft_config(peft_config: object) -> PeftConfig | None:
    """`rlasync.weights.adapter.check_peft_config`, imported only when a peft_config is given (it needs torch)."""
    if peft_config is None:
        return None
    from rlasync.weights.adapter import check_peft_config

    return check_peft_config(peft_config)
