"""bench/vllm_weight_sync.py's flat-bucket sync rounds on a CPU, over an engine that copies from the mapped buckets."""

import asyncio
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "bench"))

import vllm_common  # noqa: E402
import vllm_weight_sync  # noqa: E402


class BucketEngine:
    """Pause/resume, a `load_weights` that copies the mapped buckets into its parameters and reports its own part
    (as vLLM's worker does), a slow `generate` that fails while paused (a request the bench must count)."""

    def __init__(self, params):
        self.params, self.paused, self.loads, self.round_trip_s = params, False, 0, 0.01

    async def pause(self):
        self.paused = True

    async def resume(self):
        self.paused = False

    async def weight_fingerprint(self, names):
        await asyncio.sleep(0.001)
        return {}

    async def load_weights(self, mapped):
        assert self.paused
        started = time.perf_counter()
        for name, view in mapped:
            self.params[name].copy_(view)
        self.loads += 1
        engine_s = time.perf_counter() - started
        await asyncio.sleep(self.round_trip_s)
        return {
            "how": "recorded" if self.loads == 1 else "replayed",
            "engine_s": engine_s,
            "map_s": 0.0,
            "queue_s": engine_s,
            "gpu_wait_s": 0.0,
        }

    async def generate(self, prompt, params):
        await asyncio.sleep(0.05)
        if prompt[0] % 2:
            raise RuntimeError("a failed request")
        return prompt


def test_flat_sync_rounds_load_the_weights_and_split_the_round_trip():
    named = [("w", torch.randn(4, 3)), ("v", torch.randn(5))]
    engine = BucketEngine({name: torch.zeros_like(t) for name, t in named})
    out = asyncio.run(
        vllm_weight_sync.flat_ipc_sync(engine, named, vocab=50, rounds=3, device="cpu", requests=8, new_tokens=4)
    )
    assert all(torch.equal(engine.params[name], t) for name, t in named)
    assert len(out["noop_rpc_ms"]) == 7
    for label in ("idle", "generating"):
        part = out[label]
        assert [r["how"] for r in part["rounds"]] == (["recorded"] if label == "idle" else ["replayed"]) + [
            "replayed"
        ] * 3
        assert part["median_load_ms"] >= 10 > part["median_worker_ms"]  # the round trip is outside the worker
        assert part["median_total_ms"] >= part["median_load_ms"]
    prompts = vllm_common.random_prompts(8, 64, 50, seed=11)
    assert out["generating"]["request_errors"] == sum(p[0] % 2 for p in prompts)
    assert out["idle"]["request_errors"] == 0


def test_door_rounds_switch_the_sync_door_on_and_time_its_syncs():
    """`door_rounds` over the fake vLLM engine of the door's tests (its worker in-process): the door opens, every
    sync arrives (applied on the nudge: no step runs here), the rows split the wait from the worker's load."""
    from rlasync.weights.ipc import MappedWeights, SharedWeights
    from rlasync.weights.plan import ManifestEntry
    from tests.unit.engine.test_vllm_door import DoorEngine
    from tests.unit.engine.test_vllm_engine import WEIGHTS

    class Generating(DoorEngine):
        async def generate(self, prompt, params):
            await asyncio.sleep(0.02)
            return prompt

    manifest = [ManifestEntry(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in WEIGHTS.items()]
    shared = SharedWeights.pack(WEIGHTS.items(), manifest, "cpu")
    engine = Generating("m")
    assert not engine.direct_sync
    prompts = vllm_common.random_prompts(4, 8, 50, seed=1)
    try:
        out = asyncio.run(
            vllm_weight_sync.door_rounds(engine, MappedWeights(shared.key, shared.handles()), prompts, 2, 4)
        )
    finally:
        shared.release()
        engine.close_door()
        engine._llm.worker.close_sync_door()
    model = engine._llm.worker.model_runner.model
    assert engine.direct_sync and torch.equal(model.a, WEIGHTS["a"])
    for label in ("door_idle", "door_generating"):
        part = out[label]
        assert len(part["rounds"]) == 3 and part["request_errors"] == 0
        assert all(r["total_ms"] >= r["worker_ms"] >= 0 and r["wait_ms"] >= 0 for r in part["rounds"])
        assert part["max_total_ms"] >= part["median_total_ms"]
    assert out["door_generating"]["applied"] == {"nudge": 6}
