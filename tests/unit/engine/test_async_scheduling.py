"""Asynchronous scheduling (`TorchEngine(async_scheduling=True)`): step N+1 is launched before step N's ids are read,
its input ids fed back on the device. With a seed per request, it gives exactly the tokens, log-probs, top-N and
candidate sets of the synchronous engine: greedy and sampled, EOS / stop-id and max_tokens stops, preemption,
requests arriving mid-run, repetition penalties (drained steps), and a weight update between pause and resume."""

import asyncio

import pytest
import torch

from rlasync.engine import SamplingParams
from tests.unit.engine.test_torch_engine import (
    PROMPTS,
    assert_ends_greedy_under,
    generate_all,
    greedy_reference,
    make_engine,
    perturbed_state,
    tiny_model,
    wait_until,
)

PARAMS = [
    SamplingParams(max_tokens=12, temperature=0),
    SamplingParams(max_tokens=20, temperature=1.0, seed=3, num_logprobs=3),
    SamplingParams(max_tokens=1, temperature=0.8, seed=4),
    SamplingParams(max_tokens=25, temperature=1.2, top_k=8, top_p=0.9, seed=5, return_sampling_mask=True),
    SamplingParams(max_tokens=17, temperature=0.9, min_p=0.05, seed=6, num_logprobs=2),
    SamplingParams(max_tokens=30, temperature=1.0, seed=7, stop_token_ids=[11, 12, 13, 14, 15, 16, 17, 18, 19]),
    SamplingParams(max_tokens=9, temperature=0, ignore_eos=True),
]


def as_tuple(record):
    return (
        record.output_ids,
        record.output_log_probs,
        record.output_sampler_logprobs,
        record.output_sampling_mask,
        record.finish_reason,
    )


def assert_same_records(got, want):
    """Exact tokens, finish reasons, candidate sets and top-N ids; log-probs to 1e-5 (a step of another batch
    composition, e.g. holding a request that stopped in the step before, changes CPU float sums in the last bits)."""
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert (a[0], a[3], a[4]) == (b[0], b[3], b[4])
        assert a[1] == pytest.approx(b[1], abs=1e-5)
        assert (a[2] is None) == (b[2] is None)
        for top_a, top_b in zip(a[2] or [], b[2] or []):
            assert top_a.keys() == top_b.keys()
            assert list(top_a.values()) == pytest.approx(list(top_b.values()), abs=1e-5)


async def staggered(engine, jobs, every=2):
    """Start the jobs a few at a time, each batch once the engine made `every` more steps (arrivals mid-run)."""
    tasks = []
    for i, (prompt, params) in enumerate(jobs):
        if i and i % 3 == 0:
            target = engine.stats().extra["num_steps"] + every
            await wait_until(lambda t=target: engine.stats().extra["num_steps"] >= t or not engine.stats().num_running)
        tasks.append(asyncio.create_task(engine.generate(prompt, params)))
    return await asyncio.gather(*tasks)


def run_both(model_factory, jobs, **engine_kwargs):
    out = {}
    for mode in (False, True):
        engine = make_engine(model_factory(), async_scheduling=mode, **engine_kwargs)
        assert engine.async_scheduling is mode
        records = asyncio.run(staggered(engine, jobs))
        out[mode] = ([as_tuple(r) for r in records], engine.stats())
    return out


def jobs_of(n):
    return [(PROMPTS[i % len(PROMPTS)], PARAMS[i % len(PARAMS)]) for i in range(n)]


def test_async_is_bitwise_sync_when_every_step_holds_the_same_requests():
    """All requests arrive at once and stop by length only: no step holds a token to discard, so both modes run the
    same batches and give bitwise the same records."""
    jobs = [
        (
            p,
            SamplingParams(
                max_tokens=4 + 3 * i, temperature=1.0, seed=i, num_logprobs=2, top_k=20, return_sampling_mask=True
            ),
        )
        for i, p in enumerate(PROMPTS)
    ]
    out = {}
    for mode in (False, True):
        engine = make_engine(tiny_model("qwen3", init=0.05), async_scheduling=mode)
        launch, fed_back = engine._runner.launch, []

        def spy(chunks, previous=None, launch=launch, fed_back=fed_back):
            fed_back.append(sum(chunk.feedback_row is not None for chunk in chunks))
            return launch(chunks, previous)

        engine._runner.launch = spy
        records = asyncio.run(generate_all(engine, [p for p, _ in jobs], [s for _, s in jobs]))
        out[mode] = [as_tuple(r) for r in records]
        assert (sum(fed_back) > 0) is mode  # the async run's decode inputs came from the device
    assert out[True] == out[False]
    assert [len(r[0]) for r in out[True]] == [4 + 3 * i for i in range(len(PROMPTS))]


