"""AsyncDistillationTrainer end to end on the shared Ray local cluster (CPU): a tiny random student distils a
different tiny random teacher (same tokenizer, a sharper output head) hosted by a TeacherScorer; the run finishes,
logs a finite `jsd`, changes the weights, removes every actor, and lowers the JSD on a fixed batch."""

import json
import math

import numpy as np
import pytest

from tests.integration.tiny_runs import tiny_distill_config

pytestmark = pytest.mark.integration

K = 4


@pytest.fixture(scope="module")
def teacher_dir(tiny_model_dir, tmp_path_factory):
    """Same architecture and tokenizer as the student, another seed, and a head scaled up so the teacher's
    next-token distributions are peaked (a target the student is far from)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = tmp_path_factory.mktemp("tiny_teacher")
    torch.manual_seed(1)
    teacher = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_model_dir))
    with torch.no_grad():
        teacher.lm_head.weight.mul_(40.0)
    teacher.save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(path)
    return str(path)


def fixed_rows(teacher_path, prompts, completion_len=8):
    """The dataset's rendered prompts with random completions (what the untrained student samples: near-uniform
    tokens), and the teacher's top-K (+ realised token) log-probs computed here from its full logits."""
    import torch
    from transformers import AutoTokenizer

    from rlasync.algorithms.distill.batching import collate_rows
    from rlasync.algorithms.distill.learner_step import distill_row_tensors
    from rlasync.algorithms.distill.samples import DistillationSample
    from rlasync.data.prompts import render_prompt
    from rlasync.model import load_model

    teacher = load_model(teacher_path)
    tokenizer = AutoTokenizer.from_pretrained(teacher_path)
    rng = np.random.default_rng(0)
    samples = []
    for i, prompt in enumerate(prompts):
        prompt_ids = render_prompt(tokenizer, prompt, None)
        ids = np.r_[prompt_ids, rng.integers(5, teacher.config.vocab_size, completion_len)]
        n, prompt_len = len(ids), len(prompt_ids)
        with torch.no_grad():
            lps = torch.log_softmax(teacher(input_ids=torch.as_tensor(ids)[None]).logits[0].double(), -1).numpy()
        top_ids, top_lps = np.full((n, K + 1), -1), np.full((n, K + 1), -np.inf)
        for j in range(prompt_len, n):
            order = np.argsort(-lps[j - 1])[:K].tolist()
            if ids[j] not in order:
                order.append(int(ids[j]))
            top_ids[j, : len(order)], top_lps[j, : len(order)] = order, lps[j - 1, order]
        mask = np.r_[np.zeros(prompt_len, np.int8), np.ones(completion_len, np.int8)]
        samples.append(DistillationSample(ids, mask, top_ids, top_lps, prompt_id=i))
    return [distill_row_tensors(collate_rows([samples], pad_token_id=0), 0)]


def jsd_of(model_path, rows):
    from rlasync.algorithms.distill.learner_step import evaluate_jsd
    from rlasync.algorithms.distill.loss import DistillLossConfig
    from rlasync.model import load_model

    return evaluate_jsd(load_model(model_path), rows, DistillLossConfig())


def alive(actor_ids):
    from ray._private.state import actors

    assert actor_ids, "the trainer recorded no actors"
    states = {actor_id: info["State"] for actor_id, info in actors().items()}
    return [i for i in actor_ids if states.get(i, "DEAD") != "DEAD"]


STEPS = 12
# At learning_rate 5e-2 the on-policy JSD oscillated step to step and one loaded CI run ended with the held-out JSD
# at 0.99 of its start; at 1e-2 eight runs (one with both cores busy) ended at 0.63-0.68 of it, on-policy 0.66-0.73.


