"""bench/sums_e2e.py's keys computed from a synthetic metrics.jsonl (per-step and windowed records), and its command."""

import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "bench"))

import sums_e2e  # noqa: E402

STARTED = 1_000_000.0


def write_metrics(path: Path, rewards: list[float], syncs: list[float], every: int = 1) -> Path:
    """A metrics.jsonl of len(rewards) steps, one record per `every` steps holding the window's means (as the
    trainer's reduction does), step s logged at STARTED + 30 + 2 s; an evaluation record and a blank line mixed in.
    Per-step records: step 1 has no step time and a 30 s start-up wait (as the driver logs it)."""
    lines = []
    for end in range(every, len(rewards) + 1, every):
        window = range(end - every, end)
        lines.append(
            {
                "step": end,
                "time": STARTED + 30 + 2 * end,
                "reward": sum(rewards[i] for i in window) / every,
                "perf/weight_sync_s": sum(syncs[i] for i in window) / every,
                "perf/step_s": 2.0,
                "perf/rollout_wait_s": 0.5 if end <= len(rewards) // 2 else 0.1,
            }
        )
        if every == 1 and end == 1:
            lines[-1].update({"perf/step_s": None, "perf/rollout_wait_s": 30.0})
    lines.insert(3, {"eval/reward": 0.5, "time": STARTED + 99})  # no step: not a training record
    path.write_text("\n".join(json.dumps(r) for r in lines) + "\n\n")
    return path


def ramp(steps: int = 60) -> list[float]:
    """Reward 0.1 for 20 steps, then 0.95 (one dip to 0.3 at step 30)."""
    return [0.1 if s <= 20 else (0.3 if s == 30 else 0.95) for s in range(1, steps + 1)]


def test_seconds_to_reward_waits_for_a_full_window_at_the_threshold(tmp_path):
    syncs = [0.02] * 60
    syncs[41] = 0.3  # one slow sync at step 42
    records = sums_e2e.read_records(write_metrics(tmp_path / "m.jsonl", ramp(), syncs))
    assert [r["step"] for r in records] == list(range(1, 61))
    out = sums_e2e.summarize(records, STARTED)
    # steps 21-30 average (9 * 0.95 + 0.3) / 10 = 0.885 < 0.9; 22-31 = 0.885 too; 31-40 is the first window >= 0.9
    assert out["step_at_reward_0_9"] == 40
    assert out["seconds_to_reward_0_9"] == pytest.approx(30 + 2 * 40)
    assert out["weight_sync_max_s"] == pytest.approx(0.3)
    assert out["weight_sync_median_s"] == pytest.approx(0.02)
    assert out["weight_sync_max_is_per_step"] is True
    # steps 2-60 (step 1 has no step time; its 30 s start-up wait is left out): 29 waits of 0.5, 30 of 0.1
    assert out["rollout_wait_frac"] == pytest.approx((29 * 0.5 + 30 * 0.1) / 59 / 2.0)
    assert out["first_step_rollout_wait_s"] == 30.0
    assert out["last_step"] == 60 and out["seconds_total"] == pytest.approx(150)
    assert out["reward_curve"][0] == [1, 32.0, 0.1]


def test_a_run_that_never_reaches_the_threshold_says_none(tmp_path):
    records = sums_e2e.read_records(write_metrics(tmp_path / "m.jsonl", [0.5] * 30, [0.01] * 30))
    out = sums_e2e.summarize(records, STARTED)
    assert out["seconds_to_reward_0_9"] is None and out["step_at_reward_0_9"] is None
    assert sums_e2e.summarize(records, STARTED, threshold=0.5)["step_at_reward_0_5"] == 10


