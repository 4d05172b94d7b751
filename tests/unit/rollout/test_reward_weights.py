"""TRL's GRPOConfig reward-combination fields. `reward_weights`: a rollout's reward is the weighted nansum of its
reward columns, against a slow obvious reference and against TRL 1.16's own formula; the config refuses weights that
do not fit; the RewardActor path (columns scored elsewhere) weighs them the same as local functions.
`scale_rewards` ("group" / "none") and `multi_objective_aggregation` (the default only): the batch-wide values
are refused by name."""

import asyncio
import math
import random

import numpy as np
import pytest

from rlasync.algorithms.grpo.settings import rollout_settings
from rlasync.config import AsyncGRPOConfig
from rlasync.records import RolloutGroup, TrainingSequence
from rlasync.rewards import RewardTable
from rlasync.rollout.scoring import default_compute_advantages, reward_weight_vector, score_group

NAN = math.nan


def reference_reward(row: list[float], weights: list[float]) -> float:
    """The slow obvious reference: sum of weight * value over the columns that scored the rollout (None/NaN
    skipped); NaN when no column scored it (TRL: unscorable, excluded from the group's mean and std)."""
    scored = [(w, v) for w, v in zip(weights, row, strict=True) if not math.isnan(v)]
    if not scored:
        return NAN
    total = 0.0
    for weight, value in scored:
        total += weight * value
    return total


def random_columns(rng: random.Random, num_columns: int, num_rollouts: int) -> np.ndarray:
    """[C, G] rewards with some NaN (a function returning None), some rollouts no column scored."""
    values = np.array(
        [[NAN if rng.random() < 0.3 else rng.uniform(-3, 3) for _ in range(num_rollouts)] for _ in range(num_columns)]
    )
    values[:, rng.randrange(num_rollouts)] = NAN  # one rollout no column scored
    return values


def assert_same(got: np.ndarray, want: list[float]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got.tolist(), want, strict=True):
        assert (math.isnan(g) and math.isnan(w)) or g == pytest.approx(w, abs=1e-12), (got, want)


@pytest.mark.parametrize("seed", range(20))
def test_totals_match_the_reference_weighted_nansum(seed):
    rng = random.Random(seed)
    num_columns, num_rollouts = rng.randint(1, 4), rng.randint(2, 9)
    values = random_columns(rng, num_columns, num_rollouts)
    weights = [rng.choice([0.0, 1.0, 0.5, -2.0, rng.uniform(-5, 5)]) for _ in range(num_columns)]
    table = RewardTable(names=tuple(f"r{k}" for k in range(num_columns)), values=values).with_weights(weights)
    assert_same(table.totals(), [reference_reward(list(values[:, i]), weights) for i in range(num_rollouts)])


@pytest.mark.parametrize("seed", range(10))
def test_totals_match_trls_formula(seed):
    """TRL 1.16 combines the columns inline in GRPOTrainer._generate_and_score_completions (not importable
    without a model and a trainer), so the numbers are compared with its two lines, verbatim on torch tensors:

        unscorable_mask = torch.isnan(rewards_per_func).all(dim=1)
        rewards = (rewards_per_func * self.reward_weights.to(device).unsqueeze(0)).nansum(dim=1)
        rewards[unscorable_mask] = torch.nan
    """
    torch = pytest.importorskip("torch")
    rng = random.Random(100 + seed)
    num_columns, num_rollouts = rng.randint(1, 4), rng.randint(2, 9)
    values = random_columns(rng, num_columns, num_rollouts)
    weights = [rng.uniform(-2, 2) for _ in range(num_columns)]
    rewards_per_func = torch.tensor(values.T, dtype=torch.float64)  # TRL's layout: [B*G, num_funcs]
    reward_weights = torch.tensor(weights, dtype=torch.float64)
    unscorable_mask = torch.isnan(rewards_per_func).all(dim=1)
    rewards = (rewards_per_func * reward_weights.unsqueeze(0)).nansum(dim=1)
    rewards[unscorable_mask] = torch.nan
    table = RewardTable(names=tuple(f"r{k}" for k in range(num_columns)), values=values).with_weights(weights)
    assert_same(table.totals(), rewards.tolist())


def test_a_rollout_scored_only_by_weight_zero_columns_gets_zero_and_one_scored_by_none_stays_nan():
    table = RewardTable(names=("a", "b"), values=np.array([[2.0, NAN, NAN], [NAN, 5.0, NAN]])).with_weights([0, 3])
    totals = table.totals()
    assert totals[0] == 0.0 and totals[1] == 15.0 and math.isnan(totals[2])


def test_no_weights_is_the_plain_nansum():
    values = np.array([[1.0, NAN], [2.0, NAN]])
    assert_same(RewardTable(names=("a", "b"), values=values).totals(), [3.0, NAN])