def test_the_default_is_synchronous():
    assert make_engine(tiny_model("llama")).async_scheduling is False


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_async_gives_the_tokens_and_logprobs_of_sync_with_stops_and_arrivals(family):
    # eos id 5 is frequent enough in a tiny random model to stop some sampled requests early
    out = run_both(lambda: tiny_model(family, init=0.05), jobs_of(14), eos_token_ids=[5])
    assert_same_records(out[True][0], out[False][0])
    reasons = {r[-1] for r in out[True][0]}
    assert reasons == {"stop", "length"}, reasons
    # the stats count real tokens only (discarded in-flight tokens of finished requests are not generated tokens)
    assert out[True][1].extra["num_generated_tokens"] == out[False][1].extra["num_generated_tokens"]
    assert out[True][1].num_running == out[True][1].num_waiting == 0


def test_async_equals_sync_under_preemption_and_chunked_prefill():
    kwargs = dict(kv_cache_tokens=128, max_num_batched_tokens=16, block_size=4)
    out = run_both(lambda: tiny_model("llama", init=0.05), jobs_of(12), **kwargs)
    assert_same_records(out[True][0], out[False][0])
    assert out[True][1].num_preemptions > 0 and out[False][1].num_preemptions > 0


def test_async_equals_sync_with_a_repetition_penalty_in_the_mix():
    penalised = SamplingParams(max_tokens=15, temperature=1.0, seed=9, repetition_penalty=1.3, num_logprobs=2)
    jobs = jobs_of(6) + [(PROMPTS[1], penalised), (PROMPTS[3], penalised)] + jobs_of(4)
    out = run_both(lambda: tiny_model("llama", init=0.05), jobs)
    assert_same_records(out[True][0], out[False][0])


def model_and_new_weights():
    """A tiny model, a perturbed state for it, and a reference model holding that state."""
    model = tiny_model("llama")
    new_state = perturbed_state(model)
    reference = tiny_model("llama")
    reference.load_state_dict(new_state, strict=False)
    return model, new_state, reference


def test_async_pause_drains_the_step_in_flight_and_a_weight_update_applies_to_the_rest():
    model, new_state, reference = model_and_new_weights()
    engine = make_engine(model, async_scheduling=True)
    greedy = SamplingParams(max_tokens=30, temperature=0)

    async def run():
        tasks = [asyncio.create_task(engine.generate(p, greedy)) for p in PROMPTS]
        await wait_until(lambda: engine.stats().extra["num_steps"] >= 3)
        await engine.pause()
        requests = [*engine._scheduler.running, *engine._scheduler.waiting]
        assert requests and all(r.num_pending == 0 for r in requests)  # no token left in flight
        assert all(len(r.output_log_probs) == r.num_output_tokens for r in requests)
        frozen = engine.stats().extra
        await asyncio.sleep(0.05)
        assert engine.stats().extra == frozen  # no step while paused
        await engine.load_weights(new_state.items())
        assert engine.stats().num_running == 0  # every running request was preempted (recompute)
        await engine.resume()
        return await asyncio.gather(*tasks)

    records = asyncio.run(run())
    for record in records:
        assert len(record.output_ids) == 30 and len(record.output_log_probs) == 30
    assert_ends_greedy_under(reference, records)  # every token after the sync is the new model's greedy choice


def test_async_score_is_served_between_overlapped_steps():
    engine = make_engine(tiny_model("llama"), async_scheduling=True)
    params = SamplingParams(max_tokens=60, temperature=1.0, seed=1)

    async def run():
        tasks = [asyncio.create_task(engine.generate(p, params)) for p in PROMPTS]
        await wait_until(lambda: engine.stats().extra["num_steps"] >= 2)
        scored = await engine.score([1, 2, 3, 4], 2, 2)
        still_running = not all(task.done() for task in tasks)
        await asyncio.gather(*tasks)
        return scored, still_running

    scored, still_running = asyncio.run(run())
    assert still_running  # the score did not wait for every request to finish
    assert len(scored.token_logprobs) == 2