def test_windowed_records_weigh_each_step_and_flag_the_hidden_maximum(tmp_path):
    syncs = [0.02] * 60
    syncs[41] = 0.3
    records = sums_e2e.read_records(write_metrics(tmp_path / "m.jsonl", ramp(), syncs, every=10))
    out = sums_e2e.summarize(records, STARTED)
    assert out["step_at_reward_0_9"] == 40  # record 40 holds steps 31-40's mean 0.95
    assert out["weight_sync_max_s"] == pytest.approx(0.02 + 0.028)  # the window's mean, not the step's 0.3
    assert out["weight_sync_max_is_per_step"] is False
    assert out["rollout_wait_frac"] == pytest.approx((0.5 + 0.1) / 2 / 2.0)


def test_no_records_is_a_clear_error(tmp_path):
    (tmp_path / "m.jsonl").write_text("")
    with pytest.raises(ValueError, match="no training records"):
        sums_e2e.summarize(sums_e2e.read_records(tmp_path / "m.jsonl"), STARTED)


def test_the_command_is_the_run_file_with_engine_and_per_step_logging(tmp_path):
    torch_cmd = sums_e2e.train_command("torch", tmp_path / "t", None, [])
    assert torch_cmd[1:5] == ["-m", "rlasync", "train", str(sums_e2e.CONFIG)]
    sets = [torch_cmd[i + 1] for i, x in enumerate(torch_cmd) if x == "--set"]
    assert sets == [f"output_dir={tmp_path / 't'}", "cluster.engine=torch", "logging_steps=1"]
    vllm_cmd = sums_e2e.train_command("vllm", tmp_path / "v", 50, ["seed=1"])
    sets = [vllm_cmd[i + 1] for i, x in enumerate(vllm_cmd) if x == "--set"]
    assert "cluster.engine=vllm" in sets and "max_steps=50" in sets and sets[-1] == "seed=1"
    (kwargs,) = [s for s in sets if s.startswith("cluster.engine_kwargs=")]
    assert "kv_cache_tokens" not in kwargs  # the run file's TorchEngine kwargs are no vLLM arguments
    # two vLLM engines on a quarter of the GPU each, each with a fixed KV cache (neither sizes it by what is free)
    assert "cluster.num_generation_actors=2" in sets and "cluster.generation_num_gpus=0.25" in sets
    assert json.loads(kwargs.split("=", 1)[1])["kv_cache_memory_bytes"] > 0
    direct = sums_e2e.train_command("vllm", tmp_path / "v", None, [], vllm_kwargs={"direct_sync": True})
    (kwargs,) = [s for s in direct if s.startswith("cluster.engine_kwargs=")]
    merged = json.loads(kwargs.split("=", 1)[1])
    assert merged["direct_sync"] is True and merged["max_num_seqs"] == sums_e2e.VLLM_ENGINE_KWARGS["max_num_seqs"]
    assert " " not in kwargs  # one shell word (bench/device_runs.sh splits E2E_SETS on spaces)
    assert sums_e2e.result_key("vllm", ['vllm_kwargs={"direct_sync": true}']) == "vllm_vllm_kwargs_direct_sync_true"


def test_recompute_from_metrics_merges_under_the_engine(tmp_path):
    metrics = write_metrics(tmp_path / "m.jsonl", ramp(), [0.02] * 60)
    out = tmp_path / "sums_e2e.json"
    out.write_text(json.dumps({"torch": {"seconds_to_reward_0_9": 1.0}}))
    argv = ["--metrics", str(metrics), "--started", str(STARTED), "--engines", "vllm", "--out", str(out)]
    sums_e2e.main(argv)
    data = json.loads(out.read_text())
    assert data["torch"] == {"seconds_to_reward_0_9": 1.0}  # the other engine's numbers stay
    assert data["vllm"]["seconds_to_reward_0_9"] == pytest.approx(110) and data["vllm"]["metrics"] == str(metrics)
    with pytest.raises(SystemExit):
        sums_e2e.main(["--metrics", str(metrics), "--engines", "torch", "--out", str(out)])  # no --started


