"""Evaluation during training on the driver's side (rlasync.driver.evaluation): transformers' schedule rules
(eval_steps defaulting to logging_steps, a fraction of max_steps, "epoch"), the config's refusals, and the StepLoop
running evaluations in the background: training steps go on while an evaluation generates, its metrics are logged
with the step that was evaluated, `on_evaluate` gets transformers' names, the run waits for the last one."""

import asyncio
import time

import pytest

from rlasync.config import AsyncDistillationConfig, AsyncGRPOConfig
from rlasync.driver import Checkpointer, StepLoop, StepSettings
from rlasync.driver.evaluation import BackgroundEvaluations, EvalSchedule, check_eval_fields
from tests.unit.driver.test_step_loop import FakeFleet, FakeQueue, FakeWeights, Journal, RecordingSink
from tests.unit.driver.test_step_loop_callbacks import TokenLearners


def grpo(**fields):
    return AsyncGRPOConfig(**{"max_steps": 10, **fields})


@pytest.mark.parametrize(
    ("fields", "horizon", "per_epoch", "every", "at_end"),
    [
        ({}, 10, 5, None, False),  # eval_strategy="no"
        ({"eval_strategy": "steps", "eval_steps": 3}, 10, 5, 3, False),
        ({"eval_strategy": "steps", "logging_steps": 4}, 10, 5, 4, False),  # unset: logging_steps
        ({"eval_strategy": "steps", "eval_steps": 0.25}, 10, 5, 3, False),  # ceil(0.25 x max_steps)
        ({"eval_strategy": "epoch"}, 10, 5, 5, True),
        ({"eval_strategy": "epoch"}, None, 0, None, True),  # a stream: only at the end
    ],
)
def test_schedule_follows_transformers_rules(fields, horizon, per_epoch, every, at_end):
    schedule = EvalSchedule.from_config(grpo(**fields), horizon, per_epoch)
    assert (schedule.every, schedule.at_end) == (every, at_end)
    if every:
        assert [s for s in range(1, 11) if schedule.due(s)] == list(range(every, 11, every))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"eval_strategy": "sometimes"}, "eval_strategy='sometimes': use one of 'no', 'steps', 'epoch'"),
        ({"eval_strategy": "steps", "eval_steps": 0}, "eval_steps=0"),
        ({"eval_strategy": "steps", "eval_steps": 0.5, "max_steps": -1}, "eval_steps=0.5 is a fraction"),
        ({"num_generations_eval": 0}, "num_generations_eval=0"),
    ],
)
def test_bad_eval_settings_name_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        grpo(**fields)


def test_a_strategy_without_an_eval_dataset_and_distillation_are_refused():
    with pytest.raises(ValueError, match="pass eval_dataset= to the trainer"):
        check_eval_fields(grpo(eval_strategy="steps"), has_eval_dataset=False)
    check_eval_fields(grpo(), has_eval_dataset=False)  # "no" needs none
    with pytest.raises(ValueError, match="not supported by distillation"):
        AsyncDistillationConfig(eval_strategy="steps")


class SlowEvaluation:
    """Takes `seconds` per evaluation; records when each started and ended."""

    def __init__(self, seconds):
        self.seconds, self.calls = seconds, []

    async def __call__(self, version):
        started = time.perf_counter()
        await asyncio.sleep(self.seconds)
        self.calls.append((version, started, time.perf_counter()))
        return {"eval/reward": float(version), "eval/generation_s": self.seconds}


class TimedLearners(TokenLearners):
    def __init__(self, step_s):
        super().__init__()
        self.step_s, self.ends = step_s, []

    async def train_step(self, refs):
        await asyncio.sleep(self.step_s)
        self.ends.append(time.perf_counter())
        return await super().train_step(refs)


class Evaluated:
    def __init__(self):
        self.metrics, self.logs = [], []

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self.metrics.append((state.global_step, dict(metrics)))

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs))


