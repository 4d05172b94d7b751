"""`AsyncDistillationTrainer`: on-policy distillation (SPEC §9) on Ray actors, TRL's constructor.

    trainer = AsyncDistillationTrainer(model="smollm2-135m-instruct", args=AsyncDistillationConfig(...),
                                       train_dataset=dataset)                    # teachers: teacher_server_urls
    trainer = AsyncDistillationTrainer(model=student, args=args, train_dataset=dataset,
                                       teacher_model="Qwen/Qwen3-1.7B")          # or {teacher_id: path}: local teachers
    trainer.train()                      # or train(resume_from_checkpoint=True / "out/checkpoint-20")

The actors are GRPO's with two changes (DESIGN.md §1): the rollout side is a `DistillRolloutActor` (one
`AsyncDistillationLoop`: student `generate` through the GenerationActors, teacher `score` through one
`TeacherScorer` per teacher id), and the learners run in "distill" mode (`rlasync.learner.distill`: plain
padding-free rows, Σ L² balanced, the JSD loss with the LM head). The queue, the staleness gate, the step loop,
the weight sync to the student GenerationActors (teachers never receive weights), logging, checkpoints
(`rollout_state.json` + model + optimizer) and resume are `AsyncGRPOTrainer`'s.

Teachers: by default the `teacher_server_urls` (`vllm serve` teachers, the spec's deployment), each reached by a
TeacherScorer holding a `vllm_server` client. For local runs and tests, `teacher_model` (a path, hub id or alias,
or `{teacher_id: path}`) is hosted by TeacherScorers on the cluster's engine ("torch" on CPU or a GPU, or "vllm").
All teachers must share the student's tokenizer (candidate ids index the student's vocabulary).

The learning-rate schedule defaults to linear decay over `args.resolved_max_steps(len(train_dataset), P)` (SPEC
§9.6: `max_steps`, else the epoch ceiling). Ray is imported inside functions only.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from rlasync.config.distill import AsyncDistillationConfig
from rlasync.data import validate_prompt_dataset
from rlasync.distill import AsyncDistillationLoop
from rlasync.trainers.grpo import AsyncGRPOTrainer

logger = logging.getLogger(__name__)

LOCAL_TEACHER_ENGINES = ("torch", "vllm")


class AsyncDistillationTrainer(AsyncGRPOTrainer):
    """Asynchronous on-policy distillation (TRL's `AsyncDistillationTrainer` API). Subclass and set `loop_cls` (an
    `AsyncDistillationLoop`) to customise the worker loop."""

    loop_cls: type[AsyncDistillationLoop] = AsyncDistillationLoop  # type: ignore[assignment]

    def __init__(
        self,
        model: Any,
        args: AsyncDistillationConfig | None = None,
        train_dataset: Any = None,
        teacher_model: str | Mapping[str, str] | None = None,
        processing_class: Any = None,
        callbacks: Sequence[Any] | None = None,
        loop_cls: type[AsyncDistillationLoop] | None = None,
    ) -> None:
        self.args = args if args is not None else AsyncDistillationConfig()
        if not isinstance(self.args, AsyncDistillationConfig):
            raise ValueError(
                f"args must be an AsyncDistillationConfig, got {type(self.args).__name__} (AsyncGRPOConfig belongs "
                "to AsyncGRPOTrainer)"
            )
        if loop_cls is not None:
            self.loop_cls = loop_cls
        if train_dataset is None:
            raise ValueError("`train_dataset` is required: pass a dataset with a 'prompt' column")
        validate_prompt_dataset(train_dataset)
        self.train_dataset = train_dataset
        self.teachers = self._teacher_specs(teacher_model)
        self.model = self._model_path(model)
        self.processing_class = processing_class
        self.callbacks = list(callbacks or [])
        self.state: dict[str, Any] = {"global_step": 0, "policy_version": 0}
        self.actor_ids: list[str] = []
        self.tools = None
        self.environment_factory = None
        self.reward_funcs: list[Any] = []

    # ---- setup --------------------------------------------------------------------------------------------------

    def _teacher_specs(self, teacher_model: str | Mapping[str, str] | None) -> dict[str, dict[str, Any]]:
        """teacher id -> the TeacherScorer's engine settings (`model`, `engine`, `base_url`), in stable order."""
        if teacher_model is None:
            return {
                teacher_id: {"model": None, "engine": "vllm_server", "base_url": url}
                for teacher_id, url in (self.args.teacher_server_urls or {}).items()
            }
        engine = self.args.cluster.engine if self.args.cluster.engine in LOCAL_TEACHER_ENGINES else "torch"
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
        return {teacher_id: {"model": path, "engine": engine, "base_url": None} for teacher_id, path in models.items()}

    def _actor_requests(self) -> dict[str, tuple[int, float, float]]:
        """GRPO's roles without reward actors, plus one TeacherScorer per teacher (a local one takes a generation
        actor's resources; a `vllm serve` client only its CPUs)."""
        c = self.args.cluster
        requests = {role: value for role, value in super()._actor_requests().items() if role != "reward"}
        local = sum(1 for spec in self.teachers.values() if spec["base_url"] is None)
        remote = len(self.teachers) - local
        requests["generation"] = (c.num_generation_actors + local, c.generation_num_cpus, c.generation_num_gpus)
        if remote:
            requests["teacher client"] = (remote, c.generation_num_cpus, 0.0)
        return requests

    @property
    def teacher_ids(self) -> list[str]:
        """Teacher ids in stable order (the learner's `teacher_id_idx` indices)."""
        return list(self.teachers)

    def _check_rollouts(self, ray: Any) -> None:
        for index, rollout in enumerate(self._rollouts):
            health = ray.get(rollout.health.remote(), timeout=60)
            if health["error"]:
                raise RuntimeError(f"distillation rollout actor {index} failed: {health['error']}")

    # ---- the run ------------------------------------------------------------------------------------------------

    def _train(self, ray: Any, resume_dir: str | None) -> dict[str, Any]:
        from actors.distill_rollout import DistillRolloutActor
        from actors.teacher import TeacherScorer
        from rlasync.model.registry import resolve_model

        args, cluster = self.args, self.args.cluster
        timeout = cluster.collective_timeout_s
        model, tokenizer, resume_state, start_step, version = self._starting_point(resume_dir)

        # the student's engines (they receive the weight syncs), then the teachers (scoring only, no weights)
        for teacher_id, spec in self.teachers.items():
            if spec["model"] is not None and self.processing_class is None:
                check_same_vocabulary(tokenizer, resolve_model(spec["model"]), teacher_id)
        gens = self._spawn_engines(model)
        teachers = {
            teacher_id: self._spawn(
                TeacherScorer, teacher_id=teacher_id,
                model=resolve_model(spec["model"]) if spec["model"] is not None else None, engine=spec["engine"],
                base_url=spec["base_url"], engine_kwargs=cluster.engine_kwargs if spec["base_url"] is None else None,
                num_cpus=cluster.generation_num_cpus, num_gpus=cluster.generation_num_gpus if spec["base_url"] is None
                else 0.0,
            )
            for teacher_id, spec in self.teachers.items()
        }  # fmt: skip
        ray.get([t.stats.remote() for t in teachers.values()], timeout=timeout + 600)  # built (or failed) by now
        budget, tokens_per_step, samples_per_step = self._step_budget(ray, gens)
        num_learners = cluster.num_learners
        horizon = args.resolved_max_steps(len(self.train_dataset), num_learners)
        learners = self._spawn_learners(ray, model, budget, resume_dir, mode="distill", max_steps=horizon,
                                        teacher_ids=self.teacher_ids)  # fmt: skip
        # epochs over distinct prompts: a group of one sample per row (SPEC §9.6)
        sync, version = self._connect_weights(ray, learners, gens, "rlasync-distill-queue", tokens_per_step,
                                              resume_state, version)  # fmt: skip
        queue = sync.queue

        dataset_ref = ray.put(self.train_dataset)
        inflight = args.resolved_max_inflight_tasks(num_learners)
        per_actor = max(1, -(-inflight // cluster.num_rollout_actors))
        self._rollouts = [
            self._spawn(DistillRolloutActor, index=i, config=args, tokenizer=tokenizer, dataset=dataset_ref,
                        queue=queue, students=gens, teachers=teachers, seed=args.seed,
                        loop_cls=self.loop_cls, max_inflight_tasks=per_actor, num_cpus=cluster.rollout_num_cpus)
            for i in range(cluster.num_rollout_actors)
        ]  # fmt: skip
        ray.get([rollout.start.remote() for rollout in self._rollouts], timeout=timeout + 600)

        return self._step_loop(ray, queue, learners, sync, tokenizer, start_step=start_step, version=version,
                               tokens_per_step=tokens_per_step, samples_per_step=samples_per_step, timeout=timeout,
                               horizon=horizon)  # fmt: skip


def check_same_vocabulary(student: str, teacher: str, teacher_id: str) -> None:
    """Raise `ValueError` unless the teacher's tokenizer maps every token to the same id as the student's (SPEC §9.4:
    the teacher's candidate ids index the student's vocabulary; a different one trains on wrong tokens, silently)."""
    from transformers import AutoTokenizer

    student_vocab = AutoTokenizer.from_pretrained(student).get_vocab()
    teacher_vocab = AutoTokenizer.from_pretrained(teacher).get_vocab()
    if student_vocab != teacher_vocab:
        differing = sum(1 for token, index in teacher_vocab.items() if student_vocab.get(token) != index)
        raise ValueError(
            f"teacher_model[{teacher_id!r}] ({teacher}) has a different vocabulary from the student ({len(teacher_vocab)} "
            f"vs {len(student_vocab)} tokens, {differing} teacher tokens with another id): the teacher's candidate "
            "ids index the student's vocabulary, so distillation would train on wrong tokens; use a teacher that "
            "shares the student's tokenizer"
        )


__all__ = ["AsyncDistillationTrainer", "check_same_vocabulary"]