def test_a_variant_merges_beside_the_default_not_over_it():
    assert sums_e2e.result_key("torch", None) == "torch" and sums_e2e.result_key("vllm", []) == "vllm"
    assert sums_e2e.result_key("torch", ["token_budget=2048"]) == "torch_token_budget_2048"
    assert sums_e2e.result_key("torch", ["a.b=1", "c=x y"]) == "torch_a_b_1_c_x_y"


def test_a_run_past_its_budget_is_stopped_with_sigterm_and_given_time_to_save(tmp_path):
    """The budget sends SIGTERM, as a preemption would, and waits for the run to end by itself (its final
    checkpoint); a run that ignores it is killed after the grace period; one within its budget is left alone."""
    saved = tmp_path / "saved"
    graceful = (
        "import signal, sys, time, pathlib\n"
        "def stop(*_):\n"
        f"    time.sleep(0.3); pathlib.Path({str(saved)!r}).write_text('checkpoint'); sys.exit(143)\n"
        "signal.signal(signal.SIGTERM, stop)\n"
        "time.sleep(60)\n"
    )
    assert sums_e2e.run_within([sys.executable, "-c", graceful], budget_s=1.0, grace_s=30) == (143, "budget")
    assert saved.read_text() == "checkpoint"
    stubborn = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(60)\n"
    assert sums_e2e.run_within([sys.executable, "-c", stubborn], budget_s=0.5, grace_s=0.5) == (-9, "budget")
    assert sums_e2e.run_within([sys.executable, "-c", "import sys; sys.exit(3)"], budget_s=30) == (3, None)


def test_a_run_is_stopped_a_set_number_of_steps_after_it_reached_the_threshold(tmp_path):
    """`--stop-after-steps`: the metrics file is polled while the run goes; SIGTERM once the windowed reward reached
    the threshold and that many more steps were logged, not before (nor on a file not yet written)."""
    metrics = tmp_path / "metrics.jsonl"
    started = 1000.0

    def write(rewards):
        lines = [json.dumps({"step": i + 1, "time": started + i, "reward": r}) for i, r in enumerate(rewards)]
        metrics.write_text("\n".join(lines) + "\n")

    assert not sums_e2e.reached_and_ran(metrics, started, 0.9, 2, 3)  # no file yet
    write([0.1, 0.95, 0.95, 0.95, 0.95])  # the 2-step window reaches 0.9 at step 3
    assert not sums_e2e.reached_and_ran(metrics, started, 0.9, 2, 3)
    write([0.1, 0.95, 0.95, 0.95, 0.95, 0.95])
    assert sums_e2e.reached_and_ran(metrics, started, 0.9, 2, 3)
    write([0.1] * 40)
    assert not sums_e2e.reached_and_ran(metrics, started, 0.9, 2, 0)

    polls = []

    def done():  # says "done" at its third look
        polls.append(1)
        return len(polls) >= 3

    graceful = "import signal, sys, time\nsignal.signal(signal.SIGTERM, lambda *_: sys.exit(143))\ntime.sleep(60)\n"
    began = time.monotonic()
    result = sums_e2e.run_within([sys.executable, "-c", graceful], budget_s=60, grace_s=30, done=done, poll_s=0.1)
    assert result == (143, "done") and len(polls) == 3 and time.monotonic() - began < 30


