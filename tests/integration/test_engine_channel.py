"""The rollout actors' channel to a GenerationActor (`actors.engine_channel`): many requests in one call, results
through one stream, the same results as one call each, per-request errors kept apart, a dead actor failing its
requests retryably."""

import asyncio

import pytest

from rlasync.engine.base import EngineError, RequestRejectedError, SamplingParams


def _actor(ray_cluster, tiny_model_dir):
    from actors.generation import GenerationActor

    return GenerationActor.options(num_cpus=0.5, max_restarts=0).remote(
        model=tiny_model_dir,
        serve_initial_weights=True,
        engine_kwargs={"max_model_len": 64, "kv_cache_tokens": 4096, "max_num_seqs": 16},
    )


def test_a_batch_of_requests_goes_in_one_call_and_matches_one_call_each(ray_cluster, tiny_model_dir):
    from actors.engine_channel import EngineChannel

    handle = _actor(ray_cluster, tiny_model_dir)
    try:
        requests = [
            ([5 + i % 7, 6, 7][: 1 + i % 3], SamplingParams(max_tokens=6 + i % 5, seed=100 + i, ignore_eos=True))
            for i in range(24)
        ]
        channel = EngineChannel(handle, max_batch=16)

        async def through_channel():
            return await asyncio.gather(*(channel.generate(ids, sampling) for ids, sampling in requests))

        streamed = asyncio.run(through_channel())
        one_each = ray_cluster.get([handle.generate.remote(ids, sampling) for ids, sampling in requests])
        assert channel.calls == 2 and channel.requests == 24  # one event-loop turn: 24 requests in 2 calls of <= 16
        assert channel.streams == 1  # their results through the channel's one stream
        assert [r.output_ids for r in streamed] == [r.output_ids for r in one_each]
        flat = [lp for r in streamed for lp in r.output_log_probs]
        assert flat == pytest.approx([lp for r in one_each for lp in r.output_log_probs], abs=1e-5)
        assert [len(r.output_ids) for r in streamed] == [6 + i % 5 for i in range(24)]

        async def with_a_rejected_request():
            good = channel.generate([5, 6], SamplingParams(max_tokens=4, seed=1))
            too_long = channel.generate(list(range(5, 40)) * 3, SamplingParams(max_tokens=4, seed=2))
            return await asyncio.gather(good, too_long, return_exceptions=True)

        good, rejected = asyncio.run(with_a_rejected_request())
        assert len(good.output_ids) == 4
        assert isinstance(rejected, RequestRejectedError), rejected  # its own error, not retried, the other answered
    finally:
        ray_cluster.kill(handle)


def test_a_dead_generation_actor_fails_its_unanswered_requests_with_a_retryable_error(ray_cluster, tiny_model_dir):
    from actors.engine_channel import EngineChannel

    handle = _actor(ray_cluster, tiny_model_dir)
    channel = EngineChannel(handle, name="generation actor 3")
    ray_cluster.get(handle.max_model_len.remote())

    async def killed_mid_stream():
        futures = [
            channel.generate([5, 6, 7], SamplingParams(max_tokens=60, seed=i, ignore_eos=True)) for i in range(8)
        ]
        await asyncio.sleep(0.05)
        ray_cluster.kill(handle)
        return await asyncio.wait_for(asyncio.gather(*futures, return_exceptions=True), timeout=60)

    results = asyncio.run(killed_mid_stream())
    errors = [r for r in results if isinstance(r, BaseException)]
    assert errors and all(
        isinstance(e, EngineError) and "generation actor 3 (" in str(e) and "did not answer" in str(e) for e in errors
    )
