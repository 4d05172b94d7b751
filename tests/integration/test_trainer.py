"""AsyncGRPOTrainer end to end on a Ray local cluster (CPU), tiny random Llama: steps, weight sync, metrics,
checkpoint + resume, errors surfaced from train(), and every actor gone afterwards."""

import json
import time

import pytest

from tests.integration.tiny_runs import (
    arithmetic_rows,
    assert_every_taken_sample_trained,
    digit_reward,
    tiny_grpo_config,
)

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("pickle_by_value")]

ACCEPTANCE_KEYS = (
    "reward",
    "frac_zero_std_groups",
    "perf/step_s",
    "perf/rollout_wait_s",
    "rollout/backpressure_s",
    "rollout/keep_rate",
    "sample/staleness_mean",
    "rollout/queue_size",
    "batch/packing_ratio",
    "entropy",
    # the documents' names (docs/algorithms.md §8.2); perf/*_mfu are omitted on the CPU
    "num_tokens",
    "perf/fwd_bwd_forwarded_tokens_per_s",
    "perf/wall_clock_forwarded_tokens_per_s",
    "perf/wall_clock_trained_tokens_per_s",
    "rollout/score_queue_size",
    "rollout/score_wait_s",
    "rollout/score_block_s",
    "perf/weight_sync_barrier_s",
    "perf/forwarded_tok_s_fwd_bwd",
)


FILL_FLOOR = 0.75
"""A row closes when the next sample does not fit: what is left is less than one sample's novel tokens (a tiny
model's prompt of ~30 tokens + 8, against a budget of 192)."""


def raising_reward(completions, **kwargs):
    raise ZeroDivisionError("boom in the reward")


def short_reward(completions, **kwargs):
    return [0.0]


def make_config(tmp_path, **changes):
    return tiny_grpo_config(tmp_path, **{"max_steps": 3, "num_sampler_logprobs": 4, **changes})


def alive(ray, actor_ids):
    from ray._private.state import actors  # the GCS table: no dashboard needed (a test may; the Cluster does not)

    assert actor_ids, "the trainer recorded no actors"
    states = {actor_id: info["State"] for actor_id, info in actors().items()}
    return [i for i in actor_ids if states.get(i, "DEAD") != "DEAD"]


