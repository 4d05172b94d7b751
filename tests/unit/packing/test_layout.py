"""pack(): the DFS layout of docs/algorithms.md §4.2, checked on the worked examples and against a slow reference."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from rlasync.packing import IGNORE_INDEX, TreeRow, pack, sample_positions
from rlasync.records import RolloutSample


def make_sample(ids, mask, lps=None, advantage=0.0, group_id=0, **extras):
    return RolloutSample(
        input_ids=np.asarray(ids, dtype=np.int64),
        completion_mask=mask,
        sampler_logprobs=np.zeros(len(ids)) if lps is None else lps,
        advantage=advantage,
        group_id=group_id,
        **extras,
    )


def row_of(samples):
    row = TreeRow()
    for sample in samples:
        row.add(sample)
    return row


# ---- worked examples ---------------------------------------------------------------------------------------


def test_pack_reproduces_spec_worked_example():
    row = row_of(
        [
            make_sample([11, 12, 13, 21, 22], [0, 0, 0, 1, 1], [0, 0, 0, -0.1, -0.2], 1.0, 7),
            make_sample([11, 12, 13, 31, 32], [0, 0, 0, 1, 1], [0, 0, 0, -0.3, -0.4], -1.0, 7),
            make_sample([11, 12, 41, 51], [0, 0, 0, 1], [0, 0, 0, -0.5], 0.5, 9),
        ]
    )
    packed = pack(row)
    assert packed.input_ids.tolist() == [11, 12, 13, 21, 22, 13, 31, 32, 12, 41, 51]
    assert packed.position_ids.tolist() == [0, 1, 2, 3, 4, 2, 3, 4, 1, 2, 3]
    x = IGNORE_INDEX
    assert packed.shift_labels.tolist() == [x, x, 21, 22, x, 31, 32, x, x, 51, x]
    assert packed.subtree_end.tolist() == [11, 8, 5, 5, 5, 8, 8, 8, 11, 11, 11]
    assert packed.tree_cu_seqlens_q.tolist() == [0, 1, 2, 5, 8, 11]
    assert packed.tree_kv_index.tolist() == [0, 0, 1, 0, 1, 2, 3, 4, 0, 1, 5, 6, 7, 0, 8, 9, 10]
    assert packed.tree_cu_seqlens_k.tolist() == [0, 1, 3, 8, 13, 17]
    assert packed.tree_max_seqlens.tolist() == [3, 5]
    assert packed.token_index.tolist() == [2, 3, 5, 6, 9]
    assert packed.target_ids.tolist() == [21, 22, 31, 32, 51]
    np.testing.assert_array_equal(packed.sampler_logprobs, np.float32([-0.1, -0.2, -0.3, -0.4, -0.5]))
    assert packed.advantages.tolist() == [1.0, 1.0, -1.0, -1.0, 0.5]
    assert packed.sample_index.tolist() == [0, 0, 1, 1, 2]
    assert (packed.num_samples, packed.num_raw_tokens, packed.num_tokens) == (3, 14, 11)
    assert (packed.num_trained_tokens, packed.load) == (5, 36)
    assert packed.sampler_topk_ids is None and packed.sampling_mask is None and packed.has_sampling_mask is None
    dtypes = {
        "input_ids": np.int64,
        "position_ids": np.int64,
        "subtree_end": np.int64,
        "shift_labels": np.int64,
        "tree_cu_seqlens_q": np.int32,
        "tree_kv_index": np.int64,
        "tree_cu_seqlens_k": np.int32,
        "tree_max_seqlens": np.int32,
        "token_index": np.int64,
        "target_ids": np.int64,
        "sampler_logprobs": np.float32,
        "advantages": np.float32,
        "sample_index": np.int64,
    }
    assert {name: getattr(packed, name).dtype for name in dtypes} == {n: np.dtype(d) for n, d in dtypes.items()}


def test_pack_reproduces_seed_two_rollout_example():
    p1, p2, p3, a1, a2, b1, b2 = 1, 2, 3, 10, 11, 20, 21
    row = row_of(
        [make_sample([p1, p2, p3, a1, a2], [0, 0, 0, 1, 1]), make_sample([p1, p2, p3, b1, b2], [0, 0, 0, 1, 1])]
    )
    packed = pack(row)
    assert packed.num_tokens == 8  # instead of 10
    assert packed.input_ids.tolist() == [p1, p2, p3, a1, a2, p3, b1, b2]
    assert packed.position_ids.tolist() == [0, 1, 2, 3, 4, 2, 3, 4]
    assert packed.tree_cu_seqlens_q.tolist() == [0, 2, 5, 8]
    assert packed.tree_kv_index.tolist() == [0, 1, 0, 1, 2, 3, 4, 0, 1, 5, 6, 7]
    assert packed.token_index.tolist() == [2, 3, 5, 6]  # a1 a2 predicted at 2 3, b1 b2 at 5 6
    assert packed.target_ids.tolist() == [a1, a2, b1, b2]
    assert [p.tolist() for p in sample_positions(row)] == [[0, 1, 2, 3, 4], [0, 1, 5, 6, 7]]


def test_shared_position_yields_one_loss_term_per_sample():
    # Identical samples share the whole path; each keeps its own term, log-prob and advantage.
    row = row_of([make_sample([1, 2], [0, 1], [0, -0.5], 1.0), make_sample([1, 2], [0, 1], [0, -0.7], -1.0)])
    packed = pack(row)
    assert packed.token_index.tolist() == [0, 0]
    assert packed.advantages.tolist() == [1.0, -1.0]
    np.testing.assert_array_equal(packed.sampler_logprobs, np.float32([-0.5, -0.7]))
    assert packed.shift_labels.tolist() == [2, IGNORE_INDEX]


def test_first_position_is_never_a_loss_term():
    packed = pack(row_of([make_sample([4, 5, 6], [1, 0, 1])]))
    assert packed.token_index.tolist() == [1]
    assert packed.num_trained_tokens == 1


def test_empty_row_packs_to_empty_arrays():
    packed = pack(TreeRow())
    assert packed.num_tokens == 0 and packed.num_trained_tokens == 0
    assert packed.tree_cu_seqlens_q.tolist() == [0] and packed.tree_cu_seqlens_k.tolist() == [0]
    assert packed.tree_max_seqlens.tolist() == [0, 0]


def test_extras_are_gathered_at_targets_and_padded_across_samples():
    topk_ids = np.arange(6).reshape(3, 2) + 100
    topk_logprobs = -np.arange(6, dtype=np.float32).reshape(3, 2)
    sampling_mask = np.asarray([[-1, -1, -1], [7, 8, -1], [9, -1, -1]])
    with_extras = make_sample(
        [1, 2, 3],
        [0, 1, 1],
        sampler_topk_ids=topk_ids,
        sampler_topk_logprobs=topk_logprobs,
        sampling_mask=sampling_mask,
    )
    plain = make_sample([5, 6], [0, 1])
    wide = make_sample([8, 9], [0, 1], sampler_topk_ids=[[1, 2, 3]] * 2, sampler_topk_logprobs=[[-1.0] * 3] * 2)
    packed = pack(row_of([with_extras, plain, wide]))
    assert packed.sampler_topk_ids.tolist() == [[102, 103, -1], [104, 105, -1], [-1, -1, -1], [1, 2, 3]]
    assert packed.sampler_topk_logprobs.dtype == np.float32
    assert packed.sampler_topk_logprobs[:2, :2].tolist() == [[-2.0, -3.0], [-4.0, -5.0]]
    assert np.isneginf(packed.sampler_topk_logprobs[2]).all() and np.isneginf(packed.sampler_topk_logprobs[:2, 2]).all()
    assert packed.sampling_mask.tolist() == [[7, 8, -1], [9, -1, -1], [-1, -1, -1], [-1, -1, -1]]
    assert packed.has_sampling_mask.tolist() == [True, True, False, False]


# ---- slow, obvious reference on random rows --------------------------------------------------------------------

TOKENS = st.integers(0, 3)  # a small alphabet, so unrelated samples also share prefixes by accident


@st.composite
def random_samples(draw):
    """Samples mixing GRPO groups (shared prompts), multi-turn chains, unrelated and single-token samples."""
    prompts = draw(st.lists(st.lists(TOKENS, min_size=1, max_size=5), min_size=1, max_size=3))
    samples = []
    for i in range(draw(st.integers(1, 7))):
        kind = draw(st.sampled_from(["group", "extend", "fresh"]))
        if kind == "group":
            group_id = draw(st.integers(0, len(prompts) - 1))
            ids = prompts[group_id] + draw(st.lists(TOKENS, max_size=4))
        elif kind == "extend" and samples:
            base = draw(st.sampled_from(samples))
            group_id, ids = base.group_id, base.input_ids.tolist() + draw(st.lists(TOKENS, min_size=1, max_size=4))
        else:
            group_id, ids = 100 + i, draw(st.lists(TOKENS, min_size=1, max_size=6))
        mask = draw(st.lists(st.integers(0, 1), min_size=len(ids), max_size=len(ids)))
        extras = {}
        if draw(st.booleans()):
            width = draw(st.integers(1, 3))
            extras["sampler_topk_ids"] = np.arange(len(ids) * width).reshape(len(ids), width) + 1000 * i
            extras["sampler_topk_logprobs"] = -extras["sampler_topk_ids"].astype(np.float32)
        if draw(st.booleans()):
            extras["sampling_mask"] = np.arange(len(ids) * 2).reshape(len(ids), 2) + 1000 * i
        lps = -(np.arange(len(ids)) + 100 * i) / 1000.0
        samples.append(make_sample(ids, mask, lps, advantage=i - 0.5, group_id=group_id, **extras))
    return samples


def visible_keys(packed, q):
    return {k for k in range(packed.num_tokens) if k <= q < packed.subtree_end[k]}


def reference_nodes(samples):
    """Distinct key-sequence prefixes = the nodes a prefix trie keyed (token, next token) must have."""
    nodes = set()
    for sample in samples:
        ids = sample.input_ids.tolist()
        keys = tuple(zip(ids, ids[1:] + [None]))
        nodes.update(keys[: p + 1] for p in range(len(ids)))
    return nodes


def expected_terms(samples, positions):
    terms = []
    for i, (sample, packed_positions) in enumerate(zip(samples, positions)):
        for p in range(1, len(sample)):
            if sample.completion_mask[p]:
                terms.append((packed_positions[p - 1], sample.input_ids[p], sample.sampler_logprobs[p], i, p))
    return terms


def check_paths(packed, samples, positions):
    for sample, packed_positions in zip(samples, positions):
        assert packed.input_ids[packed_positions].tolist() == sample.input_ids.tolist()
        assert packed.position_ids[packed_positions].tolist() == list(range(len(sample)))
        for p, q in enumerate(packed_positions.tolist()):
            assert visible_keys(packed, q) == set(packed_positions[: p + 1].tolist())


def check_segments(packed):
    """Bottom-right aligned causal attention over each segment's path = the subtree_end rule."""
    cu_q, cu_k, kv = packed.tree_cu_seqlens_q, packed.tree_cu_seqlens_k, packed.tree_kv_index
    assert cu_q[0] == 0 and cu_q[-1] == packed.num_tokens and len(cu_q) == len(cu_k)
    for s in range(len(cu_q) - 1):
        queries = range(cu_q[s], cu_q[s + 1])
        path = kv[cu_k[s] : cu_k[s + 1]].tolist()
        assert path[len(path) - len(queries) :] == list(queries)
        for j, q in enumerate(queries):
            assert set(path[: len(path) - len(queries) + j + 1]) == visible_keys(packed, q)
    assert packed.tree_max_seqlens.tolist() == [np.diff(cu_q).max(initial=0), np.diff(cu_k).max(initial=0)]