def test_distillation_run_lowers_the_jsd_to_the_teacher(ray_cluster, tiny_model_dir, teacher_dir, tmp_path):
    from rlasync import AsyncDistillationTrainer
    from rlasync.data import arithmetic_dataset

    args = tiny_distill_config(tmp_path, max_steps=STEPS, teacher_top_k=K)
    dataset = arithmetic_dataset(64, seed=0)
    trainer = AsyncDistillationTrainer(
        model=tiny_model_dir, args=args, train_dataset=dataset, teacher_model=teacher_dir
    )
    state = trainer.train()
    assert state["global_step"] == STEPS and state["policy_version"] == STEPS + 1  # cold sync + one per step
    assert alive(trainer.actor_ids) == []

    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    jsd = [r["jsd"] for r in records if "jsd" in r]
    assert len(jsd) == STEPS and all(math.isfinite(v) and v > 0 for v in jsd)
    keys = set().union(*records)
    for key in (
        "entropy",
        "teacher_entropy",
        "grad_norm",
        "rollout/score_s",
        "completions/mean_length",
        "batch/row_imbalance",
        "sample/staleness_mean",
        "perf/step_s",
    ):
        assert key in keys, f"missing {key}; have {sorted(keys)}"

    final = tmp_path / f"checkpoint-{STEPS}"
    assert (final / "rollout_state.json").is_file() and (final / "optimizer.pt").is_file()
    import torch
    from safetensors.torch import load_file

    before, after = load_file(f"{tiny_model_dir}/model.safetensors"), load_file(str(final / "model.safetensors"))
    assert any(not torch.equal(before[k], after[k]) for k in before)

    rows = fixed_rows(teacher_dir, [dataset[i]["prompt"] for i in range(8)])
    jsd_before, jsd_after = jsd_of(tiny_model_dir, rows), jsd_of(str(final), rows)
    # both the on-policy JSD the learner trained on and the JSD on fixed teacher-scored rows fall (see STEPS)
    assert np.mean(jsd[-3:]) < 0.85 * np.mean(jsd[:3]), jsd
    assert jsd_after < 0.85 * jsd_before, (jsd_before, jsd_after, jsd)


def test_two_teachers_route_by_column_and_a_run_resumes(ray_cluster, tiny_model_dir, teacher_dir, tmp_path):
    """MOPD through the actors: rows name their teacher (`teacher_id`), both TeacherScorers score, the learner logs
    per-teacher metrics; then the run resumes from its checkpoint at its step and policy version."""
    from rlasync import AsyncDistillationTrainer
    from rlasync.data import arithmetic_dataset

    rows = arithmetic_dataset(32, seed=1)
    dataset = [{**rows[i], "teacher_id": "sharp" if i % 2 else "student_like"} for i in range(len(rows))]

    def config(max_steps):  # the tiny run's cluster: its default CPU requests fit student + 2 teachers on 2 CPUs
        return tiny_distill_config(
            tmp_path,
            max_steps=max_steps,
            max_completion_length=6,
            token_budget=160,
            save_steps=2,
            max_staleness=1,
            teacher_top_k=K,
        )

    teachers = {"student_like": tiny_model_dir, "sharp": teacher_dir}
    trainer = AsyncDistillationTrainer(
        model=tiny_model_dir, args=config(2), train_dataset=dataset, teacher_model=teachers
    )
    state = trainer.train()
    assert state["global_step"] == 2 and alive(trainer.actor_ids) == []
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    fractions = {
        teacher: sum(r.get(f"teacher_token_frac/{teacher}", 0.0) for r in records) / len(records)
        for teacher in teachers
    }
    assert all(0.0 < f < 1.0 for f in fractions.values()), fractions  # both teachers scored part of every step
    assert sum(fractions.values()) == pytest.approx(1.0)
    # the sharp teacher is far from the student, the student-like one is the student itself (jsd ~ 0 early on); each
    # teacher's first logged value (a step's batch is what arrived first: one teacher's samples alone at times, as
    # seen on a loaded CI machine, so the two may come from different steps)
    first = {
        teacher: next(r[f"teacher_jsd/{teacher}"] for r in records if f"teacher_jsd/{teacher}" in r)
        for teacher in teachers
    }
    assert first["sharp"] > 10 * max(first["student_like"], 1e-6), first

    resumed = AsyncDistillationTrainer(
        model=tiny_model_dir, args=config(3), train_dataset=dataset, teacher_model=teachers
    )
    state = resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert state["global_step"] == 3 and state["policy_version"] == 3 + 1 + 1  # saved version 3, cold sync, one step
    assert alive(resumed.actor_ids) == []


def test_distillation_with_max_staleness_zero_runs_synchronously(ray_cluster, tiny_model_dir, teacher_dir, tmp_path):
    """max_staleness=0 (docs/algorithms.md §2.3.4) for distillation: each version generates its step's samples, the
    run finishes and nothing is dropped as stale."""
    from rlasync import AsyncDistillationTrainer
    from rlasync.data import arithmetic_dataset

    args = tiny_distill_config(tmp_path, max_steps=3, max_staleness=0, teacher_top_k=K)
    trainer = AsyncDistillationTrainer(
        model=tiny_model_dir, args=args, train_dataset=arithmetic_dataset(64, seed=0), teacher_model=teacher_dir
    )
    assert trainer.train()["global_step"] == 3
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert sum(r.get("sample/dropped_stale_count", 0) for r in records) == 0
    assert all(r["sample/staleness_max"] == 0 for r in records if r.get("sample/staleness_max") is not None)
    assert alive(trainer.actor_ids) == []
