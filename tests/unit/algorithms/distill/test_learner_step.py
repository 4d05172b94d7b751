"""DistillLearnerStep / DistillScorer: padding-free rows -> distillation loss -> one optimizer step (CPU, tiny Qwen3),
checked against a slow reference computed from the model's full logits of each sample on its own."""

import math

import numpy as np
import pytest
import torch

from rlasync.algorithms.distill.batching import FixedCountBatcher, collate_rows
from rlasync.algorithms.distill.learner_step import DistillLearnerStep, DistillScorer, distill_row_tensors, evaluate_jsd
from rlasync.algorithms.distill.loss import DistillLossConfig
from rlasync.algorithms.distill.samples import DistillationSample
from rlasync.config.kernels import KernelSettings
from rlasync.learner import OptimizerSettings, build_optimizer
from rlasync.model import enable_tree_attention

VOCAB = 64
K = 4


def tiny_model(seed=0):
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    return enable_tree_attention(AutoModelForCausalLM.from_config(config))


def make_sample(rng, prompt_id, prompt_len, completion_len, teacher_logits=None):
    """A sample whose teacher candidates are the top-K of a random full distribution (total mass < 1), with the
    realised token appended as the K+1-th candidate when it is outside the top-K."""
    n = prompt_len + completion_len
    ids = rng.integers(0, VOCAB, n)
    top_ids = np.full((n, K + 1), -1, np.int64)
    top_lps = np.full((n, K + 1), -np.inf, np.float32)
    for j in range(prompt_len, n):
        logits = rng.normal(size=VOCAB) * 2 if teacher_logits is None else teacher_logits
        lps = torch.log_softmax(torch.as_tensor(logits, dtype=torch.float64), -1).numpy()
        order = np.argsort(-lps)[:K].tolist()
        if ids[j] not in order:
            order.append(int(ids[j]))
        top_ids[j, : len(order)] = order
        top_lps[j, : len(order)] = lps[order]
    mask = np.r_[np.zeros(prompt_len, np.int8), np.ones(completion_len, np.int8)]
    return DistillationSample(ids, mask, top_ids, top_lps, prompt_id=prompt_id)


def reference_loss(model, samples, global_n_tokens, temperature=1.0, grad_accum_steps=1, device="cpu"):
    """Σ over samples and completion positions of forward KL(T‖S) on the K+1 support plus the tail bucket, from
    each sample's full logits (ordinary forward, one sample at a time), float64, / max(n_tokens, 1) / GA."""
    total = torch.zeros((), dtype=torch.float64)
    count = 0
    for sample in samples:
        ids = torch.as_tensor(sample.input_ids, device=device)
        logits = model(input_ids=ids[None], use_cache=False).logits[0].double().cpu()
        logp = torch.log_softmax(logits / temperature, -1)
        for j in range(1, len(sample)):
            if not sample.completion_mask[j]:
                continue
            valid = sample.teacher_topk_ids[j] != -1
            cand = torch.as_tensor(sample.teacher_topk_ids[j][valid])
            t = torch.as_tensor(sample.teacher_topk_logprobs[j][valid], dtype=torch.float64)
            s = logp[j - 1, cand]
            t = torch.cat([t, torch.log1p(-t.exp().sum())[None]])
            s = torch.cat([s, torch.log1p(-s.exp().sum())[None]])
            total = total + (t.exp() * (t - s)).sum()
            count += 1
    return total / max(global_n_tokens, 1) / grad_accum_steps, count


def rows_for(samples, num_ranks=1, device="cpu"):
    batch = collate_rows([samples] if num_ranks == 1 else samples, pad_token_id=0)
    return [distill_row_tensors(batch, rank, torch.device(device)) for rank in range(num_ranks)], batch


CUDA = pytest.param(
    "cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
)


