"""Checkpointer: checkpoint-N written through a .tmp folder, the resume point (newest complete checkpoint),
save_total_limit pruning; and the metrics file of a resumed run keeps one record per step."""

import asyncio
import json
import logging
from pathlib import Path

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
    (path / "model.safetensors").write_bytes(b"\x02" + b"\x00" * 7 + b"{}")  # an empty, well-formed safetensors file
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


def test_a_failed_save_leaves_no_checkpoint_that_looks_complete_and_no_partial_folder(tmp_path):
    with pytest.raises(RuntimeError, match="disk full"):
        save(Checkpointer(tmp_path), 4, Learners(fail=True))
    assert not (tmp_path / "checkpoint-4").exists() and not (tmp_path / "checkpoint-4.tmp").exists()
    (tmp_path / "checkpoint-4.tmp").mkdir()  # a leftover of a save that was killed (SIGKILL: no clean-up)
    save(Checkpointer(tmp_path), 4)  # a later save of the same step replaces the leftover
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-4"]


def test_a_save_the_disk_refuses_names_the_folder_the_space_and_the_newest_intact_checkpoint(tmp_path):
    from rlasync.driver.checkpoint import CheckpointSaveError

    save(Checkpointer(tmp_path), 2)

    class FullDisk(Learners):
        async def save(self, directory, tokenizer):
            (Path(directory) / "model.safetensors").write_text("half")
            raise RuntimeError("ray::LearnerActor.save() ...\nSafetensorError: No space left on device (os error 28)")

    with pytest.raises(CheckpointSaveError) as info:
        save(Checkpointer(tmp_path), 4, FullDisk())
    message = str(info.value)
    assert f"saving checkpoint-4 into {tmp_path} failed (SafetensorError: No space left on device" in message
    assert "GB free" in message and "GB needed (the size of checkpoint-2)" in message
    assert f"the newest intact checkpoint is {tmp_path / 'checkpoint-2'}" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2"]


def test_resume_true_takes_the_newest_complete_checkpoint_and_logs_the_skipped_ones(tmp_path, caplog):
    complete(tmp_path / "checkpoint-2", 2)
    complete(tmp_path / "checkpoint-10", 10)  # numeric order, not text order
    (tmp_path / "checkpoint-12").mkdir()  # killed while saving (an older layout, without .tmp)
    (tmp_path / "checkpoint-14.tmp").mkdir()
    with caplog.at_level(logging.WARNING):
        assert Checkpointer(tmp_path).resume_dir(True) == str(tmp_path / "checkpoint-10")
    assert "checkpoint-12" in caplog.text


def test_a_checkpoint_holds_the_run_config_when_given(tmp_path):
    checkpointer = Checkpointer(tmp_path)
    checkpointer.run_config = {"num_generations": 4, "cluster": {"num_learners": 1}}
    path = save(checkpointer, 1)
    assert json.loads((Path(path) / "run_config.json").read_text()) == checkpointer.run_config


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