def test_a_table_refuses_a_weight_count_other_than_its_columns():
    with pytest.raises(ValueError, match="1 weight\\(s\\) for 2 column"):
        RewardTable(names=("a", "b"), values=np.zeros((2, 3))).with_weights([1.0])


# ---- score_group: weighted rewards, unweighted per-column metrics, environment columns weigh 1 ----


def make_group(num_rollouts: int, **fields) -> RolloutGroup:
    return RolloutGroup(
        prompts=[[{"role": "user", "content": "q"}]] * num_rollouts,
        completions=[[{"role": "assistant", "content": f"c{i}"}] for i in range(num_rollouts)],
        completions_ids=[[10 + i] for i in range(num_rollouts)],
        completions_sequences=[
            [TrainingSequence([1, 10 + i], [0, 1], [0.0, -0.1], f"c{i}")] for i in range(num_rollouts)
        ],
        group_id=1,
        policy_version=0,
        **fields,
    )


def accuracy(completions, **kwargs):
    return [1.0, 0.0, None, 1.0]


def brevity(completions, **kwargs):
    return [0.5, 1.0, None, None]


def metric_values(scored):
    values = {}
    for key, value in scored.metrics:
        values.setdefault(key, []).append(value)
    return values


def test_score_group_weighs_the_functions_and_keeps_the_column_metrics_unweighted():
    weights = [2.0, -1.0]
    scored = asyncio.run(score_group(make_group(4), [accuracy, brevity], reward_weights=weights))
    want = [reference_reward(row, weights) for row in ([1.0, 0.5], [0.0, 1.0], [NAN, NAN], [1.0, NAN])]
    assert_same(scored.rewards, want)  # [1.5, -1.0, NaN, 2.0]
    assert scored.advantages[2] == 0.0  # unscorable: advantage 0, as TRL
    scored_rewards = np.array([1.5, -1.0, 2.0])
    expected = (scored_rewards - scored_rewards.mean()) / (scored_rewards.std() + 1e-8)
    np.testing.assert_allclose(scored.advantages[[0, 1, 3]], expected)
    metrics = metric_values(scored)
    assert metrics["reward"] == [1.5, -1.0, 2.0]  # TRL's `reward`: the weighted sum, unscorable left out
    assert metrics["rewards/accuracy/mean"] == [1.0, 0.0, 1.0]  # TRL's `rewards/<name>/mean`: unweighted
    assert metrics["rewards/brevity/mean"] == [0.5, 1.0]
    assert [s.metrics["reward_trained"] for s in scored.samples if not math.isnan(s.metrics["reward_trained"])] == [
        1.5,
        -1.0,
        2.0,
    ]


def test_environment_and_rollout_columns_weigh_one():
    group = make_group(
        4,
        env_rewards=[("Calc", 10.0), None, ("Calc", 20.0), None],
        rollout_rewards=[None, None, None, 100.0],
    )
    scored = asyncio.run(score_group(group, [accuracy, brevity], reward_weights=[0.0, 2.0]))
    assert scored.reward_table.names == ("accuracy", "brevity", "Calc", "rollout_reward")
    # rollout 0: 0*1 + 2*0.5 + 10; 1: 0*0 + 2*1; 2: only Calc; 3: 0*1 + 100
    assert_same(scored.rewards, [11.0, 2.0, 20.0, 100.0])


def test_columns_scored_elsewhere_are_weighed_like_local_functions():
    """The RewardActor path: the functions' table comes back and is passed as `function_columns`; the same
    weights give the same rewards, and the column order is the local one (functions first)."""
    weights = [3.0, 0.5]
    group_kwargs = {"env_rewards": [("Calc", 1.0), None, None, None]}
    local = asyncio.run(score_group(make_group(4, **group_kwargs), [accuracy, brevity], reward_weights=weights))
    remote_table = [("accuracy", accuracy([None] * 4)), ("brevity", brevity([None] * 4))]
    remote = asyncio.run(
        score_group(make_group(4, **group_kwargs), [], function_columns=remote_table, reward_weights=weights)
    )
    assert remote.reward_table.names == local.reward_table.names == ("accuracy", "brevity", "Calc")
    assert_same(remote.rewards, local.rewards.tolist())
    assert_same(local.rewards, [3.0 + 0.25 + 1.0, 0.5, NAN, 3.0])


def test_score_group_refuses_weights_that_do_not_fit():
    with pytest.raises(ValueError, match=r"reward_weights has 1 weight\(s\) \[1.0\] for 2 reward function\(s\)"):
        asyncio.run(score_group(make_group(4), [accuracy, brevity], reward_weights=[1.0]))
    with pytest.raises(ValueError, match="reward_weights=.*finite number"):
        reward_weight_vector([1.0, math.inf], 2)