def make(tmp_path, evaluation, learners, horizon=4, every=2, callbacks=()):
    journal = Journal()
    settings = StepSettings(horizon=horizon, tokens_per_step=10, logging_steps=1, save_steps=100, poll_s=0.0)
    sink = RecordingSink()
    loop = StepLoop(
        settings,
        queue=FakeQueue(journal, num_samples=100),
        learners=learners,
        weights=FakeWeights(journal),
        fleet=FakeFleet(journal, None),
        checkpointer=Checkpointer(tmp_path),
        sinks=[sink],
        callbacks=list(callbacks),
        state={},
        evaluations=BackgroundEvaluations(evaluation, EvalSchedule(every)),
    )
    return loop, sink


def test_steps_go_on_while_an_evaluation_runs_and_its_metrics_carry_the_evaluated_step(tmp_path):
    evaluation, learners, seen = SlowEvaluation(0.3), TimedLearners(0.05), Evaluated()
    loop, sink = make(tmp_path, evaluation, learners, callbacks=[seen])
    asyncio.run(loop.run())
    (_, first_start, first_end), _ = evaluation.calls
    assert learners.ends[2] < first_end  # step 3 trained while step 2's evaluation was still generating
    eval_records = [(step, record) for step, record in sink.records if "eval/reward" in record]
    assert [step for step, _ in eval_records] == [2, 4]  # logged with the step evaluated, the last one waited for
    assert all(record["eval/wall_s"] >= 0.3 for _, record in eval_records)
    assert [step for step, _ in eval_records] == [
        r["step"] for r in loop.trainer_state.log_history if "eval/reward" in r
    ]
    assert [sorted(m) for _, m in seen.metrics] == [["eval_generation_s", "eval_reward", "eval_wall_s"]] * 2
    assert sum("eval/reward" in logs for logs in seen.logs) == 2  # on_log as well, as transformers' evaluate


def test_the_step_loop_does_not_wait_for_an_evaluation(tmp_path):
    """Training 4 steps with two 1-s evaluations takes about as long as without them, plus at most the last one."""
    learners = TimedLearners(0.05)
    loop, _ = make(tmp_path, SlowEvaluation(1.0), learners)
    started = time.perf_counter()
    asyncio.run(loop.run())
    trained_at = learners.ends[-1] - started
    assert trained_at < 1.0  # the 4 steps (0.2 s of training) were not held up by the evaluation of step 2
    assert time.perf_counter() - started >= 1.0  # the run's end waited for step 4's evaluation


def test_evaluations_that_pile_up_are_skipped_with_a_warning(caplog):
    async def scenario():
        evaluations = BackgroundEvaluations(SlowEvaluation(10), EvalSchedule(1), max_inflight=2)
        started = [evaluations.after_step(step, step) for step in (1, 2, 3)]
        evaluations.cancel()
        return started, evaluations.skipped

    started, skipped = asyncio.run(scenario())
    assert started == [True, True, False] and skipped == 1
    assert "evaluation at step 3 skipped" in caplog.text


def test_an_epoch_schedule_evaluates_the_final_step_once(tmp_path):
    async def scenario():
        evaluation = SlowEvaluation(0.0)
        evaluations = BackgroundEvaluations(evaluation, EvalSchedule(3, at_end=True))
        for step in range(1, 7):
            evaluations.after_step(step, step)
        first = [s for s, _ in await evaluations.finish(6, 6)]
        evaluations.after_step(7, 7)
        second = [s for s, _ in await evaluations.finish(7, 7)]
        return first, second

    first, second = asyncio.run(scenario())
    assert first == [3, 6]  # step 6 was just evaluated: not twice
    assert second == [7]


def test_the_console_shows_an_evaluations_reward():
    from rlasync.console import metrics_text

    assert metrics_text({"eval/reward": 0.5, "eval/generation_s": 3.0}) == "eval reward 0.500"


def test_a_failed_evaluation_is_reported_as_the_evaluation_of_its_step():
    async def broken(version):
        raise KeyError("answer")

    async def scenario():
        evaluations = BackgroundEvaluations(broken, EvalSchedule(2))
        evaluations.after_step(2, 3)
        await asyncio.sleep(0)
        return evaluations.finished()

    with pytest.raises(RuntimeError, match=r"the evaluation of step 2 \(eval_dataset\) failed: 'answer'"):
        asyncio.run(scenario())
