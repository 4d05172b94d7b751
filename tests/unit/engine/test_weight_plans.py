"""Syncs from persistent buffers: the first load's copies recorded (`CopyPlan`), later syncs replayed as batched
copies; equal to the per-tensor load for plain HF names and for fused (vLLM-style qkv) parameters; a loader that
transforms its sources is not replayed (it keeps loading)."""

import asyncio

import pytest
import torch

from rlasync.engine.weights import CopyPlan, PlannedLoader, load_named_weights
from rlasync.weights import build_manifest, stream_parameters
from rlasync.weights.ipc import MappedWeights, SharedWeights


def tiny(seed):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    )
    return AutoModelForCausalLM.from_config(config)


def same(a, b):
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


def perturb(model, seed):
    torch.manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            param.add_(torch.randn_like(param))


def test_persistent_buckets_are_filled_in_one_batch_equal_to_tensor_by_tensor_and_reused():
    learner = tiny(0)
    manifest = build_manifest(learner, dtype=torch.bfloat16)
    batched = SharedWeights.allocate(manifest, "cpu", bucket_bytes=4096)
    pointers = [buffer.data_ptr() for buffer in batched.buffers]
    batched.fill(stream_parameters(learner, dtype=torch.bfloat16), manifest)
    one_by_one = SharedWeights.pack(list(stream_parameters(learner, dtype=torch.bfloat16)), manifest, "cpu", 4096)
    assert all(torch.equal(a, b) for a, b in zip(batched.views(), one_by_one.views(), strict=True))
    handles = batched.handles()
    perturb(learner, 1)
    batched.fill(stream_parameters(learner, dtype=torch.bfloat16), manifest)  # the next version: same buckets
    assert [buffer.data_ptr() for buffer in batched.buffers] == pointers and batched.handles() is handles
    expected = dict(stream_parameters(learner, dtype=torch.bfloat16))
    assert all(torch.equal(view, expected[name]) for name, view in MappedWeights(batched.key, handles))
    with pytest.raises(ValueError, match="stream and manifest differ"):
        batched.fill(stream_parameters(learner), manifest)  # float32 where the buckets hold bf16
    batched.release()
    one_by_one.release()


def test_a_recorded_plan_replays_the_named_load_and_follows_new_contents():
    learner, engine = tiny(0), tiny(1)
    manifest = build_manifest(learner)
    shared = SharedWeights.pack(stream_parameters(learner), manifest, "cpu", bucket_bytes=2048)
    mapped = MappedWeights(shared.key, shared.handles())
    loader = PlannedLoader()
    load = lambda stream: load_named_weights(engine, stream)  # noqa: E731
    assert loader.load(engine, mapped, load) == "recorded"
    assert same(learner, engine) and loader.plans[shared.key].replayable
    for version in range(2):
        perturb(learner, 10 + version)
        shared.fill(stream_parameters(learner), manifest)
        assert loader.load(engine, mapped, load) == "replayed"
        assert same(learner, engine)
    assert loader.load(engine, stream_parameters(learner), load) == "loaded"  # a plain stream: no plan
    shared.release()


class Fused(torch.nn.Module):
    """vLLM-style: q, k, v stacked in one parameter, loaded by shards (narrow + copy_), a bias sliced."""

    def __init__(self):
        super().__init__()
        self.qkv = torch.nn.Parameter(torch.zeros(12, 4))
        self.out = torch.nn.Parameter(torch.zeros(4, 4))

    def load_weights(self, pairs):
        offsets = {"q.weight": (0, 6), "k.weight": (6, 3), "v.weight": (9, 3)}
        for name, tensor in pairs:
            if name in offsets:
                start, size = offsets[name]
                self.qkv.data.narrow(0, start, size).copy_(tensor)
            else:
                self.out.data.copy_(tensor)


def fused_sources(seed):
    torch.manual_seed(seed)
    return {
        "q.weight": torch.randn(6, 4),
        "k.weight": torch.randn(3, 4),
        "v.weight": torch.randn(3, 4),
        "out.weight": torch.randn(4, 4),
    }


def test_fused_shards_replay_equal_to_the_models_own_loader():
    from rlasync.weights.plan import ManifestEntry

    manifest = [ManifestEntry(name, "float32", tuple(t.shape)) for name, t in fused_sources(0).items()]
    shared = SharedWeights.pack(fused_sources(0).items(), manifest, "cpu")
    pairs = list(MappedWeights(shared.key, shared.handles()))
    model, reference = Fused(), Fused()
    plan = CopyPlan.record(model.load_weights, pairs, model.parameters())
    assert plan.replayable and len(plan.targets) == 4
    shared.fill(fused_sources(1).items(), manifest)
    assert plan.replay() == 4
    reference.load_weights(fused_sources(1).items())
    assert torch.equal(model.qkv, reference.qkv) and torch.equal(model.out, reference.out)
    shared.release()


class PaddedEmbedding(torch.nn.Module):
    """vLLM's VocabParallelEmbedding loader: the rows it has are copied in, the padded rows zeroed, an empty slice
    when the vocabulary needs no padding (`param[vocab:].fill_(0)`)."""

    def __init__(self, vocab, padded):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.full((padded, 4), 7.0))

    def load_weights(self, pairs):
        for _, tensor in pairs:
            self.weight[: tensor.shape[0]].data.copy_(tensor)
            self.weight[tensor.shape[0] :].data.fill_(0)


