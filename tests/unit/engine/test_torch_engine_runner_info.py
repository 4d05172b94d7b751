"""TorchEngine's public view of its model runner (`runner_info`) and its sampler switch (`set_compiled_sampler`), the
hooks bench/engine_throughput.py reads and flips instead of the engine's private runner."""

from __future__ import annotations

import asyncio

import pytest

from rlasync.engine import SamplingParams
from tests.unit.engine.test_torch_engine import PROMPTS, make_engine, tiny_model


def test_runner_info_describes_the_cpu_engine():
    engine = make_engine(tiny_model("qwen3", init=0.05))
    info = engine.runner_info()
    assert set(info) == {
        "attention_backend",
        "block_size",
        "cuda_graphs",
        "mixed_cuda_graphs",
        "graphed_step_tokens",
        "compiled_sampler",
        "compiled_layers",
        "fused_layers",
    }
    assert info["cuda_graphs"] is False and info["compiled_sampler"] is False  # CPU: no graphs, eager by default
    assert info["compiled_layers"] is False  # off unless asked for
    assert info["fused_layers"] is False  # on by default for CUDA only
    assert info["mixed_cuda_graphs"] is False and info["graphed_step_tokens"] is None
    assert info["block_size"] == engine.block_size > 0
    assert isinstance(info["attention_backend"], str) and info["attention_backend"]


def test_set_compiled_sampler_switches_the_sampler_used_by_the_next_steps(monkeypatch):
    import rlasync.engine.sampler_compiled as compiled_module
    from rlasync.engine.sampler import sample

    calls = []

    def fake_compiled(*args, **kwargs):
        calls.append(1)
        return sample(*args, **kwargs)  # the eager sampler's results, counted as the compiled path

    monkeypatch.setattr(compiled_module, "sample_compiled", fake_compiled)
    engine = make_engine(tiny_model("qwen3", init=0.05))
    params = SamplingParams(max_tokens=3, temperature=1.0, seed=1, ignore_eos=True)

    async def one() -> list[int]:
        return (await engine.generate(PROMPTS[0], params)).output_ids

    eager = asyncio.run(one())
    assert calls == []
    engine.set_compiled_sampler(True)
    assert engine.runner_info()["compiled_sampler"] is True
    assert asyncio.run(one()) == eager and len(calls) == 3  # one sampler call per new token, same seeded tokens
    engine.set_compiled_sampler(False)
    assert asyncio.run(one()) == eager and len(calls) == 3


def test_on_the_cpu_every_step_runs_eagerly_and_no_eager_share_is_reported():
    """The runner counts the steps whose decoder ran eagerly; without CUDA graphs that is every step, so the engine
    leaves `num_eager_steps` out of its stats (the gauge `rollout/engine_eager_step_frac` is for graphed engines)."""
    engine = make_engine(tiny_model("qwen3", init=0.05))
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=3, ignore_eos=True)

    async def run() -> None:
        await asyncio.gather(*(engine.generate(prompt, params) for prompt in PROMPTS))

    asyncio.run(run())
    extra = engine.stats().extra
    assert extra["num_steps"] >= 4 and engine.runner.eager_steps == extra["num_steps"]
    assert "num_eager_steps" not in extra
    assert extra["fused_layers"] == 0.0 and engine.runner_info()["fused_layers"] is False  # CPU: transformers' layers
    assert engine.runner_info()["graphed_step_tokens"] is None  # no mixed-step graphs: only the budget bounds a step
    engine.bound_steps(64)  # what a bench with stand-in graphs sets
    assert engine.runner_info()["graphed_step_tokens"] == 64
    with pytest.raises(ValueError, match="bound_steps"):
        engine.bound_steps(0)
