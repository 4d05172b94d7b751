"""GrpoLearnerStep: tree-packed micro-batches -> GRPO loss -> one optimizer step (CPU, tiny Qwen3)."""

import math

import numpy as np
import pytest
import torch

from rlasync.algorithms.grpo.learner_step import GrpoLearnerStep
from rlasync.algorithms.grpo.loss import LossConfig
from rlasync.learner import OptimizerSettings, build_optimizer
from rlasync.model import enable_tree_attention, sequence_logprobs
from rlasync.packing import TokenBudgetBatcher, pack
from rlasync.rollout import RolloutSample

VOCAB = 64


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
        tie_word_embeddings=True,
    )
    return enable_tree_attention(AutoModelForCausalLM.from_config(config))


def on_policy_group(model, group_id, advantages, rng, prompt_len=6, completion_len=5, top_k=4):
    """Samples whose sampler log-probs (and top-K) are the model's own: ratio 1 at the first step."""
    prompt = rng.integers(0, VOCAB, prompt_len).tolist()
    seqs = [prompt + rng.integers(0, VOCAB, completion_len).tolist() for _ in advantages]
    with torch.no_grad():
        lps = sequence_logprobs(model, seqs, [prompt_len] * len(seqs), packing="none")
        logits = model(torch.tensor(seqs)).logits.log_softmax(-1)  # [G, L, V]
    samples = []
    for seq, lp, logit, adv in zip(seqs, lps, logits, advantages):
        n = len(seq)
        sampler = np.zeros(n, np.float32)
        sampler[prompt_len:] = lp.numpy()
        top = torch.topk(logit[:-1], top_k, dim=-1)  # row p-1 predicts token p
        ids = np.full((n, top_k), -1, np.int64)
        vals = np.full((n, top_k), -np.inf, np.float32)
        ids[1:], vals[1:] = top.indices.numpy(), top.values.numpy()
        mask = np.r_[np.zeros(prompt_len, np.int8), np.ones(completion_len, np.int8)]
        samples.append(
            RolloutSample(seq, mask, sampler, adv, group_id, sampler_topk_ids=ids, sampler_topk_logprobs=vals)
        )
    return samples


def rows_of(samples, budget=64):
    batches = TokenBudgetBatcher(num_ranks=1, token_budget=budget).plan(samples)
    return [pack(batch.rows[0]) for batch in batches]


def make_step(model, loss_config, lr=1e-2, max_grad_norm=1.0):
    optimizer, scheduler = build_optimizer(model, OptimizerSettings(learning_rate=lr, max_grad_norm=max_grad_norm))
    return GrpoLearnerStep(model, optimizer, scheduler, loss_config, max_grad_norm=max_grad_norm)


