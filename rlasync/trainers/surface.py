"""transformers' `Trainer` surface of the async trainers, the part a TRL user touches besides `train()`:

    trainer.state                      transformers' TrainerState (global_step, max_steps, log_history, ...)
    trainer.add_callback(cb) / remove_callback(cb) / pop_callback(cb)     a TrainerCallback class or instance
    trainer.train()                    -> TrainOutput(global_step, training_loss, metrics)
    trainer.model                      before train(): what was passed; after: the trained model, loaded lazily from
                                       the final checkpoint (a property: a user who never reads it pays nothing)
    trainer.save_model(output_dir)     the final weights + config + tokenizer (no optimizer or rollout state)
    trainer.push_to_hub()              offline: save_model into a local folder (hub_model_id, or a path), and say so
    trainer.log(logs)                  into the run's metrics (the next window) and on_log; outside a run: log_history

The trainer's `train()` (rlasync.trainers.base) runs the StepLoop, which fires the callbacks' events during the run.
"""

from __future__ import annotations

import functools
import logging
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

# What save_model leaves out of a checkpoint: the resume-only files.
RESUME_ONLY = ("rollout_state.json", "trainer_state.json", "optimizer", "scheduler", "rng_state")


@functools.cache
def _train_output_cls() -> type:
    from transformers.trainer_utils import TrainOutput

    class RunOutput(TrainOutput):  # type: ignore[misc, valid-type]
        """transformers' `TrainOutput(global_step, training_loss, metrics)`; a string key reads the run's state
        dict (`output["queue"]`, `output["policy_version"]`), as the earlier dict return of `train()` did."""

        run_state: dict[str, Any]

        def __getitem__(self, key: Any) -> Any:
            return self.run_state[key] if isinstance(key, str) else super().__getitem__(key)

        def keys(self) -> Any:
            return self.run_state.keys()

    return RunOutput


