"""transformers' `Trainer` surface of the async trainers, the part a TRL user touches besides `train()`:

    trainer.state                      transformers' TrainerState (global_step, max_steps, log_history, ...)
    trainer.add_callback(cb) / remove_callback(cb) / pop_callback(cb)     a TrainerCallback class or instance
    trainer.callback_handler           transformers' CallbackHandler over the same callbacks
    trainer.train()                    -> TrainOutput(global_step, training_loss, metrics)
    trainer.model                      before train(): a model object as passed, else a LazyModel of the initial
                                       model (loaded on first use); after: the trained model, loaded lazily from the
                                       final checkpoint (a property: a user who never reads it pays nothing)
    trainer.processing_class           the tokenizer passed, else the model's, loaded on first use
    trainer.accelerator                the driver process's accelerate surface (rlasync.trainers.accelerator)
    trainer.optimizer / lr_scheduler   descriptions of what the learner actors hold (class, hyper-parameters)
    trainer.save_model(output_dir)     the final weights + config + tokenizer (no optimizer or rollout state)
    trainer.log_metrics(split, m) / save_metrics(split, m) / save_state()     transformers' helpers, same files
    trainer.create_model_card(...)     a README.md model card in output_dir (offline)
    trainer.push_to_hub(**kwargs)      offline: save_model + model card into a local folder (hub_model_id, or a
                                       path), and say so; `hub_model_id` names it
    trainer.log(logs)                  into the run's metrics (the next window) and on_log; outside a run: log_history
    trainer.is_world_process_zero() / is_local_process_zero()      True: the driver writes every output

The trainer's `train()` (rlasync.trainers.base) runs the StepLoop, which fires the callbacks' events during the run.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlasync.driver.model_proxy import LazyModel, load_plain

if TYPE_CHECKING:
    from rlasync.config.base import TrainerConfig
    from rlasync.pipeline.settings import QueueSettings

logger = logging.getLogger(__name__)

MODEL_CARD_KWARGS = (
    "model_name",
    "dataset_name",
    "language",
    "license",
    "tags",
    "finetuned_from",
    "tasks",
    "dataset_tags",
    "dataset",
    "dataset_args",
)
"""What `create_model_card` / `push_to_hub` take: transformers' model-card fields and TRL's `dataset_name`."""

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

    args: TrainerConfig
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
        self._initial_model: LazyModel | None = None
        self._accelerator: Any = None

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

    @property
    def callback_handler(self) -> Any:
        """transformers' `CallbackHandler` over the trainer's callbacks (the same list: adding through either adds
        to both), its model / tokenizer / optimizer / scheduler the trainer's."""
        return _callback_handler_cls()(self)

    def _event(self, name: str, **kwargs: Any) -> None:
        """An event fired by the trainer itself (`on_init_end`, `on_log` outside a run, `on_push_begin`)."""
        full = {
            "model": self._lazy_model(),
            "processing_class": self.given_processing_class,
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

    # ---- the model and the tokenizer ---------------------------------------------------------------------------

    @property
    def model(self) -> Any:
        """Before `train()`: a model object as passed, else a `LazyModel` of the model argument (path, hub id or
        alias; loaded on first use). After: the trained model, loaded on first access from the final checkpoint
        (AutoModelForCausalLM, the trainer's dtype)."""
        if not self.run_state.get("global_step"):
            return self._model_input if hasattr(self._model_input, "save_pretrained") else self._lazy_model()
        if self._trained_model is None:
            self._trained_model = load_plain(str(self.final_checkpoint()), self.args.dtype)
        return self._trained_model

    def _lazy_model(self) -> Any:
        """A `LazyModel` of the final checkpoint after `train()`, else of the initial model (a model object given:
        that object)."""
        if hasattr(self._model_input, "save_pretrained") and not self.run_state.get("global_step"):
            return self._model_input
        if self._initial_model is None:

            def source() -> str:
                if self.run_state.get("global_step"):
                    return str(self.final_checkpoint())
                from rlasync.model.registry import resolve_model

                return resolve_model(self.model_path)

            self._initial_model = LazyModel(source, self.args.dtype, "the trainer's model")
        return self._initial_model

    @property
    def processing_class(self) -> Any:
        """The tokenizer passed to the trainer, else the model's (AutoTokenizer, loaded on first use)."""
        if getattr(self, "_tokenizer", None) is None:
            from transformers import AutoTokenizer

            from rlasync.model.registry import resolve_model

            sources = [resolve_model(self.model_path)]
            name = getattr(self._model_input, "name_or_path", None)
            if name:  # a model object: saved without its tokenizer, which its own source has
                sources.append(name)
            for index, source in enumerate(sources):
                try:
                    self._tokenizer = AutoTokenizer.from_pretrained(source)
                    break
                except (OSError, ValueError) as exc:
                    if index == len(sources) - 1:
                        raise ValueError(
                            f"processing_class: no tokenizer could be loaded from {sources} ({type(exc).__name__}: "
                            f"{str(exc)[:200]}); pass processing_class=tokenizer to the trainer"
                        ) from exc
        return self._tokenizer

    @processing_class.setter
    def processing_class(self, value: Any) -> None:
        self._given_tokenizer = value
        self._tokenizer = value

    @property
    def given_processing_class(self) -> Any:
        """The `processing_class` argument as given (None: the model's tokenizer, which the actors load)."""
        return getattr(self, "_given_tokenizer", None)

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
                model = load_plain(resolve_model(self.model_path), self.args.dtype)
            model.save_pretrained(target)
            self.processing_class.save_pretrained(target)
        logger.info("saved the model to %s", target)
        return str(target)

    @property
    def hub_model_id(self) -> str:
        """The repository `push_to_hub` writes: `args.hub_model_id`, else the output_dir's name (transformers'
        rule). Offline, the folder is `push_to_hub`'s return value."""
        return self.args.hub_model_id or Path(self.args.output_dir).resolve().name

    def push_to_hub(
        self,
        commit_message: str | None = "End of training",
        blocking: bool = True,
        token: str | None = None,
        revision: str | None = None,
        private: bool | None = None,
        **kwargs: Any,
    ) -> str:
        """transformers' call shape, offline (no network): `on_push_begin`, then the model (`save_model`) and its
        model card (`create_model_card`'s keyword arguments, TRL's `dataset_name` among them) go to a local folder,
        `hub_model_id` when it is a local path (absolute, or starting with ./ or ../), else
        `<output_dir>/hub/<hub_model_id>`. A log line names the folder; it is returned."""
        if token is not None or revision is not None:
            raise ValueError(
                "push_to_hub: token / revision are not supported (offline: the model goes to a local folder)"
            )
        unknown = sorted(set(kwargs) - set(MODEL_CARD_KWARGS))
        if unknown:
            raise TypeError(
                f"push_to_hub got unexpected keyword arguments {unknown} (it takes the model card's: "
                f"{', '.join(MODEL_CARD_KWARGS)})"
            )
        self._event("on_push_begin")
        repo = self.hub_model_id
        local = Path(repo).is_absolute() or repo.startswith(("./", "../"))
        target = Path(repo) if local else Path(self.args.output_dir) / "hub" / repo
        path = self.save_model(str(target))
        kwargs.setdefault("model_name", Path(repo).name)
        self._write_model_card(Path(path), commit_message=commit_message, **kwargs)
        logger.warning(
            "push_to_hub: no network here, so the model was written to the local folder %s (hub id %r); "
            "upload it with `huggingface-cli upload`",
            path,
            repo,
        )
        return path

    # ---- transformers' helpers around train() ----------------------------------------------------------------

    @property
    def accelerator(self) -> Any:
        """What scripts call on accelerate's Accelerator, for the driver process (rlasync.trainers.accelerator)."""
        if self._accelerator is None:
            from rlasync.trainers.accelerator import DriverAccelerator

            self._accelerator = DriverAccelerator(
                num_processes=self.args.cluster.num_learners, mixed_precision="bf16" if self.args.bf16 else "no"
            )
        return self._accelerator

    def is_world_process_zero(self) -> bool:
        """True: the driver process writes every output (the learners' rank 0 only writes checkpoints)."""
        return True

    def is_local_process_zero(self) -> bool:
        return True

    def log_metrics(self, split: str, metrics: dict[str, Any]) -> None:
        """transformers' `log_metrics`: a `***** {split} metrics *****` table on stdout."""
        from transformers.trainer_pt_utils import log_metrics

        log_metrics(self, split, metrics)

    def metrics_format(self, metrics: dict[str, Any]) -> dict[str, Any]:
        from transformers.trainer_pt_utils import metrics_format

        return metrics_format(metrics)

    def save_metrics(self, split: str, metrics: dict[str, Any], combined: bool = True) -> None:
        """transformers' `save_metrics`: `<output_dir>/{split}_results.json`, and (combined) merged into
        `<output_dir>/all_results.json`."""
        from transformers.trainer_pt_utils import save_metrics

        os.makedirs(self.args.output_dir, exist_ok=True)
        save_metrics(self, split, metrics, combined)

    def save_state(self) -> None:
        """transformers' `save_state`: the TrainerState (global_step, max_steps, log_history, ...) to
        `<output_dir>/trainer_state.json`, which `TrainerState.load_from_json` reads. (A run resumes from its
        `checkpoint-<step>` folders, which hold the optimizer and rollout state as well.)"""
        from transformers.trainer_pt_utils import save_state

        os.makedirs(self.args.output_dir, exist_ok=True)
        save_state(self)

    def create_model_card(
        self,
        model_name: str | None = None,
        dataset_name: str | None = None,
        tags: str | list[str] | None = None,
        **kwargs: Any,
    ) -> None:
        """A model card, `<output_dir>/README.md` (TRL's arguments `model_name`, `dataset_name`, `tags`, and
        transformers' `language`, `license`, `finetuned_from`, `tasks`, `dataset_tags`, `dataset`, `dataset_args`):
        the base model, the datasets, the trainer and its final metrics. Offline: nothing is uploaded."""
        unknown = sorted(set(kwargs) - set(MODEL_CARD_KWARGS))
        if unknown:
            raise TypeError(f"create_model_card got unexpected keyword arguments {unknown}")
        os.makedirs(self.args.output_dir, exist_ok=True)
        self._write_model_card(
            Path(self.args.output_dir), model_name=model_name, dataset_name=dataset_name, tags=tags, **kwargs
        )

    def _write_model_card(self, folder: Path, commit_message: str | None = None, **fields: Any) -> Path:
        base = fields.get("finetuned_from") or (self.model_path if not _is_local_copy(self.model_path) else None)
        datasets = [d for d in _as_list(fields.get("dataset_name")) + _as_list(fields.get("dataset")) if d]
        kind = "grpo" if "GRPO" in type(self).__name__ else "distillation"
        tags = list(dict.fromkeys(["generated_from_trainer", "rlasync", kind, *_as_list(fields.get("tags"))]))
        name = fields.get("model_name") or Path(self.args.output_dir).resolve().name
        header = {
            "base_model": base,
            "library_name": "transformers",
            "model_name": name,
            "tags": tags,
            "datasets": datasets or None,
            "language": fields.get("language"),
            "license": fields.get("license"),
        }
        lines = ["---"] + [f"{key}: {json.dumps(value)}" for key, value in header.items() if value is not None]
        lines += ["---", "", f"# Model Card for {name}", ""]
        about = f"a fine-tuned version of [{base}](https://huggingface.co/{base})" if base else "a fine-tuned model"
        on = (
            f" on the {', '.join(f'[{d}](https://huggingface.co/datasets/{d})' for d in datasets)} dataset"
            if datasets
            else ""
        )
        lines.append(f"This model is {about}{on}.")
        lines.append(f"It was trained with rlasync's `{type(self).__name__}` (TRL's API, asynchronous, on Ray actors).")
        lines += ["", "## Training procedure", ""]
        lines.append(f"- steps: {self.state.global_step}")
        last = _last_metrics(self.state.log_history)
        for key in sorted(last):
            lines.append(f"- final `{key}`: {last[key]:.6g}")
        if commit_message:
            lines += ["", commit_message]
        lines += ["", "## Framework versions", ""] + [f"- {lib}: {version}" for lib, version in _versions()]
        path = folder / "README.md"
        path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        return path

    @property
    def optimizer(self) -> Any:
        """What the learner actors hold (the optimizer itself lives there): a `LearnerOptimizer` with the class
        name, `defaults` (its hyper-parameters) and `param_groups` (one group, without parameters)."""
        optimizer, _ = self._learner_optimizer()
        return optimizer

    @property
    def lr_scheduler(self) -> Any:
        """What the learner actors hold: a `LearnerScheduler` with the class name, `lr_scheduler_type`, the warmup
        and total steps, and `get_last_lr()` (the last logged learning rate)."""
        _, scheduler = self._learner_optimizer()
        return scheduler

    def _learner_optimizer(self) -> tuple[Any, Any]:
        import torch

        from rlasync.learner.step import OptimizerSettings, build_optimizer

        settings = dataclasses.replace(OptimizerSettings.from_config(self.args), **self.optimizer_overrides)
        horizon = settings.max_steps if settings.max_steps > 0 else self.state.max_steps
        built, scheduler = build_optimizer(
            torch.nn.Linear(1, 1), dataclasses.replace(settings, max_steps=max(int(horizon or 0), 1))
        )
        defaults = {key: value for key, value in built.defaults.items() if _plain_value(value)}
        warmup = settings.warmup_steps
        warmup = math.ceil(warmup * horizon) if 0 < warmup < 1 and horizon else int(warmup)
        optimizer = LearnerOptimizer(type(built).__name__, defaults)
        lr = [entry["learning_rate"] for entry in self.state.log_history if "learning_rate" in entry]
        described = LearnerScheduler(
            type(scheduler).__name__,
            "custom" if settings.scheduler_factory is not None else settings.lr_scheduler_type,
            warmup,
            int(horizon) if horizon and horizon > 0 else None,
            [float(lr[-1])] if lr else [float(defaults.get("lr", settings.learning_rate))],
        )
        return optimizer, described

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


def estimated_max_steps(config: TrainerConfig, queue: QueueSettings) -> int:
    """An epoch run's step count (`max_steps=-1`), for `state.max_steps`: its samples, `num_train_epochs x rows x
    num_generations` (a distillation row is one sample), over a step's `per_device_train_batch_size x
    gradient_accumulation_steps x cluster.num_learners` (TRL's step), rounded up; 0 when unknown (a streaming
    dataset). The StepLoop raises it when the run goes on longer (steps by tokens vary in size) and sets the
    final step at the end."""
    return estimated_steps(config, getattr(queue, "num_rows", 0), getattr(queue, "num_epochs", None))


def estimated_steps(config: TrainerConfig, rows: int, epochs: float | None) -> int:
    """`epochs x rows x num_generations` samples over TRL's step (`samples_per_step`), rounded up; 0 without rows
    or epochs."""
    if not rows or not epochs:
        return 0
    samples = epochs * rows * getattr(config, "num_generations", 1)
    return max(1, math.ceil(samples / config.samples_per_step(config.cluster.num_learners)))


@dataclasses.dataclass(frozen=True)
class LearnerOptimizer:
    """The optimizer the learner actors hold, described: its class name and hyper-parameters (`defaults`, and
    `param_groups` as one group without parameters, for code that reads `optimizer.param_groups[0]["lr"]`)."""

    name: str
    defaults: dict[str, Any]

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [dict(self.defaults)]

    def __repr__(self) -> str:
        values = ", ".join(f"{key}={value!r}" for key, value in self.defaults.items())
        return f"{self.name}({values}) [on the learner actors]"


@dataclasses.dataclass(frozen=True)
class LearnerScheduler:
    """The learning-rate scheduler the learner actors hold, described."""

    name: str
    lr_scheduler_type: str
    num_warmup_steps: int
    num_training_steps: int | None
    last_lr: list[float]

    def get_last_lr(self) -> list[float]:
        """The last logged learning rate (the configured one before the first log)."""
        return list(self.last_lr)

    def __repr__(self) -> str:
        return (
            f"{self.name}({self.lr_scheduler_type}, warmup {self.num_warmup_steps}, "
            f"{self.num_training_steps} steps) [on the learner actors]"
        )


@functools.cache
def _callback_handler_cls() -> type:
    from transformers.trainer_callback import CallbackHandler

    class TrainerCallbackHandler(CallbackHandler):  # type: ignore[misc, valid-type]
        """transformers' CallbackHandler sharing the trainer's callback list and reading its model / tokenizer /
        optimizer descriptions when an event is called."""

        def __init__(self, trainer: Any) -> None:  # no super().__init__: it copies the list and warns
            self.trainer = trainer
            self.callbacks = trainer.callbacks
            self.train_dataloader = None
            self.eval_dataloader = None

        @property
        def model(self) -> Any:
            return self.trainer._lazy_model()

        @property
        def processing_class(self) -> Any:
            return self.trainer.given_processing_class

        @property
        def optimizer(self) -> Any:
            return None  # the real one is on the learners: trainer.optimizer describes it

        @property
        def lr_scheduler(self) -> Any:
            return None

    return TrainerCallbackHandler


def _is_local_copy(path: str) -> bool:
    """A path the trainer wrote (an instantiated model saved to output_dir): not a base model id."""
    return Path(path).name == "initial_model"


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return [value] if isinstance(value, str) else list(value)


def _plain_value(value: Any) -> bool:
    return (
        value is None
        or isinstance(value, bool | int | float | str)
        or (isinstance(value, tuple) and all(isinstance(v, int | float) for v in value))
    )


def _last_metrics(log_history: list[dict[str, Any]]) -> dict[str, float]:
    """The headline metrics of the last logged window (loss, reward, learning rate)."""
    keys = ("loss", "reward", "reward_std", "learning_rate")
    for entry in reversed(log_history):
        found = {key: float(entry[key]) for key in keys if isinstance(entry.get(key), int | float)}
        if found:
            return found
    return {}


def _versions() -> list[tuple[str, str]]:
    from importlib import metadata

    found = []
    for lib in ("rlasync", "transformers", "torch", "ray"):
        try:
            found.append((lib, metadata.version(lib)))
        except metadata.PackageNotFoundError:
            continue
    return found


__all__ = [
    "estimated_max_steps",
    "estimated_steps",
    "MODEL_CARD_KWARGS",
    "RESUME_ONLY",
    "LearnerOptimizer",
    "LearnerScheduler",
    "TrainerSurface",
]
