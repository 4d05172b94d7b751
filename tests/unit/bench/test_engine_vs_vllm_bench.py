"""bench/engine_vs_vllm.py's timed modes and ratios on a CPU, over fake engines that record what they were sent."""

import asyncio
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "bench"))

import engine_vs_vllm  # noqa: E402
import vllm_common  # noqa: E402


class FakeEngine:
    """Generates `max_tokens` tokens per request (after `delay_s`); logs (seeding switch, seed, log-probs, max
    tokens) of every request. `vllm_like`: it has vLLM's `use_request_seeds` switch."""

    def __init__(self, vllm_like: bool, delay_s: float = 0.0):
        if vllm_like:
            self.use_request_seeds = False  # VLLMEngine's default
        self.delay_s, self.sent = delay_s, []

    async def generate(self, prompt, params):
        self.sent.append(
            (getattr(self, "use_request_seeds", None), params.seed, params.num_logprobs, params.max_tokens)
        )
        await asyncio.sleep(self.delay_s)
        return SimpleNamespace(output_ids=[1] * params.max_tokens)


def test_every_mode_sends_its_seeding_policy_and_logprobs():
    engine = FakeEngine(vllm_like=True)
    prompts = [[5, 6, 7]] * 40
    result = asyncio.run(engine_vs_vllm.measure(engine, prompts, new_tokens=4, repeats=2))
    assert set(result) == {"unseeded", "unseeded_logprobs8", "seeded", "seeded_logprobs8"}
    timed = [s for s in engine.sent if s[3] == 4]  # the warm-up asks for 16 tokens
    assert len(timed) == 4 * 2 * 40
    for index, (name, seeded, logprobs) in enumerate(engine_vs_vllm.MODES * 2):
        batch = timed[index * 40 : (index + 1) * 40]
        assert {s[2] for s in batch} == {logprobs}, name
        assert {s[0] for s in batch} == {seeded}, name  # vLLM's switch follows the mode
        seeds = [s[1] for s in batch]
        assert seeds == (list(range(40)) if seeded else [None] * 40), name
    for name in result:
        assert len(result[name]["runs"]) == 2
        assert result[name]["runs"][0]["new_tokens"] == 40 * 4
    assert engine.use_request_seeds is False  # left as training runs it
    warm = [s for s in engine.sent if s[3] == 16]
    assert {(s[0], s[2]) for s in warm} == {(False, 0), (False, 8), (True, 0), (True, 8)}


def test_torch_engine_side_has_no_switch_and_gets_no_seed_when_unseeded():
    engine = FakeEngine(vllm_like=False)
    asyncio.run(engine_vs_vllm.measure(engine, [[1, 2]] * 3, new_tokens=2, repeats=1))
    assert not hasattr(engine, "use_request_seeds")
    timed = [s for s in engine.sent if s[3] == 2]
    assert [s[1] for s in timed[:3]] == [None, None, None] and [s[1] for s in timed[6:9]] == [0, 1, 2]


def test_ratios_are_torch_over_vllm_per_mode():
    vllm = {name: {"new_tokens_per_s": 100.0} for name, _, _ in engine_vs_vllm.MODES}
    torch_engine = {name: {"new_tokens_per_s": 50.0 * (i + 1)} for i, (name, _, _) in enumerate(engine_vs_vllm.MODES)}
    got = engine_vs_vllm.ratios(torch_engine, vllm)
    assert got == {
        "ratio_unseeded": 0.5,
        "ratio_unseeded_logprobs8": 1.0,
        "ratio_seeded": 1.5,
        "ratio_seeded_logprobs8": 2.0,
    }
    del vllm["seeded"]
    assert "ratio_seeded" not in engine_vs_vllm.ratios(torch_engine, vllm)


def test_median_of_repeats_is_kept():
    engine = FakeEngine(vllm_like=False, delay_s=0.0)
    result = asyncio.run(engine_vs_vllm.measure(engine, [[1]] * 2, new_tokens=3, repeats=3))
    for mode in result.values():
        rates = sorted(r["new_tokens_per_s"] for r in mode["runs"])
        assert mode["new_tokens_per_s"] == pytest.approx(rates[1])


def test_defaults_are_the_issue_shape_and_vllm_best_mode():
    args = engine_vs_vllm.build_parser().parse_args(["--out", "/tmp/x"])
    assert (args.concurrency, args.prompt_len, args.new_tokens) == (256, 256, 256)
    assert args.engine_mode == "default" and args.json_name == "engine_vs_vllm_h200.json"


def test_the_built_in_engine_runs_every_mode_on_a_cpu():
    """A tiny random Qwen3 in the real TorchEngine: all four modes generate every token, without preemptions."""
    import engine_throughput
    import torch
    from transformers import AutoModelForCausalLM

    from rlasync.engine import TorchEngine

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(engine_throughput.qwen3_06b_config(tiny=True), dtype=torch.float32)
    engine = TorchEngine(model.eval(), device="cpu", max_model_len=64, kv_cache_tokens=2048, max_num_seqs=8)

    async def run():
        try:
            return await engine_vs_vllm.measure(engine, [[5, 6, 7, 8]] * 4, new_tokens=3, repeats=1)
        finally:
            await engine.close()

    result = asyncio.run(run())
    for name, _, _ in engine_vs_vllm.MODES:
        (timed,) = result[name]["runs"]
        assert timed["new_tokens"] == 4 * 3 and timed["preemptions"] == 0, name
        assert result[name]["new_tokens_per_s"] > 0


