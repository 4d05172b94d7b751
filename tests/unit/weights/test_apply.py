"""The engine side of a weight sync (`load_while_pausing`) on a busy TorchEngine (CPU)."""

import asyncio
import time

import pytest
import torch

from rlasync.engine import SamplingParams, TorchEngine
from rlasync.weights.apply import load_while_pausing, take_bytes


def tiny_model(seed):
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=256,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    return AutoModelForCausalLM.from_config(config).eval()


class SlowStream:
    """A received broadcast: yields (name, tensor) with a delay per entry; records when each entry was taken."""

    def __init__(self, state, delay_s=0.005):
        self.items = iter(list(state.items()))
        self.delay_s = delay_s
        self.taken_at: list[float] = []

    def __iter__(self):
        return self

    def __next__(self):
        time.sleep(self.delay_s)
        item = next(self.items)
        self.taken_at.append(time.perf_counter())
        return item


@pytest.mark.parametrize("staging_bytes", [0, 1 << 30])
def test_weights_load_while_the_engine_pauses_and_it_resumes(staging_bytes):
    engine = TorchEngine(
        tiny_model(0), device="cpu", max_model_len=128, kv_cache_tokens=2048, block_size=4, eos_token_ids=[]
    )
    new_state = {k: v.detach().clone() for k, v in tiny_model(1).state_dict().items()}
    greedy = SamplingParams(max_tokens=40, temperature=0)

    real_pause = engine.pause

    async def slow_pause():  # a long step in flight: the pause takes 0.3 s
        await asyncio.sleep(0.3)
        await real_pause()

    engine.pause = slow_pause

    async def run():
        busy = [asyncio.create_task(engine.generate([1 + i, 2, 3], greedy)) for i in range(8)]
        await asyncio.sleep(0.05)
        stream = SlowStream(new_state)
        stream.start = time.perf_counter()
        phases = await load_while_pausing(engine, stream, staging_bytes)
        records = await asyncio.gather(*busy)
        after = await engine.generate([5, 6, 7], greedy)
        return phases, stream, records, after

    phases, stream, records, after = asyncio.run(run())
    assert not engine.is_paused
    assert all(len(r.output_ids) == 40 for r in records)  # generation went on after the sync
    assert set(phases) == {"pause_s", "load_s", "resume_s", "total_s"} and phases["total_s"] >= phases["pause_s"]
    params = dict(engine.model.named_parameters())
    assert all(torch.equal(params[name], value) for name, value in new_state.items() if name in params)
    paused = stream.start + phases["pause_s"]
    if staging_bytes == 0:
        assert min(stream.taken_at) >= paused  # nothing received before the engine paused
    else:
        assert max(stream.taken_at) < paused  # the whole transfer overlapped the wait for the pause
        assert phases["pause_s"] >= 0.3
    reference = TorchEngine(
        tiny_model(1), device="cpu", max_model_len=128, kv_cache_tokens=2048, block_size=4, eos_token_ids=[]
    )
    assert after.output_ids == asyncio.run(reference.generate([5, 6, 7], greedy)).output_ids


def test_a_failing_stream_still_resumes_the_engine():
    engine = TorchEngine(tiny_model(0), device="cpu", max_model_len=64, kv_cache_tokens=512, eos_token_ids=[])

    def broken():
        yield "model.norm.weight", torch.ones(32)
        raise TimeoutError("weight-sync group: broadcast stalled")

    with pytest.raises(TimeoutError, match="stalled"):
        asyncio.run(load_while_pausing(engine, broken(), 1 << 20))
    assert not engine.is_paused


def test_take_bytes_stops_at_the_limit_and_leaves_the_rest():
    stream = iter([("a", torch.zeros(4)), ("b", torch.zeros(4)), ("c", torch.zeros(4))])  # 16 bytes each
    assert [n for n, _ in take_bytes(stream, 17)] == ["a", "b"]
    assert [n for n, _ in stream] == ["c"]
    assert take_bytes(iter([("a", torch.zeros(4))]), 0) == []


class OutOfProcessEngine:
    """An engine whose `load_weights` reports its own part of the load (as vLLM's workers do) after a round trip."""

    def __init__(self, engine_s, round_trip_s):
        self.engine_s, self.round_trip_s, self.is_paused = engine_s, round_trip_s, False

    async def pause(self):
        self.is_paused = True

    async def resume(self):
        self.is_paused = False

    async def load_weights(self, named_tensors):
        await asyncio.sleep(self.engine_s + self.round_trip_s)
        return {"how": "replayed", "engine_s": self.engine_s}


def test_an_engine_reporting_its_own_load_time_gets_it_into_the_phases_and_the_metric():
    from actors.cluster_weights import sync_timings

    phases = asyncio.run(load_while_pausing(OutOfProcessEngine(0.01, 0.05), iter([]), 0, load=[]))
    assert phases["engine_load_s"] == 0.01 and phases["load_s"] >= 0.06
    plain = asyncio.run(load_while_pausing(OutOfProcessEngine(0.0, 0.0), iter([]), 0, load=[]))
    timings = sync_timings(1.0, time.time(), [0.1], [{**plain, "engine_load_s": 0.02}, phases])
    assert timings["perf/weight_sync_engine_load_s"] == 0.02  # the slowest engine's
    assert timings["perf/weight_sync_transfer_s"] == phases["load_s"]
    del plain["engine_load_s"]
    assert "perf/weight_sync_engine_load_s" not in sync_timings(1.0, time.time(), [0.1], [plain])  # none says
