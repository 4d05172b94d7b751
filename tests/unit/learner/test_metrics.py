"""reduce_across_ranks: docs/algorithms.md §8.1 rules applied across learner ranks (two ranks as threads, a fake all-reduce)."""

import math
import threading

import pytest
import torch

from rlasync.learner import reduce_across_ranks
from rlasync.learner.metrics import local_all_reduce


def run_two_ranks(records):
    """reduce_across_ranks on two 'ranks' whose all-reduce combines their vectors (SUM, MAX)."""
    barrier = threading.Barrier(2)
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    results, errors = [None, None], [None, None]

    def body(rank):
        def all_reduce(sums, maxes):
            seen[rank] = (sums, maxes)
            barrier.wait(10)
            other = seen[1 - rank]
            if other[0].shape != sums.shape or other[1].shape != maxes.shape:
                raise RuntimeError("vector shapes differ")  # a real collective would hang or fail here
            return sums + other[0], torch.maximum(maxes, other[1])

        try:
            results[rank] = reduce_across_ranks(records[rank], all_reduce)
        except Exception as exc:  # noqa: BLE001
            errors[rank] = exc

    threads = [threading.Thread(target=body, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(20)
    for error in errors:
        if error is not None:
            raise error
    return results


def test_each_key_is_reduced_by_its_rule_across_ranks():
    rank0 = {
        "ratio": (3.0, 4.0),
        "batch/trained_tokens_per_step": 40.0,
        "tools/unknown_name_total": 1.0,
        "sampling/importance_sampling_ratio/max": 1.5,
        "clip_ratio/low_min": 0.2,
        "loss": 0.5,
        "perf/fwd_bwd_s": 2.0,
        "sampling/sampling_logp_difference/max": math.nan,
        "entropy_gauge": math.nan,
    }
    rank1 = {
        "ratio": (1.0, 4.0),
        "batch/trained_tokens_per_step": 24.0,
        "tools/unknown_name_total": 2.0,
        "sampling/importance_sampling_ratio/max": 1.1,
        "clip_ratio/low_min": 0.1,
        "loss": 1.5,
        "perf/fwd_bwd_s": 4.0,
        "sampling/sampling_logp_difference/max": 0.3,
        "entropy_gauge": math.nan,
    }
    out0, out1 = run_two_ranks([rank0, rank1])
    assert out0 == pytest.approx(out1, nan_ok=True)
    assert out0["ratio"] == (4.0, 8.0)  # a rate stays a pair: Σ num / Σ den at log time
    assert out0["batch/trained_tokens_per_step"] == 64.0  # all ranks' terms
    assert out0["tools/unknown_name_total"] == 3.0
    assert out0["sampling/importance_sampling_ratio/max"] == 1.5 and out0["clip_ratio/low_min"] == 0.1
    assert out0["loss"] == 1.0 and out0["perf/fwd_bwd_s"] == 3.0
    assert out0["sampling/sampling_logp_difference/max"] == 0.3  # a rank without terms (NaN) is ignored
    assert math.isnan(out0["entropy_gauge"])


def test_ranks_with_different_keys_are_an_error():
    with pytest.raises(RuntimeError, match="different metric keys|shapes differ"):
        run_two_ranks([{"loss": 1.0, "a": 2.0}, {"loss": 1.0, "b": 2.0}])


def test_one_rank_is_the_identity():
    metrics = {"ratio": (1.0, 2.0), "loss": 0.25, "x_max": 3.0}
    assert reduce_across_ranks(metrics, local_all_reduce) == metrics