def test_short_run_trains_syncs_logs_and_cleans_up(ray_cluster, tiny_model_dir, tmp_path):
    from rlasync import AsyncGRPOTrainer

    trainer = AsyncGRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=digit_reward,
        args=make_config(tmp_path, save_steps=2, gradient_accumulation_steps=2),
        train_dataset=arithmetic_rows(),
    )
    state = trainer.train()
    assert state["global_step"] == 3
    assert state["policy_version"] == 4  # cold sync + one per step
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    keys = set().union(*records)
    missing = [k for k in ACCEPTANCE_KEYS if k not in keys]
    assert not missing, f"missing metrics {missing}; have {sorted(keys)}"
    # the step's composition (docs/algorithms.md §4.5.1): GA = 2 micro-batches of one row of token_budget unique
    # tokens, filled until the next sample does not fit (on this stream TRL's rule and ours are one: P = 1)
    assert [r["batch/microbatches_per_step"] for r in records] == [2.0, 2.0, 2.0]
    assert all(r["batch/row_fill_frac"] >= FILL_FLOOR for r in records), [r["batch/row_fill_frac"] for r in records]
    assert all(r["batch/samples_per_step"] == 2 * r["batch/samples_per_row"] for r in records)
    # the first step waits for the first groups to be generated and scored: that wait is measured
    assert records[0]["perf/rollout_wait_s"] > 0
    # the start-up's phases, with the first step only; the phases after Ray's connection add up to within the total
    startup = {k.split("/")[-1]: v for k, v in records[0].items() if k.startswith("perf/startup/")}
    assert set(startup) == {"ray_s", "learners_s", "engines_s", "cold_sync_s", "rollouts_s", "total_s"}, startup
    assert all(v >= 0 for v in startup.values()) and startup["learners_s"] > 0
    assert sum(v for k, v in startup.items() if k != "total_s") <= startup["total_s"] + 1e-6, startup
    assert not any(k.startswith("perf/startup/") for r in records[1:] for k in r)
    assert all(r["perf/fetch_samples_s"] >= 0 and r["perf/pack_s"] > 0 for r in records)  # the learner's own phases
    # its process's garbage collections are timed (the heap frozen after set-up: none need run, each is timed)
    assert all(0 <= r["perf/learner_gc_max_s"] < 5.0 for r in records)
    assert all(r["perf/learner_gc_refreezes"] in range(9) for r in records)
    assert [r["num_tokens"] for r in records] == sorted(r["num_tokens"] for r in records) and records[0][
        "num_tokens"
    ] > 0
    assert not any(k.endswith("_mfu") for k in keys)  # no peak FLOPs on the CPU
    assert alive(ray_cluster, trainer.actor_ids) == []

    # transformers' surface: TrainOutput, TrainerState, the trained model loaded from the final checkpoint
    from transformers import AutoModelForCausalLM
    from transformers.trainer_utils import TrainOutput

    assert isinstance(state, TrainOutput) and state.global_step == 3 and state.metrics["policy_version"] == 4
    assert trainer.state.global_step == 3 and [e["step"] for e in trainer.state.log_history] == [1, 2, 3]
    assert trainer.model.config.num_hidden_layers == 2
    AutoModelForCausalLM.from_pretrained(trainer.save_model(str(tmp_path / "final")))

    # the weights changed, and a checkpoint resumes at its step and policy version
    ckpt = tmp_path / "checkpoint-2"
    assert (ckpt / "rollout_state.json").is_file() and (ckpt / "optimizer.pt").is_file()
    assert (tmp_path / "checkpoint-3" / "model.safetensors").is_file()
    import torch
    from safetensors.torch import load_file

    before = load_file(f"{tiny_model_dir}/model.safetensors")
    after = load_file(str(tmp_path / "checkpoint-3" / "model.safetensors"))
    assert any(not torch.equal(before[k], after[k]) for k in before)
    saved = json.loads((ckpt / "rollout_state.json").read_text())
    assert saved["model_version"] == 3 and saved["prompt_index"] > 0
    assert saved["allowance"]["completed_rollouts"] > 0 and saved["allowance"]["tokens_per_step"] > 0  # resumed too

    resumed = AsyncGRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=digit_reward,
        args=make_config(tmp_path, max_steps=4, gradient_accumulation_steps=2),
        train_dataset=arithmetic_rows(),
    )
    state = resumed.train(resume_from_checkpoint=str(ckpt))
    assert state["global_step"] == 4 and state["policy_version"] == 3 + 1 + 2
    assert alive(ray_cluster, resumed.actor_ids) == []
    # step 3, logged by the first run after checkpoint-2, is logged again by the resumed run: once in the file
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    # num_tokens continues from checkpoint-2's count (saved in its trainer_state.json), and the log history too
    at_ckpt = json.loads((ckpt / "trainer_state.json").read_text())["num_tokens"]
    assert at_ckpt == records[1]["num_tokens"] and records[2]["num_tokens"] > at_ckpt
    assert [e["step"] for e in resumed.state.log_history] == [1, 2, 3, 4]
    assert not list(tmp_path.glob("checkpoint-*.tmp"))  # every checkpoint was completed and renamed