def test_the_generation_sides_figures_are_summarized_when_logged(tmp_path):
    """Generated tokens/s (median) and the engine's eager-step share (mean, NaN records left out) come from the
    rollout gauges; a run without them (vLLM, or an older run) says None."""
    path = write_metrics(tmp_path / "m.jsonl", [0.5] * 6, [0.01] * 6)
    records = sums_e2e.read_records(path)
    assert sums_e2e.summarize(records, STARTED)["engine_eager_step_frac_mean"] is None
    gauges = [(9000.0, 0.5), (12000.0, float("nan")), (11000.0, 0.0), (13000.0, 0.1)]
    for record, (tokens_per_s, eager) in zip(records, gauges):
        record.update({"rollout/generated_tokens_per_s": tokens_per_s, "rollout/engine_eager_step_frac": eager})
    out = sums_e2e.summarize(records, STARTED)
    assert out["generated_tokens_per_s_median"] == pytest.approx(11500.0)
    assert out["engine_eager_step_frac_mean"] == pytest.approx(0.2)
    assert out["engine_fused_layers_frac_mean"] is None
    for record, fused in zip(records, (1.0, 0.0, 1.0, 1.0)):
        record["rollout/engine_fused_layers_frac"] = fused
    assert sums_e2e.summarize(records, STARTED)["engine_fused_layers_frac_mean"] == pytest.approx(0.75)
    assert out["engine_launch_max_s"] is None
    for record, launch in zip(records, (0.02, 0.31, float("nan"), 0.05)):
        record["rollout/engine_launch_max_s"] = launch
    assert sums_e2e.summarize(records, STARTED)["engine_launch_max_s"] == pytest.approx(0.31)


def test_gzipped_metrics_read_as_plain_ones(tmp_path):
    """bench/results/e2e/ keeps each run's metrics.jsonl gzipped; `--metrics` reads either."""
    import gzip

    path = write_metrics(tmp_path / "m.jsonl", [0.5] * 6, [0.01] * 6)
    packed = tmp_path / "m.jsonl.gz"
    packed.write_bytes(gzip.compress(path.read_bytes()))
    assert sums_e2e.read_records(packed) == sums_e2e.read_records(path) and len(sums_e2e.read_records(path)) == 6


def test_what_a_slow_sync_waited_behind_is_summarized(tmp_path):
    """The largest dispatch wait of a sync, the generation actor's loop lag and longest collection (medians over the
    steps) and its refreezes (the last count); None where a run did not log them."""
    path = write_metrics(tmp_path / "m.jsonl", [0.5] * 4, [0.01] * 4)
    records = sums_e2e.read_records(path)
    assert sums_e2e.summarize(records, STARTED)["generation_gc_refreezes"] is None
    logged = [(0.01, 0.03, 0.08, 0.0), (0.2, 0.25, 0.09, 1.0), (0.02, 0.02, 0.004, 1.0), (0.01, 0.01, 0.003, 1.0)]
    for record, (dispatch, lag, gc_max, refreezes) in zip(records, logged):
        record.update(
            {
                "perf/weight_sync_dispatch_s": dispatch,
                "perf/generation_loop_lag_max_s": lag,
                "perf/generation_gc_max_s": gc_max,
                "perf/generation_gc_refreezes": refreezes,
                "perf/learner_gc_max_s": gc_max / 2,
                "perf/learner_gc_refreezes": refreezes,
            }
        )
    out = sums_e2e.summarize(records, STARTED)
    assert out["learner_gc_max_s"] == pytest.approx(0.045) and out["learner_gc_refreezes"] == 1.0  # the largest
    assert out["weight_sync_dispatch_max_s"] == 0.2
    assert out["generation_loop_lag_max_s_median"] == pytest.approx(0.025)
    assert out["generation_gc_max_s_median"] == pytest.approx((0.08 + 0.004) / 2)
    assert out["generation_gc_refreezes"] == 1.0
    assert out["generation_cpu_frac_median"] is None  # not logged by this run


def test_the_syncs_parts_are_summarized_as_medians_and_at_the_largest_sync(tmp_path):
    path = write_metrics(tmp_path / "m.jsonl", [0.5] * 3, [0.03, 0.12, 0.04])
    records = sums_e2e.read_records(path)
    for record, (pause, dispatch) in zip(records, [(0.01, 0.005), (0.08, 0.03), (0.02, 0.006)]):
        record.update({"perf/weight_sync_pause_s": pause, "perf/weight_sync_dispatch_s": dispatch})
    parts = sums_e2e.summarize(records, STARTED)["weight_sync_parts"]
    assert parts["max_step"] == records[1]["step"]
    assert parts["pause"] == {"median_s": 0.02, "at_max_s": 0.08}
    assert parts["dispatch"] == {"median_s": 0.006, "at_max_s": 0.03}
    assert "transfer" not in parts  # not logged by this run


