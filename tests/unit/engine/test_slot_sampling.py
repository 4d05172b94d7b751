"""Per-slot sampling tensors (`SlotSampling`) give the batch `BatchSampling.from_params` gives, rows are written only
when a slot changes owner, and a step's results leave the device packed in one tensor and unpack to the same values."""

import pytest
import torch

from rlasync.engine.base import SamplingParams
from rlasync.engine.runner import _unpack
from rlasync.engine.sampler import BatchSampling, sample
from rlasync.engine.slot_sampling import SlotSampling

PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.7, top_k=5, num_logprobs=3),
    SamplingParams(temperature=1.3, top_p=0.8, min_p=0.05, repetition_penalty=1.2),
    SamplingParams(temperature=1.0, top_k=-1, num_logprobs=1, return_sampling_mask=True, top_p=0.9),
]
SEEDS = [2**64 - 1, 5, 123456789, 0]


def assert_same_batch(got: BatchSampling, want: BatchSampling) -> None:
    for name in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty", "seeds"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert got.num_logprobs == want.num_logprobs
    assert got.plan == want.plan


def test_slot_batches_equal_from_params_in_any_slot_order_and_write_only_new_owners():
    slots = SlotSampling(8, "cpu")
    batch, steps = slots.batch([6, 0, 3, 1], PARAMS, SEEDS, [0, 4, 9, 2])
    assert_same_batch(batch, BatchSampling.from_params(PARAMS, SEEDS, "cpu"))
    assert steps.tolist() == [0, 4, 9, 2]
    assert slots.num_writes == 4
    # a later step with a subset, reordered: nothing is rewritten
    order = [2, 0, 3]
    batch, _ = slots.batch([3, 6, 1], [PARAMS[i] for i in order], [SEEDS[i] for i in order], [1, 1, 1])
    assert_same_batch(batch, BatchSampling.from_params([PARAMS[i] for i in order], [SEEDS[i] for i in order], "cpu"))
    assert slots.num_writes == 4
    # slot 0 changes owner (new params), slot 6 keeps its params object but gets another seed: both rewritten
    new = SamplingParams(temperature=0.5, top_k=2)
    batch, _ = slots.batch([0, 6], [new, PARAMS[0]], [77, 78], [0, 0])
    assert_same_batch(batch, BatchSampling.from_params([new, PARAMS[0]], [77, 78], "cpu"))
    assert slots.num_writes == 6


def test_slot_batch_samples_the_same_tokens_as_from_params():
    torch.manual_seed(0)
    logits = torch.randn(4, 50) * 3
    steps = torch.tensor([0, 3, 7, 1])
    slots = SlotSampling(4, "cpu")
    batch, slot_steps = slots.batch([3, 2, 1, 0], PARAMS, SEEDS, steps.tolist())
    got = sample(logits, batch, slot_steps)
    want = sample(logits, BatchSampling.from_params(PARAMS, SEEDS, "cpu"), steps)
    assert torch.equal(got.token_ids, want.token_ids)
    assert torch.equal(got.logprobs, want.logprobs)
    assert torch.equal(got.candidate_ids, want.candidate_ids)


def test_bad_slots_are_refused_with_the_field_named():
    slots = SlotSampling(2, "cpu")
    with pytest.raises(ValueError, match="slot 2 is outside"):
        slots.batch([2], PARAMS[:1], SEEDS[:1], [0])
    with pytest.raises(ValueError, match="2 slots, 1 params"):
        slots.batch([0, 1], PARAMS[:1], SEEDS[:1], [0])
    with pytest.raises(ValueError, match="capacity=0"):
        SlotSampling(0, "cpu")


def test_packed_results_unpack_to_the_sampler_tensors():
    torch.manual_seed(1)
    logits = torch.randn(4, 40) * 2
    result = sample(logits, BatchSampling.from_params(PARAMS, SEEDS, "cpu"), torch.zeros(4, dtype=torch.int64))
    tokens = _unpack(result, PARAMS)
    assert [t.token_id for t in tokens] == result.token_ids.tolist()
    assert [t.logprob for t in tokens] == result.logprobs.tolist()
    for row, (token, p) in enumerate(zip(tokens, PARAMS)):
        if p.num_logprobs:
            ids = result.topn_ids[row, : p.num_logprobs].tolist()
            lps = result.topn_logprobs[row, : p.num_logprobs].tolist()
            assert token.top_logprobs == {i: lp for i, lp in zip(ids, lps) if lp != float("-inf")}
        else:
            assert token.top_logprobs is None
        if p.filters and p.return_sampling_mask:
            assert token.candidates == result.candidate_ids[row, : int(result.num_candidates[row])].tolist()
            assert token.candidates  # a non-empty candidate set
        else:
            assert token.candidates is None
