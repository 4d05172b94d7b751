"""The varlen tree attention (root-path segments, `rlasync.model.segment_attention`) against the tree rule and the
dense backend: the plan's visibility is exactly `dense_tree_mask`, the segment loop equals masked SDPA, and whole
models score and train the same (CPU, float32; tests/gpu runs the FlashAttention kernel)."""

import copy

import numpy as np
import pytest
import torch

from rlasync.config import KernelSettings
from rlasync.model import enable_tree_attention, packed_token_scores
from rlasync.model.row_shapes import pad_row_tensors
from rlasync.model.segment_attention import reference_segment_attention, segment_attention, segment_plan
from rlasync.model.tree_mask import build_tree_attention, dense_tree_mask, resolve_backend
from tests.unit.model.test_tree_forward import TOL, _compare, decoder_layers_over

SHAPES = ["grpo", "chain", "disjoint", "ragged", "mixed"]


def _row(packed_tensors, scenarios, shape, seed=0):
    return packed_tensors(*scenarios(shape, seed=seed))


def _visibility(plan) -> torch.Tensor:
    """The [N, N] mask the plan implies: query i of a segment sees its keys j <= i + (keys - queries)."""
    n = plan.num_tokens
    mask = torch.zeros(n, n, dtype=torch.bool)
    qs, ks, index = plan.query_start.tolist(), plan.key_start.tolist(), plan.key_index.tolist()
    for s in range(plan.num_segments):
        lq, lk = qs[s + 1] - qs[s], ks[s + 1] - ks[s]
        for i in range(lq):
            for j in range(i + lk - lq + 1):
                mask[qs[s] + i, index[ks[s] + j]] = True
    return mask


def test_a_prompt_with_two_completions_is_two_segments_sharing_the_prompt_keys():
    # prompt 0-2, completion A 3-4, completion B 5-6 (depth-first): A continues the prompt, B starts a segment
    subtree_end = [7, 7, 7, 5, 5, 7, 7]
    depth = [0, 1, 2, 3, 4, 3, 4]
    plan = segment_plan(subtree_end, depth)
    assert plan.query_start.tolist() == [0, 5, 7]
    assert plan.key_start.tolist() == [0, 5, 10]
    assert plan.key_index.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 5, 6]
    assert plan.max_query % 128 == 0 and plan.max_key >= 5


@pytest.mark.parametrize("shape", SHAPES)
def test_the_plan_sees_exactly_what_the_tree_rule_shows(packed_tensors, scenarios, shape):
    row = _row(packed_tensors, scenarios, shape, seed=4)
    plan = segment_plan(row.subtree_end, row.position_ids)
    assert torch.equal(_visibility(plan), dense_tree_mask(row.subtree_end))
    assert plan.num_keys == int(plan.key_start[-1]) == plan.key_index.numel()


def test_rows_that_are_not_depth_first_tries_are_refused():
    with pytest.raises(ValueError, match="depth-first trie"):
        segment_plan([3, 3, 3], [0, 2, 1])  # depths skip a level: no parent at depth 1 before token 1


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2)])
def test_the_segment_loop_equals_masked_sdpa_with_gradients(packed_tensors, scenarios, window, heads):
    row = _row(packed_tensors, scenarios, "mixed", seed=1)
    n, (hq, hkv), d = row.num_tokens, heads, 8
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, h, n, d, generator=gen, dtype=torch.float64, requires_grad=True) for h in (hq, hkv, hkv))
    plan = segment_plan(row.subtree_end, row.position_ids)
    out = segment_attention(q, k, v, plan, 0.3, window)  # [1, N, Hq, D]
    mask = dense_tree_mask(row.subtree_end, row.position_ids, window)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, scale=0.3, enable_gqa=hq != hkv
    ).transpose(1, 2)
    assert (out - expected).abs().max() < 1e-10
    weights = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    grads = torch.autograd.grad((out * weights).sum(), (q, k, v))
    expected_grads = torch.autograd.grad((expected * weights).sum(), (q, k, v))
    assert all((g - e).abs().max() < 1e-10 for g, e in zip(grads, expected_grads))


def test_the_reference_loop_handles_an_empty_row():
    plan = segment_plan(np.zeros(0, np.int64), np.zeros(0, np.int64))
    q = torch.zeros(0, 2, 4)
    assert reference_segment_attention(q, q, q, plan, None, None).shape == (0, 2, 4)


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_sliding", "gemma2"])
def test_models_score_and_train_on_the_varlen_backend_as_unpacked(make_model, scenarios, family):
    """gemma2 softcaps its scores, which the varlen kernel cannot: its layers take the dense masks."""
    reference_model = make_model(family)
    tree_model = enable_tree_attention(copy.deepcopy(reference_model))
    value_diff, grad_diff = _compare(reference_model, tree_model, *scenarios("mixed", seed=7), backend="varlen")
    assert value_diff <= TOL and grad_diff <= TOL, (value_diff, grad_diff)


