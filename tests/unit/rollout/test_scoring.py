"""Group scoring: TRL's scoring tests (docs/algorithms.md §12.1), the zero-std drop, reward columns, metrics."""

import asyncio
import math

import numpy as np
import pytest

from rlasync.metrics import MetricSink
from rlasync.records import RolloutGroup, TrainingSequence
from rlasync.rewards import RewardFunctionError
from rlasync.rollout.scoring import score_group


def two_reward(completions, **kwargs):
    # Deterministic per-conversation reward: two conversations get rewards 1.0 and 3.0.
    return [1.0, 3.0]


def maybe_none(completions, **kwargs):
    return [None, 2.0]


def make_group(completions_sequences, completions_ids=None, **fields):
    n = len(completions_sequences)
    return RolloutGroup(
        prompts=[[{"role": "user", "content": "hi"}]] * n,
        completions=[[{"role": "assistant", "content": f"c{i}"}] for i in range(n)],
        completions_ids=completions_ids or [[10 + i] for i in range(n)],
        completions_sequences=completions_sequences,
        group_id=fields.pop("group_id", 5),
        policy_version=fields.pop("policy_version", 7),
        **fields,
    )


def one_row_each(n):
    return [[TrainingSequence([1, 2, 10 + i], [0, 0, 1], [0, 0, -0.1], f"c{i}")] for i in range(n)]


def score(group, reward_funcs, **kwargs):
    return asyncio.run(score_group(group, reward_funcs, **kwargs))


def metric_values(scored):
    """The group's metric items as {key: [values in order]}."""
    values = {}
    for key, value in scored.metrics:
        values.setdefault(key, []).append(value)
    return values


def test_one_advantage_per_conversation_stamped_on_every_row():
    # conv 0: one row; conv 1: two rows (a fork).
    seq_a = TrainingSequence([1, 2, 3, 10, 11], [0, 0, 0, 1, 1], [0, 0, 0, -0.1, -0.2], "c0")
    seq_b1 = TrainingSequence([1, 2, 3, 20, 21], [0, 0, 0, 1, 1], [0, 0, 0, -0.3, -0.4], "c1")
    seq_b2 = TrainingSequence([1, 2, 3, 20, 99, 30], [0, 0, 0, 0, 0, 1], [0, 0, 0, 0, 0, -0.5], "c1")
    group = make_group([[seq_a], [seq_b1, seq_b2]], completions_ids=[[10, 11], [20, 21, 30]], row_index=42)

    scored = score(group, [two_reward])
    samples = scored.samples

    assert not scored.dropped and len(samples) == 3  # 1 row for conv 0 + 2 rows for conv 1
    # rewards [1, 3] -> mean 2, std 1 -> advantages [-1, +1]; the fork's two rows carry the same advantage.
    assert samples[0].advantage == pytest.approx(-1.0)
    assert samples[1].advantage == pytest.approx(1.0)
    assert samples[1].advantage == samples[2].advantage
    np.testing.assert_allclose(scored.advantages, [-1.0, 1.0])
    assert scored.rewards.tolist() == [1.0, 3.0] and group.rewards.tolist() == [1.0, 3.0]
    # Each sample maps 1:1 onto its source TrainingSequence.
    for sample, sequence in zip(samples, [seq_a, seq_b1, seq_b2], strict=True):
        np.testing.assert_array_equal(sample.input_ids, sequence.input_ids)
        np.testing.assert_array_equal(sample.completion_mask, sequence.completion_mask)
        np.testing.assert_array_equal(sample.sampler_logprobs, sequence.sampler_logprobs)
    assert all(s.policy_version == 7 and s.group_id == 5 and s.row_index == 42 for s in samples)
    assert samples[2].prompt == group.prompts[1] and samples[2].completion == group.completions[1]


def test_metrics_are_per_conversation_and_independent():
    seq_a = TrainingSequence([1, 2, 10], [0, 0, 1], [0, 0, -0.1], "c0")
    seq_b1 = TrainingSequence([1, 2, 20], [0, 0, 1], [0, 0, -0.2], "c1")
    seq_b2 = TrainingSequence([1, 2, 20, 30], [0, 0, 0, 1], [0, 0, 0, -0.3], "c1")
    group = make_group([[seq_a], [seq_b1, seq_b2]], completions_ids=[[10], [20, 30]])

    samples = score(group, [two_reward]).samples

    assert samples[0].metrics["reward_trained"] == 1.0
    assert samples[1].metrics["reward_trained"] == 3.0 and samples[2].metrics["reward_trained"] == 3.0
    assert samples[0].metrics["reward_group_std"] == pytest.approx(1.0)
    assert samples[1].metrics["rewards/two_reward/group_std"] == pytest.approx(1.0)
    # The fork's two rows must not share a metrics dict (the score loop mutates it per sample).
    assert samples[1].metrics is not samples[2].metrics
    assert set(samples[0].metrics) == {"reward_trained", "reward_group_std", "rewards/two_reward/group_std"}


