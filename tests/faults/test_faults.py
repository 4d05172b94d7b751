"""Fault injection on CPU (tiny random Llama, Ray local cluster): kill -9 each actor kind mid-run.

rollout, reward, teacher   restarted by Ray; the dead rollout actor's leases are released, the run finishes and
                           every prompt of the epoch ends in exactly one counted outcome
generation                 restarted by Ray; its failed requests are retried, the driver re-opens the weight
                           transport and sends it the current policy, and the run finishes (1 and 2 engines)
learner, queue, generation stop-and-resume: the run stops within a bound with an error naming the dead actor and
(restarts used up)         the checkpoint to resume from; `train(resume_from_checkpoint=True)` continues there
a frozen (SIGSTOPped) generation actor is named as such within the hang bound, with when it last answered, whether
a weight sync or the rollouts' requests wait on it (not a hung rollout loop, nor an actor that lost it); the
restarts of rollout and reward actors are reported (faults/*_restarts)
"""

import json
import os
import signal
import time

import pytest

from tests.integration.tiny_runs import (
    arithmetic_rows,
    assert_exactly_once,
    digit_reward,
    tiny_distill_config,
    tiny_grpo_config,
)

pytestmark = [pytest.mark.integration, pytest.mark.faults, pytest.mark.usefixtures("pickle_by_value")]

NUM_ROWS = 24


def make_config(tmp_path, **changes):
    return tiny_grpo_config(tmp_path, **{"max_steps": -1, "num_train_epochs": 1.0, "token_budget": 96, **changes})


def actor_table(actor_ids):
    from ray._private.state import actors

    table = actors()
    return [table[i] for i in actor_ids if i in table]


def find(actor_ids, class_name):
    rows = [row for row in actor_table(actor_ids) if row["ActorClassName"] == class_name and row["State"] == "ALIVE"]
    assert rows, f"no live {class_name} among {[r['ActorClassName'] for r in actor_table(actor_ids)]}"
    return rows[0]


class KillAt:
    """A callback: at `on_step_begin` of step `step` (global_step == step - 1), send `sig` to the process of the
    first live actor of `class_name` this run created."""

    def __init__(self, trainer_ids, class_name, step, sig=signal.SIGKILL):
        self.ids, self.class_name, self.step, self.sig = trainer_ids, class_name, step, sig
        self.pid = None
        self.killed_at = None

    def on_step_begin(self, args, state, control, **kwargs):
        if self.pid is None and state.global_step == self.step - 1:
            self.pid = find(self.ids, self.class_name)["Pid"]
            os.kill(self.pid, self.sig)
            self.killed_at = time.monotonic()


def alive(actor_ids):
    return [row["ActorID"] for row in actor_table(actor_ids) if row["State"] != "DEAD"]


def grpo_trainer(tiny_model_dir, tmp_path, class_name, step, sig=signal.SIGKILL, cluster=None, **changes):
    from rlasync import AsyncGRPOTrainer

    args = make_config(tmp_path, **changes)
    for key, value in (cluster or {}).items():
        setattr(args.cluster, key, value)
    trainer = AsyncGRPOTrainer(
        model=tiny_model_dir, reward_funcs=digit_reward, args=args, train_dataset=arithmetic_rows(NUM_ROWS)
    )
    kill = KillAt(trainer.actor_ids, class_name, step, sig)
    trainer.callbacks.append(kill)
    return trainer, kill


@pytest.mark.parametrize(
    "class_name, cluster", [("RolloutActor", {}), ("RewardActor", {"num_reward_actors": 1})], ids=["rollout", "reward"]
)
def test_a_killed_rollout_or_reward_actor_is_restarted_and_the_epoch_is_consumed_exactly_once(
    ray_cluster, tiny_model_dir, tmp_path, class_name, cluster
):
    trainer, kill = grpo_trainer(tiny_model_dir, tmp_path, class_name, step=2, cluster=cluster)
    state = trainer.train()
    assert kill.pid is not None, "the run ended before the kill"
    assert_exactly_once(state["queue"], NUM_ROWS)
    restarted = [row for row in actor_table(trainer.actor_ids) if row["ActorClassName"] == class_name]
    assert restarted and restarted[0]["NumRestarts"] >= 1
    metric = {"RolloutActor": "faults/rollout_restarts", "RewardActor": "faults/reward_restarts"}[class_name]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    counts = [r[metric] for r in records if metric in r]
    assert counts and counts[-1] >= 1, f"no record of the restart ({metric})"
    assert (tmp_path / f"checkpoint-{state['global_step']}" / "trainer_state.json").is_file()  # the final model
    assert alive(trainer.actor_ids) == []


