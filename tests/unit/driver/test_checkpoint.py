"""Checkpointer: checkpoint-N written through a .tmp folder, the resume point (newest complete checkpoint),
save_total_limit pruning; and the metrics file of a resumed run keeps one record per step."""

import asyncio
import json
import logging

import pytest

from rlasync.driver import Checkpointer
from rlasync.driver.checkpoint import read_step
from rlasync.metrics.sinks import JsonlSink


class Queue:
    async def rollout_state(self):
        return {"prompt_index": 7, "model_version": 3}


class Learners:
    def __init__(self, fail=False):
        self.fail, self.saw = fail, []

    async def save(self, directory, tokenizer):
        self.saw.append(directory)
        from pathlib import Path

        assert (Path(directory) / "rollout_state.json").is_file()  # written before the model, as TRL does
        if self.fail:
            raise RuntimeError("disk full")
        (Path(directory) / "model.safetensors").write_text("weights")


def save(checkpointer, step, learners=None, **state):
    return asyncio.run(checkpointer.save(step, {"policy_version": 3, **state}, Queue(), learners or Learners(), None))


def complete(path, step):
    path.mkdir(parents=True)
    (path / "trainer_state.json").write_text(json.dumps({"global_step": step}))


def test_a_checkpoint_is_written_under_tmp_and_renamed_when_complete(tmp_path):
    learners = Learners()
    path = save(Checkpointer(tmp_path), 4, learners)
    assert path == str(tmp_path / "checkpoint-4") and learners.saw == [str(tmp_path / "checkpoint-4.tmp")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-4"]
    assert json.loads((tmp_path / "checkpoint-4" / "rollout_state.json").read_text()) == {
        "prompt_index": 7,
        "model_version": 3,
    }
    assert json.loads((tmp_path / "checkpoint-4" / "trainer_state.json").read_text()) == {
        "policy_version": 3,
        "global_step": 4,
    }
    assert read_step(path) == 4


def test_a_failed_save_leaves_no_checkpoint_that_looks_complete(tmp_path):
    with pytest.raises(RuntimeError, match="disk full"):
        save(Checkpointer(tmp_path), 4, Learners(fail=True))
    assert not (tmp_path / "checkpoint-4").exists() and (tmp_path / "checkpoint-4.tmp").is_dir()
    save(Checkpointer(tmp_path), 4)  # a later save of the same step replaces the leftover
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-4"]


def test_resume_true_takes_the_newest_complete_checkpoint_and_logs_the_skipped_ones(tmp_path, caplog):
    complete(tmp_path / "checkpoint-2", 2)
    complete(tmp_path / "checkpoint-10", 10)  # numeric order, not text order
    (tmp_path / "checkpoint-12").mkdir()  # killed while saving (an older layout, without .tmp)
    (tmp_path / "checkpoint-14.tmp").mkdir()
    with caplog.at_level(logging.WARNING):
        assert Checkpointer(tmp_path).resume_dir(True) == str(tmp_path / "checkpoint-10")
    assert "checkpoint-12" in caplog.text


def test_resume_errors_and_plain_values(tmp_path):
    checkpointer = Checkpointer(tmp_path)
    assert checkpointer.resume_dir(None) is None and checkpointer.resume_dir(False) is None
    with pytest.raises(ValueError, match="no complete checkpoint"):
        checkpointer.resume_dir(True)
    (tmp_path / "checkpoint-3").mkdir()
    with pytest.raises(ValueError, match="no complete checkpoint"):
        checkpointer.resume_dir(True)
    with pytest.raises(ValueError, match="is not a directory"):
        checkpointer.resume_dir(str(tmp_path / "nope"))
    assert checkpointer.resume_dir(str(tmp_path / "checkpoint-3")) == str(tmp_path / "checkpoint-3")
    assert read_step(tmp_path / "checkpoint-3") == 3  # no trainer_state.json: the folder's name


def test_starting_point_of_a_fresh_and_a_resumed_run(tmp_path):
    assert Checkpointer.starting_point(None) == (None, 0, 0)
    path = save(Checkpointer(tmp_path), 6)
    state, step, version = Checkpointer.starting_point(path)
    assert (state.prompt_index, step, version) == (7, 6, 3)


def test_save_total_limit_keeps_the_newest_complete_checkpoints(tmp_path):
    checkpointer = Checkpointer(tmp_path, save_total_limit=2)
    (tmp_path / "checkpoint-1.tmp").mkdir(parents=True)  # never counted
    for step in (2, 4, 10, 12):
        save(checkpointer, step)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1.tmp", "checkpoint-10", "checkpoint-12"]


def test_a_resumed_run_does_not_duplicate_metrics_records(tmp_path):
    path = tmp_path / "metrics.jsonl"
    first = JsonlSink(path)
    for step in (1, 2, 3):  # the interrupted run logged step 3 after checkpoint-2
        first.write(step, {"loss": float(step)})
    first.close()
    resumed = JsonlSink(path, resume_step=2)
    for step in (3, 4):
        resumed.write(step, {"loss": 10.0 + step})
    resumed.close()
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4] and records[2]["loss"] == 13.0
    JsonlSink(path).close()  # a fresh run (no resume) appends, as before
    assert len(path.read_text().splitlines()) == 4