class TrainerSurface:
    """Mixin of `AsyncTrainerBase`: the transformers-shaped state, callbacks and model access."""

    args: Any
    model_path: str
    processing_class: Any
    run_state: dict[str, Any]

    def _init_surface(self, callbacks: Sequence[Any] | None) -> None:
        self._state: Any = None
        self._control: Any = None
        self.callbacks: list[Any] = []
        for callback in callbacks or []:
            self.add_callback(callback)
        self._log_inbox: list[dict[str, float]] = []
        self._resize_requests: Any = None  # rlasync.driver.elastic.ResizeRequests of the running train()
        self._training = False
        self._trained_model: Any = None
        self._final_dir: Path | None = None

    # transformers' TrainerState / TrainerControl, made on first use: importing them loads transformers' trainer
    # (torch, peft), seconds that a run stopped by a check before Ray starts should not pay
    @property
    def state(self) -> Any:
        if self._state is None:
            from transformers import TrainerState

            self._state = TrainerState(is_local_process_zero=True, is_world_process_zero=True)
        return self._state

    @state.setter
    def state(self, value: Any) -> None:
        self._state = value

    @property
    def control(self) -> Any:
        if self._control is None:
            from transformers import TrainerControl

            self._control = TrainerControl()
        return self._control

    @control.setter
    def control(self, value: Any) -> None:
        self._control = value

    # ---- callbacks (transformers' Trainer semantics) ---------------------------------------------------------

    def add_callback(self, callback: Any) -> None:
        """Add a callback: a `TrainerCallback` class (instantiated here) or an instance."""
        self.callbacks.append(callback() if isinstance(callback, type) else callback)

    def pop_callback(self, callback: Any) -> Any:
        """Remove and return the first callback equal to `callback`, or of that class; None when absent."""
        for index, existing in enumerate(self.callbacks):
            if existing is callback or (isinstance(callback, type) and type(existing) is callback):
                return self.callbacks.pop(index)
        return None

    def remove_callback(self, callback: Any) -> None:
        """Remove the first callback equal to `callback`, or of that class (nothing when absent, as transformers)."""
        self.pop_callback(callback)

    def _event(self, name: str, **kwargs: Any) -> None:
        """An event fired by the trainer itself (`on_init_end`, `on_log` outside a run)."""
        full = {
            "model": None,
            "processing_class": self.processing_class,
            "optimizer": None,
            "lr_scheduler": None,
            "train_dataloader": None,
            "eval_dataloader": None,
            **kwargs,
        }
        for callback in self.callbacks:
            method = getattr(callback, name, None)
            if method is not None:
                result = method(self.args, self.state, self.control, **full)
                if result is not None and hasattr(result, "should_training_stop"):
                    self.control = result

    # ---- results ----------------------------------------------------------------------------------------------

    def _train_output(self, run_state: dict[str, Any], runtime_s: float, start_step: int) -> Any:
        """transformers' TrainOutput of a finished run; `training_loss` is the mean `loss` of the logged windows."""
        RunOutput = _train_output_cls()
        self.run_state = run_state
        self._trained_model, self._final_dir = None, None
        losses = [entry["loss"] for entry in self.state.log_history if isinstance(entry.get("loss"), int | float)]
        training_loss = sum(losses) / len(losses) if losses else float("nan")
        steps = int(run_state.get("global_step", 0))
        trained = steps - start_step
        metrics = {
            "train_runtime": round(runtime_s, 4),
            "train_steps_per_second": round(trained / runtime_s, 3) if runtime_s > 0 else 0.0,
            "train_loss": training_loss,
            "policy_version": int(run_state.get("policy_version", 0)),
        }
        output = RunOutput(global_step=steps, training_loss=training_loss, metrics=metrics)
        output.run_state = dict(run_state)
        return output

    def final_checkpoint(self) -> Path:
        """The checkpoint the last `train()` ended with (its final model)."""
        from rlasync.driver.checkpoint import Checkpointer, is_complete

        step = int(self.run_state.get("global_step", 0))
        path = Checkpointer(self.args.output_dir).path(step)
        if not step or not is_complete(path):
            raise RuntimeError(
                f"no final checkpoint: {path} {'is incomplete' if path.exists() else 'does not exist'}; call "
                "train() first (the trained model is read from its last checkpoint)"
            )
        return path

    # ---- the model -------------------------------------------------------------------------------------------

    @property
    def model(self) -> Any:
        """Before `train()`: the model argument (a path, hub id, alias or model). After: the trained model,
        loaded on first access from the final checkpoint (AutoModelForCausalLM, the trainer's dtype)."""
        if not self.run_state.get("global_step"):
            return self._model_input
        if self._trained_model is None:
            self._trained_model = _load_plain(str(self.final_checkpoint()), self.args.dtype)
        return self._trained_model

    @model.setter
    def model(self, value: Any) -> None:
        self._model_input = value

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> str:
        """Write the final weights, config and tokenizer to `output_dir` (default `args.output_dir`): a folder
        `from_pretrained` loads. Before `train()`: the initial model (and its tokenizer). Returns the folder."""
        target = Path(output_dir or self.args.output_dir)
        target.mkdir(parents=True, exist_ok=True)
        if self.run_state.get("global_step"):
            source = self.final_checkpoint()
            for item in source.iterdir():
                if item.name.startswith(RESUME_ONLY):
                    continue
                if item.is_dir():
                    shutil.copytree(item, target / item.name, dirs_exist_ok=True)
                else:
                    shutil.copy2(item, target / item.name)
        else:
            model = self._model_input
            from rlasync.model.registry import resolve_model

            if not hasattr(model, "save_pretrained"):
                model = _load_plain(resolve_model(self.model_path), self.args.dtype)
            model.save_pretrained(target)
            tokenizer = self.processing_class
            if tokenizer is None:
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(resolve_model(self.model_path))
            tokenizer.save_pretrained(target)
        logger.info("saved the model to %s", target)
        return str(target)

    def push_to_hub(
        self,
        commit_message: str | None = "End of training",
        blocking: bool = True,
        token: str | None = None,
        revision: str | None = None,
        **kwargs: Any,
    ) -> str:
        """transformers' call shape, offline (no network): the model is saved to a local folder, `hub_model_id`
        when it is a local path (absolute, or starting with ./ or ../), else `<output_dir>/hub/<hub_model_id>`
        (`<output_dir>/hub/<output_dir's name>` without one). A log line names the folder; it is returned."""
        if token is not None or revision is not None:
            raise ValueError(
                "push_to_hub: token / revision are not supported (offline: the model goes to a local folder)"
            )
        unknown = sorted(
            set(kwargs)
            - {
                "model_name",
                "language",
                "license",
                "tags",
                "finetuned_from",
                "tasks",
                "dataset_tags",
                "dataset",
                "dataset_args",
            }
        )
        if unknown:
            raise TypeError(f"push_to_hub got unexpected keyword arguments {unknown}")
        repo = self.args.hub_model_id or Path(self.args.output_dir).resolve().name
        local = Path(repo).is_absolute() or repo.startswith(("./", "../"))
        target = Path(repo) if local else Path(self.args.output_dir) / "hub" / repo
        path = self.save_model(str(target))
        (Path(path) / "README.md").write_text(
            f"---\nlibrary_name: transformers\ntags: [rlasync, {kwargs.get('model_name') or 'grpo'}]\n---\n"
            f"# {repo}\n\nTrained with rlasync ({type(self).__name__}); {commit_message or ''}\n"
        )
        logger.warning(
            "push_to_hub: no network here, so the model was written to the local folder %s (hub id %r); "
            "upload it with `huggingface-cli upload`",
            path,
            repo,
        )
        return path

    def resize(self, generation: int | None = None, rollout: int | None = None) -> None:
        """Elastic pools: ask for `generation` GenerationActors and/or `rollout` rollout actors (within
        `cluster.min_*_actors` / `cluster.max_*_actors`), applied after the next training step. Works during
        `train()`: from a TrainerCallback holding the trainer, or from another thread (docs/design.md §4)."""
        if not self._training:
            raise RuntimeError(
                "resize() works during train() (from a callback or another thread); before it, set "
                "cluster.num_generation_actors / cluster.num_rollout_actors"
            )
        self._resize_requests.request(generation=generation, rollout=rollout)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """transformers' `log`: during `train()` the values join the run's metrics (the next logged window, so
        they reach metrics.jsonl, the sinks and on_log); outside a run they are appended to `state.log_history`
        and on_log is called."""
        values = {key: float(value) for key, value in logs.items()}
        if self._training:
            self._log_inbox.append(values)
            return
        self.state.log_history.append({**values, "step": self.state.global_step})
        self._event("on_log", logs=values)


def _load_plain(path: str, dtype: str) -> Any:
    """A plain transformers causal LM (default attention, not the learner's tree attention)."""
    from transformers import AutoModelForCausalLM

    from rlasync.model.loading import resolve_dtype

    return AutoModelForCausalLM.from_pretrained(path, dtype="auto" if dtype == "auto" else resolve_dtype(dtype))


__all__ = ["RESUME_ONLY", "TrainerSurface"]