@pytest.mark.parametrize(
    "reward, message", [(raising_reward, "boom in the reward"), (short_reward, "1")], ids=["raises", "wrong_length"]
)
def test_reward_errors_surface_from_train_and_actors_are_removed(
    ray_cluster, tiny_model_dir, tmp_path, reward, message
):
    from rlasync import AsyncGRPOTrainer

    trainer = AsyncGRPOTrainer(
        model=tiny_model_dir, reward_funcs=reward, args=make_config(tmp_path), train_dataset=arithmetic_rows()
    )
    with pytest.raises(RuntimeError, match="rollout actor 0 failed") as info:
        trainer.train()
    assert reward.__name__ in str(info.value) and message in str(info.value)
    assert alive(ray_cluster, trainer.actor_ids) == []


def test_max_staleness_zero_trains_only_fresh_samples_and_counts_drops(ray_cluster, tiny_model_dir, tmp_path):
    """S = 0 over two learner ranks: the steps are not composed by the queue (a token target; the version's last step
    takes everything queued), so a step's last micro-batch may hold fewer samples than ranks: that tail is planned
    into the step's rows, and every sample taken is trained (docs/algorithms.md §4.5.2)."""
    from rlasync import AsyncGRPOTrainer

    config = make_config(tmp_path, max_staleness=0)
    config.cluster.num_learners = 2
    config.cluster.learner_num_cpus = 0.25
    trainer = AsyncGRPOTrainer(
        model=tiny_model_dir, reward_funcs=digit_reward, args=config, train_dataset=arithmetic_rows()
    )
    state = trainer.train()
    assert state["global_step"] == 3
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert_every_taken_sample_trained(state["queue"], records)  # steps the queue does not compose: no lost tail
    assert all(r["sample/staleness_max"] == 0 for r in records if r.get("sample/staleness_max") is not None)
    assert all("sample/dropped_stale_count" in r for r in records)  # counted (0 or more) in every window
    assert alive(ray_cluster, trainer.actor_ids) == []


class SlowLearner:
    """Holds each step between its take and its update, so generation runs ahead at the old policy version."""

    def __init__(self, delay_s: float):
        self.delay_s, self.events = delay_s, []

    def on_step_begin(self, args, state, control, **kwargs):
        self.events.append(("begin", state.global_step))
        time.sleep(self.delay_s)

    def on_step_end(self, args, state, control, **kwargs):
        self.events.append(("end", state.global_step))


def test_max_staleness_zero_is_synchronous_a_slow_learner_wastes_nothing(ray_cluster, tiny_model_dir, tmp_path):
    """S = 0 (docs/algorithms.md §2.3.4): while a slow learner trains, nothing is generated at the old version, so
    nothing is dropped as stale, and every step trains on the previous step's weights."""
    from rlasync import AsyncGRPOTrainer

    slow = SlowLearner(delay_s=4.0)
    trainer = AsyncGRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=digit_reward,
        args=make_config(tmp_path, max_staleness=0, max_steps=3),
        train_dataset=arithmetic_rows(),
        callbacks=[slow],
    )
    assert trainer.train()["global_step"] == 3
    assert [e for e, _ in slow.events] == ["begin", "end"] * 3
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert sum(r.get("sample/dropped_stale_count", 0) for r in records) == 0  # nothing generated ahead
    assert all(r["sample/staleness_max"] == 0 for r in records if r.get("sample/staleness_max") is not None)
    # Only fresh samples are trained, so each step's sampler log-probs come from an engine that received the
    # previous step's weights: they match the learner's recomputation (a missed sync would show here).
    gaps = [r["sampling/sampling_logp_difference/max"] for r in records if "sampling/sampling_logp_difference/max" in r]
    assert len(gaps) == 3 and max(gaps) < 1e-3, gaps
    assert alive(ray_cluster, trainer.actor_ids) == []


