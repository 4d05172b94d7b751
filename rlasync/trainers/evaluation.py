"""The trainer's side of evaluation: the `eval_dataset` argument and transformers' `trainer.evaluate()`.

During `train()` the evaluations run on the cluster (`eval_strategy` / `eval_steps`: rlasync.driver.evaluation,
actors/evaluation.py). `trainer.evaluate()` before or after `train()` needs no cluster: it builds the configured
engine (`cluster.engine`) in this process over the newest model (the final checkpoint after `train()`, else the
model the trainer was given), runs the trainer's rollout loop class over it with the reward functions here, and
evaluates the same way (rlasync.rollout.evaluation). It returns transformers' dict (`eval_reward`,
`eval_rewards/<name>/mean`, `eval_completions/mean_length`, ...; the prefix is `metric_key_prefix`), logs it
(`state.log_history`, `on_log`) and fires `on_evaluate`. This module never imports Ray.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from rlasync.rollout.evaluation import EvalTally, evaluate_rows, trainer_metric_names
from rlasync.trainers.surface import estimated_steps

if TYPE_CHECKING:
    from rlasync.config.base import TrainerConfig


def checked_eval_dataset(eval_dataset: Any, config: TrainerConfig | None) -> Any:
    """The `eval_dataset` argument: an indexed dataset with a 'prompt' column (every row checked), and the eval
    settings of `config` against it (an `eval_strategy` other than "no" needs one; None: an `evaluate()` argument,
    no schedule to check). `ValueError` naming what to change."""
    from rlasync.data import validate_prompt_dataset
    from rlasync.data.streaming import is_streaming
    from rlasync.driver.evaluation import check_eval_fields

    if config is not None:
        check_eval_fields(config, eval_dataset is not None)
    if eval_dataset is None:
        return None
    if isinstance(eval_dataset, dict):
        raise ValueError(
            "eval_dataset: a dict of several eval datasets is not supported; pass one dataset with a 'prompt' column"
        )
    if is_streaming(eval_dataset):
        raise ValueError(
            "eval_dataset: a streaming (iterable) dataset is not supported for evaluation; pass an indexed dataset "
            "(e.g. datasets.Dataset, or a list of rows: take(n) of the stream)"
        )
    if len(eval_dataset) == 0:
        raise ValueError("eval_dataset is empty: pass at least one row with a 'prompt', or leave eval_dataset=None")
    validate_prompt_dataset(eval_dataset, num_rows=None)
    return eval_dataset


def check_eval_prompts(lengths: list[int], limit: int | None) -> None:
    """Every eval prompt must fit the engine (`lengths`: rendered token counts; `limit`: max_model_len): a too
    long one would fail its evaluation group at every evaluation."""
    too_long = [index for index, length in enumerate(lengths) if limit is not None and length >= limit]
    if too_long:
        raise ValueError(
            f"eval_dataset rows {too_long[:10]} render to {max(lengths[i] for i in too_long)} tokens or more, not "
            f"less than max_model_len={limit}: drop or shorten them, or raise cluster.engine_kwargs.max_model_len"
        )


def steps_per_epoch(config: TrainerConfig, dataset: Any) -> int:
    """An epoch's optimizer steps, estimated: `rows x num_generations` samples over a step's `B x GA x P` (steps by
    tokens vary in size); 0 for a streaming dataset (no length)."""
    try:
        rows = len(dataset)
    except TypeError:
        return 0
    return estimated_steps(config, rows, 1) or 1


class EvaluationMixin:
    """`evaluate()` for a trainer with `eval_dataset`, `loop_cls`, `_loop_kwargs()`, `args` and the surface's
    `log` / `_event` / `final_checkpoint`."""

    eval_dataset: Any = None
    args: TrainerConfig
    loop_cls: type

    def evaluate(
        self, eval_dataset: Any = None, ignore_keys: list[str] | None = None, metric_key_prefix: str = "eval"
    ) -> dict[str, float]:
        """transformers' `Trainer.evaluate`: the reward of the current model on `eval_dataset` (default: the
        trainer's), `num_generations_eval` completions per prompt with the configured sampling. Before or after
        `train()` (during it, `eval_strategy` runs the evaluations on the cluster)."""
        if getattr(self, "_training", False):
            raise RuntimeError(
                "evaluate() during train(): the evaluations of a run are scheduled by eval_strategy / eval_steps "
                "(on the cluster's engines); call evaluate() before or after train()"
            )
        dataset = self.eval_dataset if eval_dataset is None else checked_eval_dataset(eval_dataset, None)
        if dataset is None:
            raise ValueError("Trainer: evaluation requires an eval_dataset (pass eval_dataset= here or to the trainer)")
        tally = asyncio.run(self._evaluate_locally(dataset))
        metrics = {
            metric_key_prefix + key[len("eval") :]: value
            for key, value in trainer_metric_names(tally.metrics()).items()
            if key[len("eval_") :] not in set(ignore_keys or ())
        }
        self.log(metrics)  # type: ignore[attr-defined]
        self._event("on_evaluate", metrics=metrics)  # type: ignore[attr-defined]
        return metrics

    def _evaluation_model(self) -> tuple[str, int]:
        """(model path, policy version): the final checkpoint after `train()`, else the trainer's model."""
        run_state = getattr(self, "run_state", {}) or {}
        if run_state.get("global_step"):
            return str(self.final_checkpoint()), int(run_state.get("policy_version", 0))  # type: ignore[attr-defined]
        from rlasync.model.registry import resolve_model

        return resolve_model(self.model_path), 0  # type: ignore[attr-defined]

    async def _evaluate_locally(self, dataset: Any) -> EvalTally:
        from rlasync.config.vocab import EngineKind
        from rlasync.driver.spec import engine_dtype
        from rlasync.engine.factory import make_engine

        config, cluster = self.args, self.args.cluster
        model, version = self._evaluation_model()
        tokenizer = getattr(self, "given_processing_class", None)
        if tokenizer is None:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(model)
        base_url = None
        if EngineKind(cluster.engine).traits.needs_url:
            base_url = cluster.vllm_server_url or getattr(config, "vllm_server_base_url", None)
        engine = make_engine(
            cluster.engine,
            model,
            base_url=base_url,
            dtype=engine_dtype(config),
            **(cluster.engine_kwargs or {}),
        )
        try:
            loop = self.loop_cls(
                config=config,
                tokenizer=tokenizer,
                engine=[engine],
                prompt_source=None,
                sink=None,
                **self._loop_kwargs(),  # type: ignore[attr-defined]
            )
            generations = getattr(config, "num_generations_eval", None) or config.num_generations
            rows = [(index, dataset[index]) for index in range(len(dataset))]
            return await evaluate_rows(loop, rows, num_generations=generations, policy_version=version)
        finally:
            close = getattr(engine, "close", None)
            if close is not None and asyncio.iscoroutine(closing := close()):
                await closing


__all__ = ["EvaluationMixin", "check_eval_prompts", "checked_eval_dataset", "steps_per_epoch"]
