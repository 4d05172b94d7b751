"""bench/distill_transfer.py's CPU parts: held-out data, the exact-verifier evaluation (a fake engine, then the
built-in engine on a tiny random model), checkpoints and curves, the one-GPU distillation config."""

import asyncio
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "bench"))

import distill_transfer  # noqa: E402


def test_held_out_questions_are_distinct_and_left_out_of_training():
    held = distill_transfer.eval_rows("sums", 50)
    questions = [distill_transfer.question(r) for r in held]
    assert len(held) == 50 and len(set(questions)) == 50
    assert all(r["teacher_id"] == "sums" and " + " in distill_transfer.question(r) for r in held)
    rows = distill_transfer.train_rows(["sums", "diffs"], 3000, seed=1, held_out=held)
    assert not set(questions) & {distill_transfer.question(r) for r in rows}
    assert [r["teacher_id"] for r in rows[:4]] == ["sums", "diffs", "sums", "diffs"]  # the tasks interleaved
    assert all(" - " in distill_transfer.question(r) for r in rows if r["teacher_id"] == "diffs")
    assert all(int(r["answer"]) >= 0 for r in rows)
    with pytest.raises(ValueError, match="task 'products'"):
        distill_transfer.task_rows("products", 3, 0)


class EchoTokenizer:
    """Renders a conversation to [row index]; decodes a reply's ids as the digits they are."""

    def __init__(self, rows):
        self.index = {distill_transfer.question(r): i for i, r in enumerate(rows)}

    def apply_chat_template(self, messages, add_generation_prompt, tokenize, **kwargs):
        assert add_generation_prompt and tokenize
        return [self.index[messages[-1]["content"]]]

    def decode(self, ids, skip_special_tokens):
        return "The answer is " + "".join(str(i) for i in ids)


class KnowsEvenRows:
    """Greedy only; answers rows with an even index right, the others off by one."""

    def __init__(self, rows):
        self.rows = rows

    async def generate(self, prompt_ids, params):
        assert params.temperature == 0
        row = self.rows[prompt_ids[0]]
        answer = int(row["answer"]) + (prompt_ids[0] % 2)
        return SimpleNamespace(output_ids=[int(d) for d in str(answer)])


def test_accuracy_is_the_exact_verifiers_share():
    rows = distill_transfer.eval_rows("sums", 10)
    got = asyncio.run(distill_transfer.accuracy(KnowsEvenRows(rows), EchoTokenizer(rows), rows, max_tokens=8))
    assert got["accuracy"] == pytest.approx(0.5) and got["n"] == 10
    assert got["samples"][0][1] == f"The answer is {rows[0]['answer']}"


def test_evaluate_model_runs_the_built_in_engine_greedily(tmp_path):
    import e2e_grpo

    folder = e2e_grpo.build_random_model(tmp_path / "tiny", tiny=True, dtype="float32", device="cpu")
    rows = {"sums": distill_transfer.eval_rows("sums", 6), "diffs": distill_transfer.eval_rows("diffs", 3)}
    first = distill_transfer.evaluate_model(folder, rows, max_tokens=4)
    again = distill_transfer.evaluate_model(folder, rows, max_tokens=4)
    assert first["sums"]["n"] == 6 and first["diffs"]["n"] == 3
    assert 0.0 <= first["sums"]["accuracy"] <= 1.0
    assert first == again  # greedy: the same replies twice


def test_checkpoints_are_the_complete_ones_by_step_and_the_curve_follows_them(tmp_path):
    for step, complete in ((20, True), (5, True), (10, False)):
        folder = tmp_path / f"checkpoint-{step}"
        folder.mkdir()
        if complete:
            (folder / "trainer_state.json").write_text("{}")
    (tmp_path / "checkpoint-30.tmp").mkdir()
    assert [s for s, _ in distill_transfer.checkpoints(tmp_path)] == [5, 20]
    evaluations = {step: {"sums": {"accuracy": acc}} for step, acc in ((0, 0.1), (20, 0.85), (5, 0.4))}
    got = distill_transfer.curve(evaluations, {0: 12.34, 5: 40.0}, "sums")
    assert got == [[0, 12.3, 0.1], [5, 40.0, 0.4], [20, None, 0.85]]


