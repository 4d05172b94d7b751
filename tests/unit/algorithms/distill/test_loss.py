"""The on-policy distillation loss (docs/algorithms.md §9.3, §8.4) against slow, obvious per-position references."""

from __future__ import annotations

import math

import pytest
import torch

from rlasync.algorithms.distill.loss import (
    DistillLossConfig,
    add_tail_bucket,
    distillation_loss,
    distillation_metrics,
    distillation_row_loss,
    generalized_jsd,
    narrow_support,
    num_stats,
    support_divergence,
)
from rlasync.metrics import MetricSink

NEG_INF = -math.inf
F64 = torch.float64


# ---------------------------------------------------------------------------------------------------------------
# Slow references: one position at a time, dense softmax, Python loops over the support
# ---------------------------------------------------------------------------------------------------------------


def ref_position(z, ids, t_lps, valid, beta, tail):
    """(D summed over the support, student entropy, teacher entropy) for one position; z = final logits [V]."""
    log_p = z - torch.logsumexp(z, 0)
    slots = [w for w in range(len(ids)) if bool(valid[w])]
    s = [log_p[int(ids[w])] for w in slots]
    t = [torch.as_tensor(float(t_lps[w]), dtype=z.dtype) for w in slots]
    if tail:
        s_mass = torch.logsumexp(torch.stack(s), 0).clamp_max(-1e-7)
        t_mass = torch.logsumexp(torch.stack(t), 0).clamp_max(-1e-7)
        s.append(torch.log(1 - torch.exp(s_mass)))
        t.append(torch.log(1 - torch.exp(t_mass)))
    else:
        s_norm, t_norm = torch.logsumexp(torch.stack(s), 0), torch.logsumexp(torch.stack(t), 0)
        s = [x - s_norm for x in s]
        t = [x - t_norm for x in t]
    d = z.new_zeros(())
    teacher_entropy = 0.0
    for si, ti in zip(s, t):
        ps, pt = si.exp(), ti.exp()
        teacher_entropy -= float((pt * ti).detach())
        if beta == 0:
            d = d + pt * (ti - si)
        elif beta == 1:
            d = d + ps * (si - ti)
        else:
            log_m = torch.log((1 - beta) * ps + beta * pt)
            d = d + beta * pt * (ti - log_m) + (1 - beta) * ps * (si - log_m)
    entropy = float(-(log_p.exp() * log_p).sum().detach())
    return d, entropy, teacher_entropy


def ref_loss(hidden, weight, bias, ids, t_lps, valid, beta, tau, tail, scale=1.0, softcap=None):
    total = hidden.new_zeros(())
    jsd = ent = tent = count = 0.0
    for n in range(hidden.shape[0]):
        if not bool(valid[n].any()):
            continue
        z = weight @ hidden[n]
        if bias is not None:
            z = z + bias
        z = z * scale
        if softcap is not None:
            z = softcap * torch.tanh(z / softcap)
        z = z / tau
        d, e, te = ref_position(z, ids[n], t_lps[n], valid[n], beta, tail)
        total = total + d
        jsd += float(d.detach())
        ent += e
        tent += te
        count += 1
    return total, (jsd, ent, tent, count)


