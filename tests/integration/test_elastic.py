"""Elastic pools on a Ray local cluster (CPU, tiny random Llama): a run that starts with 1 engine + 1 rollout actor
gets a second of each mid-run (`trainer.resize` from a callback), loses them again, and finishes its epoch with
every prompt consumed exactly once; the added engine served requests holding the current policy version."""

import json

import pytest

from tests.integration.tiny_runs import assert_exactly_once, digit_reward, tiny_grpo_config

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("pickle_by_value")]

NUM_ROWS = 16


class Resize:
    """At the end of step `grow_at`: two engines and two rollout actors; at `shrink_at`: one of each again."""

    def __init__(self, trainer, grow_at=1, shrink_at=4):
        self.trainer, self.grow_at, self.shrink_at = trainer, grow_at, shrink_at

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.grow_at:
            self.trainer.resize(generation=2, rollout=2)
        elif state.global_step == self.shrink_at:
            self.trainer.resize(generation=1, rollout=1)


def test_engines_and_rollout_actors_join_and_leave_and_every_prompt_is_consumed_once(
    ray_cluster, tiny_model_dir, tmp_path
):
    from rlasync import AsyncGRPOTrainer
    from rlasync.data import arithmetic_dataset

    args = tiny_grpo_config(
        tmp_path,
        max_steps=-1,
        num_train_epochs=1.0,
        token_budget=64,
        cluster={
            "generation_num_cpus": 0.3,
            "max_generation_actors": 2,
            "max_rollout_actors": 2,
        },
    )
    trainer = AsyncGRPOTrainer(
        model=tiny_model_dir, reward_funcs=digit_reward, args=args, train_dataset=arithmetic_dataset(NUM_ROWS, seed=0)
    )
    trainer.callbacks.append(Resize(trainer))
    with pytest.raises(RuntimeError, match="during train"):
        trainer.resize(generation=2)
    state = trainer.train()

    assert_exactly_once(state["queue"], NUM_ROWS)

    events = {event["action"]: event for event in trainer.run_state["elastic_events"]}
    assert list(events) == ["add_engine", "add_rollout", "remove_rollout", "remove_engine"]
    assert events["add_engine"]["actor"] == events["remove_engine"]["actor"] == "generation actor 1"
    assert events["add_rollout"]["actor"] == events["remove_rollout"]["actor"] == "rollout actor 1"
    left = events["remove_engine"]
    assert left["requests"] > 0, "the added engine served no request"
    assert left["weights_version"] == left["policy_version"] > events["add_engine"]["policy_version"] > 0

    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    sizes = [(r["elastic/generation_actors"], r["elastic/rollout_actors"]) for r in records]
    assert sizes[0] == (2.0, 2.0) and (2.0, 2.0) in sizes and sizes[-1] == (1.0, 1.0)
    assert state["global_step"] > 4
