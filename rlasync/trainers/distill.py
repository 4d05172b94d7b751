"""`AsyncDistillationTrainer`: on-policy distillation (docs/algorithms.md §9) on Ray actors, TRL's constructor.

    trainer = AsyncDistillationTrainer(model="smollm2-135m-instruct", args=AsyncDistillationConfig(...),
                                       train_dataset=dataset)                    # teachers: teacher_server_urls
    trainer = AsyncDistillationTrainer(model=student, args=args, train_dataset=dataset,
                                       teacher_model="Qwen/Qwen3-1.7B")          # or {teacher_id: path}: local teachers
    trainer.train()                      # or train(resume_from_checkpoint=True / "out/checkpoint-20")

The run is GRPO's with two changes (docs/design.md §1), both named by the `distill` algorithm's spec
(rlasync.algorithms.distill.spec): the `RolloutActor` runs an `AsyncDistillationLoop` (student `generate` through
the GenerationActors, teacher `score` through one `TeacherScorer` per teacher id), and the learners run the
distillation objective (rlasync.algorithms.distill.objective: plain padding-free rows, Σ L² balanced, the JSD loss
with the LM head). The queue, the staleness gate, the step loop, the weight sync to the student GenerationActors
(teachers never receive weights), logging, checkpoints (`rollout_state.json` + model + optimizer) and resume are
the common driver's.

Teachers: by default the `teacher_server_urls` (`vllm serve` teachers, the spec's deployment), each reached by a
TeacherScorer holding a `vllm_server` client. For local runs and tests, `teacher_model` (a path, hub id or alias,
or `{teacher_id: path}`) is hosted by TeacherScorers on the cluster's engine ("torch" on CPU or a GPU, or "vllm").
All teachers must share the student's tokenizer (candidate ids index the student's vocabulary).

The learning-rate schedule defaults to linear decay over `args.resolved_max_steps(len(train_dataset), P)` (docs/algorithms.md
§9.6: `max_steps`, else the epoch ceiling), which is also the run's horizon. This module never imports Ray.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from rlasync.algorithms.distill.loop import AsyncDistillationLoop
from rlasync.config.distill import AsyncDistillationConfig
from rlasync.config.vocab import EngineKind
from rlasync.data import validate_prompt_dataset
from rlasync.data.streaming import is_streaming
from rlasync.driver import LearnerSpec, RolloutSpec, RunSpec, TeacherSpec, actor_requests
from rlasync.pipeline.settings import QueueSettings
from rlasync.trainers.base import AsyncTrainerBase
from rlasync.trainers.checks import _refuse_trl_workers, check_same_vocabulary

if TYPE_CHECKING:
    from peft import PeftConfig

logger = logging.getLogger(__name__)


class AsyncDistillationTrainer(AsyncTrainerBase):
    """Asynchronous on-policy distillation (TRL's `AsyncDistillationTrainer` API). Subclass and set `loop_cls` (an
    `AsyncDistillationLoop`) to customise the worker loop."""

    loop_cls: type[AsyncDistillationLoop] = AsyncDistillationLoop
    algorithm_name = "distill"

    def __init__(
        self,
        model: Any,
        args: AsyncDistillationConfig | None = None,
        train_dataset: Any = None,
        processing_class: Any = None,
        callbacks: Sequence[Any] | None = None,
        optimizers: tuple[Any, Any] = (None, None),
        peft_config: PeftConfig | None = None,
        rollout_worker: Any = None,
        weight_transfer: Any = None,
        *,
        teacher_model: str | Mapping[str, str] | None = None,
        loop_cls: type[AsyncDistillationLoop] | None = None,
    ) -> None:
        # TRL 1.16's parameters in TRL's positional order (TRL has no `teacher_model`: its teacher is a server);
        # rlasync's additions are keyword-only
        _refuse_trl_workers(rollout_worker, weight_transfer)
        args = args if args is not None else AsyncDistillationConfig()
        if not isinstance(args, AsyncDistillationConfig):
            raise ValueError(
                f"args must be an AsyncDistillationConfig, got {type(args).__name__} (AsyncGRPOConfig belongs "
                "to AsyncGRPOTrainer)"
            )
        self._begin_init(args, loop_cls)
        self.peft_config = _checked_peft_config(peft_config)  # a peft.LoraConfig: the student trains adapters only
        if train_dataset is None:
            raise ValueError("`train_dataset` is required: pass a dataset with a 'prompt' column")
        validate_prompt_dataset(train_dataset)
        self.teachers = self._teacher_specs(teacher_model)
        self._end_init(model, train_dataset, processing_class, callbacks, optimizers)

    # ---- setup --------------------------------------------------------------------------------------------------

    def _teacher_specs(self, teacher_model: str | Mapping[str, str] | None) -> dict[str, TeacherSpec]:
        """teacher id -> the TeacherScorer's engine settings (`model`, `engine`, `base_url`), in stable order."""
        if teacher_model is None:
            return {
                teacher_id: TeacherSpec(teacher_id, model=None, engine=EngineKind.VLLM_SERVER, base_url=url)
                for teacher_id, url in (self.args.teacher_server_urls or {}).items()
            }
        engine = EngineKind(self.args.cluster.engine)
        engine = EngineKind.TORCH if engine.traits.remote else engine  # a local teacher: the built-in engine
        if isinstance(teacher_model, Mapping):
            if not teacher_model:
                raise ValueError("teacher_model={}: give at least one {teacher_id: model path} entry")
            models = dict(teacher_model)
        elif isinstance(teacher_model, str):
            ids = self.args.teacher_ids
            if len(ids) != 1:
                raise ValueError(
                    f"teacher_model is one model but teacher_server_urls names {len(ids)} teachers ({ids}): pass "
                    "teacher_model as a {teacher_id: path} dict for several teachers"
                )
            models = {ids[0]: teacher_model}
        else:
            raise ValueError(
                f"teacher_model must be a path, hub id or alias, or a {{teacher_id: path}} dict, got "
                f"{type(teacher_model).__name__}"
            )
        for teacher_id, path in models.items():
            if not isinstance(teacher_id, str) or not teacher_id or not isinstance(path, str) or not path:
                raise ValueError(f"teacher_model: entry {teacher_id!r}: {path!r} must map a teacher id to a model path")
        return {teacher_id: TeacherSpec(teacher_id, model=path, engine=engine) for teacher_id, path in models.items()}

    def _actor_requests(self) -> dict[str, tuple[int, float, float]]:
        """GRPO's roles without reward actors, plus one TeacherScorer per teacher (`cluster.teacher_num_cpus`
        each; a local one also a generation actor's GPUs, a `vllm serve` client none)."""
        c = self.args.cluster
        requests = {role: value for role, value in actor_requests(c).items() if role != "reward"}
        local = sum(1 for spec in self.teachers.values() if spec.is_local)
        remote = len(self.teachers) - local
        if local:
            requests["teacher"] = (local, c.teacher_num_cpus, c.generation_num_gpus)
        if remote:
            requests["teacher client"] = (remote, c.teacher_num_cpus, 0.0)
        return requests

    @property
    def teacher_ids(self) -> list[str]:
        """Teacher ids in stable order (the learner's `teacher_id_idx` indices)."""
        return list(self.teachers)

    # ---- the run ------------------------------------------------------------------------------------------------

    def build_spec(self, resume_dir: str | None) -> RunSpec:
        """Rollout actors of the distillation loop (students and teachers, the in-flight task budget split over the actors), learners
        with the distillation objective over the resolved horizon, local teachers resolved (the preflight checked
        their vocabulary against the student's), and the queue over the dataset's rows (one sample per row and epoch, docs/algorithms.md §9.6)."""
        from rlasync.model.registry import resolve_model

        args, cluster = self.args, self.args.cluster
        if is_streaming(self.train_dataset) and args.max_steps <= 0:
            raise ValueError(
                "a streaming train_dataset has no length, so the learning-rate horizon cannot be derived from "
                "num_train_epochs: set max_steps > 0"
            )
        horizon = args.resolved_max_steps(0 if args.max_steps > 0 else len(self.train_dataset), cluster.num_learners)
        inflight = args.resolved_max_inflight_tasks(cluster.num_learners)
        spec = self._run_spec(
            resume_dir,
            rollout=RolloutSpec(
                loop_cls=self.loop_cls,
                loop_kwargs={"max_inflight_tasks": max(1, -(-inflight // cluster.num_rollout_actors))},
            ),
            learner=LearnerSpec(max_steps=horizon, teacher_ids=self.teacher_ids, peft_config=self.peft_config),
            queue=QueueSettings.for_dataset(args, self.train_dataset),
            horizon=horizon,
            requests=self._actor_requests(),
        )
        teachers = {}
        for teacher_id, teacher in self.teachers.items():
            if teacher.model is None:
                teachers[teacher_id] = teacher
                continue
            teachers[teacher_id] = TeacherSpec(teacher_id, model=resolve_model(teacher.model), engine=teacher.engine)
        spec.teachers = teachers
        return spec


__all__ = ["AsyncDistillationTrainer", "check_same_vocabulary"]


def _checked_peft_config(peft_config: object) -> PeftConfig | None:
    """`rlasync.weights.adapter.check_peft_config`, imported only when a peft_config is given (it needs torch)."""
    if peft_config is None:
        return None
    from rlasync.weights.adapter import check_peft_config

    return check_peft_config(peft_config)
