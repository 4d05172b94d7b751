"""Sampling limits (issue 34): every setting the configs allow at its extreme (temperature at
`rlasync.config.base.MIN_TEMPERATURE` and GRPO's floor, top_k=1, top_p and min_p at their limits, the repetition
penalty at both ends of its range, max_tokens=1) samples the token it should with finite log-probs, in the eager
sampler, the compiled sampler's formulation and the CPU engine with a tiny random model; each case in well under a
second. Past the limits the float32 scaling does break (the config refuses those values: tests/unit/test_bad_inputs.py).
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from rlasync.config.base import MIN_TEMPERATURE, REPETITION_PENALTY_RANGE
from rlasync.config.grpo import GRPO_MIN_TEMPERATURE, GRPO_MIN_TOP_P
from rlasync.engine.base import SamplingParams
from rlasync.engine.sampler import BatchSampling, sample
from rlasync.engine.sampler_compiled import sample_compiled
from tests.unit.engine.test_torch_engine import generate_all, make_engine, tiny_model

LOW_PENALTY, HIGH_PENALTY = REPETITION_PENALTY_RANGE
EXTREMES = {
    "min_temperature": dict(temperature=MIN_TEMPERATURE),
    "grpo_min_temperature": dict(temperature=GRPO_MIN_TEMPERATURE),
    "top_k_1": dict(top_k=1),
    "grpo_min_top_p": dict(top_p=GRPO_MIN_TOP_P),
    "min_p_1": dict(min_p=1.0),
    "min_p_0.999": dict(min_p=0.999),
    "low_penalty_min_temperature": dict(temperature=MIN_TEMPERATURE, repetition_penalty=LOW_PENALTY),
    "high_penalty_min_temperature": dict(temperature=MIN_TEMPERATURE, repetition_penalty=HIGH_PENALTY),
    "all_filters_at_limits": dict(temperature=MIN_TEMPERATURE, top_k=1, top_p=GRPO_MIN_TOP_P, min_p=1.0),
}
# Logits as large as real models' (|x| up to 60), seen half of the vocabulary for the repetition penalty.
VOCAB = 512


def batch_of(settings, rows=4, num_logprobs=3):
    params = [SamplingParams(max_tokens=4, seed=i, num_logprobs=num_logprobs, **settings) for i in range(rows)]
    return BatchSampling.from_params(params, list(range(rows)), torch.device("cpu"))


def logits_and_seen(rows=4):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(rows, VOCAB, generator=gen) * 20
    logits[:, 7] = 60.0  # the largest logit of every row, positive: the penalty divides it
    seen = torch.zeros(rows, VOCAB, dtype=torch.bool)
    seen[:, : VOCAB // 2] = True
    return logits, seen


def expected_greedy(logits, seen, penalty):
    x = torch.where(seen & (penalty != 1), torch.where(logits > 0, logits / penalty, logits * penalty), logits)
    return x.argmax(dim=-1)


@pytest.mark.parametrize("settings", list(EXTREMES.values()), ids=list(EXTREMES))
def test_sampler_at_the_limits_returns_the_argmax_with_finite_logprobs(settings):
    logits, seen = logits_and_seen()
    batch = batch_of(settings)
    steps = torch.zeros(4, dtype=torch.int64)
    started = time.monotonic()
    for result in (
        sample(logits, batch, steps, seen_tokens=seen),
        sample_compiled(logits, batch, steps, seen_tokens=seen, compile=False),
    ):
        # every extreme here is greedy in effect (the logit gaps are >> the temperature, or one candidate)
        assert torch.equal(result.token_ids, expected_greedy(logits, seen, settings.get("repetition_penalty", 1.0)))
        assert torch.isfinite(result.logprobs).all() and (result.logprobs <= 0).all()
        assert torch.isfinite(result.topn_logprobs[:, 0]).all()
    assert time.monotonic() - started < 5


def test_below_the_temperature_floor_float32_breaks():
    """Why the floor exists and why it is not lower: far below it `x / T` overflows and the top token is lost."""
    logits, _ = logits_and_seen()
    batch = batch_of(dict(temperature=1e-38), num_logprobs=0)
    result = sample(logits, batch, torch.zeros(4, dtype=torch.int64))
    assert not torch.equal(result.token_ids, logits.argmax(dim=-1))  # the overflowed argmax left the candidates


@pytest.mark.parametrize(
    "settings",
    [
        dict(temperature=MIN_TEMPERATURE, max_tokens=6),
        dict(temperature=GRPO_MIN_TEMPERATURE, top_p=GRPO_MIN_TOP_P, max_tokens=6),
        dict(temperature=1.0, top_k=1, min_p=1.0, max_tokens=6),
        dict(temperature=MIN_TEMPERATURE, repetition_penalty=HIGH_PENALTY, max_tokens=6),
        dict(temperature=MIN_TEMPERATURE, repetition_penalty=LOW_PENALTY, max_tokens=6),
        dict(temperature=1.0, max_tokens=1),  # max_completion_length=1
    ],
    ids=["min_temperature", "grpo_floors", "top_k_1_min_p_1", "high_penalty", "low_penalty", "max_tokens_1"],
)
def test_engine_finishes_at_the_limits(settings):
    engine = make_engine(tiny_model("llama", init=0.05))
    params = [SamplingParams(seed=s, **settings) for s in range(3)]
    started = time.monotonic()
    records = asyncio.run(asyncio.wait_for(generate_all(engine, [[17, 3, 99]] * 3, params), timeout=30))
    assert time.monotonic() - started < 30
    for record in records:
        assert len(record.output_ids) == settings["max_tokens"]
        assert all(lp <= 0 and lp == lp and lp > float("-inf") for lp in record.output_log_probs)