def test_all_none_reward_conversation_is_unscorable():
    # TRL 1.16 (no drop): a conversation every reward func returns None for gets advantage 0 and NaN reward.
    group = make_group(one_row_each(2))

    scored = score(group, [maybe_none], drop_zero_std_groups=False)
    samples = scored.samples

    assert len(samples) == 2 and not scored.dropped
    assert samples[0].advantage == 0.0  # unscorable -> advantage 0
    assert math.isnan(samples[0].metrics["reward_trained"])
    assert samples[1].advantage == 0.0  # only one scorable row -> zero-centered
    assert samples[1].metrics["reward_trained"] == 2.0


def test_single_scorable_rollout_group_is_dropped_by_default():
    scored = score(make_group(one_row_each(2)), [maybe_none])

    assert scored.dropped and scored.samples == []
    assert scored.advantages.tolist() == [0.0, 0.0]
    assert math.isnan(scored.rewards[0]) and scored.rewards[1] == 2.0
    assert metric_values(scored) == {
        "frac_zero_std_groups": [1.0],
        "reward": [2.0],
        "reward_zero_std_groups": [2.0],
        "rewards/maybe_none/mean": [2.0],
    }


def test_zero_std_group_is_dropped_and_counted():
    def always_one(completions, **kwargs):
        return [1.0] * len(completions)

    scored = score(make_group(one_row_each(4)), [always_one])
    assert scored.dropped and scored.samples == []
    assert metric_values(scored)["frac_zero_std_groups"] == [1.0]
    assert metric_values(scored)["reward_zero_std_groups"] == [1.0]
    assert metric_values(scored)["reward"] == [1.0] * 4

    kept = score(make_group(one_row_each(4)), [always_one], drop_zero_std_groups=False)
    assert not kept.dropped and [s.advantage for s in kept.samples] == [0.0] * 4


def test_group_without_any_scored_reward_is_dropped_without_a_reward():
    def nothing(completions, **kwargs):
        return [None] * len(completions)

    scored = score(make_group(one_row_each(3)), [nothing])
    assert scored.dropped and np.isnan(scored.rewards).all()
    assert metric_values(scored) == {"frac_zero_std_groups": [1.0]}


def test_kept_group_metrics_cover_every_scored_completion():
    def graded(completions, **kwargs):
        return [0.0, 1.0, None, 1.0]

    def bonus(completions, **kwargs):
        return [0.5, None, None, 0.5]

    scored = score(make_group(one_row_each(4)), [graded, bonus])
    assert not scored.dropped and len(scored.samples) == 4
    assert scored.rewards[[0, 1, 3]].tolist() == [0.5, 1.0, 1.5] and math.isnan(scored.rewards[2])
    assert metric_values(scored) == {
        "frac_zero_std_groups": [0.0],
        "reward": [0.5, 1.0, 1.5],
        "rewards/graded/mean": [0.0, 1.0, 1.0],
        "rewards/bonus/mean": [0.5, 0.5],
    }
    metrics = scored.samples[0].metrics
    assert metrics["rewards/bonus/group_std"] == 0.0
    assert metrics["rewards/graded/group_std"] == pytest.approx(np.std([0.0, 1.0, 1.0]))
    assert metrics["reward_group_std"] == pytest.approx(np.std([0.5, 1.0, 1.5]))


def test_group_metrics_feed_the_metric_sink():
    def always_one(completions, **kwargs):
        return [1.0] * len(completions)

    sink = MetricSink()
    sink.update(score(make_group(one_row_each(2)), [two_reward]).metrics)
    sink.update(score(make_group(one_row_each(4)), [always_one]).metrics)
    logged = sink.reduce()
    assert logged["reward"] == pytest.approx((1 + 3 + 4) / 6)  # mean over every scored completion
    assert logged["frac_zero_std_groups"] == 0.5
    assert logged["reward_zero_std_groups"] == 1.0
    assert logged["rewards/two_reward/mean"] == 2.0 and logged["rewards/always_one/mean"] == 1.0


def test_compute_advantages_hook_sees_rewards_and_runs_for_dropped_groups():
    seen = []

    def hook(group):
        seen.append(group.rewards.copy())
        return np.arange(len(group), dtype=np.float64)

    def constant(completions, **kwargs):
        return [2.0] * len(completions)

    dropped = score(make_group(one_row_each(3)), [constant], compute_advantages=hook)
    assert dropped.dropped and dropped.advantages.tolist() == [0.0, 1.0, 2.0]
    kept = score(make_group(one_row_each(2)), [two_reward], compute_advantages=hook)
    assert [s.advantage for s in kept.samples] == [0.0, 1.0]
    assert [r.tolist() for r in seen] == [[2.0, 2.0, 2.0], [1.0, 3.0]]


