"""The TorchEngine's `compiled_layers`: each decoder layer compiled by inductor (dynamic shapes), the paged attention
outside the compiled graphs. Same tokens and log-probs as the eager layers on the CPU; a compile that fails turns
the layers back to eager and the step runs; the attention function is opaque to Dynamo."""

from __future__ import annotations

import asyncio
import logging

import torch

from rlasync.engine import SamplingParams
from tests.unit.engine.test_torch_engine import PROMPTS, make_engine, tiny_model


def generate_all(engine, params):
    async def run():
        return await asyncio.gather(*(engine.generate(p, params) for p in PROMPTS))

    return asyncio.run(run())


def test_compiled_layers_give_the_eager_tokens_and_logprobs(tmp_path, monkeypatch):
    """Prompts of several lengths at once (prefill chunks and decodes of many batch sizes: one dynamic compile
    serves them), greedy with 3 log-probs: the tokens equal, the log-probs within float32 rounding."""
    monkeypatch.setenv("RLASYNC_CACHE", str(tmp_path))  # inductor's cache goes under it (not the user's)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    params = SamplingParams(max_tokens=6, temperature=0.0, num_logprobs=3, ignore_eos=True)
    eager = generate_all(make_engine(tiny_model("qwen3", init=0.3)), params)
    compiled_engine = make_engine(tiny_model("qwen3", init=0.3), compiled_layers=True)
    assert compiled_engine.runner_info()["compiled_layers"] is True
    compiled = generate_all(compiled_engine, params)
    assert compiled_engine.runner_info()["compiled_layers"] is True  # it ran compiled, no fallback
    for a, b in zip(eager, compiled):
        assert a.output_ids == b.output_ids
        assert torch.allclose(torch.tensor(a.output_log_probs), torch.tensor(b.output_log_probs), atol=1e-4)
        for top_a, top_b in zip(a.output_sampler_logprobs, b.output_sampler_logprobs):
            assert top_a.keys() == top_b.keys()
            assert all(abs(top_a[t] - top_b[t]) < 1e-4 for t in top_a)


def test_a_failed_compile_falls_back_to_eager_layers(monkeypatch, caplog):
    """A compile error raised by a compiled layer: warned once, the layers uncompiled, the step run again eagerly;
    the tokens are the eager engine's."""
    import torch._dynamo.exc

    from rlasync.engine import runner as runner_module

    def broken_compile(model):
        from rlasync.model.checkpointing import decoder_layers

        def fail(*args, **kwargs):
            raise torch._dynamo.exc.TorchDynamoException("backend failed (test)")

        for layer in decoder_layers(model):
            layer._compiled_call_impl = fail  # what nn.Module.compile installs, failing

    monkeypatch.setattr(runner_module, "compile_engine_layers", broken_compile)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    eager = generate_all(make_engine(tiny_model("llama")), params)
    engine = make_engine(tiny_model("llama"), compiled_layers=True)
    with caplog.at_level(logging.WARNING, logger="rlasync.engine.runner"):
        fallback = generate_all(engine, params)
    assert [r.output_ids for r in fallback] == [r.output_ids for r in eager]
    assert engine.runner_info()["compiled_layers"] is False
    assert sum("compiled decoder layers failed" in r.getMessage() for r in caplog.records) == 1


def test_the_paged_attention_function_is_opaque_to_dynamo():
    """Registered through `torch.compiler.disable`: a compiled layer breaks its graph around it instead of tracing
    the kernels' Python launchers and the step's metadata."""
    from transformers import AttentionInterface

    from rlasync.engine.paged_attention import ATTENTION_NAME, paged_attention_forward, register_paged_attention

    register_paged_attention()
    registered = AttentionInterface()[ATTENTION_NAME]
    assert registered is not paged_attention_forward
    assert getattr(registered, "__wrapped__", None) is paged_attention_forward