def make_case(seed, n=11, hidden_size=6, vocab=13, k=4, beta=0.0, empty_rows=(3,)):
    """Random hidden states, head, and a teacher top-k (+ realised token) per position, narrowed for beta."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, hidden_size, generator=g, dtype=F64)
    weight = torch.randn(vocab, hidden_size, generator=g, dtype=F64) * 0.7
    bias = torch.randn(vocab, generator=g, dtype=F64) * 0.3
    teacher_logits = 2.0 * torch.randn(n, vocab, generator=g, dtype=F64)
    teacher_lp_full = torch.log_softmax(teacher_logits, -1)
    top = teacher_lp_full.topk(k, -1)
    actual = torch.randint(0, vocab, (n,), generator=g)
    ids = torch.full((n, k + 1), -1, dtype=torch.long)
    lps = torch.full((n, k + 1), NEG_INF, dtype=F64)
    ids[:, :k], lps[:, :k] = top.indices, top.values
    for i in range(n):
        if int(actual[i]) not in ids[i, :k].tolist():
            ids[i, k], lps[i, k] = actual[i], teacher_lp_full[i, actual[i]]
        if i % 4 == 1:  # ragged: fewer candidates reported
            ids[i, 2:], lps[i, 2:] = -1, NEG_INF
    for i in empty_rows:
        ids[i], lps[i] = -1, NEG_INF
    sup_ids, sup_lps, valid = narrow_support(ids, lps, actual, beta)
    return hidden, weight, bias, sup_ids, sup_lps, valid


# ---------------------------------------------------------------------------------------------------------------
# Narrowed support
# ---------------------------------------------------------------------------------------------------------------

IDS = torch.tensor([[5, 9, 7, -1]])
LPS = torch.tensor([[-0.1, -2.0, -3.0, NEG_INF]])


@pytest.mark.parametrize(
    ("ids", "lps", "actual", "beta", "want_ids", "want_lps", "want_mask"),
    [
        (IDS, LPS, 9, 0.5, [5, 9], [-0.1, -2.0], [True, True]),
        (IDS, LPS, 5, 0.5, [5, 5], [-0.1, -0.1], [True, False]),
        (IDS, LPS, 42, 0.5, [5, 42], [-0.1, NEG_INF], [True, False]),
        (torch.tensor([[-1, 9, 7, -1]]), LPS, 9, 0.5, [-1, 9], [-0.1, -2.0], [False, True]),
        (IDS, LPS, 9, 1.0, [9], [-2.0], [True]),
        (IDS, LPS, 42, 1.0, [42], [NEG_INF], [False]),
    ],
)
def test_narrow_support_cases(ids, lps, actual, beta, want_ids, want_lps, want_mask):
    got_ids, got_lps, got_mask = narrow_support(ids, lps, torch.tensor([actual]), beta)
    assert got_ids.tolist() == [want_ids]
    assert got_mask.tolist() == [want_mask]
    # log-probs are only meaningful on valid slots
    for got, want, keep in zip(got_lps[0].tolist(), want_lps, want_mask):
        if keep:
            assert got == pytest.approx(want)


def test_narrow_support_beta_zero_keeps_the_full_support():
    ids, lps, valid = narrow_support(IDS, LPS, torch.tensor([42]), 0.0)
    assert ids is IDS and lps is LPS
    assert valid.tolist() == [[True, True, True, False]]


def test_narrow_support_actual_lp_is_the_max_over_matching_valid_slots():
    ids = torch.tensor([[3, 9, 9, -1]])
    lps = torch.tensor([[-0.5, -2.5, -1.5, -0.1]])  # the -1 slot's log-prob must be ignored
    got_ids, got_lps, valid = narrow_support(ids, lps, torch.tensor([9]), 0.3)
    assert got_ids.tolist() == [[3, 9]] and valid.tolist() == [[True, True]]
    assert got_lps[0, 1].item() == pytest.approx(-1.5)


# ---------------------------------------------------------------------------------------------------------------
# Divergence pieces
# ---------------------------------------------------------------------------------------------------------------


def test_generalized_jsd_formulas_and_mask():
    s = torch.tensor([[-0.5, -1.5, -2.0]], dtype=F64)
    t = torch.tensor([[-1.0, -0.7, NEG_INF]], dtype=F64)
    mask = torch.tensor([[True, True, False]])
    ps, pt = s.exp()[0, :2], t.exp()[0, :2]
    forward = generalized_jsd(s, t, 0.0, mask)
    assert torch.allclose(forward[0, :2], pt * (t[0, :2] - s[0, :2]))
    reverse = generalized_jsd(s, t, 1.0, mask)
    assert torch.allclose(reverse[0, :2], ps * (s[0, :2] - t[0, :2]))
    beta = 0.3
    m = (1 - beta) * ps + beta * pt
    mixed = beta * pt * (t[0, :2] - m.log()) + (1 - beta) * ps * (s[0, :2] - m.log())
    assert torch.allclose(generalized_jsd(s, t, beta, mask)[0, :2], mixed)
    for d in (forward, reverse):
        assert d[0, 2].item() == 0.0  # masked slot contributes exactly 0


def test_generalized_jsd_zero_teacher_probability_is_finite_with_finite_gradients():
    s = torch.tensor([-0.2, -1.8], dtype=F64, requires_grad=True)
    t = torch.tensor([0.0, NEG_INF], dtype=F64)  # the teacher puts no mass on the second token
    mask = torch.tensor([True, True])
    for beta in (0.0, 0.5):
        d = generalized_jsd(s, t, beta, mask)
        assert torch.isfinite(d).all()
        (grad,) = torch.autograd.grad(d.sum(), s)
        assert torch.isfinite(grad).all()


def test_tail_bucket_holds_the_leftover_mass_and_stays_positive():
    x = torch.log(torch.tensor([[0.5, 0.2, 0.9], [0.6, 0.4, 0.3]], dtype=F64))
    valid = torch.tensor([[True, True, False], [True, True, False]])
    out, mask = add_tail_bucket(x, valid)
    assert mask.tolist() == [[True, True, False, True]] * 2
    assert out[0, 3].item() == pytest.approx(math.log(0.3))
    assert out[0, 2].item() == NEG_INF
    # full mass: clamped at -1e-7, so the tail is log(1 - exp(-1e-7)) ~ log(1e-7), finite
    assert out[1, 3].item() == pytest.approx(math.log(-math.expm1(-1e-7)))
    assert math.isfinite(out[1, 3].item())


@pytest.mark.parametrize("tail", [True, False])
@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_per_position_sums_are_non_negative(beta, tail):
    g = torch.Generator().manual_seed(7)
    n, vocab, k = 200, 30, 6
    student = torch.log_softmax(3 * torch.randn(n, vocab, generator=g, dtype=F64), -1)
    teacher = torch.log_softmax(3 * torch.randn(n, vocab, generator=g, dtype=F64), -1)
    ids = torch.stack([torch.randperm(vocab, generator=g)[: k + 1] for _ in range(n)])
    ids[::5, k - 2 :] = -1
    lps = torch.where(ids >= 0, teacher.gather(1, ids.clamp(min=0)), torch.tensor(NEG_INF, dtype=F64))
    actual = ids[:, k - 3]
    sup_ids, sup_lps, valid = narrow_support(ids, lps, actual, beta)
    s_lp = torch.where(valid, student.gather(1, sup_ids.clamp(min=0)), torch.tensor(NEG_INF, dtype=F64))
    d, _, _ = support_divergence(s_lp, sup_lps, valid, beta, tail)
    sums = d.sum(-1)
    assert (sums >= -1e-12).all()
    if beta == 1.0 and not tail:  # one renormalised slot: both sides put all their mass on it
        assert sums.abs().max() < 1e-12
    else:
        assert (sums > 1e-6).sum() > n // 2  # and not trivially zero


# ---------------------------------------------------------------------------------------------------------------
# Chunked loss vs the reference: values, gradients and statistics
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tail", [True, False])
@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_chunked_loss_matches_reference_values_and_gradients(beta, tail):
    hidden, weight, bias, ids, lps, valid = make_case(seed=int(beta * 10) + tail, beta=beta)
    tau = 1.7
    params = [p.clone().requires_grad_(True) for p in (hidden, weight, bias)]
    loss, stats = distillation_loss(*params, ids, lps, valid, beta, tau, tail, chunk_size=4)
    grads = torch.autograd.grad(loss, params)
    ref_params = [p.clone().requires_grad_(True) for p in (hidden, weight, bias)]
    ref, (jsd, ent, tent, count) = ref_loss(*ref_params, ids, lps, valid, beta, tau, tail)
    ref_grads = torch.autograd.grad(ref, ref_params)
    assert count == int(valid.any(-1).sum()) >= 7  # all-empty positions are skipped
    assert loss.item() == pytest.approx(ref.item(), rel=1e-10, abs=1e-12)
    degenerate = beta == 1.0 and not tail  # a single renormalised slot: D = 0 everywhere
    assert (loss.item() == 0.0) if degenerate else (loss.item() > 1e-3)
    for got, want in zip(grads, ref_grads):
        assert torch.allclose(got, want, rtol=1e-8, atol=1e-10)
        assert degenerate or got.abs().sum() > 0
    assert stats.shape == (num_stats(1),)
    assert stats[:4].tolist() == pytest.approx([jsd, ent, tent, count], rel=1e-10)
    assert stats[4:].abs().sum() == 0  # per-teacher slots are all zero with one teacher


def test_chunked_loss_applies_logit_scale_and_softcap_like_the_reference():
    hidden, weight, bias, ids, lps, valid = make_case(seed=3, beta=0.5)
    params = [p.clone().requires_grad_(True) for p in (hidden, weight, bias)]
    loss, _ = distillation_loss(*params, ids, lps, valid, 0.5, 0.8, True, chunk_size=5, logit_scale=1.7, softcap=2.5)
    grads = torch.autograd.grad(loss, params)
    ref_params = [p.clone().requires_grad_(True) for p in (hidden, weight, bias)]
    ref, _ = ref_loss(*ref_params, ids, lps, valid, 0.5, 0.8, True, scale=1.7, softcap=2.5)
    ref_grads = torch.autograd.grad(ref, ref_params)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-10)
    for got, want in zip(grads, ref_grads):
        assert torch.allclose(got, want, rtol=1e-8, atol=1e-10)
    plain, _ = distillation_loss(hidden, weight, bias, ids, lps, valid, 0.5, 0.8, True)
    assert abs(plain.item() - loss.item()) > 1e-4  # the transforms matter


def test_temperature_divides_the_student_logits():
    hidden, weight, _, ids, lps, valid = make_case(seed=5, beta=0.0)
    tau = 2.5
    hot, hot_stats = distillation_loss(hidden, weight, None, ids, lps, valid, 0.0, tau, True)
    # z / τ = W (h / τ): the same loss at τ = 1 on scaled hidden states
    scaled, scaled_stats = distillation_loss(hidden / tau, weight, None, ids, lps, valid, 0.0, 1.0, True)
    cold, cold_stats = distillation_loss(hidden, weight, None, ids, lps, valid, 0.0, 1.0, True)
    assert hot.item() == pytest.approx(scaled.item(), rel=1e-12)
    assert hot_stats[1].item() == pytest.approx(scaled_stats[1].item(), rel=1e-12)  # entropy at τ
    assert abs(hot.item() - cold.item()) > 1e-3
    assert hot_stats[1] > cold_stats[1]  # a hotter student has a higher entropy
    assert hot_stats[2].item() == pytest.approx(cold_stats[2].item())  # teacher entropy untouched


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_sparse_loss_with_full_vocabulary_support_equals_dense_reference(beta):
    g = torch.Generator().manual_seed(11)
    n, hidden_size, vocab = 7, 5, 9
    hidden = torch.randn(n, hidden_size, generator=g, dtype=F64)
    weight = torch.randn(vocab, hidden_size, generator=g, dtype=F64)
    teacher = torch.log_softmax(2 * torch.randn(n, vocab, generator=g, dtype=F64), -1)
    ids = torch.stack([torch.randperm(vocab, generator=g) for _ in range(n)])  # K = V: every token, shuffled
    lps = teacher.gather(1, ids)
    valid = torch.ones_like(ids, dtype=torch.bool)
    loss, _ = distillation_loss(hidden, weight, None, ids, lps, valid, beta, 1.0, True, chunk_size=3)
    s = torch.log_softmax(hidden @ weight.T, -1)
    ps, pt = s.exp(), teacher.exp()
    if beta == 0:
        dense = (pt * (teacher - s)).sum()
    elif beta == 1:
        dense = (ps * (s - teacher)).sum()
    else:
        log_m = ((1 - beta) * ps + beta * pt).log()
        dense = (beta * pt * (teacher - log_m) + (1 - beta) * ps * (s - log_m)).sum()
    assert loss.item() == pytest.approx(dense.item(), rel=1e-9)


@pytest.mark.parametrize("beta", [0.5, 1.0])
def test_ragged_and_padded_positions_give_finite_loss_and_gradients(beta):
    hidden, weight, bias, ids, lps, valid = make_case(seed=9, beta=beta, empty_rows=(0, 4, 5))
    params = [p.clone().requires_grad_(True) for p in (hidden, weight, bias)]
    for tail in (True, False):
        loss, stats = distillation_loss(*params, ids, lps, valid, beta, 1.0, tail, chunk_size=2)
        assert torch.isfinite(loss) and torch.isfinite(stats).all()
        grads = torch.autograd.grad(loss, params)
        assert all(torch.isfinite(g).all() for g in grads)
        assert grads[0][[0, 4, 5]].abs().sum() == 0  # padded positions get no gradient


def test_chunk_size_changes_neither_loss_nor_per_teacher_stats():
    hidden, weight, bias, ids, lps, valid = make_case(seed=21, n=29, beta=0.0, empty_rows=(2, 17))
    g = torch.Generator().manual_seed(0)
    teacher_index = torch.randint(0, 3, (29,), generator=g)
    results = []
    for chunk in (3, 256):
        params = [p.clone().requires_grad_(True) for p in (hidden, weight, bias)]
        loss, stats = distillation_loss(
            *params, ids, lps, valid, 0.0, 1.0, True, chunk_size=chunk, teacher_index=teacher_index, num_teachers=3
        )
        results.append((loss, stats, torch.autograd.grad(loss, params)))
    (loss3, stats3, grads3), (loss256, stats256, grads256) = results
    assert loss3.item() == pytest.approx(loss256.item(), rel=1e-12)
    assert torch.allclose(stats3, stats256, rtol=1e-12, atol=0)
    for a, b in zip(grads3, grads256):
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12)
    # per-teacher stats partition the counted positions, exactly as routed
    has = valid.any(-1)
    tokens = stats3[4:7]
    assert tokens.tolist() == [float((has & (teacher_index == t)).sum()) for t in range(3)]
    assert tokens.sum().item() == stats3[3].item() == 27
    assert stats3[7:10].sum().item() == pytest.approx(stats3[0].item(), rel=1e-12)
    assert stats3[10:13].sum().item() == pytest.approx(stats3[2].item(), rel=1e-12)
    # each teacher's jsd is the jsd of its own positions alone
    for t in range(3):
        mine = has & (teacher_index == t)
        alone, _ = distillation_loss(hidden[mine], weight, bias, ids[mine], lps[mine], valid[mine], 0.0, 1.0, True)
        assert stats3[7 + t].item() == pytest.approx(alone.item(), rel=1e-10)


def test_no_vocabulary_sized_tensor_is_kept_for_backward():
    hidden, weight, bias, ids, lps, valid = make_case(seed=6, n=40)
    params = [p.clone().requires_grad_(True) for p in (hidden, weight, bias)]
    saved = []

    def pack(tensor):
        saved.append(tuple(tensor.shape))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, _ = distillation_loss(*params, ids, lps, valid, 0.0, 1.0, True, chunk_size=8)
    vocab = weight.shape[0]
    assert not [shape for shape in saved if len(shape) == 2 and shape[1] == vocab]  # logits are recomputed
    reference, _ = ref_loss(*params, ids, lps, valid, 0.0, 1.0, True)
    assert loss.item() == pytest.approx(reference.item(), rel=1e-10)  # and the loss is still right


def test_single_teacher_ignores_teacher_index():
    hidden, weight, bias, ids, lps, valid = make_case(seed=2)
    _, stats = distillation_loss(
        hidden, weight, bias, ids, lps, valid, 0.0, 1.0, True, teacher_index=torch.zeros(11, dtype=torch.long)
    )
    assert stats.shape == (7,) and stats[4:].abs().sum() == 0 and stats[3] == 10


def test_autocast_runs_the_head_in_bf16_and_matches_fp32_loosely():
    hidden, weight, bias, ids, lps, valid = make_case(seed=4, beta=0.5)
    params = [p.float().requires_grad_(True) for p in (hidden, weight, bias)]
    exact, _ = distillation_loss(*params, ids, lps.float(), valid, 0.5, 1.0, True, chunk_size=4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        approx, _ = distillation_loss(*params, ids, lps.float(), valid, 0.5, 1.0, True, chunk_size=4)
    assert approx.dtype == torch.float32  # logits upcast to fp32 before the softmax
    assert approx.item() == pytest.approx(exact.item(), rel=0.05)
    grads = torch.autograd.grad(approx, params)
    exact_grads = torch.autograd.grad(exact, params)
    for got, want in zip(grads, exact_grads):
        assert torch.isfinite(got).all()
        assert torch.allclose(got, want, rtol=0.1, atol=0.05)


# ---------------------------------------------------------------------------------------------------------------
# One packed row
# ---------------------------------------------------------------------------------------------------------------


def make_row(seed, k=3, vocab=10, hidden_size=4):
    """Two packed samples: prompt 3 + completion 4, prompt 2 + completion 3 (L = 12)."""
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab, (12,), generator=g)
    completion_mask = torch.tensor([0, 0, 0, 1, 1, 1, 1, 0, 0, 1, 1, 1])
    teacher_ids = torch.full((12, k + 1), -1, dtype=torch.long)
    teacher_lps = torch.full((12, k + 1), NEG_INF, dtype=F64)
    for j in range(12):
        if completion_mask[j]:
            top = torch.randperm(vocab, generator=g)[:k]
            lp = torch.log_softmax(torch.randn(vocab, generator=g, dtype=F64), -1)
            teacher_ids[j, :k], teacher_lps[j, :k] = top, lp[top]
            if int(input_ids[j]) not in top.tolist():
                teacher_ids[j, k], teacher_lps[j, k] = input_ids[j], lp[input_ids[j]]
    teacher_ids[5], teacher_lps[5] = -1, NEG_INF  # a completion position without teacher signal
    weight = torch.randn(vocab, hidden_size, generator=g, dtype=F64)
    bias = torch.randn(vocab, generator=g, dtype=F64)
    hidden = torch.randn(12, hidden_size, generator=g, dtype=F64)
    return hidden, weight, bias, input_ids, completion_mask, teacher_ids, teacher_lps


@pytest.mark.parametrize("beta", [0.0, 0.5, 1.0])
def test_row_loss_shifts_by_one_and_normalises(beta):
    hidden, weight, bias, input_ids, cmask, t_ids, t_lps = make_row(seed=1)
    config = DistillLossConfig(beta=beta, teacher_temperature=1.3, add_tail_bucket=True)
    loss, stats = distillation_row_loss(
        hidden,
        weight,
        bias,
        input_ids,
        cmask,
        t_ids,
        t_lps,
        config=config,
        global_n_tokens=14,
        num_processes=2,
        grad_accum_steps=3,
    )
    # by hand: hidden j predicts token j+1 and meets teacher row j+1; trained where cmask[j+1] and signal
    total = hidden.new_zeros(())
    used = []
    for j in range(11):
        ids, lps, valid = narrow_support(t_ids[j + 1 : j + 2], t_lps[j + 1 : j + 2], input_ids[j + 1 : j + 2], beta)
        if cmask[j + 1] and valid.any():
            used.append(j)
            z = (weight @ hidden[j] + bias) / 1.3
            total = total + ref_position(z, ids[0], lps[0], valid[0], beta, True)[0]
    expected_used = [2, 3, 5, 8, 9, 10] if beta != 1.0 else None  # row 5 (hidden 4) has no signal
    if expected_used is not None:
        assert used == expected_used
    assert stats[3].item() == len(used)
    assert loss.item() == pytest.approx(total.item() / (14 / 2) / 3, rel=1e-10)


def test_row_loss_normaliser_floors_tokens_per_rank_at_one():
    hidden, weight, bias, input_ids, cmask, t_ids, t_lps = make_row(seed=2)
    config = DistillLossConfig()
    small, _ = distillation_row_loss(
        hidden, weight, bias, input_ids, cmask, t_ids, t_lps, config=config, global_n_tokens=1, num_processes=4
    )
    raw, _ = distillation_row_loss(
        hidden, weight, bias, input_ids, cmask, t_ids, t_lps, config=config, global_n_tokens=1, num_processes=1
    )
    assert small.item() == pytest.approx(raw.item())


@pytest.mark.parametrize("case", ["no_completion", "no_teacher_signal"])
def test_zero_signal_row_gives_zero_loss_and_a_gradient_on_every_parameter(case):
    hidden, weight, bias, input_ids, cmask, t_ids, t_lps = make_row(seed=3)
    if case == "no_completion":
        cmask = torch.zeros_like(cmask)
    else:
        t_ids, t_lps = torch.full_like(t_ids, -1), torch.full_like(t_lps, NEG_INF)
    embed = torch.nn.Parameter(hidden.clone())  # stands in for the backbone
    head_w, head_b = torch.nn.Parameter(weight.clone()), torch.nn.Parameter(bias.clone())
    loss, stats = distillation_row_loss(
        embed * 2, head_w, head_b, input_ids, cmask, t_ids, t_lps, config=DistillLossConfig(beta=0.5), global_n_tokens=7
    )
    assert loss.item() == 0.0
    assert stats.abs().sum() == 0 and stats.shape == (7,)
    loss.backward()
    for p in (embed, head_w, head_b):
        assert p.grad is not None and p.grad.abs().sum() == 0


def test_row_loss_routes_teacher_index_with_the_shift():
    hidden, weight, bias, input_ids, cmask, t_ids, t_lps = make_row(seed=4)
    teacher_id_idx = torch.tensor([0] * 7 + [1] * 5)  # sample 1 -> teacher 0, sample 2 -> teacher 1
    _, stats = distillation_row_loss(
        hidden,
        weight,
        bias,
        input_ids,
        cmask,
        t_ids,
        t_lps,
        config=DistillLossConfig(),
        global_n_tokens=7,
        teacher_id_idx=teacher_id_idx,
        num_teachers=2,
    )
    # hidden 2, 3, 5 predict tokens 3, 4, 6 of sample 1; hidden 8, 9, 10 tokens 9, 10, 11 of sample 2
    assert stats[4:6].tolist() == [3.0, 3.0]


# ---------------------------------------------------------------------------------------------------------------
# Metrics
# ---------------------------------------------------------------------------------------------------------------


def test_metrics_means_and_nan_when_nothing_counted():
    metrics = distillation_metrics(torch.tensor([3.0, 12.0, 6.0, 4.0, 0, 0, 0], dtype=F64))
    assert metrics == {"jsd": 0.75, "entropy": 3.0, "teacher_entropy": 1.5}
    empty = distillation_metrics(torch.zeros(7, dtype=F64))
    assert all(math.isnan(v) for v in empty.values())
    sink = MetricSink()
    sink.update(empty)
    sink.update(metrics)
    assert sink.reduce()["jsd"] == 0.75  # a NaN window entry is dropped


def test_mopd_metrics_rates_and_per_teacher_means():
    # teachers a, b, c: tokens 3, 1, 0 of 4
    stats = torch.tensor([2.0, 8.0, 4.0, 4.0, 3.0, 1.0, 0.0, 1.5, 0.5, 0.0, 3.0, 1.0, 0.0], dtype=F64)
    metrics = distillation_metrics(stats, ["a", "b", "c"])
    assert metrics["teacher_token_frac/a"] == (3.0, 4.0)
    assert metrics["teacher_token_frac/c"] == (0.0, 4.0)  # a real 0, not NaN
    assert metrics["teacher_jsd/a"] == pytest.approx(0.5) and metrics["teacher_jsd/b"] == pytest.approx(0.5)
    assert metrics["teacher_entropy/a"] == pytest.approx(1.0) and metrics["teacher_entropy/b"] == pytest.approx(1.0)
    assert math.isnan(metrics["teacher_jsd/c"]) and math.isnan(metrics["teacher_entropy/c"])
    assert "entropy/a" not in metrics and "teacher_entropy" in metrics
    sink = MetricSink()
    sink.update(metrics)
    sink.update(distillation_metrics(torch.tensor([0, 0, 0, 2.0, 0, 0, 2.0, 0, 0, 0, 0, 0, 0], dtype=F64), "abc"))
    assert sink.reduce()["teacher_token_frac/c"] == pytest.approx(2 / 6)


def test_single_teacher_has_no_per_teacher_metrics():
    metrics = distillation_metrics(torch.tensor([1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0], dtype=F64), ["default"])
    assert set(metrics) == {"jsd", "entropy", "teacher_entropy"}


def test_loss_config_rejects_beta_outside_unit_interval():
    with pytest.raises(ValueError, match=r"beta must be in \[0.0, 1.0\], got 1.5"):
        DistillLossConfig(beta=1.5)
    with pytest.raises(ValueError, match="beta must be in"):
        distillation_loss(
            torch.zeros(1, 2),
            torch.zeros(3, 2),
            None,
            torch.zeros(1, 1, dtype=torch.long),
            torch.zeros(1, 1),
            torch.ones(1, 1, dtype=torch.bool),
            -0.1,
            1.0,
            True,
        )
