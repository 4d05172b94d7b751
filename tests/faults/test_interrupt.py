"""Interruption of the driver (`rlasync train` subprocesses on the tiny random Llama, each with its own local Ray).

SIGINT, SIGHUP, SIGTERM   one run folder, interrupted three times (resumed after the first two): every interruption
                          writes a complete final checkpoint, exits 128 + the signal number naming the checkpoint,
                          and the next `--resume` continues there with every step logged once
two runs, one folder      while the third run trains, a second run into its folder (fresh or --resume) is refused
                          with exit 2 naming the holder, before Ray starts; the third run is undisturbed
"""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

pytestmark = [pytest.mark.integration, pytest.mark.faults]

REPO = Path(__file__).resolve().parents[2]
MAX_STEPS = 400  # never reached: every run ends on a signal
RUN_TIMEOUT_S = 300


def write_run_file(tmp_path, model_dir, output_dir, **changes):
    run = {
        "model": model_dir,
        "dataset": {"name": "arithmetic", "size": 400, "seed": 0, "max_operand": 9},
        "reward_funcs": ["rlasync.rewards:last_number_reward"],
        "output_dir": str(output_dir),
        "max_steps": MAX_STEPS,
        "num_generations": 4,
        "max_completion_length": 8,
        "token_budget": 96,
        "learning_rate": 1e-2,
        "logging_steps": 1,
        "save_steps": 1000,
        "max_staleness": 2,
        "gradient_checkpointing": False,
        "top_k": 16,
        "seed": 0,
        "shutdown_grace_s": 90.0,  # a loaded CI machine; the grace exit itself is a unit test
        "cluster": {
            "rollout_num_cpus": 0.25,
            "generation_num_cpus": 0.5,
            "learner_num_cpus": 0.5,
            "queue_num_cpus": 0.1,
            "engine_kwargs": {"max_num_seqs": 16, "kv_cache_tokens": 2048, "max_model_len": 128},
            "collective_timeout_s": 60.0,
        },
        **changes,
    }
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(run))
    return path


def start(run_file, *extra):
    """`rlasync train RUN_FILE ...` in the background; its output goes to a file (a pipe could fill and block it)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false"}
    env.pop("RAY_ADDRESS", None)
    log = Path(run_file).with_name(f"train-{time.monotonic_ns()}.log")
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "rlasync", "train", str(run_file), *extra],
            cwd=REPO,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    proc.log = log
    return proc


def output(proc):
    return proc.log.read_text(errors="replace")


def steps_logged(output_dir):
    path = Path(output_dir) / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]


def wait_for_step(proc, output_dir, after, timeout=RUN_TIMEOUT_S):
    """Block until metrics.jsonl logs a step above `after` (the run is training); fail if the run ends first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if any(step > after for step in steps_logged(output_dir)):
            return
        if proc.poll() is not None:
            pytest.fail(f"the run ended (exit {proc.returncode}) before step {after + 1}:\n{output(proc)[-4000:]}")
        time.sleep(0.1)
    proc.kill()
    pytest.fail(f"no step above {after} within {timeout} s")


def finish(proc, timeout=RUN_TIMEOUT_S):
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"the run did not end within {timeout} s:\n{output(proc)[-4000:]}")
    return proc.returncode, output(proc)


def test_sigint_sighup_sigterm_write_a_final_checkpoint_resume_continues_and_a_second_run_is_locked_out(
    tiny_model_dir, tmp_path
):
    output_dir = tmp_path / "run"
    run_file = write_run_file(tmp_path, tiny_model_dir, output_dir)
    last = 0
    for number, sig in enumerate((signal.SIGINT, signal.SIGHUP, signal.SIGTERM)):
        proc = start(run_file, *(["--resume"] if number else []))
        wait_for_step(proc, output_dir, last)
        if sig == signal.SIGTERM:  # the third run trains: a second run into its folder is refused before Ray
            intruders = [start(run_file, *extra) for extra in ((), ("--resume",))]
            for intruder in intruders:
                code, out = finish(intruder, timeout=120)
                assert code == 2, out[-4000:]
                holder = f"is in use by another run (host {socket.gethostname()}, pid {proc.pid},"
                assert holder in out and "Started a local Ray" not in out, out[-4000:]
            assert proc.poll() is None, "the run holding the folder was disturbed"
        proc.send_signal(sig)
        sent = time.monotonic()
        code, out = finish(proc)
        took = time.monotonic() - sent
        assert code == 128 + sig, f"{sig.name}: exit {code}\n{out[-4000:]}"
        assert took < 90, f"{sig.name}: {took:.0f} s from the signal to the exit"
        steps = steps_logged(output_dir)
        assert steps == list(range(1, steps[-1] + 1)), f"{sig.name}: steps logged {steps}"  # each once, none lost
        final = output_dir / f"checkpoint-{steps[-1]}"
        assert (final / "trainer_state.json").is_file() and (final / "model.safetensors").is_file(), out[-4000:]
        assert json.loads((final / "trainer_state.json").read_text())["global_step"] == steps[-1]
        assert not list(output_dir.glob("*.tmp")), "a partial checkpoint folder was left"
        assert f"interrupted by {sig.name}" in out and str(final) in out, out[-4000:]
        assert "SIGTERM received at time" not in out, "Ray's C++ handler ran"  # its stack dump
        assert "__ray_ready__ failed" not in out, out[-4000:]  # the teardown prints nothing that reads as an error
        assert steps[-1] > last and not (output_dir / ".rlasync.lock").exists()
        last = steps[-1]
