"""StepLoop with fakes for the queue, the learners, the weight transport and the fleet: the order of a step's
parts, the cadences, the stopping rules, the hang check and the callback events (no Ray, milliseconds)."""

import asyncio
import dataclasses
import json

import pytest

from rlasync.driver import Checkpointer, StepLoop, StepSettings, Taken


class Journal(list):
    """What happened, in order, across every fake."""


class FakeQueue:
    """Hands out `num_samples` samples of `tokens_each` tokens, one per take, then reports the stream done."""

    def __init__(self, journal, num_samples=100, tokens_each=10, empty_polls=0):
        self.journal, self.left, self.tokens_each, self.empty_polls = journal, num_samples, tokens_each, empty_polls
        self.version = None
        self.finished = []
        self.unplanned = []
        self.next_ref = 0

    async def take(self, token_target, timeout_s):
        if self.empty_polls:
            self.empty_polls -= 1
            return Taken(metrics=[("rollout/queue_size", 0.0)])
        if not self.left:
            return Taken()
        self.left -= 1
        self.next_ref += 1
        self.journal.append("take")
        return Taken(refs=[f"ref{self.next_ref}"], num_tokens=self.tokens_each, metrics=[("rollout/queue_size", 1.0)])

    async def finish_step(self, tokens, unplanned=0):
        self.finished.append(tokens)
        self.unplanned.append(unplanned)
        self.journal.append("finish_step")

    async def set_policy_version(self, version):
        self.version = version

    async def state(self):
        return {"done": self.left == 0, "queue_size": 0, "inflight_groups": 0}

    async def rollout_state(self):
        return {"prompt_index": self.next_ref, "model_version": self.version or 0}


class FakeLearners:
    def __init__(self, journal, fail_at=None):
        self.journal, self.fail_at = journal, fail_at
        self.trained = []

    async def train_step(self, refs):
        self.trained.append(list(refs))
        if self.fail_at is not None and len(self.trained) == self.fail_at:
            raise RuntimeError("learner rank 0 failed: boom")
        self.journal.append("train")
        return [("loss", 0.5), ("perf/pack_s", 0.01)]

    async def save(self, directory, tokenizer):
        self.journal.append("save")
        (pathlib_path(directory) / "model.safetensors").write_text("weights")


def pathlib_path(directory):
    from pathlib import Path

    return Path(directory)


class FakeWeights:
    def __init__(self, journal):
        self.journal = journal

    async def sync(self, version):
        self.journal.append("sync")
        return version + 1, {"perf/weight_sync_s": 0.1}


class FakeFleet:
    def __init__(self, journal, error=None):
        self.journal, self.error = journal, error
        self.checks = []
        self.stopped = False

    async def check_health(self, stale_after_s):
        self.checks.append(stale_after_s)
        if self.error:
            raise RuntimeError(self.error)

    async def drain_metrics(self):
        self.journal.append("drain")
        return [("reward", 1.0)]

    async def stop(self):
        self.stopped = True


class RecordingSink:
    def __init__(self):
        self.records, self.closed = [], False

    def write(self, step, record):
        self.records.append((step, record))

    def close(self):
        self.closed = True


class Callback:
    def __init__(self, journal, stop_at=None):
        self.journal, self.stop_at = journal, stop_at
        self.seen_args = []

    def on_step_begin(self, args, state, control, **kwargs):
        self.journal.append("on_step_begin")
        self.seen_args.append(args)

    def on_step_end(self, args, state, control, **kwargs):
        self.journal.append("on_step_end")
        if self.stop_at is not None and state.global_step >= self.stop_at:
            control.should_training_stop = True

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.journal.append("on_log")

    def on_save(self, args, state, control, checkpoint=None, **kwargs):
        self.journal.append(f"on_save:{checkpoint.rsplit('/', 1)[-1]}")

    def on_train_end(self, args, state, control, **kwargs):
        self.journal.append("on_train_end")


def make_loop(
    tmp_path,
    *,
    horizon=3,
    num_samples=100,
    tokens_per_step=10,
    samples_per_step=None,
    weight_sync_steps=1,
    logging_steps=1,
    save_steps=100,
    fleet_error=None,
    empty_polls=0,
    fail_at=None,
    stop_at=None,
):
    journal = Journal()
    settings = StepSettings(
        horizon=horizon,
        tokens_per_step=tokens_per_step,
        samples_per_step=samples_per_step,
        weight_sync_steps=weight_sync_steps,
        logging_steps=logging_steps,
        save_steps=save_steps,
        hang_timeout_s=42.0,
        poll_s=0.0,
    )
    queue = FakeQueue(journal, num_samples=num_samples, empty_polls=empty_polls)
    sink = RecordingSink()
    callback = Callback(journal, stop_at=stop_at)
    loop = StepLoop(
        settings,
        queue=queue,
        learners=FakeLearners(journal, fail_at),
        weights=FakeWeights(journal),
        fleet=FakeFleet(journal, fleet_error),
        checkpointer=Checkpointer(tmp_path),
        sinks=[sink],
        callbacks=[callback],
        callback_args="the-config",
        state={},
        tokenizer=None,
    )
    return loop, journal, sink


