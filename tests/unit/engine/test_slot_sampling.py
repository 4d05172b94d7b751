"""Per-slot sampling tensors (`SlotSampling`) give the batch `BatchSampling.from_params` gives, rows are written only
when a slot changes owner, and a step's results leave the device packed in one tensor and unpack to the same values."""

import pytest
import torch

from rlasync.engine.base import SamplingParams
from rlasync.engine.runner import _unpack
from rlasync.engine.sampler import BatchSampling, sample
from rlasync.engine.slot_sampling import SlotSampling
from rlasync.records import TopLogprobs

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
            # a packed row: the step's N ranked ids, then their log-probs
            assert token.top_logprobs.tolist() == result.topn_ids[row].tolist() + result.topn_logprobs[row].tolist()
            (top,) = TopLogprobs.from_rows([token.top_logprobs], p.num_logprobs)  # as the request reads it
            assert top == {i: lp for i, lp in zip(ids, lps) if lp != float("-inf")}
        else:
            assert token.top_logprobs is None
        if p.filters and p.return_sampling_mask:
            assert token.candidates == result.candidate_ids[row, : int(result.num_candidates[row])].tolist()
            assert token.candidates  # a non-empty candidate set
        else:
            assert token.candidates is None


def test_a_step_with_the_same_slots_reuses_the_last_batch_until_a_slot_is_rewritten():
    slots = SlotSampling(8, "cpu")
    order = [6, 0, 3, 1]
    first, _ = slots.batch(order, PARAMS, SEEDS, [0, 4, 9, 2])
    again, steps = slots.batch(order, PARAMS, SEEDS, [1, 5, 10, 3])
    assert again is first and slots.num_reused == 1
    assert steps.tolist() == [1, 5, 10, 3]  # the steps are always this step's
    assert_same_batch(again, BatchSampling.from_params(PARAMS, SEEDS, "cpu"))
    new = SamplingParams(temperature=0.5, top_k=2)  # slot 6 changes owner: the batch is rebuilt
    changed, _ = slots.batch(order, [new, *PARAMS[1:]], SEEDS, [0, 0, 0, 0])
    assert slots.num_reused == 1
    assert_same_batch(changed, BatchSampling.from_params([new, *PARAMS[1:]], SEEDS, "cpu"))
    swapped = [0, 6, 3, 1]  # the same slots in another order: rebuilt
    params = [PARAMS[1], new, PARAMS[2], PARAMS[3]]
    seeds = [SEEDS[1], SEEDS[0], SEEDS[2], SEEDS[3]]
    batch, _ = slots.batch(swapped, params, seeds, [0, 0, 0, 0])
    assert slots.num_reused == 1
    assert_same_batch(batch, BatchSampling.from_params(params, seeds, "cpu"))
    for subset in (swapped, [6], [1, 3], [0]):
        owners = [params[swapped.index(slot)] for slot in subset]
        want = any(p.filters and p.return_sampling_mask for p in owners)
        assert slots.wants_candidates(subset) == want, subset
    plain = SamplingParams(temperature=1.0, top_k=3, return_sampling_mask=False)  # filters, no mask asked
    slots.batch([2], [plain], [5], [0])
    assert not slots.wants_candidates([2]) and slots.wants_candidates([2, 6])


def test_unpacked_top_logprobs_keep_the_rank_order_and_drop_the_padding_of_short_candidate_sets():
    """A row asking for more log-probs than it has candidates (top_k=2, 4 log-probs) reports only the finite ones;
    the others report N entries, best first."""
    params = [
        SamplingParams(temperature=1.0, top_k=2, num_logprobs=4),
        SamplingParams(temperature=1.0, num_logprobs=4),
        SamplingParams(temperature=0.0, num_logprobs=2),
    ]
    torch.manual_seed(2)
    logits = torch.randn(3, 30) * 2
    result = sample(logits, BatchSampling.from_params(params, [1, 2, 3], "cpu"), torch.zeros(3, dtype=torch.int64))
    tokens = _unpack(result, params)
    short, full, greedy = (
        list(TopLogprobs.from_rows([t.top_logprobs], p.num_logprobs)[0].items()) for t, p in zip(tokens, params)
    )
    assert len(short) == 2 and len(full) == 4 and len(greedy) == 2
    for row, items in enumerate((short, full, greedy)):
        n = params[row].num_logprobs
        assert [i for i, _ in items] == result.topn_ids[row, : len(items)].tolist()
        assert [lp for _, lp in items] == result.topn_logprobs[row, : len(items)].tolist()
        assert result.topn_logprobs[row, len(items) : n].eq(float("-inf")).all()
        assert all(type(i) is int and type(lp) is float for i, lp in items)
        assert [lp for _, lp in items] == sorted((lp for _, lp in items), reverse=True)


def test_a_requests_top_logprobs_from_steps_of_different_widths_read_as_its_own_top_k():
    """A request asking for 2 log-probs in steps whose widest ask was 4, then 2, then none at all (None): its record
    holds its own 2 best of each step, ranked, with pads where a step had none."""
    import numpy as np

    from rlasync.engine.request import Request

    request = Request(0, [1, 2], SamplingParams(num_logprobs=2, max_tokens=8), 0, 8, frozenset())
    rows = [
        np.array([7.0, 3.0, 9.0, 1.0, -0.1, -0.5, -2.0, -3.0]),  # N = 4
        np.array([4.0, 6.0, -0.2, -np.inf]),  # N = 2, one candidate only
        None,
    ]
    for token, row in zip([7, 4, 5], rows):
        request.append(token, -0.1, row)
    top = request.to_turn_record().output_sampler_logprobs
    assert list(top) == [{7: -0.1, 3: -0.5}, {4: -0.2}, {}]
    assert top.ids.tolist() == [[7, 3], [4, -1], [-1, -1]]