def test_async_failed_collect_fails_the_steps_in_flight_and_the_engine_goes_on(monkeypatch):
    from rlasync.engine import EngineError

    engine = make_engine(tiny_model("llama"), async_scheduling=True)
    collect, calls = engine._runner.collect, []

    def failing_third(step):
        calls.append(step)
        if len(calls) == 3:  # a decode step is in flight behind it
            raise RuntimeError("injected")
        return collect(step)

    monkeypatch.setattr(engine._runner, "collect", failing_third)
    params = SamplingParams(max_tokens=8, temperature=0)

    async def run():
        failed = await asyncio.gather(*(engine.generate(p, params) for p in PROMPTS), return_exceptions=True)
        assert engine.stats().kv_cache_usage_frac == 0 and engine.stats().num_running == 0
        later = await engine.generate(PROMPTS[0], params)
        return failed, later

    failed, later = asyncio.run(run())
    assert all(isinstance(e, EngineError) and "injected" in str(e) for e in failed)
    assert len(later.output_ids) == 8


def test_async_cancelled_request_frees_its_blocks_and_slot_while_others_go_on():
    engine = make_engine(tiny_model("llama"), async_scheduling=True)
    params = SamplingParams(max_tokens=40, temperature=1.0, seed=2)

    async def run():
        victim = asyncio.create_task(engine.generate(PROMPTS[4], params))
        others = [asyncio.create_task(engine.generate(p, params)) for p in PROMPTS[:3]]
        await wait_until(lambda: engine.stats().extra["num_steps"] >= 4)
        victim.cancel()
        await asyncio.gather(victim, return_exceptions=True)
        records = await asyncio.gather(*others)
        assert engine.stats().kv_cache_usage_frac == 0
        assert sorted(engine._scheduler._free_slots) == list(range(engine._scheduler.max_num_seqs))
        return records, victim

    records, victim = asyncio.run(run())
    assert victim.cancelled()
    assert all(len(r.output_ids) == 40 for r in records)


def test_the_incremental_decode_staging_holds_in_a_real_run_with_preemptions():
    """The decode graphs stage their block table incrementally (`cuda_graphs.DecodeStaging`), trusting that a
    request's block list only grows in place or is replaced. In an overlapped CPU run with preemptions, arrivals and
    chunked prefill, every decode step's staging equals `stage_decode` from scratch."""
    import numpy as np

    from rlasync.engine.cuda_graphs import DecodeStaging, stage_decode
    from rlasync.engine.kv_cache import num_blocks_for

    engine = make_engine(
        tiny_model("llama", init=0.05),
        async_scheduling=True,
        kv_cache_tokens=128,
        max_num_batched_tokens=16,
        block_size=4,
        max_num_seqs=8,
    )
    pool = engine._runner.pool
    max_blocks = num_blocks_for(engine.max_model_len, pool.block_size)
    staging = DecodeStaging(8, pool.block_size, pool.null_block, max_blocks)
    forward, checked = engine._runner.forward, []

    def spy(chunks, feedback_ids=None):
        if all(len(chunk.token_ids) == 1 for chunk in chunks):
            args = ([c.token_ids[0] for c in chunks], [c.start for c in chunks], [c.block_ids for c in chunks])
            staging.stage(*args, 8)
            want64 = np.zeros((3, 8), dtype=np.int64)
            want32 = np.zeros(8 * (2 + max_blocks) + 1, dtype=np.int32)
            stage_decode(want64, want32, *args, 8, pool.block_size, pool.null_block, max_blocks)
            assert (staging.host64.numpy() == want64).all() and (staging.host32.numpy() == want32).all()
            checked.append(len(chunks))
        return forward(chunks, feedback_ids)

    engine._runner.forward = spy
    asyncio.run(staggered(engine, jobs_of(12)))
    assert engine.stats().num_preemptions > 0 and len(checked) > 10
    assert staging.rows_written < sum(checked)  # rows were reused, not rewritten every step


