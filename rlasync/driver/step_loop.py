"""`StepLoop`: the driver's loop, pure asyncio over the protocols of `rlasync.driver.protocols` (no Ray).

    take (token target, or a sample count) -> learners train -> finish_step -> every weight_sync_steps: sync ->
    on_step_end -> drain the rollout metrics -> every logging_steps: log a window -> every save_steps: checkpoint

until the horizon (`max_steps`), the end of the prompt stream, or a callback's `control.should_training_stop`;
then the last window is logged and the final model saved (unless that step was just saved). While it waits for
samples the loop checks the rollout fleet's health (a failed or hung rollout loop) and asks the `Watchdog`
(`rlasync.driver.watchdog`) whether a step is overdue: then the run stops with the reason (docs/algorithms.md §2.1).
A prompt stream that ends before a single step trained is reported the same way.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rlasync.driver.checkpoint import Checkpointer
from rlasync.driver.protocols import Fleet, LearnerGroup, MetricItems, SampleQueue, WeightTransport
from rlasync.driver.watchdog import NoProgressError, Watchdog, WatchdogSettings
from rlasync.metrics import MetricSink

if TYPE_CHECKING:
    from rlasync.config.base import TrainerConfig

logger = logging.getLogger(__name__)

TAKE_POLL_S = 5.0
EVENTS = ("on_step_begin", "on_step_end", "on_log", "on_save", "on_train_end")


@dataclass(frozen=True)
class StepSettings:
    """What the loop needs of the config: the horizon (None: until the prompt stream ends), the cadences, the step's
    size (`samples_per_step` set: a fixed sample count, else `tokens_per_step` raw tokens), the hang limit and the
    watchdog's settings (its floor defaults to the hang limit)."""

    horizon: int | None
    tokens_per_step: int
    samples_per_step: int | None = None
    weight_sync_steps: int = 1
    logging_steps: int = 1
    save_steps: int = 500
    hang_timeout_s: float = 300.0
    poll_s: float = TAKE_POLL_S
    watchdog: WatchdogSettings | None = None

    @classmethod
    def from_config(cls, config: TrainerConfig, *, horizon: int | None, tokens_per_step: int, samples_per_step: int | None,
                    hang_timeout_s: float, hang_setting: str = "rollout_worker_timeout") -> StepSettings:  # fmt: skip
        """`hang_timeout_s` and `hang_setting` (the config field it comes from, named in messages): the trainer's
        heartbeat limit, also the watchdog's floor."""
        watchdog = WatchdogSettings(
            timeout_s=config.watchdog_timeout_s, floor_s=hang_timeout_s, floor_setting=hang_setting,
            action=config.watchdog_action,
        )  # fmt: skip
        return cls(
            horizon=horizon, tokens_per_step=tokens_per_step, samples_per_step=samples_per_step,
            weight_sync_steps=config.weight_sync_steps, logging_steps=config.logging_steps,
            save_steps=config.save_steps, hang_timeout_s=hang_timeout_s, watchdog=watchdog,
        )  # fmt: skip

    def watchdog_settings(self) -> WatchdogSettings:
        return self.watchdog if self.watchdog is not None else WatchdogSettings(floor_s=self.hang_timeout_s)


@dataclass
class TrainerControl:
    """The `control` argument of the callback events (TRL's TrainerControl fields); a callback sets
    `should_training_stop` to end the run after the current step (the final model is still saved)."""

    should_training_stop: bool = False
    should_epoch_stop: bool = False
    should_save: bool = False
    should_evaluate: bool = False
    should_log: bool = False


def check_actor_health(name: str, health: dict[str, Any], stale_after_s: float,
                       setting: str = "rollout_worker_timeout") -> None:  # fmt: skip
    """Raise `RuntimeError` when the actor `name` reports an error, or runs with a heartbeat older than
    `stale_after_s` (a hung loop; `setting` names the config field in the message). `health` is
    `{"error", "running", "heartbeat_age_s"}`, as the rollout actors' `health()` returns it."""
    if health.get("error"):
        raise RuntimeError(f"{name} failed: {health['error']}")
    age = health.get("heartbeat_age_s", 0.0)
    if health.get("running") and age > stale_after_s:
        raise RuntimeError(
            f"{name}: no heartbeat for {age:.0f} s (> {setting}={stale_after_s}): the rollout loop is hung"
        )