@pytest.mark.parametrize("engines", [1, 2], ids=["one-engine", "two-engines"])
def test_a_killed_generation_actor_is_restarted_synced_and_the_epoch_is_consumed_exactly_once(
    ray_cluster, tiny_model_dir, tmp_path, engines
):
    trainer, kill = grpo_trainer(
        tiny_model_dir, tmp_path, "GenerationActor", step=2, cluster={"num_generation_actors": engines}
    )
    state = trainer.train()
    assert kill.pid is not None, "the run ended before the kill"
    assert_exactly_once(state["queue"], NUM_ROWS)
    restarted = [row for row in actor_table(trainer.actor_ids) if row["ActorClassName"] == "GenerationActor"]
    assert len(restarted) == engines and max(row["NumRestarts"] for row in restarted) >= 1
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    counts = [r["faults/generation_restarts"] for r in records if "faults/generation_restarts" in r]
    assert counts and counts[-1] >= 1, "no record of the generation restart"
    assert all(r["step"] < 2 for r in records if "faults/generation_restarts" not in r)  # counted from the restart on
    versions = [r["policy_version"] for r in records]
    assert versions == sorted(versions) and versions[-1] > state["global_step"]  # the restart's sync is a version
    assert (tmp_path / f"checkpoint-{state['global_step']}" / "trainer_state.json").is_file()
    assert alive(trainer.actor_ids) == []


@pytest.mark.parametrize(
    "class_name, name",
    [
        ("LearnerActor", "learner rank 0"),
        ("QueueActor", "the queue actor (StalenessQueue)"),
        ("GenerationActor", "generation actor 0"),
    ],
    ids=["learner", "queue", "generation-restarts-used-up"],
)
def test_a_killed_learner_queue_or_engine_stops_the_run_naming_it_and_resume_continues(
    ray_cluster, tiny_model_dir, tmp_path, class_name, name, monkeypatch
):
    if class_name == "GenerationActor":  # no restart left: stop-and-resume, like the queue and the learners
        monkeypatch.setattr("actors.cluster_faults.MAX_RESTARTS", 0)
    trainer, kill = grpo_trainer(tiny_model_dir, tmp_path, class_name, step=3, save_steps=2)
    with pytest.raises(RuntimeError) as info:
        trainer.train()
    stopped_after = time.monotonic() - kill.killed_at
    message = str(info.value)
    assert message.startswith(f"{name} died"), message
    assert "--resume" in message and str(tmp_path / "checkpoint-2") in message, message
    assert stopped_after < 60, f"the run took {stopped_after:.0f} s to stop after the kill"
    assert alive(trainer.actor_ids) == []
    if class_name != "LearnerActor":
        return
    from rlasync import AsyncGRPOTrainer

    resumed = AsyncGRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=digit_reward,
        args=make_config(tmp_path, max_steps=4),
        train_dataset=arithmetic_rows(NUM_ROWS),
    )
    state = resumed.train(resume_from_checkpoint=True)
    assert state["global_step"] == 4
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == sorted(set(steps)) and steps[-1] == 4  # the resumed run replaced the records after step 2
    saved = json.loads((tmp_path / "checkpoint-2" / "rollout_state.json").read_text())
    assert state["queue"]["first_untrained_index"] >= saved["prompt_index"]
    assert alive(resumed.actor_ids) == []


@pytest.mark.parametrize("weight_sync_steps", [1, 100], ids=["seen-by-the-weight-sync", "seen-by-the-rollouts"])
def test_a_frozen_generation_actor_is_named_within_the_hang_bound_with_when_it_last_answered(
    ray_cluster, tiny_model_dir, tmp_path, weight_sync_steps
):
    bound_s = 8.0  # rollout_worker_timeout: the hang bound
    trainer, kill = grpo_trainer(
        tiny_model_dir,
        tmp_path,
        "GenerationActor",
        step=2,
        sig=signal.SIGSTOP,
        rollout_worker_timeout=bound_s,
        weight_sync_steps=weight_sync_steps,  # 100: no sync after the freeze, the rollouts' requests wait on it
    )
    try:
        with pytest.raises(RuntimeError) as info:
            trainer.train()
        stopped_after = time.monotonic() - kill.killed_at
    finally:
        if kill.pid is not None:
            os.kill(kill.pid, signal.SIGCONT)  # no stopped process left behind
    message = str(info.value)
    assert message.startswith("generation actor 0 made no progress"), message
    assert "rollout loop is hung" not in message and "queue actor" not in message
    assert "it last answered" in message and " s ago (" in message, message
    seen_by = "the weight sync" if weight_sync_steps == 1 else "rollout actor 0"
    assert f"while {seen_by}" in message, message
    # the bound, the 10-s probe and a loaded machine's polls; not the 300-s default nor a weight sync's deadline
    assert stopped_after < bound_s + 40, f"the run took {stopped_after:.0f} s to stop after the SIGSTOP"


def test_a_killed_teacher_is_restarted_and_the_distillation_run_finishes(ray_cluster, tiny_model_dir, tmp_path):
    """A TeacherScorer is stateless: Ray restarts it and retries the scoring calls, and the run reaches max_steps."""
    from rlasync import AsyncDistillationTrainer

    trainer = AsyncDistillationTrainer(
        model=tiny_model_dir,
        args=tiny_distill_config(tmp_path, max_steps=4),
        train_dataset=arithmetic_rows(64),
        teacher_model=tiny_model_dir,
    )
    kill = KillAt(trainer.actor_ids, "TeacherScorer", step=2)
    trainer.callbacks.append(kill)
    state = trainer.train()
    assert kill.pid is not None, "the run ended before the kill"
    assert state["global_step"] == 4
    restarted = [row for row in actor_table(trainer.actor_ids) if row["ActorClassName"] == "TeacherScorer"]
    assert restarted and restarted[0]["NumRestarts"] >= 1
    assert (tmp_path / "checkpoint-4" / "trainer_state.json").is_file()
    assert alive(trainer.actor_ids) == []
