"""The token allowance's learned state across a resume: the keep rate, the mean tokens per rollout and the last
step's tokens are saved in `rollout_state.json` and restored, so a resumed run's gate continues where the run stopped
instead of from its priors (keep rate 1.0, one group at a time); checkpoints written before it still load."""

import json
import random

import pytest

from rlasync.pipeline import (
    AllowanceState,
    QueueEntry,
    QueueService,
    RolloutState,
    TokenAllowance,
    read_rollout_state,
    write_rollout_state,
)
from rlasync.pipeline.settings import QueueSettings

G = 4  # rollouts per group
TOKENS = 100  # raw tokens per rollout


def settings(max_staleness=2, tokens_per_step=10_000):
    return QueueSettings(10**6, None, max_staleness, tokens_per_step=tokens_per_step)


def run_groups(service, pattern):
    """One group per entry of `pattern` (True kept, False dropped for zero spread), each taken once queued (then a
    new policy version, which S = 0 needs to start the next group)."""
    for kept in pattern:
        lease = service.try_next_group(G)
        assert lease is not None
        if kept:
            version = service.policy_version
            service.put_group(
                [
                    QueueEntry(payload=None, group_id=lease.group_id, policy_version=version, num_tokens=TOKENS)
                    for _ in range(G)
                ]
            )
            assert len(service.take(G * TOKENS).entries) == G
            service.set_policy_version(version + 1)
        else:
            service.drop_group(lease.group_id, "zero_std", num_tokens=G * TOKENS)


def admitted(service):
    count = 0
    while service.try_next_group(G) is not None:
        count += 1
    return count


def test_a_resumed_run_keeps_the_learned_keep_rate_mean_and_step_tokens(tmp_path):
    service = QueueService.create(settings())
    run_groups(service, [i % 5 == 0 for i in range(1000)])  # one group in five kept
    service.finish_step(8_000)
    assert service.allowance.keep_rate == pytest.approx(0.2, abs=0.03)
    write_rollout_state(tmp_path, service.rollout_state())
    saved = json.loads((tmp_path / "rollout_state.json").read_text())
    assert set(saved["allowance"]) == {
        "tokens_per_step",
        "completed_rollouts",
        "completed_tokens",
        "keep_kept_weight",
        "keep_scored_weight",
    }

    resumed = QueueService.create(settings(), resume=read_rollout_state(tmp_path))
    fresh = QueueService.create(settings())
    assert resumed.allowance.keep_rate == service.allowance.keep_rate  # not the prior 1.0
    assert resumed.allowance.mean_tokens_per_rollout == TOKENS
    assert resumed.allowance.tokens_per_step == 8_000 and resumed.allowance.allowance_tokens == 16_000
    # the gate admits at once what the run admitted before it stopped: ~1 / k as many groups as at full, no cold start
    n_resumed, n_fresh = admitted(resumed), admitted(fresh)
    assert n_fresh == 1  # a cold start: one group until the first completes
    full_count = 16_000 // (G * TOKENS)  # 40 groups counted at full
    assert n_resumed > 2.5 * full_count


def test_the_restored_estimates_continue_as_an_uninterrupted_run():
    rng = random.Random(0)
    pattern = [rng.random() < 0.3 for _ in range(600)]
    whole = QueueService.create(settings())
    run_groups(whole, pattern)
    first = QueueService.create(settings())
    run_groups(first, pattern[:250])
    state = RolloutState.from_dict(first.rollout_state().to_dict())  # through the actor's dict, as a resume does
    second = QueueService.create(settings(), resume=state)
    run_groups(second, pattern[250:])
    assert second.allowance.keep_rate_estimate == pytest.approx(whole.allowance.keep_rate_estimate, rel=1e-9)
    assert second.allowance.mean_tokens_per_rollout == whole.allowance.mean_tokens_per_rollout


def test_an_old_checkpoint_without_the_allowance_resumes_from_the_priors(tmp_path):
    (tmp_path / "rollout_state.json").write_text('{"prompt_index": 12, "model_version": 3}')
    state = read_rollout_state(tmp_path)
    assert state == RolloutState(prompt_index=12, model_version=3) and state.allowance is None
    assert state.to_dict() == {"prompt_index": 12, "model_version": 3}  # written back as it was
    resumed = QueueService.create(settings(tokens_per_step=5_000), resume=state)
    assert resumed.allowance.keep_rate == 1.0 and resumed.allowance.mean_tokens_per_rollout is None
    assert resumed.allowance.tokens_per_step == 5_000  # the configured estimate
    assert admitted(resumed) == 1  # the cold start
    assert resumed.try_next_group(G) is None
    # a state saved before anything completed restores the priors too
    nothing = AllowanceState(tokens_per_step=5_000)
    allowance = TokenAllowance(max_staleness=2, tokens_per_step=5_000)
    allowance.restore(nothing)
    assert allowance.keep_rate == 1.0 and allowance.try_acquire(G) and not allowance.try_acquire(G)


def test_max_staleness_zero_keeps_its_configured_step_size():
    service = QueueService.create(settings(max_staleness=0, tokens_per_step=2_000))
    run_groups(service, [True, False] * 10)
    service.finish_step(3_000)
    resumed = QueueService.create(settings(max_staleness=0, tokens_per_step=2_000), resume=service.rollout_state())
    assert resumed.allowance.allowance_tokens == 2_000  # the version's budget: the configured step, fixed
    assert resumed.allowance.keep_rate == service.allowance.keep_rate
    assert resumed.allowance.tokens_per_step == 3_000


@pytest.mark.parametrize(
    "allowance, message",
    [
        ({"completed_rollouts": 4}, "no 'tokens_per_step'"),
        ({"tokens_per_step": 0}, "tokens_per_step must be an integer >= 1"),
        ({"tokens_per_step": 10, "completed_rollouts": -1}, "completed_rollouts must be a finite number >= 0"),
        ({"tokens_per_step": 10, "keep_kept_weight": "x"}, "keep_kept_weight must be a finite number"),
        ({"tokens_per_step": 10, "keep_kept_weight": 5.0, "keep_scored_weight": 1.0}, "exceeds keep_scored_weight"),
        ({"tokens_per_step": 10, "completed_tokens": 5}, "completed_rollouts=0"),
        ({"tokens_per_step": 10, "keep_rate": 0.2}, "unknown fields"),
        ([1, 2], "must be a JSON object"),
    ],
)
def test_a_bad_allowance_entry_names_the_field_and_the_fix(tmp_path, allowance, message):
    (tmp_path / "rollout_state.json").write_text(json.dumps({"prompt_index": 1, "allowance": allowance}))
    with pytest.raises(ValueError, match=message) as info:
        read_rollout_state(tmp_path)
    assert "rollout_state.json" in str(info.value)


def test_the_fix_for_a_bad_field_says_how_to_start_from_the_priors():
    with pytest.raises(ValueError, match="remove the 'allowance' entry"):
        AllowanceState(tokens_per_step=10, completed_rollouts=-1)


def test_restoring_a_running_allowance_is_refused():
    allowance = TokenAllowance(max_staleness=1, tokens_per_step=1000)
    allowance.try_acquire(G)
    with pytest.raises(ValueError, match="restore it before the run starts"):
        allowance.restore(AllowanceState(tokens_per_step=1000))