@pytest.mark.parametrize("launch_on_loop", [False, True])
def test_launch_on_loop_runs_the_launch_on_the_loop_thread_with_the_same_tokens(launch_on_loop):
    """`launch_on_loop`: each overlapped step's launch runs on the event loop's thread (else in a worker thread), its
    collect in a worker thread either way; the tokens and log-probs are the synchronous engine's."""
    import threading

    jobs = jobs_of(10)
    sync = make_engine(tiny_model("qwen3", init=0.05), async_scheduling=False, eos_token_ids=[5])
    want = [as_tuple(r) for r in asyncio.run(staggered(sync, jobs))]
    engine = make_engine(
        tiny_model("qwen3", init=0.05), async_scheduling=True, launch_on_loop=launch_on_loop, eos_token_ids=[5]
    )
    threads = {"launch": set(), "collect": set()}
    for name in threads:
        original = getattr(engine.runner, name)

        def wrapped(*args, _original=original, _name=name, **kwargs):
            threads[_name].add(threading.get_ident())
            return _original(*args, **kwargs)

        setattr(engine.runner, name, wrapped)

    async def run():
        loop_thread = threading.get_ident()
        return loop_thread, await staggered(engine, jobs)

    loop_thread, records = asyncio.run(run())
    assert_same_records([as_tuple(r) for r in records], want)
    assert threads["launch"] and threads["collect"]
    assert (threads["launch"] == {loop_thread}) is launch_on_loop
    assert loop_thread not in threads["collect"]


# ---- loads between steps (the weight sync without a pause) ---------------------------------------------------------


@pytest.mark.parametrize("async_mode", [False, True])
def test_a_load_between_steps_reaches_the_running_requests_without_a_pause(async_mode):
    import time

    model, new_state, reference = model_and_new_weights()
    engine = make_engine(model, async_scheduling=async_mode)
    greedy = SamplingParams(max_tokens=30, temperature=0)
    # Steps of 20 ms or more: the load (started from another thread, which a busy machine may start late) lands
    # with well over ten tokens still to come, not after the requests finished.
    name = "launch" if async_mode else "execute"
    inner = getattr(engine.runner, name)

    def slow_step(*args, **kwargs):
        time.sleep(0.02)
        return inner(*args, **kwargs)

    setattr(engine.runner, name, slow_step)

    async def run():
        tasks = [asyncio.create_task(engine.generate(p, greedy)) for p in PROMPTS]
        await wait_until(lambda: engine.stats().extra["num_steps"] >= 3)
        assert engine.stats().num_running > 0
        preemptions = engine.stats().num_preemptions
        phases = await asyncio.to_thread(engine.load_between_steps, new_state.items())
        assert not engine.is_paused and set(phases) == {"wait_s", "load_s"}
        return await asyncio.gather(*tasks), preemptions

    records, preemptions = asyncio.run(run())
    assert engine.stats().num_preemptions >= preemptions + 1  # the running requests recomputed their KV
    for record in records:
        assert len(record.output_ids) == 30 and len(record.output_log_probs) == 30
    assert_ends_greedy_under(reference, records)  # every token after the load is the new model's greedy choice


@pytest.mark.parametrize("async_mode", [False, True])
def test_a_load_between_steps_waits_for_the_step_being_launched_and_no_step_sees_mixed_weights(async_mode):
    import threading
    import time

    model = tiny_model("llama")
    engine = make_engine(model, async_scheduling=async_mode)
    first = next(model.parameters())
    runner = engine.runner
    name = "launch" if async_mode else "execute"
    inner = getattr(runner, name)
    seen, in_step = [], threading.Event()

    def slow_step(*args, **kwargs):  # the weights a step starts with are those it ends with
        before = first.detach().clone()
        in_step.set()
        time.sleep(0.03)
        out = inner(*args, **kwargs)
        seen.append(torch.equal(before, first))
        return out

    setattr(runner, name, slow_step)
    new_state = perturbed_state(model)

    async def run():
        tasks = [asyncio.create_task(engine.generate(p, SamplingParams(max_tokens=12, temperature=0))) for p in PROMPTS]
        await wait_until(lambda: engine.stats().extra["num_steps"] >= 2)
        in_step.clear()
        await asyncio.to_thread(in_step.wait, 5)  # a step is running now: the load queues behind it
        phases = await asyncio.to_thread(engine.load_between_steps, new_state.items())
        await asyncio.gather(*tasks)
        return phases

    phases = asyncio.run(run())
    assert phases["wait_s"] >= 0.01  # it waited for the step's launch to end
    assert seen and all(seen)
    assert torch.equal(first, new_state[next(n for n, _ in model.named_parameters())])