def test_the_steps_parts_are_summarized_as_means_from_the_second_step_with_what_they_leave_uncovered(tmp_path):
    records = sums_e2e.read_records(write_metrics(tmp_path / "m.jsonl", [0.5] * 3, [0.1, 0.1, 0.2]))
    assert sums_e2e.summarize(records, STARTED)["step_parts"] is None  # a run before the driver timed its parts
    for record, (tail, take, call) in zip(records, [(None, 30.0, 9.0), (0.1, 0.5, 1.2), (0.3, 0.2, 1.0)]):
        record.update({"perf/take_s": take, "perf/train_call_s": call, "perf/learner_step_s": call - 0.1})
        if tail is not None:
            record["perf/step_tail_s"] = tail
    parts = sums_e2e.summarize(records, STARTED)["step_parts"]
    assert parts["step"] == 2.0 and parts["take"] == pytest.approx(0.35) and parts["train_call"] == pytest.approx(1.1)
    assert parts["learner_step"] == pytest.approx(1.0) and parts["weight_sync"] == pytest.approx(0.15)
    assert parts["unaccounted"] == pytest.approx(2.0 - (0.2 + 0.35 + 1.1 + 0.15))  # the first step left out
    assert "fwd_bwd" not in parts  # not logged by this run


def test_how_busy_the_engines_the_queue_and_the_rollout_actors_were_is_summarized(tmp_path):
    """The busiest engine's, the queue actor's and the busiest rollout actor's CPU fraction and the queue's loop lag,
    medians over the steps."""
    records = sums_e2e.read_records(write_metrics(tmp_path / "m.jsonl", [0.5] * 3, [0.01] * 3))
    for record, (engine, queue, lag) in zip(records, [(0.9, 0.2, 0.01), (1.0, 0.4, 0.05), (0.7, 0.3, 0.02)]):
        record.update(
            {"perf/generation_cpu_frac": engine, "perf/queue_cpu_frac": queue, "perf/queue_loop_lag_max_s": lag}
        )
        record["rollout/actor_cpu_frac_max"] = queue + 0.5
    out = sums_e2e.summarize(records, STARTED)
    assert out["generation_cpu_frac_median"] == pytest.approx(0.9)
    assert out["queue_cpu_frac_median"] == pytest.approx(0.3)
    assert out["queue_loop_lag_max_s_median"] == pytest.approx(0.02)
    assert out["rollout_actor_cpu_frac_median"] == pytest.approx(0.8)


def test_a_previous_runs_metrics_in_the_folder_neither_stop_nor_summarize_the_new_run(tmp_path, monkeypatch):
    """A second run into the same folder: the first run's metrics.jsonl (which reached the threshold) is removed
    before the command starts, so `--stop-after-steps` waits for the new run's own records (2026-12-06: a variant
    run was stopped 2 s in by its predecessor's records)."""
    run_dir = tmp_path / "sums_torch"
    run_dir.mkdir()
    write_metrics(run_dir / "metrics.jsonl", ramp(), [0.02] * 60)
    new_run = "import time; time.sleep(0.5)"  # logs nothing and ends by itself
    monkeypatch.setattr(sums_e2e, "train_command", lambda *a, **k: [sys.executable, "-c", new_run])
    args = SimpleNamespace(
        run_root=str(tmp_path), steps=None, set=[], config="x.yaml", stop_after_steps=3, threshold=0.9, window=10,
        budget_s=30,
    )  # fmt: skip
    result = sums_e2e.run_engine(args, "torch")
    assert result["returncode"] == 0 and "stopped_by" not in result
    assert "seconds_to_reward_0_9" not in result and not (run_dir / "metrics.jsonl").exists()
