"""The console: the progress callback rendered from a sequence of step-loop events (pure), the quiet environment,
and the CLI's end-of-run summary."""

import io
import json
from types import SimpleNamespace

import pytest

from rlasync import cli
from rlasync.console import ProgressCallback, eta_s, format_duration, progress_line, quiet_actors, run_summary


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_progress_line_has_step_eta_and_the_window_numbers():
    logs = {
        "reward": 0.8701,
        "rollout/queue_size": 4.0,
        "sample/staleness_mean": 0.375,
        "perf/step_s": 9.66,
        "loss": 1.0,
    }
    line = progress_line(10, 15, logs, elapsed_s=100.0, start_step=0)
    assert line == "step 10/15 (67%) | ETA 50s | reward 0.870 | queue 4 | stale 0.38 | step 9.7s"


def test_progress_line_without_horizon_or_numbers():
    assert progress_line(3, None, {"reward": float("nan")}, elapsed_s=65.0) == "step 3 | elapsed 1m05s"


def test_eta_counts_only_the_steps_this_process_trained():
    assert eta_s(12, 20, start_step=10, elapsed_s=30.0) == pytest.approx(15.0 * 8)  # resumed at 10: 2 steps in 30 s
    assert eta_s(10, 20, start_step=10, elapsed_s=30.0) is None
    assert eta_s(5, -1, start_step=0, elapsed_s=30.0) is None
    assert format_duration(3725) == "1h02m" and format_duration(185) == "3m05s" and format_duration(42.4) == "42s"


def _drive(callback, records, *, max_steps=6, state_as_object=False, step_s=10.0, logging_steps=2):
    """Feed the callback as the StepLoop does: on_step_begin, on_step_end, every logging_steps on_log."""
    clock = callback.clock
    args = SimpleNamespace(max_steps=max_steps)
    state = SimpleNamespace(global_step=0, max_steps=max_steps) if state_as_object else {"global_step": 0}
    for step in range(1, max_steps + 1):
        callback.on_step_begin(args, state, None)
        clock.now += step_s
        if state_as_object:
            state.global_step = step
        else:
            state["global_step"] = step
        callback.on_step_end(args, state, None)
        if step % logging_steps == 0:
            callback.on_log(args, state, None, logs=records[step // logging_steps - 1])
    callback.on_train_end(args, state, None)


@pytest.mark.parametrize("state_as_object", [False, True])
def test_plain_lines_one_per_logging_step_off_a_terminal(state_as_object):
    stream = io.StringIO()
    callback = ProgressCallback(stream, clock=Clock())
    records = [{"reward": r, "perf/step_s": 10.0} for r in (0.3, 0.6, 0.9)]
    _drive(callback, records, state_as_object=state_as_object)
    lines = stream.getvalue().splitlines()
    assert lines == [
        "step 2/6 (33%) | ETA 40s | reward 0.300 | step 10.0s",
        "step 4/6 (67%) | ETA 20s | reward 0.600 | step 10.0s",
        "step 6/6 (100%) | ETA 0s | reward 0.900 | step 10.0s",
    ]
    assert callback.bar is None and callback.last_logs == records[-1]


class FakeTTY(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_gets_one_tqdm_bar_and_disable_tqdm_turns_it_off():
    stream = FakeTTY()
    callback = ProgressCallback(stream, clock=Clock())
    _drive(callback, [{"reward": 0.5, "rollout/queue_size": 2.0}] * 3)
    text = stream.getvalue()
    assert "6/6" in text and "reward 0.500 | queue 2" in text and "\n" not in text.rstrip("\n").split("\r")[-1]
    assert callback.lines == []  # no plain lines alongside the bar
    plain = FakeTTY()
    off = ProgressCallback(plain, disable_tqdm=True, clock=Clock())
    _drive(off, [{"reward": 0.5}] * 3)
    assert off.bar is None and len(plain.getvalue().splitlines()) == 3


def test_quiet_actors_sets_only_what_the_user_did_not():
    env = {"TRANSFORMERS_VERBOSITY": "info"}
    added = quiet_actors(environ=env)
    assert env["TRANSFORMERS_VERBOSITY"] == "info" and "TRANSFORMERS_VERBOSITY" not in added
    assert env["HF_HUB_DISABLE_PROGRESS_BARS"] == "1"
    assert quiet_actors(verbose=True, environ={}) == {}


def _fake_run(tmp_path):
    out = tmp_path / "run"
    (out / "checkpoint-2").mkdir(parents=True)
    (out / "checkpoint-10").mkdir()
    rows = [{"step": 5, "reward": 0.31}, {"step": 10, "reward": 0.864, "loss": 0.1}, {"step": 10, "loss": 0.2}]
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return out


def test_run_summary_names_the_checkpoint_metrics_and_final_reward(tmp_path):
    out = _fake_run(tmp_path)
    text = run_summary(out, {"global_step": 10}, wall_s=289.0)
    assert text.splitlines()[0] == "done: 10 steps in 4m49s, final reward 0.864 (steps up to 10)"
    assert f"checkpoint  {out / 'checkpoint-10'}" in text and f"metrics     {out / 'metrics.jsonl'}" in text
    assert f"rlasync plot {out}" in text
    assert "(none written)" in run_summary(tmp_path / "empty", {}, wall_s=1.0)


def test_cli_train_ends_with_the_summary_not_a_dict(tmp_path, monkeypatch, capsys):
    out = _fake_run(tmp_path)

    class Trainer:
        def preflight(self):
            pass

        def train(self, resume_from_checkpoint=None):
            return {"global_step": 10, "policy_version": 10}

    config = SimpleNamespace(output_dir=str(out), resume_from_checkpoint=None, overwrite_output_dir=True)  # a rerun
    run = SimpleNamespace(config=config)
    monkeypatch.setattr(cli, "_build_trainer", lambda path, overrides: (run, Trainer()))
    monkeypatch.setattr("rlasync.console.quiet_actors", lambda verbose: {})  # leave this process's environment alone
    assert cli.main(["train", "run.yaml"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("done: 10 steps in ") and "final reward 0.864" in printed and "{" not in printed
    assert cli.main(["train", "run.yaml", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"output_dir": str(out), "global_step": 10, "policy_version": 10}
