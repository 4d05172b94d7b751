"""Evaluation with a rollout loop's own policy (rlasync.rollout.evaluation): every held-out row gets
`num_generations_eval` completions from the loop's engines, scored by its reward path (local functions or the
reward scorer), nothing reaches the sink or the training metrics, and the tally reduces to the `eval/` metrics."""

import asyncio
import random

import pytest

from rlasync.algorithms.grpo.loop import AsyncRolloutLoop
from rlasync.config import AsyncGRPOConfig
from rlasync.rewards import RewardTable
from rlasync.rollout.evaluation import EvalTally, evaluate_rows, split_rows, trainer_metric_names


class NoSource:
    def lease(self):
        raise AssertionError("an evaluation leases nothing")


class NoSink:
    def put(self, result):
        raise AssertionError("an evaluation puts nothing in the queue")


def right_answer(completions, answer, **kwargs):
    return [1.0 if answer[i] in c[0]["content"] else 0.0 for i, c in enumerate(completions)]


def length_penalty(completion_ids, **kwargs):
    return [-0.1 * len(ids) for ids in completion_ids]


def make_loop(tokenizer, engine, reward_weights=None, **kwargs):
    args = AsyncGRPOConfig(
        num_generations=4, max_completion_length=16, max_concurrent_rollouts=3, reward_weights=reward_weights
    )
    return AsyncRolloutLoop(
        config=args,
        tokenizer=tokenizer,
        engine=engine,
        prompt_source=NoSource(),
        sink=NoSink(),
        rng=random.Random(0),
        **kwargs,
    )


def eval_rows(n):
    return [(i, {"prompt": [{"role": "user", "content": f"say {i}"}], "answer": str(i)}) for i in range(n)]


def echo_script(text, turn):
    """Answers the number asked for on even rows, 'no' on odd ones."""
    number = int(text.rsplit("say ", 1)[1].split("<")[0])
    return str(number) if number % 2 == 0 else "no"


def test_every_row_gets_num_generations_scored_completions(char_tokenizer, scripted_engine):
    engine = scripted_engine(char_tokenizer, echo_script)
    loop = make_loop(char_tokenizer, engine, reward_funcs=[right_answer, length_penalty])
    tally = asyncio.run(evaluate_rows(loop, eval_rows(4), num_generations=2, policy_version=7))
    assert len(engine.requests) == 8  # 4 rows x num_generations_eval=2, not num_generations=4
    metrics = tally.metrics()
    assert metrics["eval/rewards/right_answer/mean"] == pytest.approx(0.5)  # rows 0 and 2 answered
    lengths = [len(turn.output_ids) for turn in engine.turns]
    assert metrics["eval/completions/mean_length"] == pytest.approx(sum(lengths) / 8)
    assert metrics["eval/rewards/length_penalty/mean"] == pytest.approx(-0.1 * sum(lengths) / 8)
    assert metrics["eval/reward"] == pytest.approx(0.5 - 0.1 * sum(lengths) / 8)
    assert metrics["eval/reward_std"] > 0
    assert metrics["eval/num_prompts"] == 4 and metrics["eval/num_completions"] == 8
    assert metrics["eval/policy_version"] == 7
    assert not loop.counters["groups_scored"]  # no training group was counted or emitted


def test_eval_reward_is_weighted_by_reward_weights_and_the_columns_are_not(char_tokenizer, scripted_engine):
    engine = scripted_engine(char_tokenizer, echo_script)
    loop = make_loop(char_tokenizer, engine, reward_weights=[2.0, 0.5], reward_funcs=[right_answer, length_penalty])
    metrics = asyncio.run(evaluate_rows(loop, eval_rows(4), num_generations=2, policy_version=0)).metrics()
    mean_length = sum(len(turn.output_ids) for turn in engine.turns) / 8
    assert metrics["eval/rewards/right_answer/mean"] == pytest.approx(0.5)
    assert metrics["eval/rewards/length_penalty/mean"] == pytest.approx(-0.1 * mean_length)
    assert metrics["eval/reward"] == pytest.approx(2.0 * 0.5 + 0.5 * -0.1 * mean_length)