def test_one_epoch_consumes_every_prompt_exactly_once(ray_cluster, tiny_model_dir, tmp_path):
    """max_steps=-1, one epoch over 13 prompts: training stops when the stream is exhausted, and every prompt ended
    in exactly one counted outcome (trained, dropped as a zero-std group, or failed for good: the last prompt is
    longer than max_model_len, so the engine rejects it and it must not be leased again forever)."""
    from datasets import Dataset

    from rlasync import AsyncGRPOTrainer

    rows = arithmetic_rows(12).to_list()
    rows.append({**rows[0], "prompt": [{"role": "user", "content": " ".join(["1"] * 200)}]})
    config = make_config(tmp_path, max_steps=-1, num_train_epochs=1.0)
    trainer = AsyncGRPOTrainer(
        model=tiny_model_dir, reward_funcs=digit_reward, args=config, train_dataset=Dataset.from_list(rows)
    )
    state = trainer.train()
    queue = state["queue"]
    assert queue["done"] and queue["consumed_groups"] == 13 and queue["first_untrained_index"] == 13
    outcomes = {k: v for k, v in queue["outcomes"].items() if k != "stale"}  # stale groups are re-leased
    assert sum(outcomes.values()) == 13 and set(outcomes) <= {"trained", "zero_std", "filtered", "failed"}
    assert outcomes.get("failed") == 1
    assert queue["queue_size"] == 0 and queue["inflight_groups"] == 0
    # max_steps=-1: the final model is saved when the epochs end
    assert (tmp_path / f"checkpoint-{state['global_step']}" / "trainer_state.json").is_file()
    assert alive(ray_cluster, trainer.actor_ids) == []


def test_two_learner_ranks_two_rollout_actors_and_a_reward_actor(ray_cluster, tiny_model_dir, tmp_path):
    from rlasync import AsyncGRPOTrainer

    config = make_config(tmp_path, max_steps=2, gradient_accumulation_steps=2)
    config.cluster.num_learners = 2
    config.cluster.num_rollout_actors = 2
    config.cluster.num_reward_actors = 1  # reward functions in a RewardActor, not in the rollout loops
    config.cluster.learner_num_cpus = 0.25
    config.cluster.gil_switch_interval_s = 0.001  # set in the generation and rollout actors' processes
    trainer = AsyncGRPOTrainer(
        model=tiny_model_dir, reward_funcs=digit_reward, args=config, train_dataset=arithmetic_rows()
    )
    state = trainer.train()
    assert state["global_step"] == 2 and state["policy_version"] == 3
    assert len(trainer.actor_ids) == 1 + 2 + 1 + 1 + 2  # engine, learners, queue, reward actor, rollout actors
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(r["batch/samples_per_row"] > 0 for r in records if "batch/samples_per_row" in r)
    # a step is GA = 2 micro-batches of one row per rank, composed by the queue as both ranks plan it (§4.5.1)
    assert [r["batch/microbatches_per_step"] for r in records] == [2.0, 2.0]
    assert all(r["batch/samples_per_step"] == 4 * r["batch/samples_per_row"] for r in records)
    # the driver split each step: a rank was sent only its rows' samples (docs/design.md §6.2)
    assert all(0 < r["batch/samples_per_rank_max"] < r["batch/samples_per_step"] for r in records)
    assert_every_taken_sample_trained(state["queue"], records)
    # FSDP2 over two gloo ranks: the step's metrics are reduced over both; every sync logs its phases
    sync_keys = (
        "perf/weight_sync_s",
        "perf/weight_sync_pause_s",
        "perf/weight_sync_transfer_s",
        "perf/weight_sync_resume_s",
        "perf/weight_sync_dispatch_s",
        "perf/weight_sync_send_s",
        "perf/generation_loop_lag_max_s",
        "perf/generation_cpu_frac",
        "perf/queue_cpu_frac",
        "perf/queue_loop_lag_max_s",
        "rollout/actor_cpu_frac_max",
    )
    for record in records:
        assert all(record[key] >= 0 for key in sync_keys), record
        assert record["perf/weight_sync_s"] >= record["perf/weight_sync_transfer_s"]
        assert record["perf/weight_sync_s"] >= record["perf/weight_sync_dispatch_s"]
        assert record["batch/trained_tokens_per_step"] > 0 and record["entropy"] > 0
    assert (tmp_path / "checkpoint-2" / "model.safetensors").is_file()  # a full state dict saved from rank 0
    assert alive(ray_cluster, trainer.actor_ids) == []


