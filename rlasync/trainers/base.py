"""What both trainers share: TRL's `args` / `state` / `callbacks`, the model as a path the actors can load, and
`train()`, which builds a `RunSpec` (pure) and makes the one call into `actors/` that runs it on Ray.

    trainer.train()  ->  preflight()  ->  resume point (Checkpointer)  ->  build_spec (subclass)
                     ->  actors.cluster.launch(spec)

`preflight()` (rlasync.trainers.preflight) checks in seconds what is known before Ray starts: the model, the
teachers, output_dir, report_to, the prompts against max_model_len and the token budget.

A subclass's `__init__` runs `_begin_init`, its own checks, then `_end_init`; it implements `build_spec` and never
touches Ray.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlasync.driver import Checkpointer, RunSpec
from rlasync.pipeline import RolloutState

if TYPE_CHECKING:
    from rlasync.config.base import TrainerConfig

logger = logging.getLogger(__name__)


class AsyncTrainerBase:
    """The common part of `AsyncGRPOTrainer` and `AsyncDistillationTrainer`."""

    loop_cls: type

    def _begin_init(self, args: TrainerConfig, loop_cls: type | None) -> None:
        """First step of a subclass's `__init__`: the (checked) config and the loop class its checks consult."""
        self.args = args
        if loop_cls is not None:
            self.loop_cls = loop_cls

    def _end_init(self, model: Any, train_dataset: Any, processing_class: Any,
                  callbacks: Sequence[Any] | None) -> None:  # fmt: skip
        """Last step, once the subclass checked its arguments: the dataset, the model as a path the actors load,
        and TRL's `callbacks` / `state`; `actor_ids` lists the Ray actors a run created."""
        self.train_dataset = train_dataset
        self.model = self._model_path(model)
        self.processing_class = processing_class
        self.callbacks = list(callbacks or [])
        self.state: dict[str, Any] = {"global_step": 0, "policy_version": 0}
        self.actor_ids: list[str] = []
        self._preflight_done = False

    # ---- public -------------------------------------------------------------------------------------------------

    def train(self, resume_from_checkpoint: str | bool | None = None) -> dict[str, Any]:
        """Run until the horizon (`max_steps`, or the epochs' prompts are consumed); returns the final state
        (`global_step`, `policy_version`, `queue`). Actors are removed on the way out, also on error."""
        self.preflight()
        checkpointer = Checkpointer(self.args.output_dir, self.args.save_total_limit)
        spec = self.build_spec(checkpointer.resume_dir(resume_from_checkpoint))
        from actors.cluster import launch  # the one way to Ray

        return launch(spec, state=self.state, actor_ids=self.actor_ids)

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

        model = resume_dir or resolve_model(self.model)  # an alias is converted once, here, not in every actor
        tokenizer = self.processing_class if self.processing_class is not None else resolve_model(model)
        resume_state, start_step, version = Checkpointer.starting_point(resume_dir)
        return model, tokenizer, resume_state, start_step, version

    def _run_spec(self, resume_dir: str | None, **fields: Any) -> RunSpec:
        """A RunSpec with the common fields (config, model, tokenizer, dataset, callbacks, starting point)."""
        model, tokenizer, resume_state, start_step, version = self._starting_point(resume_dir)
        return RunSpec(
            config=self.args, model=model, tokenizer=tokenizer, train_dataset=self.train_dataset,
            callbacks=self.callbacks, resume_dir=resume_dir, resume_state=resume_state, start_step=start_step,
            version=version, **fields,
        )  # fmt: skip


__all__ = ["AsyncTrainerBase"]