@pytest.mark.parametrize(
    ("advantages", "message"),
    [([0.0], r"one advantage per rollout, shape \(2,\); got shape \(1,\)"), ([0.0, math.nan], "non-finite")],
)
def test_bad_compute_advantages_output_is_refused(advantages, message):
    with pytest.raises(ValueError, match=message) as info:
        score(make_group(one_row_each(2)), [two_reward], compute_advantages=lambda group: advantages)
    where = "compute_advantages (tests.unit.rollout.test_scoring.test_bad_compute_advantages_output_is_refused."
    assert str(info.value).startswith(where + "<locals>.<lambda>)")  # the hook is named where it is defined


def test_environment_rollout_and_extra_columns_are_reward_sources():
    group = make_group(
        one_row_each(3),
        env_rewards=[("MathEnv", 1.0), ("CodeEnv", 0.5), None],
        rollout_rewards=[None, 2.0, None],
    )
    scored = score(group, [], extra_columns={"harness_reward": [None, None, 4.0]})
    assert scored.reward_table.names == ("MathEnv", "CodeEnv", "rollout_reward", "harness_reward")
    assert scored.rewards.tolist() == [1.0, 2.5, 4.0]
    assert metric_values(scored)["rewards/MathEnv/mean"] == [1.0]
    assert "rewards/rollout_reward/group_std" in scored.samples[0].metrics


def test_rollout_rewards_alone_are_a_source_even_when_all_none():
    scored = score(make_group(one_row_each(2), rollout_rewards=[None, None]), [])
    assert scored.dropped and scored.reward_table.names == ()


def test_no_reward_source_is_refused():
    with pytest.raises(ValueError, match="No reward source provided"):
        score(make_group(one_row_each(2)), [])


def test_tool_frequencies_cover_every_rollout_when_the_trainer_has_tools():
    """TRL's rule: calls per rollout over every rollout (dropped groups and rollouts without calls included), failed /
    all calls over the window; logged only when the trainer has tools; never per trained sample."""
    from rlasync.metrics import MetricSink
    from rlasync.rollout.rollout_metrics import group_metrics

    def by_index(completions, **kwargs):
        return [float(i) for i in range(len(completions))]

    with_calls = make_group(one_row_each(3), tool_call_counts=[0, 2, 4], tool_failure_counts=[0, 1, 0])
    scored = score(with_calls, [by_index])
    assert all(not any(key.startswith("tools/") for key in s.metrics) for s in scored.samples)
    without_calls = make_group(one_row_each(3), tool_call_counts=[0, 0, 0], tool_failure_counts=[0, 0, 0])
    sink = MetricSink()
    for group in (with_calls, without_calls):
        sink.update(group_metrics(group, score(group, [by_index]), 0.0, (0.0, 1.0), 1, tools=True))
    window = sink.reduce()
    assert window["tools/call_frequency"] == pytest.approx(6 / 6)  # 6 calls over 6 rollouts
    assert window["tools/failure_frequency"] == pytest.approx(1 / 6)  # 1 failed of 6 calls
    only_without = group_metrics(without_calls, score(without_calls, [by_index]), 0.0, (0.0, 1.0), 1, tools=True)
    assert ("tools/call_frequency", (0.0, 3.0)) in only_without  # 0.0 is logged: the model called nothing
    no_tools = group_metrics(with_calls, scored, 0.0, (0.0, 1.0), 1, tools=False)
    assert not any(key.startswith("tools/") for key, _ in no_tools)


def test_malformed_group_is_refused():
    group = make_group(one_row_each(2), tool_call_counts=[1])
    with pytest.raises(ValueError, match=r"tool_call_counts has 1 entries for 2 completions"):
        score(group, [two_reward])
    group = make_group(one_row_each(2), reward_kwargs={"solution": ["1"]})
    with pytest.raises(ValueError, match=r"reward_kwargs\['solution'\] has 1 entries"):
        score(group, [two_reward])


def test_reward_function_errors_propagate():
    def wrong_length(completions, **kwargs):
        return [1.0]

    with pytest.raises(RewardFunctionError, match="wrong_length"):
        score(make_group(one_row_each(2)), [wrong_length])


def test_dataset_columns_reach_the_reward_functions():
    def by_solution(completions, solution, **kwargs):
        return [float(c[0]["content"] == s) for c, s in zip(completions, solution, strict=True)]

    group = make_group(one_row_each(2), reward_kwargs={"solution": ["c1", "c1"]})
    assert score(group, [by_solution]).rewards.tolist() == [0.0, 1.0]