def test_weights_shared_by_handle_reach_the_engine(ray_cluster, tiny_model_dir, tmp_path):
    """cluster.weight_sync_backend="ipc" (one host, one device: shared memory on the CPU, CUDA IPC on a shared GPU):
    with max_staleness=0 every trained sample comes from an engine holding the previous step's weights, so its
    log-probs match the learner's recomputation; the shared buckets are gone afterwards."""
    from pathlib import Path

    from rlasync import AsyncGRPOTrainer

    cluster = {"weight_sync_backend": "ipc"}  # merged into the tiny run's cluster
    before = set(Path("/dev/shm").glob("rlasync-weights-*")) if Path("/dev/shm").is_dir() else set()
    trainer = AsyncGRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=digit_reward,
        args=make_config(tmp_path, max_staleness=0, max_steps=2, cluster=cluster),
        train_dataset=arithmetic_rows(),
    )
    assert trainer.train()["global_step"] == 2
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    gaps = [r["sampling/sampling_logp_difference/max"] for r in records if "sampling/sampling_logp_difference/max" in r]
    assert len(gaps) == 2 and max(gaps) < 1e-3, gaps
    assert all("perf/weight_sync_transfer_s" in r for r in records)
    for record in records:  # the phases account for the whole sync (IPC: the pause overlaps the pack)
        parts = ("barrier", "pause", "transfer", "resume", "stage", "calls", "finish")
        total = sum(record[f"perf/weight_sync_{part}_s"] for part in parts)
        pause_overlap = min(record["perf/weight_sync_pause_s"], record["perf/weight_sync_barrier_s"])
        assert total - pause_overlap <= record["perf/weight_sync_s"] * 1.05 + 2e-3, record
        assert total >= record["perf/weight_sync_s"] * 0.9, record
        assert 0 <= record["perf/weight_sync_pack_s"] <= record["perf/weight_sync_barrier_s"]
    if Path("/dev/shm").is_dir():
        assert set(Path("/dev/shm").glob("rlasync-weights-*")) == before
    assert alive(ray_cluster, trainer.actor_ids) == []


def lookup_digit(index: int) -> str:
    """Return the digit word at a position.

    Args:
        index: the position, 0 to 9
    """
    return str(index % 10)


class DigitEnv:
    """An environment whose reset writes the prompt and whose reward is how many digit words the reply held."""

    def __init__(self):
        self.target = 0
        self.resets = 0

    def reset(self, **row):
        self.resets += 1
        self.target = self.resets % 10
        return f"Say the digit {self.target}."

    def peek(self, index: int) -> str:
        """Return the digit the environment wants, offset by index.

        Args:
            index: an offset
        """
        return str((self.target + index) % 10)

    def get_reward(self):
        return float(self.resets > 0)


def test_tools_and_an_environment_without_a_dataset_reach_the_rollout_actors(ray_cluster, tiny_model_dir, tmp_path):
    """TRL's `tools=` and `environment_factory=` through Ray: the environment writes every prompt of the placeholder
    dataset (no train_dataset) and its reward column reaches the metrics next to the reward function's."""
    from rlasync import AsyncGRPOTrainer

    trainer = AsyncGRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=digit_reward,
        args=make_config(tmp_path, max_steps=2),
        tools=[lookup_digit],
        environment_factory=DigitEnv,
    )
    state = trainer.train()
    assert state["global_step"] == 2
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    keys = set().union(*records)
    assert "rewards/DigitEnv/mean" in keys, sorted(k for k in keys if "reward" in k)
    assert all(r["rewards/DigitEnv/mean"] == 1.0 for r in records if "rewards/DigitEnv/mean" in r)  # reset ran first
    assert alive(ray_cluster, trainer.actor_ids) == []