# ---- the config and the trainer ----


def test_config_accepts_a_list_and_keeps_floats():
    assert AsyncGRPOConfig(reward_weights=[1, 0.5]).reward_weights == [1.0, 0.5]
    assert AsyncGRPOConfig(reward_weights=(2, -1)).reward_weights == [2.0, -1.0]
    assert AsyncGRPOConfig().reward_weights is None


@pytest.mark.parametrize(
    ("weights", "message"),
    [
        ([1.0, math.nan], "reward_weights=.*nan is not a finite number"),
        ([1.0, math.inf], "reward_weights=.*inf is not a finite number"),
        ([True, 1.0], "reward_weights=.*True is not a finite number"),
        (["1.0"], "reward_weights=.*'1.0' is not a finite number"),
        ("1.0,0.5", "reward_weights='1.0,0.5': give a list of numbers"),
        (1.0, "reward_weights=1.0: give a list of numbers"),
    ],
)
def test_config_refuses_bad_weights_naming_the_field(weights, message):
    with pytest.raises(ValueError, match=message):
        AsyncGRPOConfig(reward_weights=weights)


def test_settings_carry_the_weights():
    assert rollout_settings(AsyncGRPOConfig(reward_weights=[1, 2])).reward_weights == (1.0, 2.0)
    assert rollout_settings(AsyncGRPOConfig()).reward_weights is None


# ---- TRL's other reward-combination fields: scale_rewards, multi_objective_aggregation ----


@pytest.mark.parametrize(("given", "kept"), [("group", "group"), (True, "group"), ("none", "none"), (False, "none")])
def test_scale_rewards_takes_trls_values(given, kept):
    assert AsyncGRPOConfig(scale_rewards=given).scale_rewards == kept


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("scale_rewards", "batch", "scale_rewards='batch' is not supported by rlasync: .*use 'group'"),
        ("scale_rewards", "std", "scale_rewards='std': use 'group'"),
        (
            "multi_objective_aggregation",
            "normalize_then_sum",
            "multi_objective_aggregation='normalize_then_sum' is not",
        ),
        ("multi_objective_aggregation", "sum", "multi_objective_aggregation='sum': use 'sum_then_normalize'"),
    ],
)
def test_batch_wide_reward_scaling_is_refused_by_name(field, value, message):
    with pytest.raises(ValueError, match=message):
        AsyncGRPOConfig(**{field: value})


def test_scale_rewards_none_centres_without_dividing_like_trl():
    """TRL (scale_rewards="none"): advantages = rewards - group mean; unscorable rollouts get 0."""
    scale_rewards = rollout_settings(AsyncGRPOConfig(scale_rewards=False)).scale_rewards
    scored = asyncio.run(
        score_group(
            make_group(4),
            [accuracy, brevity],
            reward_weights=[2.0, -1.0],
            compute_advantages=lambda group: default_compute_advantages(group, scale_rewards),
        )
    )
    rewards = np.array([1.5, -1.0, 2.0])
    np.testing.assert_allclose(scored.advantages[[0, 1, 3]], rewards - rewards.mean())
    assert scored.advantages[2] == 0.0


def test_the_loop_reads_scale_rewards_from_its_settings():
    from rlasync.algorithms.grpo.policy import RolloutPolicy

    class Policy:
        compute_advantages = RolloutPolicy.compute_advantages

        def __init__(self, scale_rewards):
            self.settings = rollout_settings(AsyncGRPOConfig(scale_rewards=scale_rewards))

    group = make_group(3)
    group.rewards = np.array([0.0, 1.0, 5.0])
    np.testing.assert_allclose(Policy("none").compute_advantages(group), [-2.0, -1.0, 3.0])
    np.testing.assert_allclose(
        Policy("group").compute_advantages(group), np.array([-2.0, -1.0, 3.0]) / (np.std([0, 1, 5]) + 1e-8)
    )


def test_the_reward_fields_have_trl_grpo_configs_names_and_defaults():
    """A TRL user switches by changing the import: TRL 1.16's GRPOConfig fields exist here with its defaults."""
    import dataclasses

    trl = pytest.importorskip("trl")
    theirs = {f.name: f.default for f in dataclasses.fields(trl.GRPOConfig)}
    ours = {f.name: f.default for f in dataclasses.fields(AsyncGRPOConfig)}
    for name in ("reward_weights", "scale_rewards", "multi_objective_aggregation"):
        assert ours[name] == theirs[name], name


# ---- GDPO's decoupled normalisation for a compute_advantages hook (the table scoring leaves on the group) ----


