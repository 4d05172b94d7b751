"""The compiled sampler (rlasync/engine/sampler_compiled.py) against the eager one (rlasync/engine/sampler.py, itself
checked against a slow per-row reference in test_sampler.py): same tokens, top-N ids and candidate sets under the
same seeds, log-probs within float tolerance; the formulation eagerly on many random batches, the compiled graph
(CPU inductor) on a few variants; and the engine option's checks."""

from __future__ import annotations

import asyncio
import random

import pytest
import torch

from rlasync.engine.base import SamplingParams
from rlasync.engine.sampler import BatchSampling, sample
from rlasync.engine.sampler_compiled import _Variant, key_ids, rank_keys, resolve_compiled_sampler, sample_compiled
from tests.unit.engine.test_sampler import make_batch


def assert_same(expected, got, atol=1e-5) -> None:
    for name in ("token_ids", "topn_ids", "candidate_ids", "num_candidates"):
        a, b = getattr(expected, name), getattr(got, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert torch.equal(a, b), (name, a, b)
    for name in ("logprobs", "topn_logprobs"):
        a, b = getattr(expected, name), getattr(got, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert torch.equal(torch.isfinite(a), torch.isfinite(b)), name
            assert torch.allclose(a, b, atol=atol, rtol=0), (name, (a - b).abs().max())


def test_rank_keys_order_is_value_desc_then_id_asc():
    x = torch.tensor([[0.5, -0.0, 2.0, 0.0, float("-inf"), 2.0, -3.0, float("-inf"), float("inf"), -1e-30]])
    ids = torch.arange(x.shape[1])
    ranked = key_ids(rank_keys(x, ids).sort(dim=-1, descending=True).values)[0].tolist()
    expected = sorted(range(x.shape[1]), key=lambda i: (-float(x[0, i]), i))  # -0.0 and 0.0 tie: by id
    assert ranked == expected
    assert rank_keys(x, ids)[0].unique().numel() == x.shape[1]


@pytest.mark.parametrize("windowed", [False, True])
def test_formulation_equals_eager_sampler(windowed):
    """`_core` run eagerly: the key-based ranking and the rest of the rules give the eager sampler's results on mixed
    batches (ties in every third row, -inf ids, penalties, greedy rows, every filter)."""
    for seed in range(25):
        params, logits, seen, seeds = make_batch(rows=24, vocab=40, seed=seed, windowed=windowed)
        batch = BatchSampling.from_params(params, seeds)
        steps = torch.arange(24) % 5
        expected = sample(logits, batch, steps, seen_tokens=seen)
        assert_same(expected, sample_compiled(logits, batch, steps, seen_tokens=seen, compile=False), atol=1e-6)
        no_candidates = sample_compiled(logits, batch, steps, seen_tokens=seen, compile=False, return_candidates=False)
        assert no_candidates.candidate_ids is None and torch.equal(no_candidates.token_ids, expected.token_ids)


def test_compiled_common_path_equals_eager_sampler():
    """The inductor-compiled graph (CPU) on the engine's common path (temperature, per-request seeds, 8 top
    log-probs, ties in some rows) at several batch sizes, one row included, with a vocabulary that is not a multiple
    of the vector width, logits at several storage offsets: one graph for all of them (a dynamic batch dimension;
    dynamo specialises sizes and offsets 0 and 1, so a single row runs as two and views are copied to offset 0,
    else a second compile would stall the engine for seconds in the middle of a run)."""
    from torch._dynamo.utils import counters

    rng = random.Random(0)
    vocab = 999
    params = [SamplingParams(temperature=1.0, num_logprobs=8, seed=i) for i in range(32)]
    logits = torch.randn(32, vocab, generator=torch.Generator().manual_seed(1)) * 4
    logits[::4] = (logits[::4] * 2).round() / 2
    graphs = []
    for rows, first in ((32, 0), (19, 0), (1, 0), (2, 0), (3, 5), (1, 7)):  # logits views at offsets 0, 5V, 7V
        batch = BatchSampling.from_params(params[:rows], [rng.getrandbits(63) for _ in range(rows)])
        steps = torch.arange(rows) * 3
        got = sample_compiled(logits[first : first + rows], batch, steps)
        assert got.token_ids.shape == (rows,) and got.topn_ids.shape == (rows, 8)
        assert_same(sample(logits[first : first + rows], batch, steps), got)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[-1] == graphs[0], f"recompiled for another batch size: unique graphs {graphs}"


@pytest.mark.slow
@pytest.mark.parametrize("windowed", [False, True])
def test_compiled_every_stage_equals_eager_sampler(windowed):
    """The compiled graph on mixed batches with every stage (penalty, greedy rows, top-k, top-p with a full sort or
    inside the top-k window, min-p, candidate sets), at two batch sizes."""
    with torch._dynamo.config.patch(recompile_limit=16):
        for rows in (24, 11):
            params, logits, seen, seeds = make_batch(rows=rows, vocab=40, seed=3, windowed=windowed)
            batch = BatchSampling.from_params(params, seeds)
            steps = torch.arange(rows) % 5
            assert_same(
                sample(logits, batch, steps, seen_tokens=seen), sample_compiled(logits, batch, steps, seen_tokens=seen)
            )


def test_variant_buckets_the_window_and_picks_the_stages():
    params = [SamplingParams(temperature=1.0, top_k=5, top_p=0.9), SamplingParams(temperature=0.0)]
    plan = BatchSampling.from_params(params, [1, 2]).plan
    variant = _Variant.of(plan, 1000, False, 4)
    assert variant == _Variant(False, 8, "window", False, "window", True, 4)
    assert _Variant.of(plan, 6, True, 0).k_width == 6  # clamped to the vocabulary
    assert _Variant.of(plan, 6, True, 0).random == "full"  # the window is the whole vocabulary
    plain = BatchSampling.from_params([SamplingParams(temperature=0.7, top_p=0.5)], [3]).plan
    assert _Variant.of(plain, 1000, False, 0) == _Variant(False, 0, "full", False, "full", False, 0)


def test_bad_shapes_are_refused():
    logits = torch.randn(4, 40)
    batch = BatchSampling.from_params([SamplingParams(repetition_penalty=1.3)] * 4, [0, 1, 2, 3])
    with pytest.raises(ValueError, match="logits must be"):
        sample_compiled(logits[:3], batch, torch.zeros(4, dtype=torch.int64), compile=False)
    with pytest.raises(ValueError, match="steps must be"):
        sample_compiled(logits, batch, torch.zeros(3, dtype=torch.int64), compile=False)
    seen = torch.zeros(4, 5, dtype=torch.bool)
    with pytest.raises(ValueError, match="seen_tokens"):
        sample_compiled(logits, batch, torch.zeros(4, dtype=torch.int64), seen_tokens=seen, compile=False)


def test_option_values():
    assert resolve_compiled_sampler(None) is False  # the default: off on the CPU ...
    assert resolve_compiled_sampler(None, "cuda") is True  # ... on for CUDA
    assert resolve_compiled_sampler(False, torch.device("cuda", 0)) is False
    assert resolve_compiled_sampler(True) is True
    assert resolve_compiled_sampler(False) is False
    for bad in ("yes", 1, 0.0):
        with pytest.raises(ValueError, match="compiled_sampler=.*must be True, False or None"):
            resolve_compiled_sampler(bad)


def test_engine_option_same_tokens_and_logprobs():
    """TorchEngine(compiled_sampler=True) against the default engine on a tiny model: the same tokens and top-N ids
    for seeded requests (several batch sizes as requests start and finish), the same log-probs within tolerance."""
    from rlasync.engine import TorchEngine
    from tests.unit.engine.test_torch_engine import PROMPTS, make_engine, tiny_model

    model = tiny_model("qwen3", init=0.05)
    params = [
        SamplingParams(max_tokens=6 + 3 * i, temperature=1.0, num_logprobs=3, seed=11 + i, ignore_eos=True)
        for i in range(len(PROMPTS))
    ]

    async def run(engine):
        return await asyncio.gather(*(engine.generate(p, s) for p, s in zip(PROMPTS, params)))

    eager = asyncio.run(run(make_engine(model)))
    engine = make_engine(model, compiled_sampler=True)
    assert engine._runner.compiled_sampler is True and make_engine(model)._runner.compiled_sampler is False
    compiled = asyncio.run(run(engine))
    for a, b in zip(eager, compiled):
        assert a.output_ids == b.output_ids
        assert a.output_log_probs == pytest.approx(b.output_log_probs, abs=1e-5)
        assert [sorted(t) for t in a.output_sampler_logprobs] == [sorted(t) for t in b.output_sampler_logprobs]
        for top_a, top_b in zip(a.output_sampler_logprobs, b.output_sampler_logprobs):
            assert list(top_a.values()) == pytest.approx(list(top_b.values()), abs=1e-5)
    with pytest.raises(ValueError, match="compiled_sampler='on'"):
        TorchEngine(model, device="cpu", max_model_len=64, kv_cache_tokens=256, compiled_sampler="on")


def test_engine_falls_back_to_eager_when_the_compile_fails(monkeypatch, caplog):
    """A compiled sampler that fails to compile (no triton, an inductor bug) is logged once and the eager sampler
    takes over: the requests finish with the eager engine's tokens; a ValueError (bad input) and an error that is
    not the compiler's are not swallowed."""
    import rlasync.engine.sampler_compiled as compiled_module
    from rlasync.engine.base import EngineError
    from tests.unit.engine.test_torch_engine import PROMPTS, make_engine, tiny_model

    model = tiny_model("qwen3", init=0.05)
    params = [SamplingParams(max_tokens=5, temperature=1.0, seed=3 + i, ignore_eos=True) for i in range(len(PROMPTS))]

    async def run(engine):
        return await asyncio.gather(*(engine.generate(p, s) for p, s in zip(PROMPTS, params)))

    eager = asyncio.run(run(make_engine(model)))
    calls = []

    def broken(*args, **kwargs):
        calls.append(1)
        raise torch._dynamo.exc.TorchDynamoException("inductor: no working C++ compiler")

    monkeypatch.setattr(compiled_module, "sample_compiled", broken)
    engine = make_engine(model, compiled_sampler=True)
    with caplog.at_level("WARNING", logger="rlasync.engine.runner"):
        fallback = asyncio.run(run(engine))
    assert [r.output_ids for r in fallback] == [r.output_ids for r in eager]
    assert len(calls) == 1 and engine._runner.compiled_sampler is False
    assert sum("compiled sampler failed" in r.getMessage() for r in caplog.records) == 1

    def bad_input(*args, **kwargs):
        raise ValueError("sample_compiled: logits must be [B, V]")

    monkeypatch.setattr(compiled_module, "sample_compiled", bad_input)
    with pytest.raises(EngineError, match="step failed: ValueError.*logits must be"):  # the step fails, loudly
        asyncio.run(run(make_engine(model, compiled_sampler=True)))

    def device_fault(*args, **kwargs):
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(compiled_module, "sample_compiled", device_fault)
    with pytest.raises(EngineError, match="step failed: RuntimeError.*illegal memory access"):
        asyncio.run(run(make_engine(model, compiled_sampler=True)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("top_k", [0, 50])
def test_cuda_compiled_equals_eager_at_engine_shape(top_k):
    """On CUDA (Triton kernels from inductor) at the benchmark's shape: 256 rows (and 77: the dynamic batch), the
    Qwen3 vocabulary, seeds, 8 top log-probs; the eager side uses the fused Triton Gumbel kernel where it applies."""
    vocab = 151936
    logits = (torch.randn(256, vocab, generator=torch.Generator().manual_seed(2)) * 3).to(torch.bfloat16).cuda()
    params = [SamplingParams(temperature=1.0, top_k=top_k, num_logprobs=8) for _ in range(256)]
    seeds = [random.Random(i).getrandbits(63) for i in range(256)]
    for rows in (256, 77):
        batch = BatchSampling.from_params(params[:rows], seeds[:rows], "cuda")
        steps = (torch.arange(rows) * 7).cuda()
        assert_same(sample(logits[:rows], batch, steps), sample_compiled(logits[:rows], batch, steps), atol=1e-4)


def test_warm_up_compiles_the_runs_sampling_so_requests_do_not_wait_for_it():
    """`TorchEngine.warm_up([params])` (what a GenerationActor does before freezing its heap): the compiled sampler
    compiles that variant there, and requests with the same sampling (slots, other batch sizes) compile nothing
    more; an engine with the eager sampler has nothing to warm."""
    import torch._dynamo

    from rlasync.model.compilation import compile_seconds
    from tests.unit.engine.test_torch_engine import PROMPTS, make_engine, tiny_model

    torch._dynamo.reset()  # nothing compiled before in this process counts
    params = SamplingParams(max_tokens=5, temperature=0.7, top_k=20, num_logprobs=6, ignore_eos=True)
    engine = make_engine(tiny_model("qwen3", init=0.05), compiled_sampler=True)
    before = compile_seconds()
    assert engine.warm_up([params]) > 0
    warmed = compile_seconds()
    assert warmed > before  # the variant compiled in warm_up

    async def run():
        return await asyncio.gather(*(engine.generate(p, params.with_seed(i)) for i, p in enumerate(PROMPTS)))

    records = asyncio.run(run())
    assert all(len(r.output_ids) == 5 for r in records)
    assert compile_seconds() == warmed  # nothing compiled while serving
    assert make_engine(tiny_model("qwen3"), compiled_sampler=False).warm_up([params]) == 0.0