def test_vllm_engine_args_reach_the_engine_options():

    args = engine_vs_vllm.build_parser().parse_args(
        ["--out", "/tmp/x", "--vllm-engine-args", '{"async_scheduling": true}']
    )
    options = vllm_common.engine_options(args)
    assert options["async_scheduling"] is True and "compilation_config" not in options  # default mode: vLLM's own
    assert "async_scheduling" not in vllm_common.engine_options(
        engine_vs_vllm.build_parser().parse_args(["--out", "x"])
    )


@pytest.mark.parametrize(("no_freeze", "variant"), [(False, None), (True, None), (False, "unfused_layers")])
def test_the_torch_engine_phase_freezes_the_heap_as_the_generation_actor_does(tmp_path, no_freeze, variant):
    """`phase_torch_engine` on a tiny random Qwen3 folder: the heap is frozen once the engine is built (unless
    --no-freeze-heap) and the collections of the timed runs are recorded; a variant runs through `Run.phase` as
    `main_gpu` runs it, with its engine kwargs."""
    import gc

    import engine_throughput
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(engine_throughput.qwen3_06b_config(tiny=True)).save_pretrained(tmp_path / "m")
    args = engine_vs_vllm.build_parser().parse_args(
        ["--out", str(tmp_path), "--concurrency", "3", "--prompt-len", "4", "--new-tokens", "2", "--repeats", "1"]
        + ["--max-model-len", "64"]
        + (["--no-freeze-heap"] if no_freeze else [])
    )
    ctx = {"args": args, "model": {"path": str(tmp_path / "m"), "vocab_size": 512}}
    try:
        if variant is None:
            result = asyncio.run(engine_vs_vllm.phase_torch_engine(ctx))
        else:
            run = vllm_common.Run(args, "engine_vs_vllm", "test")
            result = asyncio.run(run.phase(variant, engine_vs_vllm.variant_phase(variant), ctx))
            assert run.result["phases"][variant] is result and not run.result["errors"]
            assert result["runner_info"]["fused_layers"] is False
    finally:
        gc.unfreeze()
    if no_freeze:
        assert result["gc_frozen_objects"] is None
    else:
        assert result["gc_frozen_objects"] > 10_000  # torch's and transformers' objects at least
    assert set(result["gc"]) == {"gc_max_s", "gc_total_s", "gc_collections", "gc_refreezes"}
    assert result["seeded"]["runs"][0]["new_tokens"] == 3 * 2
    assert result["sampler_warm_up_s"] == 0.0  # the engine's sampler warm-up ran (nothing to compile on the CPU)


def _phase(rate: float) -> dict:
    return {name: {"new_tokens_per_s": rate} for name, _, _ in engine_vs_vllm.MODES}


def test_summary_holds_the_ratios_of_the_phases_that_ended():
    # the variants' phases did not end (the call's limit): vLLM's and the default engine's ratios are still there
    result = {"phases": {"vllm": _phase(200.0), "torch_engine": _phase(150.0)}, "summary": {}}
    engine_vs_vllm.summarise(result)
    assert result["ratio_unseeded"] == result["summary"]["ratio_seeded_logprobs8"] == 0.75
    assert result["summary"]["vllm_new_tokens_per_s"]["seeded"] == 200
    assert not [key for key in result if "layers" in key]
    result["phases"]["torch_engine_unfused_layers"] = _phase(100.0)
    engine_vs_vllm.summarise(result)
    assert result["unfused_layers_ratio_unseeded"] == 0.5
    assert result["fused_over_unfused_layers_seeded"] == 1.5
    assert "compiled_layers_ratio_unseeded" not in result
    result["phases"]["torch_engine_compiled_layers"] = _phase(300.0)
    engine_vs_vllm.summarise(result)
    assert result["compiled_layers_ratio_unseeded"] == 1.5
    assert result["compiled_over_eager_layers_seeded"] == 3.0


def test_variants_are_engine_kwargs_of_the_torch_engine_phase():
    args = engine_vs_vllm.build_parser().parse_args(
        ["--out", "x", "--variant", "unfused_layers", "--variant", "compiled_layers"]
    )
    assert args.variant == ["unfused_layers", "compiled_layers"]
    assert engine_vs_vllm.VARIANTS["unfused_layers"] == {"fused_layers": False}
    assert engine_vs_vllm.VARIANTS["compiled_layers"] == {"compiled_layers": True}
    skipped = {"phases": {"vllm": {"skipped": "time budget"}, "torch_engine": _phase(1.0)}, "summary": {}}
    engine_vs_vllm.summarise(skipped)
    assert "ratio_unseeded" not in skipped and "vllm_new_tokens_per_s" not in skipped["summary"]