def run(loop, start_step=0, version=0):
    return asyncio.run(loop.run(start_step, version))


def test_a_step_is_take_train_finish_sync_events_drain_log_then_save(tmp_path):
    loop, journal, sink = make_loop(tmp_path, horizon=2, save_steps=2)
    state = run(loop)
    assert state["global_step"] == 2 and state["policy_version"] == 2
    step = ["take", "on_step_begin", "train", "finish_step", "sync", "on_step_end", "drain", "on_log"]
    assert journal == step + step + ["save", "on_save:checkpoint-2", "on_train_end"]
    assert [s for s, _ in sink.records] == [1, 2] and sink.closed
    assert loop.callbacks[0].seen_args == ["the-config", "the-config"]  # TRL's (args, state, control) signature


def test_weight_sync_cadence_and_the_policy_version_logged(tmp_path):
    loop, journal, sink = make_loop(tmp_path, horizon=5, weight_sync_steps=2)
    state = run(loop, version=1)
    assert journal.count("sync") == 2 and state["policy_version"] == 3
    assert [r["policy_version"] for _, r in sink.records] == [1.0, 2.0, 2.0, 3.0, 3.0]
    assert all("perf/weight_sync_s" in r for s, r in sink.records if s % 2 == 0)
    assert not any("perf/weight_sync_s" in r for s, r in sink.records if s % 2 == 1)


def test_the_step_time_splits_into_the_tail_the_take_the_learners_call_the_finish_and_the_sync(tmp_path):
    """`perf/step_s` = the previous step's tail (callbacks, metrics, logging) + `perf/take_s` (the rollout wait in
    it) + `perf/train_call_s` + `perf/finish_step_s` + `perf/weight_sync_s`: each part is timed where it runs."""
    import time

    loop, _, sink = make_loop(tmp_path, horizon=4)
    take, train, sync, finish = loop.queue.take, loop.learners.train_step, loop.weights.sync, loop.queue.finish_step

    async def slow_take(*args):
        await asyncio.sleep(0.01)
        return await take(*args)

    async def slow_train(refs):
        await asyncio.sleep(0.05)
        return await train(refs)

    async def slow_sync(version):
        started = time.perf_counter()
        await asyncio.sleep(0.02)
        version, _ = await sync(version)
        return version, {"perf/weight_sync_s": time.perf_counter() - started}

    def slow_step_end(*args, **kwargs):
        time.sleep(0.04)  # a callback's work at the end of the step: the next step's tail

    async def slow_finish(*args):
        await asyncio.sleep(0.03)  # a busy queue actor answering late
        return await finish(*args)

    loop.queue.take, loop.learners.train_step, loop.weights.sync = slow_take, slow_train, slow_sync
    loop.queue.finish_step = slow_finish
    loop.callbacks[0].on_step_end = slow_step_end
    run(loop)
    records = [record for _, record in sink.records]
    assert "perf/step_tail_s" not in records[0] and records[0]["perf/train_call_s"] >= 0.05
    for record in records[1:]:
        assert record["perf/step_tail_s"] >= 0.04 and record["perf/take_s"] >= 0.01
        assert record["perf/train_call_s"] >= 0.05 and record["perf/take_s"] >= record["perf/rollout_wait_s"]
        assert record["perf/finish_step_s"] >= 0.03
        parts = sum(record[f"perf/{p}_s"] for p in ("step_tail", "take", "train_call", "finish_step", "weight_sync"))
        assert parts <= record["perf/step_s"] < parts + 0.03  # what is left: a few lines between the parts


def test_logging_window_and_save_cadence(tmp_path):
    loop, journal, sink = make_loop(tmp_path, horizon=5, logging_steps=2, save_steps=2)
    run(loop)
    assert [s for s, _ in sink.records] == [2, 4, 5]  # the last, partial window is logged too
    first = sink.records[0][1]
    assert {"perf/rollout_wait_s", "perf/step_s", "policy_version", "loss", "reward", "rollout/queue_size"} <= set(
        first
    )
    saves = [e for e in journal if e.startswith("on_save")]
    assert saves == ["on_save:checkpoint-2", "on_save:checkpoint-4", "on_save:checkpoint-5"]  # 5: the final model
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4", "checkpoint-5"]


