"""TorchEngine on tiny random Llama / Qwen3 models (CPU, float32): greedy equals transformers' generate, reported
log-probs and candidate sets equal a recomputation, seeds are batch-invariant, pause/resume, weight loading, scoring,
stats, stops, rejection and failures."""

import asyncio
import math
import re

import pytest
import torch

from rlasync.engine import EngineError, RequestRejectedError, SamplingParams, TorchEngine

TINY = dict(
    vocab_size=160,
    hidden_size=48,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
    tie_word_embeddings=False,
)
PROMPTS = [
    [5],
    [17, 3, 99],
    list(range(20, 27)),
    [7, 1, 150, 64, 33, 2, 90, 11, 42, 8, 19, 100, 4],
    list(range(40, 70)),
]


def tiny_model(family="llama", seed=0, init=0.3, **overrides):
    """A tiny random causal LM; a large `init` makes logits peaky (no near-ties in greedy comparisons)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    config = {**TINY, "initializer_range": init, **overrides}
    if family == "qwen2":
        from transformers import Qwen2Config

        config = Qwen2Config(**config)
    else:
        config = LlamaConfig(**config) if family == "llama" else Qwen3Config(**config, head_dim=12)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


def make_engine(model, **kwargs):
    # the CPU reference path in float32, also on a machine with a GPU (the GPU path: test_torch_engine_cuda.py)
    options = dict(max_model_len=128, kv_cache_tokens=1024, block_size=4, eos_token_ids=[], device="cpu")
    return TorchEngine(model, **{**options, **kwargs})


def greedy_reference(model, prompt, max_new_tokens):
    ids = torch.tensor([prompt])
    out = model.generate(
        ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=0
    )
    return out[0, len(prompt) :].tolist()


async def generate_all(engine, prompts, params):
    params = params if isinstance(params, list) else [params] * len(prompts)
    return await asyncio.gather(*(engine.generate(p, s) for p, s in zip(prompts, params)))


async def wait_until(condition, timeout_s=10.0):
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not condition():
        if loop.time() > deadline:
            raise TimeoutError("condition not reached")
        await asyncio.sleep(0.001)


def perturbed_state(model, scale=0.2, seed=1):
    generator = torch.Generator().manual_seed(seed)
    return {
        name: param.detach() + scale * torch.randn(param.shape, generator=generator)
        for name, param in model.named_parameters()
    }


# ---- reference processing (the documented order: penalty, temperature, top-k, top-p, min-p) -----------------------


def reference_processed(logits, params, seen):
    """float64 processed log-probs [V] (-inf outside the candidate set) and the sorted candidate ids."""
    x = logits.double().clone()
    if params.repetition_penalty != 1:
        for token in set(seen):
            x[token] = x[token] / params.repetition_penalty if x[token] > 0 else x[token] * params.repetition_penalty
    x = x / (params.temperature if params.temperature > 0 else 1.0)
    keep = torch.ones_like(x, dtype=torch.bool)
    order = sorted(range(len(x)), key=lambda t: (-float(x[t]), t))
    if params.top_k > 0:
        keep[:] = False
        keep[order[: params.top_k]] = True
    if params.top_p < 1:
        probs = torch.softmax(x.masked_fill(~keep, -math.inf), 0)
        mass = 0.0
        for token in order:
            if not keep[token]:
                continue
            if mass >= params.top_p:
                keep[token] = False
            mass += float(probs[token])
    if params.min_p:
        keep &= torch.exp(x - x.max()) >= params.min_p
    logprobs = (x - torch.logsumexp(x[keep], 0)).masked_fill(~keep, -math.inf)
    return logprobs, keep.nonzero()[:, 0].tolist()


def recomputed(model, record):
    """Per output position: (reference processed log-probs [V], candidate ids), from one full forward."""
    ids = record.prompt_ids + record.output_ids
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0]
    start = len(record.prompt_ids) - 1
    return [
        (logits[start + j], ids[: start + 1 + j])  # the logits predicting output j, and the tokens seen before it
        for j in range(len(record.output_ids))
    ]


# ---- greedy equals transformers ------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_greedy_output_equals_transformers_generate_for_concurrent_prompts(family):
    model = tiny_model(family)
    references = [greedy_reference(model, prompt, 24) for prompt in PROMPTS]
    engine = make_engine(model)
    records = asyncio.run(generate_all(engine, PROMPTS, SamplingParams(max_tokens=24, temperature=0)))
    for record, reference in zip(records, references):
        assert record.output_ids == reference
        assert record.finish_reason == "length"
        assert record.output_sampling_mask is None and record.output_sampler_logprobs is None
        assert len(record.output_log_probs) == 24


def test_greedy_output_survives_chunked_prefill_and_preemption():
    model = tiny_model("qwen3", seed=3)
    references = [greedy_reference(model, prompt, 24) for prompt in PROMPTS]
    # 64 KV slots for ~140 tokens of work and 8 tokens per step: prompts are chunked and requests preempted
    engine = make_engine(model, max_model_len=64, kv_cache_tokens=64, max_num_batched_tokens=8)
    records = asyncio.run(generate_all(engine, PROMPTS, SamplingParams(max_tokens=24, temperature=0)))
    assert [r.output_ids for r in records] == references
    stats = engine.stats()
    assert stats.num_preemptions > 0
    assert stats.kv_cache_usage_frac == 0 and stats.num_running == stats.num_waiting == 0


# ---- sampled log-probs, candidate sets, top-N ----------------------------------------------------------------------

SAMPLING_CASES = {
    "plain": SamplingParams(max_tokens=12, temperature=1.0),
    "temperature_top_k": SamplingParams(max_tokens=12, temperature=0.7, top_k=8),
    "top_p": SamplingParams(max_tokens=12, temperature=1.3, top_p=0.85, num_logprobs=4),
    "all_filters_penalty": SamplingParams(
        max_tokens=12, temperature=0.9, top_k=40, top_p=0.9, min_p=0.05, repetition_penalty=1.3, num_logprobs=5
    ),
    "greedy_top_k": SamplingParams(max_tokens=12, temperature=0.0, top_k=5, num_logprobs=3),
}


@pytest.mark.parametrize("case", SAMPLING_CASES)
def test_reported_logprobs_candidates_and_top_n_equal_a_recomputation(case):
    params = SAMPLING_CASES[case]
    model = tiny_model("llama", seed=1, init=0.05)
    engine = make_engine(model)
    prompts = PROMPTS[1:4]
    records = asyncio.run(generate_all(engine, prompts, params))
    for record in records:
        assert len(record.output_ids) == 12 and len(record.output_log_probs) == 12
        for j, (logits, seen) in enumerate(recomputed(model, record)):
            logprobs, candidates = reference_processed(logits, params, seen)
            token = record.output_ids[j]
            assert record.output_log_probs[j] == pytest.approx(float(logprobs[token]), abs=1e-5)
            if params.filters:
                assert sorted(record.output_sampling_mask[j]) == candidates
            if params.num_logprobs:
                top = logprobs.topk(params.num_logprobs)
                expected = {int(i): float(v) for i, v in zip(top.indices, top.values) if v > -math.inf}
                got = record.output_sampler_logprobs[j]
                assert got.keys() == expected.keys()
                assert all(got[i] == pytest.approx(expected[i], abs=1e-5) for i in got)
        if not params.filters:
            assert record.output_sampling_mask is None
        if not params.num_logprobs:
            assert record.output_sampler_logprobs is None


def test_seeded_sample_is_identical_alone_and_among_ten_other_requests():
    model = tiny_model("qwen3", seed=2, init=0.05)
    engine = make_engine(model)
    seeded = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=1234)
    prompt = PROMPTS[3]
    alone = asyncio.run(engine.generate(prompt, seeded))
    others = [SamplingParams(max_tokens=8 + i, temperature=0.5 + 0.1 * i, top_k=i) for i in range(10)]
    other_prompts = [PROMPTS[i % len(PROMPTS)] + [i] * i for i in range(10)]
    crowd = asyncio.run(
        generate_all(engine, [*other_prompts[:5], prompt, *other_prompts[5:]], [*others[:5], seeded, *others[5:]])
    )
    together = crowd[5]
    assert together.output_ids == alone.output_ids
    assert together.output_log_probs == pytest.approx(alone.output_log_probs, abs=1e-5)
    unseeded = asyncio.run(generate_all(engine, [prompt] * 2, SamplingParams(max_tokens=16)))
    assert unseeded[0].output_ids != unseeded[1].output_ids  # each unseeded request draws its own seed


# ---- weights, pause -------------------------------------------------------------------------------------------------


def test_load_weights_changes_outputs_and_loading_the_old_weights_restores_them():
    model = tiny_model("llama")
    old = {name: param.detach().clone() for name, param in model.named_parameters()}
    engine = make_engine(model)
    greedy = SamplingParams(max_tokens=16, temperature=0)

    async def run():
        before = await generate_all(engine, PROMPTS, greedy)
        with pytest.raises(RuntimeError, match="pause"):
            await engine.load_weights(old.items())
        await engine.pause()
        with pytest.raises(ValueError, match="model.no_such.weight"):
            await engine.load_weights([("model.no_such.weight", torch.zeros(1))])
        await engine.load_weights(perturbed_state(model).items())
        await engine.resume()
        changed = await generate_all(engine, PROMPTS, greedy)
        await engine.pause()
        await engine.load_weights(old.items())
        await engine.resume()
        restored = await generate_all(engine, PROMPTS, greedy)
        return before, changed, restored

    before, changed, restored = asyncio.run(run())
    assert [r.output_ids for r in changed] != [r.output_ids for r in before]
    assert [r.output_ids for r in restored] == [r.output_ids for r in before]


def test_weights_loaded_mid_request_are_used_for_the_rest_of_it_and_tied_embeddings_load_by_either_name():
    model = tiny_model("qwen3", tie_word_embeddings=True)
    new_state = perturbed_state(model)  # tied: named_parameters lists the embedding once, as model.embed_tokens
    reference = tiny_model("qwen3", tie_word_embeddings=True)
    reference.load_state_dict(new_state, strict=False)
    # send the tied matrix under its other name: the input embedding must follow
    sent = {("lm_head.weight" if k == "model.embed_tokens.weight" else k): v for k, v in new_state.items()}
    engine = make_engine(model)
    greedy = SamplingParams(max_tokens=30, temperature=0)

    async def run():
        tasks = [asyncio.create_task(engine.generate(p, greedy)) for p in PROMPTS]
        await wait_until(lambda: engine.stats().extra["num_steps"] >= 3)
        await engine.pause()
        preemptions = engine.stats().num_preemptions
        await engine.load_weights(sent.items())
        assert engine.stats().num_preemptions == preemptions + engine.stats().num_waiting
        assert engine.stats().num_running == 0
        await engine.resume()
        return await asyncio.gather(*tasks)

    records = asyncio.run(run())
    assert torch.equal(model.get_input_embeddings().weight, new_state["model.embed_tokens.weight"])
    assert_ends_greedy_under(reference, records)


def assert_ends_greedy_under(reference, records, last=10):
    """Every record's last `last` tokens are `reference`'s greedy choices given the whole prefix (a weight sync
    reached the engine: the tokens after it come from the new model)."""
    for record in records:
        ids = record.prompt_ids + record.output_ids
        with torch.no_grad():
            logits = reference(torch.tensor([ids])).logits[0]
        new_choices = logits[len(record.prompt_ids) - 1 : -1].argmax(-1).tolist()
        matches = [a == b for a, b in zip(new_choices, record.output_ids)]
        assert all(matches[-last:]), matches


def test_pause_stops_progress_and_resume_finishes_every_request():
    engine = make_engine(tiny_model("llama"))
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=7)

    async def run():
        tasks = [asyncio.create_task(engine.generate(p, params)) for p in PROMPTS]
        await wait_until(lambda: engine.stats().extra["num_steps"] >= 2)
        await engine.pause()
        frozen = engine.stats()
        await asyncio.sleep(0.05)
        assert engine.stats().extra == frozen.extra
        assert not any(task.done() for task in tasks)
        assert frozen.num_running + frozen.num_waiting == len(PROMPTS)
        late = asyncio.create_task(engine.generate([3, 4], params))  # a request arriving while paused waits
        scored = asyncio.create_task(engine.score([1, 2, 3], 1, 2))  # and so does a score
        await asyncio.sleep(0.02)
        assert not late.done() and not scored.done()
        await engine.resume()
        return await asyncio.gather(*tasks, late, scored)

    *records, _ = asyncio.run(run())
    assert all(len(r.output_ids) == 40 and r.finish_reason == "length" for r in records)


def test_64_concurrent_requests_all_finish():
    engine = make_engine(tiny_model("qwen3", init=0.05), kv_cache_tokens=512, max_num_seqs=32)
    prompts = [[(7 * i + j) % 160 for j in range(1 + i % 9)] for i in range(64)]
    params = [SamplingParams(max_tokens=4 + i % 13, temperature=1.0, top_k=i % 3 * 10, seed=i) for i in range(64)]
    records = asyncio.run(generate_all(engine, prompts, params))
    assert [len(r.output_ids) for r in records] == [p.max_tokens for p in params]
    stats = engine.stats()
    assert stats.kv_cache_usage_frac == 0 and stats.num_running == stats.num_waiting == 0
    assert stats.extra["num_generated_tokens"] == sum(p.max_tokens for p in params)


# ---- score, stats ----------------------------------------------------------------------------------------------------


def test_score_equals_a_full_forward_log_softmax():
    model = tiny_model("qwen3", init=0.1)
    tokens = PROMPTS[3] + [9, 8, 7, 6, 5, 150]
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([tokens])).logits[0].double(), -1)
    engine = make_engine(model)
    prompt_length = len(PROMPTS[3])
    result = asyncio.run(engine.score(tokens, prompt_length, top_k=4))
    expected = logprobs[prompt_length - 1 : -1]
    top = expected.topk(4)
    assert result.topk_ids == top.indices.tolist()
    for row, values in zip(result.topk_logprobs, top.values.tolist()):
        assert row == pytest.approx(values, abs=1e-5)
    realised = expected.gather(1, torch.tensor(tokens[prompt_length:])[:, None])[:, 0].tolist()
    assert result.token_logprobs == pytest.approx(realised, abs=1e-5)
    with pytest.raises(RequestRejectedError):
        asyncio.run(engine.score(tokens, len(tokens), top_k=4))


def test_score_at_a_temperature_is_the_log_softmax_of_the_scaled_logits():
    model = tiny_model("qwen3", init=0.1)
    tokens = PROMPTS[2] + [4, 150, 7]
    prompt_length = len(PROMPTS[2])
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].double()[prompt_length - 1 : -1]
    engine = make_engine(model)
    hot = asyncio.run(engine.score(tokens, prompt_length, top_k=3, temperature=2.0))
    cold = asyncio.run(engine.score(tokens, prompt_length, top_k=3))
    realised = torch.tensor(tokens[prompt_length:])[:, None]
    for temperature, result in ((2.0, hot), (1.0, cold)):
        expected = torch.log_softmax(logits / temperature, -1)
        assert result.token_logprobs == pytest.approx(expected.gather(1, realised)[:, 0].tolist(), abs=1e-5)
        assert result.topk_ids == expected.topk(3).indices.tolist()
    assert hot.token_logprobs != pytest.approx(cold.token_logprobs, abs=1e-3)  # the temperature mattered
    with pytest.raises(RequestRejectedError, match="temperature"):
        asyncio.run(engine.score(tokens, prompt_length, top_k=3, temperature=0.0))


def test_stats_move_as_requests_come_and_go():
    engine = make_engine(tiny_model("llama"), kv_cache_tokens=256)
    params = SamplingParams(max_tokens=30, temperature=1.0, seed=3)
    start = engine.stats()
    assert (start.num_running, start.num_waiting, start.kv_cache_usage_frac) == (0, 0, 0.0)
    assert start.kv_capacity_tokens == 256 and start.max_model_len == 128

    async def run():
        await engine.pause()
        tasks = [asyncio.create_task(engine.generate(p, params)) for p in PROMPTS]
        await asyncio.sleep(0.01)
        queued = engine.stats()
        assert (queued.num_running, queued.num_waiting, queued.kv_cache_usage_frac) == (0, len(PROMPTS), 0.0)
        await engine.resume()
        await wait_until(lambda: engine.stats().extra["num_steps"] >= 3)
        await engine.pause()
        running = engine.stats()
        assert running.num_running == len(PROMPTS) and running.num_waiting == 0
        assert running.kv_cache_usage_frac > 0
        await engine.resume()
        await asyncio.gather(*tasks)

    asyncio.run(run())
    end = engine.stats()
    assert (end.num_running, end.num_waiting, end.kv_cache_usage_frac) == (0, 0, 0.0)


# ---- stops, rejection, failures -------------------------------------------------------------------------------------


def test_stops_on_eos_stop_ids_max_tokens_and_max_model_len():
    model = tiny_model("llama")
    greedy = greedy_reference(model, PROMPTS[2], 20)
    eos = greedy[5]
    first = greedy.index(eos)
    engine = make_engine(model, eos_token_ids=[eos], max_model_len=20)

    async def run():
        return await asyncio.gather(
            engine.generate(PROMPTS[2], SamplingParams(max_tokens=12, temperature=0)),
            engine.generate(PROMPTS[2], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)),
            engine.generate(
                PROMPTS[2], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, stop_token_ids=(greedy[2],))
            ),
            engine.generate(PROMPTS[2], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)),
            engine.generate(list(range(16)), SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)),
        )

    eos_stop, ignored, stop_id, short, long_prompt = asyncio.run(run())
    assert eos_stop.output_ids == greedy[: first + 1] and eos_stop.finish_reason == "stop"
    assert ignored.output_ids == greedy[:12] and ignored.finish_reason == "length"
    assert stop_id.output_ids == greedy[: greedy.index(greedy[2]) + 1] and stop_id.finish_reason == "stop"
    assert short.output_ids == greedy[:3] and short.finish_reason == "length"
    assert len(long_prompt.output_ids) == 4 and long_prompt.finish_reason == "length"  # 16 + 4 = max_model_len


def test_a_prompt_longer_than_max_model_len_is_rejected_at_once():
    engine = make_engine(tiny_model("llama"), max_model_len=16)

    async def run():
        for prompt in (list(range(16)), list(range(40)), []):
            with pytest.raises(RequestRejectedError):
                await asyncio.wait_for(engine.generate(prompt, SamplingParams()), timeout=1)
        for prompt, bad in (([1, 999], [999]), ([-1, 3, -5], [-1, -5]), ([2, engine.vocab_size], [engine.vocab_size])):
            with pytest.raises(RequestRejectedError, match=rf"token ids {re.escape(str(bad))} are outside the vocab"):
                await asyncio.wait_for(engine.generate(prompt, SamplingParams()), timeout=1)
        return engine.stats()

    stats = asyncio.run(run())
    assert stats.num_waiting == stats.num_running == 0


def test_a_failed_step_fails_its_requests_with_engine_error_and_the_engine_goes_on(monkeypatch):
    engine = make_engine(tiny_model("llama"))
    execute = engine._runner.execute
    calls = []

    def failing_once(chunks):
        calls.append(len(chunks))
        if len(calls) == 1:
            raise RuntimeError("injected")
        return execute(chunks)

    monkeypatch.setattr(engine._runner, "execute", failing_once)
    params = SamplingParams(max_tokens=4, temperature=0)

    async def run():
        failed = await asyncio.gather(*(engine.generate(p, params) for p in PROMPTS), return_exceptions=True)
        assert engine.stats().kv_cache_usage_frac == 0
        later = await engine.generate(PROMPTS[0], params)
        return failed, later

    failed, later = asyncio.run(run())
    assert all(isinstance(e, EngineError) and "injected" in str(e) for e in failed)
    assert len(later.output_ids) == 4


def test_close_fails_pending_requests_and_cancelled_requests_free_their_blocks():
    engine = make_engine(tiny_model("llama"))
    params = SamplingParams(max_tokens=50, temperature=1.0)

    async def run():
        task = asyncio.create_task(engine.generate(PROMPTS[4], params))
        await wait_until(lambda: engine.stats().num_running == 1)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await wait_until(lambda: engine.stats().num_running == 0)
        assert engine.stats().kv_cache_usage_frac == 0
        await engine.pause()
        pending = asyncio.create_task(engine.generate(PROMPTS[0], params))
        await asyncio.sleep(0.01)
        await engine.close()
        with pytest.raises(EngineError, match="closed"):
            await pending
        with pytest.raises(EngineError, match="closed"):
            await engine.generate(PROMPTS[0], params)

    asyncio.run(run())


def test_torch_engine_is_exported_lazily_and_is_an_engine():
    import rlasync.engine
    from rlasync.engine.torch_engine import TorchEngine as direct

    assert rlasync.engine.TorchEngine is direct
    assert isinstance(make_engine(tiny_model("llama")), rlasync.engine.Engine)


def test_unsupported_architectures_and_too_small_caches_are_refused():
    from transformers import AutoModelForCausalLM, GPT2Config

    gpt2 = AutoModelForCausalLM.from_config(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=64))
    with pytest.raises(ValueError, match="qwen3"):
        TorchEngine(gpt2, device="cpu")
    with pytest.raises(ValueError, match="kv_cache_tokens"):
        make_engine(tiny_model("llama"), kv_cache_tokens=64, max_model_len=128)


# ---- prefix caching -------------------------------------------------------------------------------------------------


def test_a_group_sharing_its_prompt_gets_the_same_tokens_and_logprobs_with_and_without_prefix_caching():
    """A GRPO group: 6 seeded requests on one prompt (plus a distinct one). With prefix caching the prompt's full
    blocks are computed once and shared; every token and log-prob is what the uncached engine gives, greedy rows
    equal transformers, and a weight load empties the cache (the next request recomputes its prompt)."""
    model = tiny_model("qwen3", seed=4, init=0.05)
    prompt = PROMPTS[4]  # 30 tokens: 7 full blocks of 4
    prompts = [prompt] * 6 + [PROMPTS[3]]
    params = [SamplingParams(max_tokens=12, temperature=1.0, top_k=20, seed=100 + i) for i in range(6)]
    params.append(SamplingParams(max_tokens=12, temperature=0))
    results, engines = {}, {}
    for caching in (False, True):
        engines[caching] = engine = make_engine(model, enable_prefix_caching=caching)
        results[caching] = asyncio.run(generate_all(engine, prompts, params))
    for cached, plain in zip(results[True], results[False]):
        assert cached.output_ids == plain.output_ids
        assert cached.output_log_probs == pytest.approx(plain.output_log_probs, abs=1e-5)
    assert results[True][-1].output_ids == greedy_reference(model, PROMPTS[3], 12)
    assert engines[False].stats().extra["prefix_cache_hit_tokens"] == 0
    hits = engines[True].stats().extra["prefix_cache_hit_tokens"]
    assert hits == 5 * 28  # the 5 followers skip the 7 full blocks

    engine = engines[True]

    async def reload_then_generate():
        await engine.pause()
        await engine.load_weights(perturbed_state(model).items())
        await engine.resume()
        return await engine.generate(prompt, SamplingParams(max_tokens=12, temperature=0))

    after = asyncio.run(reload_then_generate())
    assert engine.stats().extra["prefix_cache_hit_tokens"] == hits  # nothing reused across the weight load
    assert after.output_ids == greedy_reference(model, prompt, 12)  # the model now holds the loaded weights
