"""A run started again in the same output_dir (a notebook cell run twice, a fresh run over an old one) writes each
step once: the records after its starting step are replaced, kept aside in metrics.jsonl.replaced, with a warning."""

import json
import logging

from rlasync.metrics.sinks import JsonlSink


def _steps(path):
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_a_fresh_run_over_an_old_one_writes_each_step_once(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    first = JsonlSink(path, resume_step=0)
    for step in (1, 2, 3):
        first.write(step, {"reward": 0.1 * step})
    first.close()
    with caplog.at_level(logging.WARNING):
        again = JsonlSink(path, resume_step=0)  # the same cell, run again
    again.write(1, {"reward": 0.9})
    again.close()
    assert _steps(path) == [1] and json.loads(path.read_text())["reward"] == 0.9
    assert _steps(path.with_name("metrics.jsonl.replaced")) == [1, 2, 3]
    assert "3 records of steps after 0" in caplog.text


def test_resuming_keeps_the_steps_up_to_the_checkpoint(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"step": s, "reward": 0.0}) + "\n" for s in (1, 2, 3, 4)) + "garbage\n")
    resumed = JsonlSink(path, resume_step=2)
    resumed.write(3, {"reward": 1.0})
    resumed.close()
    lines = path.read_text().splitlines()
    assert lines[2] == "garbage" and [json.loads(x)["step"] for x in lines[:2] + lines[3:]] == [1, 2, 3]
    untouched = tmp_path / "other.jsonl"
    JsonlSink(untouched, resume_step=5).close()  # nothing later than 5: no .replaced file, no warning
    assert not (tmp_path / "other.jsonl.replaced").exists()