@pytest.mark.parametrize("teachers", [1, 2])
def test_the_distillation_config_fits_one_gpu_and_has_no_reward(tmp_path, teachers):
    args = SimpleNamespace(steps=60, eval_every=10, learning_rate=1e-5, device="cuda")
    config = distill_transfer.distill_config(args, tmp_path, teachers)
    cluster = config.cluster
    assert cluster.learner_num_gpus + cluster.generation_num_gpus * (1 + teachers) <= 1.0 + 1e-9
    assert config.beta == 0.0 and config.save_steps == 10 and config.max_steps == 60
    assert not hasattr(config, "reward_funcs")


def test_bad_runs_and_eval_interval_are_refused(tmp_path):
    out = tmp_path / "d.json"
    with pytest.raises(SystemExit):
        distill_transfer.main(["--runs", "distill,grpo", "--out", str(out)])
    with pytest.raises(SystemExit):
        distill_transfer.main(["--steps", "5", "--eval-every", "10", "--out", str(out)])
    assert not out.exists()


def test_teachers_only_trains_the_missing_teacher_and_runs_no_distillation(tmp_path, monkeypatch):
    """`--runs teachers` (its own device call): the diffs teacher MOPD needs is trained, the given sums one is not,
    both are evaluated, and no distillation runs; the later `--runs mopd --teacher2` call then finds it."""
    trained, distilled = [], []

    def fake_train(task, steps, run_dir):
        trained.append((task, steps))
        return str(run_dir / "checkpoint-120"), 250.0

    def fake_evaluate(path, rows_by_task, max_tokens):
        return {task: {"accuracy": 0.9 if "checkpoint" in path else 0.1, "samples": []} for task in rows_by_task}

    monkeypatch.setattr(distill_transfer, "train_teacher", fake_train)
    monkeypatch.setattr(distill_transfer, "evaluate_model", fake_evaluate)
    monkeypatch.setattr(distill_transfer, "run_distill", lambda *a, **k: distilled.append(a) or {})
    out = tmp_path / "d.json"
    argv = ["--runs", "teachers", "--teacher", "/t/checkpoint-98", "--teacher-steps", "120", "--eval-prompts", "4"]
    distill_transfer.main([*argv, "--run-root", str(tmp_path), "--out", str(out)])
    assert trained == [("diffs", 120)] and distilled == []
    saved = json.loads(out.read_text())
    assert saved["teachers"]["sums"] == {"checkpoint": "/t/checkpoint-98", "trained_here": False, "accuracy": 0.9}
    assert saved["teachers"]["diffs"]["checkpoint"] == str(tmp_path / "teacher_diffs" / "checkpoint-120")
    assert saved["student_base"] == {"sums": 0.1, "diffs": 0.1}


def test_merge_keeps_earlier_runs(tmp_path):
    out = tmp_path / "d.json"
    distill_transfer.merge(out, {"distill": {"minutes": 3.0}, "minutes": 3.0})
    distill_transfer.merge(out, {"mopd": {"minutes": 5.0}})
    assert json.loads(out.read_text()) == {"distill": {"minutes": 3.0}, "minutes": 3.0, "mopd": {"minutes": 5.0}}


def test_first_reaching_and_jsd_ends():
    points = [[0, 1.0, 0.1], [10, 30.0, 0.79], [20, 50.0, 0.8], [30, 70.0, 0.9]]
    assert distill_transfer.first_reaching(points, 0.8) == [20, 50.0, 0.8]
    assert distill_transfer.first_reaching(points, 0.95) is None
    series = [[1, 0.9], [2, None], [3, 0.7], [4, 0.5], [5, 0.3]]
    assert distill_transfer.ends(series, 2) == pytest.approx((0.8, 0.4))
    assert distill_transfer.ends([[1, None]]) == (None, None)