def check_terms(packed, samples, positions):
    terms = expected_terms(samples, positions)
    assert packed.token_index.tolist() == [t[0] for t in terms]
    assert packed.target_ids.tolist() == [t[1] for t in terms]
    assert packed.sampler_logprobs.tolist() == [t[2] for t in terms]
    assert packed.sample_index.tolist() == [t[3] for t in terms]
    assert packed.advantages.tolist() == [np.float32(samples[t[3]].advantage) for t in terms]
    labelled = {t[0]: t[1] for t in terms}
    assert packed.shift_labels.tolist() == [labelled.get(k, IGNORE_INDEX) for k in range(packed.num_tokens)]
    for m, (_, _, _, i, p) in enumerate(terms):
        topk = samples[i].sampler_topk_ids
        if topk is not None:
            assert packed.sampler_topk_ids[m, : topk.shape[1]].tolist() == topk[p].tolist()
        mask = samples[i].sampling_mask
        if packed.sampling_mask is not None:
            assert packed.has_sampling_mask[m] == (mask is not None)
        if mask is not None:
            assert packed.sampling_mask[m, : mask.shape[1]].tolist() == mask[p].tolist()


@settings(max_examples=60, deadline=None)
@given(random_samples())
def test_pack_matches_slow_reference_on_random_rows(samples):
    row = row_of(samples)
    packed = pack(row)
    positions = sample_positions(row)
    nodes = reference_nodes(samples)
    assert packed.num_tokens == row.num_tokens == len(nodes)
    assert packed.load == sum(len(node) for node in nodes)
    assert packed.num_raw_tokens == sum(len(s) for s in samples)
    check_paths(packed, samples, positions)
    check_segments(packed)
    check_terms(packed, samples, positions)
