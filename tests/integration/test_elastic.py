"""Elastic pools on a Ray local cluster (CPU, tiny random Llama): a run that starts with 1 engine + 1 rollout actor
gets a second of each mid-run (`trainer.resize` from a callback), loses them again, and finishes its epoch with
every prompt consumed exactly once; the added engine served requests holding the current policy version."""

import json
import sys

import pytest

pytestmark = pytest.mark.integration

NUM_ROWS = 16


def digit_reward(completions, **kwargs):
    return [
        sum(w.isdigit() for w in c[-1]["content"].split()) / max(len(c[-1]["content"].split()), 1) for c in completions
    ]


@pytest.fixture(scope="module", autouse=True)
def _pickle_by_value(ray_cluster):
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


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
    from rlasync import AsyncGRPOConfig, AsyncGRPOTrainer
    from rlasync.data import arithmetic_dataset

    args = AsyncGRPOConfig(
        output_dir=str(tmp_path),
        max_steps=-1,
        num_train_epochs=1.0,
        num_generations=4,
        max_completion_length=8,
        token_budget=64,
        learning_rate=1e-2,
        logging_steps=1,
        save_steps=100,
        max_staleness=2,
        gradient_checkpointing=False,
        temperature=1.0,
        top_k=16,
        seed=0,
        cluster={
            "engine_kwargs": {"max_num_seqs": 16, "kv_cache_tokens": 2048, "max_model_len": 128},
            "collective_timeout_s": 60.0,
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

    queue = state["queue"]
    outcomes = {k: v for k, v in queue["outcomes"].items() if k != "stale"}  # stale groups are leased again
    assert queue["done"] and queue["consumed_groups"] == NUM_ROWS and queue["first_untrained_index"] == NUM_ROWS
    assert sum(outcomes.values()) == NUM_ROWS and set(outcomes) <= {"trained", "zero_std", "filtered", "failed"}
    assert queue["queue_size"] == 0 and queue["inflight_groups"] == 0 and queue["leased_groups"] == 0

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
