import math

import numpy as np
import pytest

from rlasync.algorithms.distill.samples import (
    DistillationSample,
    build_distillation_sample,
    candidates_from_score,
    parse_position,
    parse_prompt_logprobs,
)
from rlasync.engine.base import ScoreResult

# ---- parsing vLLM's prompt_logprobs ---------------------------------------------------------------------------


def test_position_sorted_by_rank_not_by_key_or_logprob_order():
    entry = {"7": {"logprob": -2.0, "rank": 2}, "3": {"logprob": -0.1, "rank": 1}, "9": {"logprob": -3.0, "rank": 3}}
    assert parse_position(entry) == ([3, 7, 9], [-0.1, -2.0, -3.0])


def test_realised_token_outside_top_k_is_kept_as_extra_entry():
    # top_k = 2: ranks 1, 2 plus the realised token 42 at rank 17
    entry = {"42": {"logprob": -6.0, "rank": 17}, "5": {"logprob": -0.2, "rank": 1}, "6": {"logprob": -1.9, "rank": 2}}
    assert parse_position(entry) == ([5, 6, 42], [-0.2, -1.9, -6.0])


def test_nan_logprobs_are_dropped_and_empty_entries_give_no_candidates():
    entry = {"1": {"logprob": float("nan"), "rank": 1}, "2": {"logprob": -1.0, "rank": 2}}
    assert parse_position(entry) == ([2], [-1.0])
    assert parse_position(None) == ([], [])
    assert parse_position({}) == ([], [])


def test_missing_ranks_fall_back_to_logprob_order():
    assert parse_position({2: -3.0, 8: -0.5}) == ([8, 2], [-0.5, -3.0])


def test_only_completion_positions_are_parsed():
    prompt_logprobs = [
        None,
        {"11": {"logprob": -0.1, "rank": 1}},
        {"12": {"logprob": -0.3, "rank": 1}},
        {"13": {"logprob": -0.7, "rank": 1}},
    ]
    assert parse_prompt_logprobs(prompt_logprobs, prompt_length=2) == [([12], [-0.3]), ([13], [-0.7])]


# ---- ScoreResult -> K+1 candidates ----------------------------------------------------------------------------


def test_score_result_gets_the_realised_token_back_when_outside_top_k():
    # ScoreResult keeps only the top-k; the realised token's log-prob sits in token_logprobs
    result = ScoreResult(
        topk_ids=[[5, 6], [7, 8]], topk_logprobs=[[-0.1, -2.0], [-0.3, -1.0]], token_logprobs=[-4.0, -1.0]
    )
    assert candidates_from_score(result, completion_ids=[42, 8]) == [
        ([5, 6, 42], [-0.1, -2.0, -4.0]),
        ([7, 8], [-0.3, -1.0]),
    ]


def test_score_result_nan_entries_are_dropped():
    result = ScoreResult(topk_ids=[[5, 6]], topk_logprobs=[[float("nan"), -2.0]], token_logprobs=[float("nan")])
    assert candidates_from_score(result, completion_ids=[9]) == [([6], [-2.0])]


# ---- the sample -----------------------------------------------------------------------------------------------


def test_sample_layout_k_plus_one_wide_prompt_rows_all_sentinel():
    result = ScoreResult(
        topk_ids=[[5, 6], [7, 8]], topk_logprobs=[[-0.1, -2.0], [-0.3, -1.0]], token_logprobs=[-4.0, -1.0]
    )
    sample = build_distillation_sample(
        [1, 2, 3],
        [42, 8],
        result,
        top_k=2,
        prompt_id=7,
        teacher_id="math",
        policy_version=4,
        prompt=[{"role": "user", "content": "q"}],
        completion=[{"role": "assistant", "content": "a"}],
        enqueued_at=12.5,
    )
    assert sample.input_ids.tolist() == [1, 2, 3, 42, 8]
    assert sample.input_ids.dtype == np.int64
    assert sample.completion_mask.tolist() == [0, 0, 0, 1, 1]
    assert sample.teacher_topk_ids.shape == (5, 3) and sample.teacher_topk_ids.dtype == np.int64
    assert sample.teacher_topk_logprobs.dtype == np.float32
    assert sample.teacher_topk_ids.tolist() == [[-1, -1, -1]] * 3 + [[5, 6, 42], [7, 8, -1]]
    lps = sample.teacher_topk_logprobs
    assert np.isneginf(lps[:3]).all() and np.isneginf(lps[4, 2])
    np.testing.assert_allclose(lps[3], [-0.1, -2.0, -4.0], rtol=1e-6)
    assert sample.model_version == sample.policy_version == 4
    assert sample.group_id == sample.prompt_id == 7
    assert sample.teacher_id == "math" and sample.enqueued_at == 12.5 and dict(sample.metrics) == {}
    assert len(sample) == 5 and sample.num_trained_tokens == 2 and sample.width == 3


def test_builder_from_parsed_candidates_matches_score_path():
    parsed = [([5, 6, 42], [-0.1, -2.0, -4.0]), ([7, 8], [-0.3, -1.0])]
    sample = build_distillation_sample([1], [42, 8], parsed, top_k=2, prompt_id=0)
    assert sample.teacher_topk_ids[1:].tolist() == [[5, 6, 42], [7, 8, -1]]


def test_missing_teacher_positions_stay_sentinel():
    sample = build_distillation_sample([1], [4, 5, 6], [([9], [-0.5])], top_k=1, prompt_id=0)
    assert sample.teacher_topk_ids[:, 0].tolist() == [-1, 9, -1, -1]


def test_too_many_candidates_or_positions_raise():
    with pytest.raises(ValueError, match="at most teacher_top_k"):
        build_distillation_sample([1], [4], [([1, 2, 3], [-1.0, -2.0, -3.0])], top_k=1, prompt_id=0)
    with pytest.raises(ValueError, match="positions of teacher candidates"):
        build_distillation_sample([1], [4], [([1], [-1.0]), ([2], [-1.0])], top_k=1, prompt_id=0)


def test_sample_validation_rejects_misaligned_arrays():
    good = {
        "input_ids": [1, 2],
        "completion_mask": [0, 1],
        "teacher_topk_ids": [[-1], [3]],
        "teacher_topk_logprobs": [[-math.inf], [-0.5]],
        "prompt_id": 0,
    }
    DistillationSample(**good)
    with pytest.raises(ValueError, match="completion_mask"):
        DistillationSample(**{**good, "completion_mask": [0, 1, 1]})
    with pytest.raises(ValueError, match=r"shape \[2, K\+1\]"):
        DistillationSample(**{**good, "teacher_topk_ids": [[-1]]})
    with pytest.raises(ValueError, match="same shape"):
        DistillationSample(**{**good, "teacher_topk_logprobs": [[-1.0, -1.0], [-1.0, -1.0]]})
    with pytest.raises(ValueError, match="prompt"):
        DistillationSample(**{**good, "teacher_topk_ids": [[4], [3]]})