@pytest.mark.parametrize("padded", [6, 8], ids=["unpadded", "padded"])
def test_the_embedding_loaders_zeroed_padding_rows_replay(padded):
    from rlasync.weights.plan import ManifestEntry

    def rows(seed):
        return {"embed.weight": torch.randn(6, 4, generator=torch.Generator().manual_seed(seed))}

    manifest = [ManifestEntry("embed.weight", "float32", (6, 4))]
    shared = SharedWeights.pack(rows(0).items(), manifest, "cpu")
    pairs = list(MappedWeights(shared.key, shared.handles()))
    model = PaddedEmbedding(6, padded)
    plan = CopyPlan.record(model.load_weights, pairs, model.parameters())
    assert plan.replayable, plan.reason
    assert len(plan.fills) == (padded > 6)  # the empty slice's fill writes nothing: not even recorded
    shared.fill(rows(1).items(), manifest)
    model.weight.data.fill_(5.0)  # anything the replay must overwrite, padding included
    plan.replay()
    reference = PaddedEmbedding(6, padded)
    reference.load_weights(rows(1).items())
    assert torch.equal(model.weight, reference.weight)
    shared.release()


def test_a_constant_fill_over_copied_rows_is_not_replayed():
    """A fill after a copy into the same rows: replaying fills first would leave the copy's values; refused."""
    from rlasync.weights.plan import ManifestEntry

    manifest = [ManifestEntry("embed.weight", "float32", (6, 4))]
    shared = SharedWeights.pack([("embed.weight", torch.randn(6, 4))], manifest, "cpu")
    model = PaddedEmbedding(6, 6)

    def load(pairs):
        for _, tensor in pairs:
            model.weight.data.copy_(tensor)
            model.weight[:2].data.zero_()

    plan = CopyPlan.record(load, list(MappedWeights(shared.key, shared.handles())), model.parameters())
    assert not plan.replayable and "overlaps a copy" in plan.reason
    shared.release()


def test_a_loader_that_transforms_its_sources_is_not_replayed_but_still_loads(caplog):
    learner, engine = tiny(0), tiny(1)
    manifest = build_manifest(learner)
    shared = SharedWeights.pack(stream_parameters(learner), manifest, "cpu")
    mapped = MappedWeights(shared.key, shared.handles())

    def scaled_load(stream):  # builds a new tensor from each source before copying it in
        load_named_weights(engine, ((name, tensor * 1.0) for name, tensor in stream))

    loader = PlannedLoader()
    with caplog.at_level("WARNING"):
        assert loader.load(engine, mapped, scaled_load) == "recorded"
    plan = loader.plans[shared.key]
    assert not plan.replayable and "other than a source view" in plan.reason
    assert loader.reason(shared.key) == plan.reason and loader.reason("other buckets") is None
    assert "cannot be replayed" in caplog.text and plan.reason in caplog.text  # said once, not silently slow
    with pytest.raises(RuntimeError, match="cannot be replayed"):
        plan.replay()
    perturb(learner, 3)
    shared.fill(stream_parameters(learner), manifest)
    assert loader.load(engine, mapped, scaled_load) == "loaded" and same(learner, engine)
    shared.release()


def test_torch_engine_ipc_syncs_replay_and_generate_as_a_fresh_engine_would():
    from rlasync.engine import SamplingParams, TorchEngine
    from rlasync.weights.transport import choose_transport, make_receiver, make_sender

    learner = tiny(0)
    engine = TorchEngine(tiny(1), device="cpu", max_model_len=64, kv_cache_tokens=512, block_size=16)
    info = {"node": "n0", "device": "cpu", "gpu": None}
    plan, _ = choose_transport(info, [info], "ipc", host="127.0.0.1", port=1, timeout_s=10.0)
    manifest = build_manifest(learner)
    sender = make_sender(plan, "cpu", manifest=manifest)
    receiver = asyncio.run(make_receiver(plan, 1, manifest, engine, "cpu"))
    params = SamplingParams(max_tokens=6, temperature=0.0)

    async def run():
        hows = []
        for version in range(3):
            perturb(learner, 20 + version)
            await receiver.load_into(engine, sender.prepare(stream_parameters(learner)))
            hows.append(next(iter(engine._loader.plans.values())).replayable)
            assert same(learner, engine.model)
        out = await engine.generate([1, 2, 3], params)
        await engine.close()
        return hows, out

    hows, out = asyncio.run(run())
    assert hows == [True, True, True]
    fresh = TorchEngine(learner, device="cpu", max_model_len=64, kv_cache_tokens=512, block_size=16)

    async def reference():
        record = await fresh.generate([1, 2, 3], params)
        await fresh.close()
        return record

    expected = asyncio.run(reference())
    assert out.output_ids == expected.output_ids and out.output_log_probs == pytest.approx(expected.output_log_probs)
    sender.close()


def test_a_loader_the_recorder_cannot_follow_falls_back_to_plain_loads(monkeypatch, caplog):
    """An engine loader that breaks under the recording dispatch mode (a real engine's custom ops, say) still loads
    its weights: one warning, then tensor by tensor on every sync."""
    learner, engine = tiny(0), tiny(1)
    manifest = build_manifest(learner)
    shared = SharedWeights.pack(stream_parameters(learner), manifest, "cpu")
    mapped = MappedWeights(shared.key, shared.handles())

    def broken_record(load, pairs, params):
        load(pairs[:1])  # part of the weights copied, then the recorder fails
        raise RuntimeError("an op the dispatch mode cannot run")

    monkeypatch.setattr(CopyPlan, "record", broken_record)
    loader = PlannedLoader()
    with caplog.at_level("WARNING"):
        assert loader.load(engine, mapped, lambda stream: load_named_weights(engine, stream)) == "loaded"
    assert same(learner, engine) and "recording the loader's copies failed" in caplog.text
    perturb(learner, 3)
    shared.fill(stream_parameters(learner), manifest)
    assert loader.load(engine, mapped, lambda stream: load_named_weights(engine, stream)) == "loaded"
    assert same(learner, engine)
    shared.release()