@pytest.mark.parametrize("device", ["cpu", CUDA])
def test_packed_row_loss_and_gradient_match_the_per_sample_full_logits_reference(device):
    """On CUDA the row goes through the FlexAttention tree backend (a forest: one tree per sample)."""
    rng = np.random.default_rng(0)
    model = tiny_model().to(device)
    samples = [make_sample(rng, 0, 5, 6), make_sample(rng, 1, 3, 4), make_sample(rng, 2, 7, 1)]
    (row,), batch = rows_for(samples, device=device)
    assert row.num_tokens == 26 and row.subtree_end.tolist() == [11] * 11 + [18] * 7 + [26] * 8
    n_tokens = float(batch["global_n_tokens"][0])
    assert n_tokens == 11

    scorer = DistillScorer(model)
    loss, stats = scorer(row, DistillLossConfig(chunk_size=4))  # several chunks
    loss.backward()
    grad = model.lm_head.weight.grad.clone()
    model.zero_grad()
    expected, count = reference_loss(model, samples, n_tokens, device=device)
    expected.backward()

    assert count == 11 and float(stats[3]) == 11  # every completion position has teacher signal
    torch.testing.assert_close(loss.double().cpu(), expected, rtol=1e-5, atol=1e-6)
    assert float(stats[0]) / float(stats[3]) == pytest.approx(float(expected.detach()) * n_tokens / count, rel=1e-5)
    atol = 1e-7 if device == "cpu" else 1e-6  # CUDA kernels reduce in another order
    torch.testing.assert_close(grad.double(), model.lm_head.weight.grad.double(), rtol=1e-4, atol=atol)


def test_padding_is_stripped_and_rows_split_the_normaliser_over_ranks():
    rng = np.random.default_rng(1)
    model = tiny_model()
    a, b = make_sample(rng, 0, 4, 5), make_sample(rng, 1, 2, 2)
    rows, batch = rows_for([[a], [b]], num_ranks=2)
    assert rows[1].num_tokens == 4 and batch["input_ids"].shape == (2, 9)  # rank 1's row was padded to 9
    scorer = DistillScorer(model)
    config = DistillLossConfig()
    with torch.no_grad():
        loss_b, _ = scorer(rows[1], config, num_processes=2, grad_accum_steps=2)
        ref_b, _ = reference_loss(model, [b], global_n_tokens=7 / 2, grad_accum_steps=2)
    torch.testing.assert_close(loss_b.double(), ref_b, rtol=1e-5, atol=1e-6)


def test_temperature_divides_the_student_logits():
    rng = np.random.default_rng(2)
    model = tiny_model()
    sample = make_sample(rng, 0, 3, 5)
    (row,), _ = rows_for([sample])
    with torch.no_grad():
        loss, _ = DistillScorer(model)(row, DistillLossConfig(teacher_temperature=2.0))
        expected, _ = reference_loss(model, [sample], 5, temperature=2.0)
        plain, _ = reference_loss(model, [sample], 5)
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-6)
    assert abs(float(expected) - float(plain)) > 1e-4


def test_no_teacher_signal_still_touches_every_parameter_and_logs_nan():
    model = tiny_model()
    ids = np.arange(6)
    mask = np.r_[np.zeros(3, np.int8), np.ones(3, np.int8)]
    empty = DistillationSample(ids, mask, np.full((6, K + 1), -1), np.full((6, K + 1), -np.inf), prompt_id=0)
    (row,), _ = rows_for([empty])
    loss, stats = DistillScorer(model)(row, DistillLossConfig())
    loss.backward()
    assert float(loss.detach()) == 0.0 and float(stats.abs().sum()) == 0.0
    assert all(p.grad is not None for p in model.parameters())  # gradient sync would touch every parameter
    model.zero_grad(set_to_none=True)
    assert "jsd" not in make_step(model).step([row])  # NaN: dropped from the record (docs/algorithms.md §9.3)
    assert math.isnan(make_step(model).step([row], rate_pairs=True)["jsd"])  # kept for the rank reduction