def test_the_start_up_phases_are_logged_with_the_first_step_only_and_never_checkpointed(tmp_path):
    loop, _, sink = make_loop(tmp_path, horizon=3, save_steps=2)
    loop.run_state["startup_s"] = {"ray": 1.5, "engines": 12.0, "total": 30.0}  # as the Cluster leaves them
    state = run(loop)
    first, *rest = [record for _, record in sink.records]
    assert (first["perf/startup/ray_s"], first["perf/startup/engines_s"], first["perf/startup/total_s"]) == (
        1.5,
        12.0,
        30.0,
    )
    assert not any(key.startswith("perf/startup/") for record in rest for key in record)
    assert "startup_s" not in state
    assert "startup_s" not in (tmp_path / "checkpoint-2" / "trainer_state.json").read_text()


def test_stops_at_max_steps_and_resumes_from_a_step(tmp_path):
    loop, journal, _ = make_loop(tmp_path, horizon=4)
    state = run(loop, start_step=2, version=3)
    assert state["global_step"] == 4 and state["policy_version"] == 5 and journal.count("train") == 2
    assert loop.queue.finished == [10, 10]


def test_an_exhausted_stream_ends_the_run_and_the_final_model_is_saved(tmp_path):
    loop, journal, sink = make_loop(tmp_path, horizon=None, num_samples=3)
    state = run(loop)
    assert state["global_step"] == 3 and journal.count("train") == 3
    assert state["queue"]["done"]
    assert journal[-2:] == ["on_save:checkpoint-3", "on_train_end"]  # max_steps=-1: saved anyway
    assert loop.fleet.checks == [42.0]  # the empty poll checked the fleet with the hang limit


def test_a_token_target_takes_several_samples_per_step(tmp_path):
    loop, _, _ = make_loop(tmp_path, horizon=2, tokens_per_step=25)
    run(loop)
    assert [len(refs) for refs in loop.learners.trained] == [3, 3] and loop.queue.finished == [30, 30]


class ComposingQueue(FakeQueue):
    """A queue that composes steps: one sample per take; once `step_size` samples are out, a take says the step is
    full (with no sample: the next one opens the next step) until `finish_step`."""

    def __init__(self, journal, num_samples, step_size):
        super().__init__(journal, num_samples=num_samples)
        self.step_size, self.in_step = step_size, 0

    async def take(self, token_target, timeout_s):
        if self.in_step == self.step_size:
            return Taken(step_full=True)
        taken = await super().take(token_target, timeout_s)
        self.in_step += len(taken.refs)
        return taken

    async def finish_step(self, tokens, unplanned=0):
        self.in_step = 0
        await super().finish_step(tokens, unplanned)


def test_a_composed_step_takes_until_the_queue_says_it_is_full_then_a_short_last_step(tmp_path):
    loop, journal, _ = make_loop(tmp_path, horizon=None, tokens_per_step=10**6)
    loop.settings = StepSettings(horizon=None, tokens_per_step=10**6, composed=True, hang_timeout_s=42.0, poll_s=0.0)
    loop.queue = ComposingQueue(journal, num_samples=8, step_size=3)
    state = run(loop)
    assert [len(refs) for refs in loop.learners.trained] == [3, 3, 2]  # not the token target: the queue's steps
    assert state["global_step"] == 3 and loop.queue.finished == [30, 30, 20]


def test_a_sample_count_per_step(tmp_path):
    loop, _, _ = make_loop(tmp_path, horizon=2, tokens_per_step=1, samples_per_step=4)
    run(loop)
    assert [len(refs) for refs in loop.learners.trained] == [4, 4]
    assert loop.queue.unplanned == [0, 0]


def test_the_samples_no_rank_trained_are_reported_to_the_queue_with_the_step(tmp_path):
    """A short tail the learners' planner could place in no row (`batch/unplanned_count`, docs/algorithms.md
    §4.5.2) is counted by the queue at `finish_step`, not left counted as trained."""
    loop, _, sink = make_loop(tmp_path, horizon=2, tokens_per_step=1, samples_per_step=3)

    async def train_step(refs):
        return [("loss", 0.5), ("batch/unplanned_count", float(len(refs) - 2))]  # two ranks, one row each

    loop.learners.train_step = train_step
    run(loop)
    assert loop.queue.unplanned == [1, 1]
    assert [r["batch/unplanned_count"] for _, r in sink.records] == [1.0, 1.0]


