"""What both trainers share: TRL's `args` / `state` / `callbacks`, the model as a path the actors can load, and
`train()`, which builds a `RunSpec` (pure) and makes the one call into `actors/` that runs it on Ray.

    trainer.train()  ->  preflight()  ->  the folder's lock (driver/run_lock.py)  ->  resume point (Checkpointer)
                     ->  build_spec (subclass)  ->  actors.cluster.launch(spec)

`preflight()` (rlasync.trainers.preflight) checks in seconds what is known before Ray starts: the model, the
teachers, output_dir, report_to, the prompts against max_model_len and the token budget.

A subclass's `__init__` runs `_begin_init`, its own checks, then `_end_init`; it implements `build_spec` and never
touches Ray.

transformers' Trainer surface (rlasync.trainers.surface): `state` is a `TrainerState`, callbacks are
`TrainerCallback`s (`add_callback` / `remove_callback` / `pop_callback`), `train()` returns a `TrainOutput`,
`model` is the trained model after `train()` (loaded lazily from the final checkpoint), `save_model`,
`push_to_hub` (offline: a local folder), `log`; `optimizers=(optimizer, scheduler)` (rlasync.trainers.optimizers).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlasync.driver import Checkpointer, RunSpec
from rlasync.driver.elastic import ElasticBounds, ResizeRequests
from rlasync.driver.run_lock import claim_run_folder
from rlasync.pipeline import RolloutState
from rlasync.trainers.optimizers import optimizer_overrides
from rlasync.trainers.surface import TrainerSurface, estimated_max_steps

if TYPE_CHECKING:
    from rlasync.config.base import TrainerConfig

logger = logging.getLogger(__name__)


class AsyncTrainerBase(TrainerSurface):
    """The common part of `AsyncGRPOTrainer` and `AsyncDistillationTrainer`."""

    loop_cls: type
    algorithm_name: str
    """The registry name of the trainer's algorithm (rlasync.algorithms.registry); the spec says which actors,
    loop, objective and group size the run gets."""

    def _begin_init(self, args: TrainerConfig, loop_cls: type | None) -> None:
        """First step of a subclass's `__init__`: the (checked) config and the loop class its checks consult."""
        self.args = args
        if loop_cls is not None:
            self.loop_cls = loop_cls

    def _end_init(
        self,
        model: Any,
        train_dataset: Any,
        processing_class: Any,
        callbacks: Sequence[Any] | None,
        optimizers: tuple[Any, Any] = (None, None),
    ) -> None:
        """Last step, once the subclass checked its arguments: the dataset, the model as a path the actors load
        (`model_path`), the optimizer overrides, TRL's `callbacks` / `state` (transformers' TrainerState; the run's
        own dict is `run_state`); `actor_ids` lists the Ray actors a run created. Fires `on_init_end`."""
        self.train_dataset = train_dataset
        self.optimizer_overrides = optimizer_overrides(optimizers)
        self.model_path = self._model_path(model)
        self._model_input = model
        self.processing_class = processing_class
        self._init_surface(callbacks)
        self.run_state: dict[str, Any] = {"global_step": 0, "policy_version": 0}
        self.actor_ids: list[str] = []
        self._preflight_done = False
        self._event("on_init_end")

    # ---- public -------------------------------------------------------------------------------------------------

    def train(self, resume_from_checkpoint: str | bool | None = None, **kwargs: Any) -> Any:
        """Run until the horizon (`max_steps`, or the epochs' prompts are consumed); returns transformers'
        `TrainOutput(global_step, training_loss, metrics)` (`metrics` has `train_runtime`, `train_loss`,
        `policy_version`, ...). `resume_from_checkpoint` defaults to `args.resume_from_checkpoint`. Actors are
        removed on the way out, also on error. With `args.push_to_hub`, the final model is pushed (offline)."""
        if kwargs:
            raise TypeError(
                f"train() got unexpected keyword arguments {sorted(kwargs)} (rlasync takes resume_from_checkpoint)"
            )
        if resume_from_checkpoint is None:
            resume_from_checkpoint = self.args.resume_from_checkpoint
        self.preflight()
        lock = claim_run_folder(self.args, resume_from_checkpoint)  # one run per folder (driver/run_lock.py)
        checkpointer = Checkpointer(self.args.output_dir, self.args.save_total_limit)
        spec = self.build_spec(checkpointer.resume_dir(resume_from_checkpoint))
        spec.trainer_state, spec.log_inbox = self.state, self._log_inbox
        self.state.max_steps = spec.horizon or estimated_max_steps(self.args, spec.queue)  # epoch run: an estimate
        spec.resize_requests = self._resize_requests = ResizeRequests(ElasticBounds.from_cluster(self.args.cluster))
        if self.optimizer_overrides:
            spec.learner = dataclasses.replace(spec.learner, optimizer_overrides=self.optimizer_overrides)
        from actors.cluster import launch  # the one way to Ray

        started = time.perf_counter()
        self._training = True
        try:
            run_state = launch(spec, state=self.run_state, actor_ids=self.actor_ids)
        finally:
            self._training = False
            lock.release()
        output = self._train_output(run_state, time.perf_counter() - started, spec.start_step)
        if self.args.push_to_hub:
            self.push_to_hub()
        return output

    def preflight(self) -> None:
        """The checks that need no actor (model, teachers, output_dir, report_to, prompt lengths, token budget);
        `ValueError` naming the field and the fix. Runs once (train() calls it; the CLI calls it first)."""
        if not getattr(self, "_preflight_done", False):
            from rlasync.trainers.preflight import run_preflight

            run_preflight(self)
            self._preflight_done = True

    def build_spec(self, resume_dir: str | None) -> RunSpec:
        """Everything the Cluster creates and the step loop runs, for a fresh run or one resumed from `resume_dir`."""
        raise NotImplementedError

    # ---- for subclasses -----------------------------------------------------------------------------------------

    def _model_path(self, model: Any) -> str:
        if isinstance(model, str | os.PathLike):
            return str(model)
        if hasattr(model, "save_pretrained"):  # an instantiated model: the actors load it from a folder
            path = Path(self.args.output_dir) / "initial_model"
            model.save_pretrained(path)
            return str(path)
        raise ValueError(f"model must be a hub id, a local path, an alias or a PreTrainedModel, got {type(model)}")

    def _starting_point(self, resume_dir: str | None) -> tuple[str, Any, RolloutState | None, int, int]:
        """(model path, tokenizer, rollout state or None, first step, policy version) of a fresh or resumed run."""
        from rlasync.model.registry import resolve_model

        model = resume_dir or resolve_model(self.model_path)  # an alias is converted once, here, not in every actor
        tokenizer = self.given_processing_class if self.given_processing_class is not None else resolve_model(model)
        resume_state, start_step, version = Checkpointer.starting_point(resume_dir)
        return model, tokenizer, resume_state, start_step, version

    def _run_spec(self, resume_dir: str | None, **fields: Any) -> RunSpec:
        """A RunSpec with the common fields (the algorithm, config, model, tokenizer, dataset, callbacks, starting
        point, the hang limit)."""
        from rlasync.algorithms import registry

        algorithm = registry.get(self.algorithm_name)
        model, tokenizer, resume_state, start_step, version = self._starting_point(resume_dir)
        return RunSpec(
            algorithm=algorithm,
            config=self.args,
            hang_timeout_s=algorithm.hang_timeout(self.args),
            model=model,
            tokenizer=tokenizer,
            train_dataset=self.train_dataset,
            callbacks=self.callbacks,
            resume_dir=resume_dir,
            resume_state=resume_state,
            start_step=start_step,
            version=version,
            **fields,
        )


__all__ = ["AsyncTrainerBase"]