def test_scoring_goes_through_the_reward_scorer_when_the_loop_has_one(char_tokenizer, scripted_engine):
    calls = []

    async def scorer(*, prompts, completions, completion_ids, reward_kwargs):
        calls.append(len(completions))
        return RewardTable(["remote"], [[2.0] * len(completions)])

    engine = scripted_engine(char_tokenizer, echo_script)
    loop = make_loop(char_tokenizer, engine, reward_funcs=[right_answer], reward_scorer=scorer)
    tally = asyncio.run(evaluate_rows(loop, eval_rows(3), num_generations=3, policy_version=1))
    assert calls == [3, 3, 3]  # one group per row, scored remotely
    assert tally.metrics()["eval/reward"] == 2.0
    assert tally.metrics()["eval/reward_std"] == 0.0  # a constant group is kept: an evaluation drops nothing


def test_at_most_max_concurrent_rollouts_in_flight(char_tokenizer, scripted_engine):
    inflight, peak = 0, 0
    base = scripted_engine(char_tokenizer, echo_script)

    class Slow:
        async def generate(self, prompt_ids, sampling):
            nonlocal inflight, peak
            inflight += 1
            peak = max(peak, inflight)
            await asyncio.sleep(0.01)
            inflight -= 1
            return await base.generate(prompt_ids, sampling)

    loop = make_loop(char_tokenizer, Slow(), reward_funcs=[right_answer])
    asyncio.run(evaluate_rows(loop, eval_rows(5), num_generations=2, policy_version=0))
    assert peak == 3  # max_concurrent_rollouts, though 10 rollouts were asked for


def test_tallies_merge_and_metric_names():
    a = EvalTally(rewards=[1.0, 0.0], columns={"acc": [1.0, 0.0]}, lengths=[4, 6], num_prompts=1, generation_s=2.0)
    b = EvalTally(rewards=[1.0, 1.0], columns={"acc": [1.0, 1.0]}, lengths=[2, 4], num_prompts=1, generation_s=3.0)
    merged = a.merge(b).metrics()
    assert merged["eval/reward"] == 0.75 and merged["eval/rewards/acc/mean"] == 0.75
    assert merged["eval/completions/mean_length"] == 4.0 and merged["eval/num_prompts"] == 2
    assert merged["eval/generation_s"] == 3.0  # the actors run concurrently: the slowest one
    assert trainer_metric_names({"eval/reward": 1.0, "eval/rewards/acc/mean": 0.5, "loss": 2.0}) == {
        "eval_reward": 1.0,
        "eval_rewards/acc/mean": 0.5,
        "loss": 2.0,
    }
    assert split_rows(5, 2) == [[0, 2, 4], [1, 3]] and split_rows(1, 3) == [[0]]


def test_zero_generations_is_refused(char_tokenizer, scripted_engine):
    loop = make_loop(char_tokenizer, scripted_engine(char_tokenizer, echo_script), reward_funcs=[right_answer])
    with pytest.raises(ValueError, match="num_generations_eval=0"):
        asyncio.run(evaluate_rows(loop, eval_rows(1), num_generations=0, policy_version=0))


def test_a_row_the_engine_rejects_is_counted_and_left_out(char_tokenizer, scripted_engine):
    engine = scripted_engine(char_tokenizer, echo_script, max_model_len=40)
    loop = make_loop(char_tokenizer, engine, reward_funcs=[right_answer])
    rows = [*eval_rows(2), (2, {"prompt": [{"role": "user", "content": "say 4" + " pad" * 20}], "answer": "4"})]
    metrics = asyncio.run(evaluate_rows(loop, rows, num_generations=2, policy_version=0)).metrics()
    assert metrics["eval/failed_prompts"] == 1 and metrics["eval/num_completions"] == 4  # rows 0 and 1 only
    assert metrics["eval/rewards/right_answer/mean"] == 0.5


def test_eval_prompts_longer_than_the_engine_are_refused_before_the_run():
    from rlasync.trainers.evaluation import check_eval_prompts

    check_eval_prompts([10, 20], 128)
    with pytest.raises(ValueError, match=r"eval_dataset rows \[1\] render to 300 tokens.*max_model_len=128"):
        check_eval_prompts([10, 300], 128)