class StepLoop:
    """Runs the steps of one training run over a queue, a learner group, a weight transport and a fleet."""

    def __init__(self, settings: StepSettings, *, queue: SampleQueue, learners: LearnerGroup, weights: WeightTransport,
                 fleet: Fleet, checkpointer: Checkpointer, sinks: Sequence[Any] = (), callbacks: Sequence[Any] = (),
                 callback_args: Any = None, state: dict[str, Any] | None = None, tokenizer: Any = None) -> None:  # fmt: skip
        self.settings = settings
        self.queue, self.learners, self.weights, self.fleet = queue, learners, weights, fleet
        self.checkpointer = checkpointer
        self.sinks = list(sinks)
        self.callbacks = list(callbacks)
        self.callback_args = callback_args
        self.state = state if state is not None else {}
        self.tokenizer = tokenizer
        self.control = TrainerControl()
        self.window = MetricSink()
        self.watchdog = Watchdog(settings.watchdog_settings())

    async def run(self, start_step: int = 0, version: int = 0) -> dict[str, Any]:
        """Train from `start_step` at served policy `version`; returns the final state. The sinks are closed on the
        way out, also on error."""
        self.state.update(global_step=start_step, policy_version=version)
        try:
            step = await self._steps(start_step, version)
            if len(self.window):
                self._log(step, self.window.reduce())
            if step > start_step and step % self.settings.save_steps != 0:
                await self._save(step)  # the final model, however the run ended normally
            self.state["queue"] = await self.queue.state()  # epoch accounting, for callers
            self._event("on_train_end")
        finally:
            for sink in self.sinks:
                sink.close()
        return dict(self.state)

    async def _steps(self, step: int, version: int) -> int:
        s = self.settings
        last_step_end: float | None = None
        start = step
        while s.horizon is None or step < s.horizon:
            refs, wait_s, take_items, tokens = await self.take()
            if not refs:
                logger.info("the prompt stream is exhausted after %d steps", step)
                if step == start:
                    await self._nothing_trained()
                break
            self.window.update(take_items)
            self.window.add("perf/rollout_wait_s", wait_s)
            self._event("on_step_begin")
            self.window.update(await self.learners.train_step(refs))
            await self.queue.finish_step(tokens)
            step += 1
            self.watchdog.step_done()
            if step % s.weight_sync_steps == 0:
                version, timings = await self.weights.sync(version)
                self.window.update(timings)
            self.state.update(global_step=step, policy_version=version)
            self._event("on_step_end")
            self.window.update(await self.fleet.drain_metrics())
            now = time.perf_counter()
            if last_step_end is not None:
                self.window.add("perf/step_s", now - last_step_end)
            last_step_end = now
            self.window.add("policy_version", float(version))
            if step % s.logging_steps == 0:
                self._log(step, self.window.reduce())
            if step % s.save_steps == 0:
                await self._save(step)
            if self.control.should_training_stop:
                logger.info("a callback stopped training after step %d", step)
                break
        return step

    async def take(self) -> tuple[list[Any], float, MetricItems, int]:
        """Fresh samples for one step: up to the token target (or the sample count). While none comes, checks the
        fleet's health and whether the stream ended. Returns (refs, seconds spent waiting on the queue for them,
        take metrics, raw tokens)."""
        s = self.settings
        refs: list[Any] = []
        tokens, waited = 0, 0.0
        items: MetricItems = []
        while (tokens < s.tokens_per_step) if s.samples_per_step is None else (len(refs) < s.samples_per_step):
            target = s.tokens_per_step - tokens if s.samples_per_step is None else 1
            started = time.perf_counter()
            taken = await self.queue.take(max(target, 1), s.poll_s)
            waited += time.perf_counter() - started  # blocked until a fresh sample came (or the poll timed out)
            items += list(taken.metrics)
            if taken.refs:
                refs += taken.refs
                tokens += taken.num_tokens
                continue
            healths = await self.fleet.check_health(s.hang_timeout_s)
            state = await self.queue.state()
            if state["done"] and state["queue_size"] == 0 and state["inflight_groups"] == 0:
                break
            self.watchdog.check(state, list(healths or ()))
        return refs, waited, items, tokens

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
        path = await self.checkpointer.save(step, self.state, self.queue, self.learners, self.tokenizer)
        self._event("on_save", checkpoint=path)

    def _log(self, step: int, record: dict[str, Any]) -> None:
        record = {k: v for k, v in record.items() if v is not None and not (isinstance(v, float) and math.isnan(v))}
        for sink in self.sinks:
            sink.write(step, record)
        self._event("on_log", logs=record)

    def _event(self, name: str, **kwargs: Any) -> None:
        """Call `name` (TRL's TrainerCallback events: on_step_begin, on_step_end, on_log, on_save, on_train_end)
        on every callback that defines it, as `callback.name(args, state, control, **kwargs)`."""
        for callback in self.callbacks:
            method = getattr(callback, name, None)
            if method is not None:
                method(self.callback_args, self.state, self.control, **kwargs)


__all__ = [
    "EVENTS", "TAKE_POLL_S", "NoProgressError", "StepLoop", "StepSettings", "TrainerControl", "check_actor_health",
]  # fmt: skip