def make_step(model, lr=1e-2, max_steps=10, **kwargs):
    optimizer, scheduler = build_optimizer(
        model, OptimizerSettings(learning_rate=lr, lr_scheduler_type="linear", max_steps=max_steps)
    )
    return DistillLearnerStep(model, optimizer, scheduler, DistillLossConfig(), **kwargs)


def test_steps_lower_the_jsd_to_a_fixed_teacher_and_report_metrics():
    rng = np.random.default_rng(3)
    model = tiny_model()
    teacher_logits = rng.normal(size=VOCAB) * 3  # one fixed teacher distribution at every position
    samples = [make_sample(rng, i, 3, 6, teacher_logits) for i in range(4)]
    batches = FixedCountBatcher(1, 2).plan(samples)  # GA = 2 micro-batches
    rows = [distill_row_tensors(batch.collate(0), 0) for batch in batches]
    before = evaluate_jsd(model, rows, DistillLossConfig())
    step = make_step(model, lr=3e-2, max_steps=10)
    first = step.step(rows)
    for _ in range(7):
        last = step.step(rows)
    after = evaluate_jsd(model, rows, DistillLossConfig())
    assert first["jsd"] == pytest.approx(before, rel=1e-5)  # the first step's statistics are pre-update
    assert after < 0.7 * before
    assert first["batch/microbatches_per_step"] == 2.0 and first["grad_norm"] > 0
    assert math.isfinite(first["entropy"]) and math.isfinite(first["teacher_entropy"])
    assert last["learning_rate"] < first["learning_rate"]  # linear decay over max_steps


def test_multi_teacher_stats_are_reduced_and_named():
    rng = np.random.default_rng(4)
    model = tiny_model()
    a, b = make_sample(rng, 0, 3, 4).replace(teacher_id="math"), make_sample(rng, 1, 3, 2).replace(teacher_id="code")
    batch = collate_rows([[a, b]], pad_token_id=0, teacher_ids=["math", "code"])
    row = distill_row_tensors(batch, 0)
    seen = []

    def doubled(stats):  # a stand-in for a SUM all-reduce over two identical ranks
        seen.append(stats.clone())
        return stats * 2

    step = make_step(model, teacher_ids=["math", "code"], reduce_stats=doubled)
    metrics = step.step([row], rate_pairs=True)
    assert len(seen) == 1 and seen[0].shape == (4 + 3 * 2,)
    assert metrics["teacher_token_frac/math"] == (8.0, 12.0) and metrics["teacher_token_frac/code"] == (4.0, 12.0)
    assert math.isfinite(metrics["teacher_jsd/math"]) and math.isfinite(metrics["teacher_jsd/code"])


def test_a_row_planned_for_the_varlen_backend_gives_the_reference_loss(monkeypatch):
    """The distillation row's segment plan is made on the host (`segments=True`) and the varlen tree attention
    (its reference loop on the CPU) gives the per-sample reference loss."""
    import rlasync.model.segment_attention as segments

    plans = []
    loop = segments.reference_segment_attention
    monkeypatch.setattr(
        segments, "reference_segment_attention", lambda q, k, v, plan, *a: plans.append(plan) or loop(q, k, v, plan, *a)
    )
    rng = np.random.default_rng(1)
    model = tiny_model()
    samples = [make_sample(rng, 0, 5, 6), make_sample(rng, 1, 3, 4), make_sample(rng, 2, 7, 1)]
    batch = collate_rows([samples], pad_token_id=0)
    row = distill_row_tensors(batch, 0, torch.device("cpu"), segments=True)
    assert row.segments is not None and row.segments.num_segments == 3
    assert distill_row_tensors(batch, 0, torch.device("cpu")).segments is None  # planned only when asked
    loss, _ = DistillScorer(model, KernelSettings(tree_attention="varlen"))(row, DistillLossConfig(chunk_size=4))
    expected, _ = reference_loss(model, samples, float(batch["global_n_tokens"][0]))
    torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-6)
    assert plans and all(plan is row.segments for plan in plans)  # every layer used the host-made plan