def test_a_fleet_health_failure_is_raised_with_its_message_and_sinks_are_closed(tmp_path):
    loop, journal, sink = make_loop(
        tmp_path, fleet_error="rollout actor 1 failed: ZeroDivisionError: boom", empty_polls=1
    )
    with pytest.raises(RuntimeError, match="rollout actor 1 failed: ZeroDivisionError: boom"):
        run(loop)
    assert sink.closed and "train" not in journal and "on_train_end" not in journal


def test_a_learner_error_propagates_and_sinks_are_closed(tmp_path):
    loop, journal, sink = make_loop(tmp_path, horizon=3, fail_at=2)
    with pytest.raises(RuntimeError, match="learner rank 0 failed"):
        run(loop)
    assert sink.closed and [s for s, _ in sink.records] == [1] and not list(tmp_path.glob("checkpoint-*"))


def test_a_callback_stops_training_and_the_final_model_is_saved(tmp_path):
    loop, journal, sink = make_loop(tmp_path, horizon=10, stop_at=2)
    state = run(loop)
    assert state["global_step"] == 2 and journal.count("train") == 2
    assert "on_save:checkpoint-2" in journal
    saved = json.loads((tmp_path / "checkpoint-2" / "trainer_state.json").read_text())
    assert saved["global_step"] == 2 and saved["policy_version"] == 2


def test_no_final_save_when_the_last_step_was_just_saved_or_nothing_was_trained(tmp_path):
    loop, journal, _ = make_loop(tmp_path, horizon=2, save_steps=1)
    run(loop)
    assert [e for e in journal if e.startswith("on_save")] == ["on_save:checkpoint-1", "on_save:checkpoint-2"]
    loop, journal, _ = make_loop(tmp_path / "resumed", horizon=2)
    run(loop, start_step=2)  # already at the horizon: nothing trained, nothing saved
    assert "train" not in journal and not any(e.startswith("on_save") for e in journal)


def test_a_checkpoint_keeps_num_tokens_and_the_log_history_for_a_resumed_run(tmp_path):
    """trainer_state.json holds the forwarded-token count and the logged records, so a resumed run's `num_tokens`
    continues instead of restarting at 0 and its TrainerState.log_history keeps the earlier steps."""
    import json

    from rlasync.driver.checkpoint import resumed_trainer_state
    from rlasync.metrics.perf import StepPerf

    async def train_step(refs):
        return [("loss", 0.5), ("batch/forwarded_tokens_per_step", 64.0)]

    loop, _, sink = make_loop(tmp_path, horizon=2, save_steps=2)
    loop.learners.train_step = train_step
    run(loop)
    logged = [record["num_tokens"] for _, record in sink.records if "num_tokens" in record]
    assert len(logged) == 2 and logged[1] > logged[0] > 0
    saved = json.loads((tmp_path / "checkpoint-2" / "trainer_state.json").read_text())
    assert saved["num_tokens"] == logged[-1] and [r["step"] for r in saved["log_history"]] == [1, 2]
    resumed = resumed_trainer_state(tmp_path / "checkpoint-2")
    assert resumed == {"num_tokens": logged[-1], "log_history": saved["log_history"]}
    assert resumed_trainer_state(None) == {} and resumed_trainer_state(tmp_path / "missing") == {}

    again, _, sink2 = make_loop(tmp_path / "resumed", horizon=3)
    again.learners.train_step = train_step
    again.perf = StepPerf(num_tokens=resumed["num_tokens"])
    run(again, start_step=2, version=3)
    assert [record["num_tokens"] for _, record in sink2.records if "num_tokens" in record] == [logged[-1] + 64.0]


def test_a_step_takes_a_sample_per_learner_rank_and_a_shorter_last_take_is_counted_unplanned(tmp_path):
    """Two learner ranks (`min_samples=2`): a step of a token target a single sample reaches still takes one per
    rank (one row each, docs/algorithms.md §4.5.2); the stream's last sample, alone, is trained by no rank: the
    queue counts it unplanned and the last window logs it, instead of a learner error (or a silent loss)."""
    loop, journal, sink = make_loop(tmp_path, horizon=None, num_samples=5, tokens_per_step=10)
    loop.settings = dataclasses.replace(loop.settings, min_samples=2)
    state = run(loop)
    assert [len(refs) for refs in loop.learners.trained] == [2, 2] and state["global_step"] == 2
    assert loop.queue.unplanned == [0, 0, 1] and loop.queue.finished == [20, 20, 10]
    assert sink.records[-1][1]["batch/unplanned_count"] == 1.0
    assert journal.count("train") == 2 and journal[-1] == "on_train_end"