def reference_decoupled(values: np.ndarray, weights: list[float]) -> list[float]:
    """The slow obvious reference of `decoupled_group_advantages` on one group: per column, the scored values
    centred and divided by their population std + 1e-4; the weighted sum over the columns that scored a rollout
    (NaN when none did); then GRPO's group normalisation of the sums (NaN -> advantage 0)."""
    num_columns, num_rollouts = values.shape
    normalised = [[NAN] * num_rollouts for _ in range(num_columns)]
    for k in range(num_columns):
        scored = [float(v) for v in values[k] if not math.isnan(v)]
        if not scored:
            continue
        mean = sum(scored) / len(scored)
        std = math.sqrt(sum((v - mean) ** 2 for v in scored) / len(scored))
        for i in range(num_rollouts):
            if not math.isnan(values[k, i]):
                normalised[k][i] = (float(values[k, i]) - mean) / (std + 1e-4)
    sums = [reference_reward([normalised[k][i] for k in range(num_columns)], weights) for i in range(num_rollouts)]
    scored_sums = [s for s in sums if not math.isnan(s)]
    if not scored_sums:
        return [0.0] * num_rollouts
    mean = sum(scored_sums) / len(scored_sums)
    std = math.sqrt(sum((s - mean) ** 2 for s in scored_sums) / len(scored_sums))
    return [0.0 if math.isnan(s) else (s - mean) / (std + 1e-8) for s in sums]


@pytest.mark.parametrize("seed", range(20))
def test_decoupled_advantages_match_the_reference(seed):
    from rlasync.advantages import decoupled_group_advantages

    rng = random.Random(300 + seed)
    num_columns, num_rollouts = rng.randint(1, 4), rng.randint(2, 9)
    values = random_columns(rng, num_columns, num_rollouts)
    values[rng.randrange(num_columns)] *= 100.0  # one column on a far larger scale
    weights = [rng.choice([1.0, 0.5, 2.0, rng.uniform(0.1, 3)]) for _ in range(num_columns)]
    got = decoupled_group_advantages(values, np.array(weights))
    np.testing.assert_allclose(got, reference_decoupled(values, weights), rtol=1e-9, atol=1e-9)


def test_decoupled_advantages_keep_a_small_reward_from_being_drowned():
    """Summed first, a 0-100 reward decides the order alone; normalised per column first, a 0/1 reward that
    disagrees with it moves the advantages as much as it does (GDPO's point)."""
    from rlasync.advantages import decoupled_group_advantages

    values = np.array([[1.0, 1.0, 0.0, 0.0], [40.0, 45.0, 55.0, 60.0]])  # correctness, a 0-100 style score
    summed = default_compute_advantages(make_group(4, rewards=values.sum(axis=0)))
    decoupled = decoupled_group_advantages(values)
    assert list(np.argsort(summed)) == [0, 1, 2, 3]  # summed first: the larger column alone sets the order
    assert summed[:2].mean() < summed[2:].mean()  # and the correct rollouts are pushed down
    assert np.argmax(decoupled) == 1  # decoupled: the best is a correct one
    assert decoupled[:2].mean() > decoupled[2:].mean()  # and correctness counts as much as the large score


def test_decoupled_advantages_refuse_bad_shapes():
    from rlasync.advantages import decoupled_group_advantages

    with pytest.raises(ValueError, match=r"values must be \[columns, rollouts\]"):
        decoupled_group_advantages(np.zeros(4))
    with pytest.raises(ValueError, match="one weight per column"):
        decoupled_group_advantages(np.zeros((2, 4)), np.ones(3))


def test_a_compute_advantages_hook_sees_the_reward_table():
    """Scoring leaves the per-column table (unweighted values, the weights) on the group before the hook runs: a
    GDPO hook gets the functions separately, and its advantages are what the samples carry."""
    from rlasync.advantages import decoupled_group_advantages

    seen = []

    def gdpo(group):
        table = group.reward_table
        seen.append((table.names, table.values.copy(), table.weights.copy(), group.rewards.copy()))
        return decoupled_group_advantages(table.values, table.weights)

    weights = [2.0, 0.5]
    scored = asyncio.run(
        score_group(make_group(4), [accuracy, brevity], reward_weights=weights, compute_advantages=gdpo)
    )
    names, values, got_weights, rewards = seen[0]
    assert names == ("accuracy", "brevity")
    np.testing.assert_array_equal(values[0], [1.0, 0.0, NAN, 1.0])  # unweighted, None -> NaN
    np.testing.assert_array_equal(values[1], [0.5, 1.0, NAN, NAN])
    assert got_weights.tolist() == weights
    assert_same(rewards, [reference_reward(row, weights) for row in ([1.0, 0.5], [0.0, 1.0], [NAN, NAN], [1.0, NAN])])
    want = reference_decoupled(values, weights)
    np.testing.assert_allclose(scored.advantages, want, rtol=1e-9, atol=1e-12)
    assert sorted(s.advantage for s in scored.samples) == pytest.approx(sorted(want))
