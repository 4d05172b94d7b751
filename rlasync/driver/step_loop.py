"""`StepLoop`: the driver's loop, pure asyncio over the protocols of `rlasync.driver.protocols` (no Ray).

    on_train_begin, on_epoch_begin ->
    take (the step the queue composes, a token target, or a sample count) -> on_step_begin -> learners train ->
    on_substep_end (per accumulated micro-batch but the last), on_pre_optimizer_step, on_optimizer_step ->
    finish_step (with the step's unplanned samples) -> every weight_sync_steps: sync -> on_step_end -> a due evaluation starts in the background
    (rlasync.driver.evaluation; its metrics are logged with on_log + on_evaluate when they arrive) -> drain the
    rollout metrics -> every logging_steps (or when a callback set control.should_log): log a window (on_log) ->
    every save_steps (or control.should_save): checkpoint (on_save) -> ... -> the evaluations still running ->
    on_epoch_end, on_train_end

until the horizon (`max_steps`), the end of the prompt stream, or a callback's `control.should_training_stop`;
then the last window is logged and the final model saved (unless that step was just saved). Callbacks are
transformers' `TrainerCallback`s (or any object with some of its methods): each event is called as
`callback.on_x(args, state, control, model=model, processing_class=tokenizer, optimizer=None, lr_scheduler=None,
train_dataloader=None, eval_dataloader=None, ...)` with transformers' `TrainerState` and `TrainerControl`, so
transformers' own `PrinterCallback` / `ProgressCallback` work; `on_step_end` also gets `metrics` (this step's
reduced metrics) and `on_log` `logs` (the window's record). `model` is a `LazyModel`
(rlasync.driver.model_proxy): on first use it loads the newest complete checkpoint (the model the run started from
before the first save); the weights being trained live on the learners. The optimizer step itself runs on the
learners: on_substep_end / on_pre_optimizer_step / on_optimizer_step are fired, in transformers' order, once the
learners' step returned (a callback cannot change gradients). `state.max_steps` is the horizon; without one (an
epoch run) the trainer's estimate, raised when the run passes it and set to the final step at the end. The run's own state (`global_step`, `policy_version`,
`queue`) is a plain dict, `run_state`, which the checkpointer and the Cluster read. While it waits for
samples the loop checks the rollout fleet's health (a failed or hung rollout loop) and asks the `Watchdog`
(`rlasync.driver.watchdog`) whether a step is overdue: then the run stops with the reason (docs/algorithms.md §2.1).
A prompt stream that ends before a single step trained is reported the same way.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rlasync.driver.checkpoint import Checkpointer
from rlasync.driver.protocols import Fleet, LearnerGroup, MetricItems, SampleQueue, WeightTransport
from rlasync.driver.signals import ShutdownRequest, interrupted_error
from rlasync.driver.watchdog import NoProgressError, Watchdog, WatchdogSettings
from rlasync.metrics import MetricSink
from rlasync.metrics.perf import StepPerf, system_generation_rate
from rlasync.metrics.sinks import finite_values

if TYPE_CHECKING:
    from transformers import TrainerState

    from rlasync.config.base import TrainerConfig

logger = logging.getLogger(__name__)

TAKE_POLL_S = 5.0
EVENTS = (
    "on_train_begin",
    "on_epoch_begin",
    "on_step_begin",
    "on_substep_end",
    "on_pre_optimizer_step",
    "on_optimizer_step",
    "on_step_end",
    "on_log",
    "on_save",
    "on_epoch_end",
    "on_train_end",
)  # on_init_end is the trainer's; on_evaluate fires (with an eval_dataset) when an evaluation's metrics arrive


@dataclass(frozen=True)
class StepSettings:
    """What the loop needs of the config: the horizon (None: until the prompt stream ends), the cadences, the step's
    size (`samples_per_step` set: a fixed sample count; `composed`: what the queue composes, until it says the step
    is full; else `tokens_per_step` raw tokens), the hang limit and the watchdog's settings (its floor defaults to
    the hang limit)."""

    horizon: int | None
    tokens_per_step: int
    samples_per_step: int | None = None
    composed: bool = False
    """The queue composes each step as the learner plans it (docs/algorithms.md §4.5.1): take until `step_full`."""
    min_samples: int = 1
    """The learner ranks: a step takes at least one sample per rank (one row each, docs/algorithms.md §4.5.2). Fewer
    at the end of the prompt stream or on a stop are trained by no rank: counted unplanned, not trained."""
    weight_sync_steps: int = 1
    logging_steps: int = 1
    save_steps: int | None = 500
    """None: no periodic checkpoints (save_strategy="no"); the final model is still saved."""
    logging_first_step: bool = False
    hang_timeout_s: float = 300.0
    poll_s: float = TAKE_POLL_S
    watchdog: WatchdogSettings | None = None

    @classmethod
    def from_config(
        cls,
        config: TrainerConfig,
        *,
        horizon: int | None,
        tokens_per_step: int,
        samples_per_step: int | None,
        hang_timeout_s: float,
        hang_setting: str = "rollout_worker_timeout",
        composed: bool = False,
        min_samples: int = 1,
    ) -> StepSettings:
        """`hang_timeout_s` and `hang_setting` (the config field it comes from, named in messages): the trainer's
        heartbeat limit, also the watchdog's floor."""
        watchdog = WatchdogSettings(
            timeout_s=config.watchdog_timeout_s,
            floor_s=hang_timeout_s,
            floor_setting=hang_setting,
            action=config.watchdog_action,
        )
        save_steps = config.steps_of("save_steps", horizon) if config.save_strategy == "steps" else None
        return cls(
            horizon=horizon,
            tokens_per_step=tokens_per_step,
            samples_per_step=samples_per_step,
            composed=composed,
            min_samples=min_samples,
            weight_sync_steps=config.weight_sync_steps,
            logging_steps=config.steps_of("logging_steps", horizon),
            save_steps=save_steps,
            logging_first_step=config.logging_first_step,
            hang_timeout_s=hang_timeout_s,
            watchdog=watchdog,
        )

    def watchdog_settings(self) -> WatchdogSettings:
        return self.watchdog if self.watchdog is not None else WatchdogSettings(floor_s=self.hang_timeout_s)