@pytest.mark.parametrize("score_centering", [True, False])
def test_a_step_changes_every_trained_parameter_and_reports_metrics(score_centering):
    model = tiny_model()
    rng = np.random.default_rng(0)
    samples = on_policy_group(model, 0, [1.0, -1.0, 0.5, -0.5], rng) + on_policy_group(model, 1, [1.0, -1.0], rng)
    rows = rows_of(samples)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    step = make_step(model, LossConfig(score_centering=score_centering))
    metrics = step.step(rows, [r.num_trained_tokens for r in rows])
    changed = [n for n, p in model.named_parameters() if not torch.equal(before[n], p.detach())]
    assert len(changed) == len(before)
    assert step.global_step == 1
    for key in ("loss", "grad_norm", "learning_rate", "entropy", "clip_ratio/region_mean", "perf/fwd_bwd_s"):
        assert key in metrics and math.isfinite(float(metrics[key])), key
    # on-policy samples: the trainer recomputes exactly the sampler's log-probs (ratio 1, nothing masked)
    assert metrics["sampling/importance_sampling_ratio/mean"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["sampling/masked_mean"] == 0.0


def test_repeated_steps_move_probability_toward_the_positive_advantage():
    model = tiny_model(1)
    rng = np.random.default_rng(1)
    good, bad = on_policy_group(model, 0, [1.0, -1.0], rng)
    rows = rows_of([good, bad])
    step = make_step(model, LossConfig(score_centering=False), lr=3e-3)

    def logp(sample):
        with torch.no_grad():
            return float(sequence_logprobs(model, [sample.input_ids.tolist()], [6], packing="none")[0].sum())

    start = logp(good) - logp(bad)
    for _ in range(5):
        step.step(rows, [r.num_trained_tokens for r in rows])
    assert logp(good) - logp(bad) > start + 0.5


def test_gradient_accumulation_averages_micro_batches_normalised_by_their_global_terms():
    """With SGD (lr 1, no clipping) the update is -1/GA x sum_i grad(sum of row i's terms / global_terms_i)."""
    model = tiny_model(2)
    rng = np.random.default_rng(2)
    rows = rows_of(on_policy_group(model, 0, [1.0, -1.0, 0.3], rng), 32) + rows_of(
        on_policy_group(model, 1, [0.7, -0.2], rng), 32
    )
    assert len(rows) >= 2
    rows = rows[:2]
    global_terms = [r.num_trained_tokens * 3 for r in rows]  # as if two more ranks held terms too
    config = LossConfig(score_centering=False)

    reference = tiny_model(2)
    from rlasync.algorithms.grpo.learner_step import GrpoLearnerStep as _Step

    ref_step = _Step(reference, torch.optim.SGD(reference.parameters(), lr=1.0), None, config, num_ranks=3)
    expected = {n: torch.zeros_like(p) for n, p in reference.named_parameters()}
    for row, terms in zip(rows, global_terms):
        reference.zero_grad()
        loss, _ = ref_step._loss(row, terms, grad_accum_steps=1)
        loss.backward()
        for n, p in reference.named_parameters():
            expected[n] += p.grad / len(rows)

    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    step = GrpoLearnerStep(model, optimizer, scheduler, config, max_grad_norm=math.inf, num_ranks=3)
    step.step(rows, global_terms)
    for n, p in model.named_parameters():
        torch.testing.assert_close(before[n] - p.detach(), expected[n], atol=1e-6, rtol=1e-5)


def test_rate_pairs_keep_the_partial_statistics_of_the_step():
    """`rate_pairs=True` (what the learner ranks reduce across ranks): rates are (Σ num, Σ den) over the step's
    micro-batches, equal to the reduced floats of the default mode; the other keys are the same."""
    model = tiny_model(4)
    rng = np.random.default_rng(4)
    rows = rows_of(on_policy_group(model, 0, [1.0, -1.0, 0.5], rng) + on_policy_group(model, 1, [0.3, -0.3], rng), 32)
    assert len(rows) >= 2
    reference = tiny_model(4)
    config = LossConfig(score_centering=False)
    floats = make_step(reference, config, lr=0.0).step(rows, [r.num_trained_tokens for r in rows])
    pairs = make_step(model, config, lr=0.0).step(rows, [r.num_trained_tokens for r in rows], rate_pairs=True)
    assert set(pairs) >= set(floats)
    assert pairs["entropy"][1] == sum(r.num_trained_tokens for r in rows)
    for key, value in pairs.items():
        if isinstance(value, tuple):
            assert value[0] / value[1] == pytest.approx(floats[key], rel=1e-6), key
        elif key in floats and not key.startswith("perf/"):
            assert value == pytest.approx(floats[key], rel=1e-6), key


def test_decaying_schedule_without_max_steps_is_refused():
    with pytest.raises(ValueError, match="max_steps"):
        build_optimizer(tiny_model(), OptimizerSettings(lr_scheduler_type="cosine"))


def test_an_fsdp2_sharded_learner_takes_exactly_the_unsharded_step(tmp_path):
    """rlasync.learner.parallel.shard_for_training (one gloo rank on CPU): same loss, same parameter update."""
    import copy

    import torch.distributed as dist

    from rlasync.learner.parallel import shard_for_training

    model = tiny_model(3)
    rows = rows_of(on_policy_group(model, 0, [1.0, -1.0, 0.5, -0.5], np.random.default_rng(3)))
    reference = copy.deepcopy(model)

    def run(module):
        optimizer = torch.optim.SGD(module.parameters(), lr=0.5)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
        step = GrpoLearnerStep(module, optimizer, scheduler, LossConfig(), max_grad_norm=math.inf)
        return step.step(rows, [r.num_trained_tokens for r in rows])

    expected = run(reference)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        scorer = shard_for_training(model)
        metrics = run(scorer)
        updated = {name: p.full_tensor() for name, p in scorer.model.named_parameters()}
    finally:
        dist.destroy_process_group()
    assert abs(metrics["loss"] - expected["loss"]) < 1e-6
    for name, p in reference.named_parameters():
        torch.testing.assert_close(updated[name], p.detach(), atol=1e-6, rtol=1e-5, msg=name)


def test_mixed_precision_step_keeps_float32_master_weights_and_follows_the_float32_step():
    """autocast_dtype=bfloat16 (the GPU default): forward and backward (the chunked head's too) in bf16, master
    weights and the update in float32. The gradient follows the float32 step's, and an update far below bf16's
    resolution still lands in the master weights (a pure-bf16 model would round it away)."""
    model32, model_mp = tiny_model(3), tiny_model(3)
    rng = np.random.default_rng(3)
    samples = on_policy_group(model32, 0, [1.0, -1.0, 0.5, -0.5], rng)
    rows = rows_of(samples)
    grads = {}
    for name, model, dtype in (("fp32", model32, None), ("mixed", model_mp, torch.bfloat16)):
        optimizer, scheduler = build_optimizer(model, OptimizerSettings(learning_rate=0.0, max_grad_norm=1e9))
        step = GrpoLearnerStep(model, optimizer, scheduler, LossConfig(), max_grad_norm=1e9, autocast_dtype=dtype)
        step.optimizer.zero_grad = lambda set_to_none=True: None  # keep the gradients to compare them
        step.step(rows, [r.num_trained_tokens for r in rows])
        grads[name] = torch.cat([p.grad.flatten() for p in model.parameters()])
        assert all(p.dtype == torch.float32 and p.grad.dtype == torch.float32 for p in model.parameters())
    cosine = torch.nn.functional.cosine_similarity(grads["fp32"], grads["mixed"], dim=0)
    assert cosine > 0.98, cosine
    assert not torch.equal(grads["fp32"], grads["mixed"])  # the bf16 compute did happen

    before = {n: p.detach().clone() for n, p in model_mp.named_parameters()}
    optimizer, scheduler = build_optimizer(model_mp, OptimizerSettings(learning_rate=1e-7))
    GrpoLearnerStep(model_mp, optimizer, scheduler, LossConfig(), autocast_dtype=torch.bfloat16).step(
        rows, [r.num_trained_tokens for r in rows]
    )
    norm = before["model.norm.weight"]  # ~1.0: bf16's step there is 2**-7, far above an Adam step of 1e-7
    moved = model_mp.model.norm.weight.detach()
    assert not torch.equal(moved, norm)
    assert torch.equal(moved.to(torch.bfloat16), norm.to(torch.bfloat16))  # invisible at bf16 resolution


def test_the_step_reads_its_losses_and_timings_once_and_they_add_up():
    """The rows queue without waiting for the device (metrics and losses are read after the last backward): the
    logged loss is still the sum of the rows' losses as computed before the update, and each row's forward time
    lies inside its forward+backward time."""
    from rlasync.algorithms.grpo.loss import grpo_loss
    from rlasync.learner.step import RowTimer
    from rlasync.model import packed_row_to_tensors, packed_token_scores

    model = tiny_model(4)
    rng = np.random.default_rng(4)
    samples = sum((on_policy_group(model, g, [1.0, -1.0, 0.5], rng) for g in range(3)), [])
    rows = rows_of(samples, budget=40)
    assert len(rows) >= 2
    terms = [r.num_trained_tokens for r in rows]
    config = LossConfig(score_centering=False)
    expected = 0.0
    with torch.no_grad():
        for row, n in zip(rows, terms):
            t = packed_row_to_tensors(row)
            scores = packed_token_scores(model, t)
            loss, _ = grpo_loss(
                scores.logprobs,
                t.sampler_logprobs,
                t.advantages,
                t.sample_index,
                config=config,
                num_tokens_global=n,
                grad_accum_steps=len(rows),
            )
            expected += float(loss)
    metrics = make_step(model, config).step(rows, terms)
    assert metrics["loss"] == pytest.approx(expected, rel=1e-5, abs=1e-7)
    assert 0 < metrics["perf/fwd_s"] <= metrics["perf/fwd_bwd_s"]
    timer = RowTimer(torch.device("cpu"))
    for _ in range(2):
        timer.start(), timer.forward_done(), timer.backward_done()
    forward, both = timer.totals()
    assert 0 <= forward <= both