def test_a_load_between_steps_clears_the_prefix_cache():
    model = tiny_model("qwen3", seed=4, init=0.05)
    engine = make_engine(model, enable_prefix_caching=True)
    prompt = PROMPTS[4]
    greedy = SamplingParams(max_tokens=12, temperature=0)

    async def run():
        await generate_all(engine, [prompt] * 3, [greedy] * 3)
        hits = engine.stats().extra["prefix_cache_hit_tokens"]
        await asyncio.to_thread(engine.load_between_steps, perturbed_state(model).items())
        after = await engine.generate(prompt, greedy)
        return hits, after

    hits, after = asyncio.run(run())
    assert hits > 0
    assert engine.stats().extra["prefix_cache_hit_tokens"] == hits  # nothing cached under the old weights is reused
    assert after.output_ids == greedy_reference(model, prompt, 12)  # the model holds the loaded weights


def test_a_slow_launch_is_logged_with_its_step_and_reported_in_the_stats(caplog):
    """A launch of `SLOW_LAUNCH_S` or more (a kernel compiled mid-run, which holds the launch lock a weight sync
    waits for) is logged with the step's shape and counted; `launch_max_s` is the longest launch so far."""
    import time

    from rlasync.engine import warm_up

    engine = make_engine(tiny_model("qwen3", init=0.05), async_scheduling=True, eos_token_ids=[5])
    original, calls = engine.runner.launch, []

    def third_is_slow(*args, **kwargs):
        calls.append(None)
        if len(calls) == 3:
            time.sleep(warm_up.SLOW_LAUNCH_S + 0.02)
        return original(*args, **kwargs)

    engine.runner.launch = third_is_slow
    with caplog.at_level("WARNING", logger="rlasync.engine.torch_engine"):
        asyncio.run(staggered(engine, jobs_of(4)))
    extra = engine.stats().extra
    assert extra["num_slow_launches"] == 1.0
    assert warm_up.SLOW_LAUNCH_S + 0.02 <= extra["launch_max_s"] < 5.0
    (message,) = [r.getMessage() for r in caplog.records if "to launch" in r.getMessage()]
    assert message.startswith("TorchEngine: step 3 took ") and " step: " in message and "requests" in message


def test_warm_steps_runs_real_steps_and_leaves_nothing_behind(caplog):
    """`warm_steps`: a dummy GRPO-shaped run through the real steps (so what the first real steps would build is
    built at start-up); afterwards no block is held or cached, the launch record is reset (its slow launches are
    not logged), and seeded requests get exactly the tokens and log-probs of an engine that never warmed."""
    import time

    from rlasync.engine import warm_up

    sampling = [SamplingParams(max_tokens=48, temperature=1.0, num_logprobs=3)]
    jobs = jobs_of(8)
    cold = make_engine(tiny_model("qwen3", init=0.05), async_scheduling=True, eos_token_ids=[5], max_num_seqs=8)
    want = [as_tuple(r) for r in asyncio.run(staggered(cold, jobs))]

    engine = make_engine(tiny_model("qwen3", init=0.05), async_scheduling=True, eos_token_ids=[5], max_num_seqs=8)
    original, prompts = engine.runner.launch, []

    def first_is_slow(chunks, *args, **kwargs):
        if not prompts:
            time.sleep(warm_up.SLOW_LAUNCH_S + 0.02)
        prompts.append(len(chunks))
        return original(chunks, *args, **kwargs)

    engine.runner.launch = first_is_slow
    with caplog.at_level("WARNING", logger="rlasync.engine.torch_engine"):
        seconds = engine.warm_steps(sampling, num_requests=20, max_tokens=4)
    assert seconds > warm_up.SLOW_LAUNCH_S
    extra = engine.stats().extra
    assert extra["num_steps"] >= 4 and extra["num_generated_tokens"] >= 20
    assert max(prompts) == 8  # requests waited for slots: the steps ran full
    allocator = engine._scheduler.allocator
    assert allocator.num_used == 0 and allocator.num_cached == 0
    assert extra["launch_max_s"] == 0.0 and extra["num_slow_launches"] == 0.0
    assert not [r for r in caplog.records if "to launch" in r.getMessage()]
    engine.runner.launch = original
    assert_same_records([as_tuple(r) for r in asyncio.run(staggered(engine, jobs))], want)


def test_warm_steps_does_nothing_while_paused_or_serving():
    engine = make_engine(tiny_model("qwen3", init=0.05), async_scheduling=True)

    async def paused():
        await engine.pause()
        try:
            return engine.warm_steps([SamplingParams(max_tokens=4)], num_requests=4)
        finally:
            await engine.resume()

    assert asyncio.run(paused()) == 0.0
    assert engine.stats().extra["num_steps"] == 0.0