def test_a_padded_row_keeps_its_host_made_plan_exact(make_model, scenarios):
    from rlasync.model import packed_row_to_tensors
    from rlasync.packing import TreeRow, pack
    from rlasync.records import RolloutSample

    model = enable_tree_attention(make_model("qwen3"))
    row = TreeRow()
    for seq, prompt in zip(*scenarios("grpo", seed=2)):
        row.add(RolloutSample(seq, [0] * prompt + [1] * (len(seq) - prompt), [0.0] * len(seq), 0.0, 0))
    packed = pack(row)
    planned = packed_row_to_tensors(packed, segments=True)
    assert planned.segments is not None and packed_row_to_tensors(packed).segments is None
    padded = pad_row_tensors(planned, planned.num_tokens + 37)
    replanned = segment_plan(padded.subtree_end, padded.position_ids)
    for name in ("query_start", "key_start", "key_index"):
        assert torch.equal(getattr(padded.segments, name), getattr(replanned, name)), name
    with torch.no_grad():
        varlen = packed_token_scores(model, padded, backend="varlen")
        dense = packed_token_scores(model, planned, backend="dense")
    assert (varlen.logprobs - dense.logprobs).abs().max() <= TOL


def test_auto_resolves_by_device_and_the_kernel_setting_chooses_another(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setenv("RLASYNC_TREE_ATTENTION", "dense")  # the variable of old: read no more
    assert (resolve_backend("auto", cpu), resolve_backend("auto", cuda)) == ("dense", "flex")
    varlen = KernelSettings(tree_attention="varlen").tree_attention
    assert (resolve_backend(varlen, cpu), resolve_backend(varlen, cuda)) == ("varlen", "varlen")
    assert resolve_backend("flex", cuda) == "flex"
    with pytest.raises(ValueError, match="kernels.tree_attention='flash': use one of 'auto', 'flex'"):
        KernelSettings(tree_attention="flash")
    with pytest.raises(ValueError, match="unknown tree attention backend"):
        resolve_backend("fast", cpu)


def test_a_varlen_tree_hands_the_model_a_placeholder_mask_of_the_row(packed_tensors, scenarios):
    row = _row(packed_tensors, scenarios, "grpo")
    tree = build_tree_attention(row.subtree_end, row.position_ids, "varlen")
    assert tree.backend == "varlen" and tree.segments is not None
    assert tree.full_mask.shape == (1, 1, row.num_tokens, row.num_tokens) and tree.full_mask.stride() == (0,) * 4


@torch.library.custom_op("rlasync_test::segments", mutates_args=())
def _opaque_segments(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_index: torch.Tensor,
    subtree_end: torch.Tensor,
    position_ids: torch.Tensor,
    window: int,
) -> torch.Tensor:
    plan = segment_plan(subtree_end, position_ids)
    return reference_segment_attention(q, k, v, plan, None, window or None)


@_opaque_segments.register_fake
def _(q, k, v, key_index, subtree_end, position_ids, window):
    return torch.empty_like(q)


def test_a_decoder_layer_on_the_varlen_backend_compiles_without_graph_breaks(make_model, packed_tensors, monkeypatch):
    """As the FlashAttention kernel is one opaque op to the compiler, so is a stand-in here: the gather, the plan's
    fields and the layer around them trace into one graph (fullgraph), and the result is the eager one."""
    import rlasync.model.segment_attention as segments

    model = enable_tree_attention(make_model("qwen3_sliding"))
    row = packed_tensors([[1, 2, 3, 4, 5], [1, 2, 3, 9], [7, 8]], [2, 2, 1])
    tree = build_tree_attention(row.subtree_end, row.position_ids, "varlen", windows=(4,))

    def kernel(q, k, v, plan, scaling, window):
        return _opaque_segments(q, k, v, plan.key_index, row.subtree_end, row.position_ids, window or 0)

    monkeypatch.setattr(segments, "reference_segment_attention", kernel)
    layers, hidden = decoder_layers_over(model, row, tree)
    compiled = torch.compile(layers, backend="eager", fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(hidden), layers(hidden))


def test_varlen_on_a_torch_without_the_kernel_is_refused_naming_flex(monkeypatch):
    import rlasync.model.tree_mask as tree_mask

    monkeypatch.setattr(tree_mask, "varlen_available", lambda: False)
    with pytest.raises(ValueError, match="use 'flex'"):
        resolve_backend("varlen", torch.device("cuda"))
    assert resolve_backend("varlen", torch.device("cpu")) == "varlen"  # the reference loop runs anywhere
