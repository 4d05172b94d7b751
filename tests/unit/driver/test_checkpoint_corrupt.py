"""Corrupt checkpoints: a truncated safetensors / optimizer.pt, or an unreadable rollout_state.json /
trainer_state.json, gives an error naming the file (before any actor starts); `resume_from_checkpoint=True` skips a
corrupt newest checkpoint for the previous readable one and says which file it skipped."""

import json
import logging
import zipfile

import pytest

from rlasync.driver import Checkpointer
from rlasync.driver.checkpoint import CorruptCheckpointError, read_step, verify_checkpoint
from rlasync.pipeline import read_rollout_state


def safetensors_bytes(num_floats=16):
    header = json.dumps({"w": {"dtype": "F32", "shape": [num_floats], "data_offsets": [0, 4 * num_floats]}}).encode()
    return len(header).to_bytes(8, "little") + header + b"\0" * (4 * num_floats)


def zip_bytes(tmp_path):
    path = tmp_path / "archive.zip"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", b"x" * 200)
    return path.read_bytes()


def make_checkpoint(path, step, tmp_path):
    path.mkdir(parents=True)
    (path / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    (path / "rollout_state.json").write_text(json.dumps({"prompt_index": 3, "model_version": step}))
    (path / "config.json").write_text("{}")
    (path / "model.safetensors").write_bytes(safetensors_bytes())
    (path / "optimizer.pt").write_bytes(zip_bytes(tmp_path))
    return path


def truncate(path, keep):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - keep] if keep > 0 else data[:-keep])


def test_a_whole_checkpoint_verifies(tmp_path):
    verify_checkpoint(make_checkpoint(tmp_path / "checkpoint-1", 1, tmp_path))


@pytest.mark.parametrize(
    "name, damage, why",
    [
        ("model.safetensors", lambda p: truncate(p, 10), "truncated"),
        ("model.safetensors", lambda p: p.write_bytes(b"\x01\x02"), "shorter than the 8-byte header"),
        ("model.safetensors", lambda p: p.write_bytes((10**9).to_bytes(8, "little") + b"{}"), "bytes of header"),
        ("optimizer.pt", lambda p: truncate(p, 30), "truncated or not a torch.save archive"),
        ("config.json", lambda p: p.write_text('{"a": '), "JSONDecodeError"),
        ("trainer_state.json", lambda p: p.write_bytes(b'{"global_st'), "JSONDecodeError"),
    ],
    ids=[
        "safetensors-truncated",
        "safetensors-stub",
        "safetensors-header",
        "optimizer-truncated",
        "config-json",
        "trainer-state-json",
    ],
)
def test_a_damaged_file_is_named_with_the_fix(tmp_path, name, damage, why):
    checkpoint = make_checkpoint(tmp_path / "checkpoint-2", 2, tmp_path)
    damage(checkpoint / name)
    with pytest.raises(CorruptCheckpointError) as info:
        Checkpointer(tmp_path).resume_dir(str(checkpoint))
    message = str(info.value)
    assert str(checkpoint / name) in message and why in message and "earlier checkpoint" in message


def test_resume_true_skips_a_corrupt_newest_checkpoint_and_names_the_file(tmp_path, caplog):
    make_checkpoint(tmp_path / "checkpoint-2", 2, tmp_path)
    newest = make_checkpoint(tmp_path / "checkpoint-4", 4, tmp_path)
    truncate(newest / "model.safetensors", 5)
    with caplog.at_level(logging.WARNING):
        assert Checkpointer(tmp_path).resume_dir(True) == str(tmp_path / "checkpoint-2")
    assert str(newest / "model.safetensors") in caplog.text
    truncate(tmp_path / "checkpoint-2" / "optimizer.pt", 30)
    with pytest.raises(CorruptCheckpointError, match="every complete checkpoint .* is corrupt"):
        Checkpointer(tmp_path).resume_dir(True)


@pytest.mark.parametrize("text", ['{"prompt_index": ', '{"model_version": 1}', '{"prompt_index": -1}', "[1, 2]"])
def test_an_unreadable_rollout_state_names_the_file(tmp_path, text):
    (tmp_path / "rollout_state.json").write_text(text)
    with pytest.raises(ValueError) as info:
        read_rollout_state(tmp_path)
    assert str(tmp_path / "rollout_state.json") in str(info.value) and "prompt_index" in str(info.value)


def test_a_trainer_state_without_a_step_is_named(tmp_path):
    (tmp_path / "trainer_state.json").write_text('{"policy_version": 3}')
    with pytest.raises(CorruptCheckpointError, match="trainer_state.json has no integer 'global_step'"):
        read_step(tmp_path)


@pytest.mark.parametrize("layout", ["no weights", "a missing shard"])
def test_a_complete_checkpoint_without_its_weights_is_named_and_skipped(tmp_path, layout):
    older = make_checkpoint(tmp_path / "checkpoint-2", 2, tmp_path)
    newer = make_checkpoint(tmp_path / "checkpoint-4", 4, tmp_path)
    (newer / "model.safetensors").unlink()
    if layout == "a missing shard":
        (newer / "model-00001-of-00002.safetensors").write_bytes(safetensors_bytes())
        index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
        (newer / "model.safetensors.index.json").write_text(json.dumps(index))
        match = "lists model-00002-of-00002.safetensors, which is missing"
    else:
        match = "no model weights: model.safetensors"
    with pytest.raises(CorruptCheckpointError, match=match):
        verify_checkpoint(newer)
    assert Checkpointer(tmp_path).resume_dir(True) == str(older)