def unplanned_count(trained: MetricItems) -> int:
    """The step's taken samples no rank trained (`batch/unplanned_count` of the learners' items: a short tail that
    fit in no row, docs/algorithms.md §4.5.2); the queue counts them (`QueueState.unplanned_samples`)."""
    return int(sum(float(value) for name, value in trained if name == "batch/unplanned_count"))


def check_actor_health(
    name: str, health: dict[str, Any], stale_after_s: float, setting: str = "rollout_worker_timeout"
) -> None:
    """Raise `RuntimeError` when the actor `name` reports an error, or runs with a heartbeat older than
    `stale_after_s` (a hung loop; `setting` names the config field in the message). `health` is
    `{"error", "running", "heartbeat_age_s"}`, as the rollout actors' `health()` returns it."""
    if health.get("error"):
        raise RuntimeError(f"{name} failed: {health['error']}")
    age = health.get("heartbeat_age_s", 0.0)
    if health.get("running") and age > stale_after_s:
        last = time.strftime("%H:%M:%S UTC", time.gmtime(time.time() - age))
        raise RuntimeError(
            f"{name}: no heartbeat for {age:.0f} s (> {setting}={stale_after_s}; its last at {last}): "
            "the rollout loop is hung"
        )


class StepLoop:
    """Runs the steps of one training run over a queue, a learner group, a weight transport and a fleet."""

    def __init__(
        self,
        settings: StepSettings,
        *,
        queue: SampleQueue,
        learners: LearnerGroup,
        weights: WeightTransport,
        fleet: Fleet,
        checkpointer: Checkpointer,
        sinks: Sequence[Any] = (),
        callbacks: Sequence[Any] = (),
        callback_args: Any = None,
        state: dict[str, Any] | None = None,
        tokenizer: Any = None,
        trainer_state: Any = None,
        perf: StepPerf | None = None,
        log_inbox: list[dict[str, float]] | None = None,
        elastic: Any = None,
        initial_model: str | None = None,
        evaluations: Any = None,
        completions: Any = None,
    ) -> None:
        """`state`: the run's dict (updated in place, returned by `run`); `trainer_state`: the transformers
        `TrainerState` the callbacks get (a new one when None); `perf`: the throughput / MFU estimator; `elastic`:
        an `rlasync.driver.elastic.ElasticController` (`after_step(step, window) -> metric items`: resizes pools);
        `initial_model`: the folder the run started from (the callbacks' `model` before the first checkpoint);
        `evaluations`: an `rlasync.driver.evaluation.BackgroundEvaluations` (evaluation during training);
        `completions`: a `rlasync.rollout.completions_log.StepCompletionsPrinter` (`log_completions`: one table per
        logged window)."""
        from transformers import TrainerControl, TrainerState

        from rlasync.driver.model_proxy import LazyModel, latest_checkpoint_source

        self.settings = settings
        self.queue, self.learners, self.weights, self.fleet = queue, learners, weights, fleet
        self.checkpointer = checkpointer
        self.sinks = list(sinks)
        self.callbacks = list(callbacks)
        self.callback_args = callback_args
        self.run_state = state if state is not None else {}
        self.trainer_state = trainer_state if trainer_state is not None else TrainerState()
        self.tokenizer = tokenizer
        self._callback_tokenizer: Any = None
        self.control = TrainerControl()
        self.window = MetricSink()
        self.perf = perf if perf is not None else StepPerf()
        self.log_inbox = log_inbox if log_inbox is not None else []  # trainer.log(...) while the run goes
        self._last_saved_step: int | None = None
        self._last_saved_path: str | None = None
        self.stop_request: ShutdownRequest | None = (
            None  # set by the Cluster: a signal stops the run (driver/signals.py)
        )
        self.watchdog = Watchdog(settings.watchdog_settings())
        self.elastic = elastic
        self.evaluations = evaluations
        self.completions = completions
        self.model = LazyModel(
            latest_checkpoint_source(checkpointer.output_dir, initial_model),
            getattr(callback_args, "dtype", "auto"),
            "the policy's latest checkpoint",
        )

    @property
    def state(self) -> TrainerState:
        """transformers' `TrainerState`, as the callbacks see it."""
        return self.trainer_state

    async def run(self, start_step: int = 0, version: int = 0) -> dict[str, Any]:
        """Train from `start_step` at served policy `version`; returns the final state. The sinks are closed on the
        way out, also on error."""
        self.run_state.update(global_step=start_step, policy_version=version)
        ts, s = self.trainer_state, self.settings
        ts.global_step, ts.max_steps = start_step, s.horizon or ts.max_steps or 0  # an epoch run: the estimate
        ts.logging_steps, ts.save_steps = s.logging_steps, s.save_steps or 0
        try:
            self._event("on_train_begin")
            self._event("on_epoch_begin")
            step = await self._steps(start_step, version)
            if len(self.window):
                self._log(step, self.window.reduce())
            if self.evaluations is not None and not self._stopping():  # the evaluations still running, logged
                for eval_step, metrics in await self.evaluations.finish(step, self.run_state["policy_version"]):
                    self._log_eval(eval_step, metrics)
            if step > start_step and not self._saved_at(step):
                await self._save(step)  # the final model, however the run ended normally (or on a signal)
            if self._stopping():  # a signal: the final checkpoint is written, the caller tears the actors down
                raise interrupted_error(self.stop_request, self._last_saved_path, str(self.checkpointer.output_dir))
            if s.horizon is None:
                ts.max_steps = step  # an epoch run's length, known now
            self.run_state["queue"] = await self.queue.state()  # epoch accounting, for callers
            self._event("on_epoch_end")
            self._event("on_train_end")
        finally:
            if self.evaluations is not None:
                self.evaluations.cancel()
            for sink in self.sinks:
                sink.close()
        return dict(self.run_state)

    def _saved_at(self, step: int) -> bool:
        return self._last_saved_step == step

    async def _steps(self, step: int, version: int) -> int:
        s = self.settings
        last_step_end: float | None = None
        start = step
        while (s.horizon is None or step < s.horizon) and not self._stopping():
            take_start = time.perf_counter()
            refs, wait_s, take_items, tokens = await self.take()
            take_s = time.perf_counter() - take_start
            if not refs and self._stopping():
                logger.info("a signal stopped the run after step %d", step)
                break
            if not refs:
                logger.info("the prompt stream is exhausted after %d steps", step)
                if step == start:
                    await self._nothing_trained()
                break
            if len(refs) < s.min_samples:  # the stream ended (or a stop) with fewer samples than learner ranks
                await self._unplanned_step(refs, take_items, tokens)
                break
            step_window = MetricSink()
            step_window.update(take_items)
            step_window.add("perf/rollout_wait_s", wait_s)
            for phase, seconds in (self.run_state.pop("startup_s", None) or {}).items():  # the run's first step only
                step_window.add(f"perf/startup/{phase}_s", float(seconds))
            if last_step_end is not None:  # the previous step's tail: its metrics, callbacks, logging, saving
                step_window.add("perf/step_tail_s", take_start - last_step_end)
            step_window.add("perf/take_s", take_s)
            self._event("on_step_begin")
            train_start = time.perf_counter()
            trained = await self.learners.train_step(refs)
            step_window.add("perf/train_call_s", time.perf_counter() - train_start)
            step_window.update(trained)
            self._optimizer_events(trained)
            finish_start = time.perf_counter()
            await self.queue.finish_step(tokens, unplanned_count(trained))
            step_window.add("perf/finish_step_s", time.perf_counter() - finish_start)
            step += 1
            self.watchdog.step_done()
            if step % s.weight_sync_steps == 0:
                version, timings = await self.weights.sync(version)
                step_window.update(timings)
            now = time.perf_counter()
            step_s = None if last_step_end is None else now - last_step_end
            if step_s is not None:
                step_window.add("perf/step_s", step_s)
            last_step_end = now
            step_window.add("policy_version", float(version))
            step_metrics = step_window.reduce(clear=False)
            step_window.update(self.perf.step_metrics(step_metrics, step_s))
            self.window.update(step_window.items())
            self.run_state.update(global_step=step, policy_version=version)
            self.trainer_state.global_step = step
            if s.horizon is None and self.trainer_state.max_steps and step >= self.trainer_state.max_steps:
                self.trainer_state.max_steps = step + 1  # the epoch estimate was short: the run goes on
            self._event("on_step_end", metrics=step_window.reduce())
            if self.evaluations is not None:  # a due evaluation starts in the background; finished ones are logged
                self.evaluations.after_step(step, version)
                for eval_step, metrics in self.evaluations.finished():
                    self._log_eval(eval_step, metrics)
            self.window.update(system_generation_rate(list(await self.fleet.drain_metrics()), step_s))
            while self.log_inbox:
                self.window.update(self.log_inbox.pop(0))
            if self.elastic is not None:  # resize the pools (a user's request, or the policy on this window)
                self.window.update(await self.elastic.after_step(step, self.window.reduce(clear=False)))
            if step % s.logging_steps == 0 or (s.logging_first_step and step == 1) or self.control.should_log:
                self._log(step, self.window.reduce())
                if self.completions is not None:  # log_completions: this window's completions, one table
                    await self.completions.after_log(step)
            if (s.save_steps is not None and step % s.save_steps == 0) or self.control.should_save:
                await self._save(step)
            if self.control.should_training_stop:
                logger.info("a callback stopped training after step %d", step)
                break
        return step

    def _optimizer_events(self, trained: MetricItems) -> None:
        """transformers' events between on_step_begin and on_step_end: on_substep_end after every accumulated
        micro-batch but the last (`batch/microbatches_per_step` of the learners' step), then on_pre_optimizer_step
        and on_optimizer_step."""
        rows = [value for name, value in trained if name == "batch/microbatches_per_step"]
        for _ in range(max(int(rows[0]) - 1, 0) if rows else 0):
            self._event("on_substep_end")
        self._event("on_pre_optimizer_step")
        self._event("on_optimizer_step")

    async def take(self) -> tuple[list[Any], float, MetricItems, int]:
        """Fresh samples for one step: until the queue says the step is full (`composed`), else up to the token
        target (or the sample count), and at least one per learner rank (`min_samples`). While none comes, checks the fleet's health and whether the stream ended.
        Returns (refs, seconds spent waiting on the queue for them, take metrics, raw tokens)."""
        s = self.settings
        refs: list[Any] = []
        tokens, waited, full = 0, 0.0, False
        items: MetricItems = []
        while not full and (
            len(refs) < s.min_samples
            or (
                (tokens < s.tokens_per_step or s.composed)
                if s.samples_per_step is None
                else len(refs) < s.samples_per_step
            )
        ):
            target = s.tokens_per_step - tokens if s.samples_per_step is None else 1
            started = time.perf_counter()
            taken = await self.queue.take(max(target, 1), s.poll_s)
            waited += time.perf_counter() - started  # blocked until a fresh sample came (or the poll timed out)
            items += list(taken.metrics)
            full = s.composed and taken.step_full
            if full and not taken.refs:
                break
            if taken.refs:
                refs += taken.refs
                tokens += taken.num_tokens
                if self._stopping():  # what was taken is trained (a short step): nothing taken is lost
                    break
                continue
            if self._stopping():
                break
            healths = await self.fleet.check_health(s.hang_timeout_s)
            state = await self.queue.state()
            if state["done"] and state["queue_size"] == 0 and state["inflight_groups"] == 0:
                break
            self.watchdog.check(state, list(healths or ()))
        return refs, waited, items, tokens

    async def _unplanned_step(self, refs: list[Any], take_items: MetricItems, tokens: int) -> None:
        """A last take of fewer samples than learner ranks cannot fill one row per rank: no rank trains them. They
        are counted, `batch/unplanned_count` in the last window and the queue's `unplanned_samples` (they were
        counted as trained when taken), and the run ends as it would have after the previous step."""
        logger.warning(
            "the last %d samples taken (fewer than the %d learner ranks: a row each) are not trained; counted as "
            "unplanned (batch/unplanned_count)",
            len(refs),
            self.settings.min_samples,
        )
        self.window.update(take_items)
        self.window.add("batch/unplanned_count", float(len(refs)))
        await self.queue.finish_step(tokens, len(refs))

    def _stopping(self) -> bool:
        """Whether a signal asked the run to stop (no new samples are admitted; the final checkpoint follows)."""
        return self.stop_request is not None and self.stop_request.requested

    async def _nothing_trained(self) -> None:
        """The stream ended before this run trained a step: when groups were consumed (all dropped), say why."""
        state = await self.queue.state()
        outcomes = dict(state.get("outcomes") or {})
        if outcomes.get("trained", 0) or not any(outcomes.values()):
            return
        message = f"the prompt stream ended without a single training step: {self.watchdog.reason(state)}"
        if self.watchdog.settings.action == "error":
            raise NoProgressError(message)
        logger.warning("%s", message)

    async def _save(self, step: int) -> None:
        saved = {**self.run_state, "num_tokens": self.perf.num_tokens, "log_history": self.trainer_state.log_history}
        path = await self.checkpointer.save(step, saved, self.queue, self.learners, self.tokenizer)
        self._last_saved_step, self._last_saved_path = step, path
        self.control.should_save = False
        self._event("on_save", checkpoint=path)

    def _log(self, step: int, record: dict[str, Any]) -> None:
        record = finite_values(record)
        for sink in self.sinks:
            sink.write(step, record)
        self.trainer_state.log_history.append({**record, "step": step})
        self.control.should_log = False
        self._event("on_log", logs=dict(record))

    def _log_eval(self, step: int, metrics: dict[str, float]) -> None:
        """An evaluation's `eval/` metrics, a record of their own tagged with the step that was evaluated (sinks,
        `log_history`, `on_log`), then `on_evaluate` with transformers' names (`eval_reward`, ...)."""
        from rlasync.rollout.evaluation import trainer_metric_names

        record = finite_values(metrics)
        for sink in self.sinks:
            sink.write(step, record)
        self.trainer_state.log_history.append({**record, "step": step})
        self._event("on_log", logs=dict(record))
        self._event("on_evaluate", metrics=trainer_metric_names(record))

    def _processing_class(self) -> Any:
        """The tokenizer object the callbacks get (the run may carry only its local folder: loaded once, here; the
        checkpoints keep getting what the run carries)."""
        if self._callback_tokenizer is None:
            self._callback_tokenizer = self.tokenizer
            if isinstance(self.tokenizer, str | os.PathLike) and os.path.isdir(self.tokenizer):
                from transformers import AutoTokenizer

                try:
                    self._callback_tokenizer = AutoTokenizer.from_pretrained(str(self.tokenizer))
                except (OSError, ValueError) as exc:  # a callback then gets the folder
                    logger.debug("the callbacks' tokenizer: %s stays a path (%s)", self.tokenizer, exc)
        return self._callback_tokenizer

    def _event(self, name: str, **kwargs: Any) -> None:
        """Call `name` (transformers' TrainerCallback events, `EVENTS`) on every callback that defines it, as
        `callback.name(args, state, control, model=..., processing_class=..., ..., **kwargs)`; a returned
        `TrainerControl` replaces the loop's (transformers' CallbackHandler rule)."""
        full = {
            "model": self.model,
            "processing_class": self._processing_class(),
            "optimizer": None,
            "lr_scheduler": None,
            "train_dataloader": None,
            "eval_dataloader": None,
            **kwargs,
        }
        for callback in self.callbacks:
            method = getattr(callback, name, None)
            if method is None:
                continue
            result = method(self.callback_args, self.trainer_state, self.control, **full)
            if result is not None and hasattr(result, "should_training_stop"):
                self.control = result


__all__ = ["EVENTS", "TAKE_POLL_S", "NoProgressError", "StepLoop", "StepSettings", "check_actor_health"]
