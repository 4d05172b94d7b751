"""LoRA (peft) in the learner and the adapter sync, on CPU with a tiny random Llama: the optimizer holds only adapter
parameters, the tree-packed forward through the peft wrapper equals peft's own forward, gradient checkpointing
trains the adapters, an adapter sync makes the built-in engine's log-probs those of the merged peft model (1e-5,
float32; repeated syncs do not accumulate), the merged fallback sends the same weights, and a checkpoint is a peft
adapter that `PeftModel.from_pretrained` loads and that resumes adapter + optimizer state."""

import asyncio
import copy
import json

import numpy as np
import pytest
import torch

pytest.importorskip("peft")
from peft import LoraConfig, PeftModel  # noqa: E402

from rlasync.algorithms.grpo.spec import GRPO
from rlasync.config import AsyncGRPOConfig  # noqa: E402
from rlasync.learner import Learner, LearnerSettings  # noqa: E402
from rlasync.weights.adapter import (  # noqa: E402
    AdapterMerger,
    adapter_manifest,
    check_peft_config,
    is_adapter_manifest,
    lora_engine_kwargs,
    merged_manifest,
    merged_stream,
    write_adapter,
)

VOCAB = 40
SEQUENCES = [[3, 7, 9, 11, 2, 5, 8, 13, 21], [4, 6, 8, 10, 12, 14]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import AutoModelForCausalLM, LlamaConfig

    path = tmp_path_factory.mktemp("tiny_llama_lora")
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return str(path)


def lora(**overrides):
    # init_lora_weights=False: B is random too, so the adapter changes the outputs before any step
    return LoraConfig(
        **{
            "r": 4,
            "lora_alpha": 8,
            "target_modules": "all-linear",
            "init_lora_weights": False,
            "lora_dropout": 0.0,
            **overrides,
        }
    )


def settings(tmp_path, peft_config, gradient_checkpointing=False, **overrides):
    config = AsyncGRPOConfig(
        output_dir=str(tmp_path),
        max_steps=10,
        learning_rate=1e-2,
        seed=0,
        gradient_checkpointing=gradient_checkpointing,
        score_centering=False,
        num_sampler_logprobs=0,
    )
    base = GRPO.learner_settings(config, token_budget=32, peft_config=peft_config)
    return LearnerSettings(**{**base.__dict__, **overrides})


def grpo_samples(seed=0):
    from rlasync.rollout import RolloutSample

    rng = np.random.default_rng(seed)
    samples = []
    for group in range(2):
        prompt = rng.integers(2, VOCAB, 5).tolist()
        for advantage in (-1.0, 1.0, -0.5, 0.5):
            completion = rng.integers(2, VOCAB, 4).tolist()
            mask = np.r_[np.zeros(5, np.int8), np.ones(4, np.int8)]
            sampler = np.where(mask == 1, -np.log(VOCAB), 0.0).astype(np.float32)
            samples.append(RolloutSample(np.array(prompt + completion), mask, sampler, advantage, group))
    return samples


def reference_logprobs(model, ids):
    """log_softmax of a plain forward: the slow obvious reference, [len-1] log-probs of ids[1:]."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1)


def merged_reference(learner):
    """The learner's peft model merged (peft's own merge_and_unload of a copy): what the engine must equal."""
    return copy.deepcopy(learner.peft_model).merge_and_unload().eval()


def test_the_optimizer_holds_only_adapter_parameters(model_dir, tmp_path):
    learner = Learner(model_dir, settings(tmp_path, lora()))
    trainable = [name for name, p in learner.scorer.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in name or ".lora_B." in name for name in trainable)
    optimized = [p for group in learner.optimizer.param_groups for p in group["params"]]
    # 2 layers x 7 linear modules (q k v o gate up down) x (A, B); the head and the embeddings are not adapted
    assert len(optimized) == 2 * 7 * 2
    assert sum(p.numel() for p in optimized) == learner.info()["trainable_parameters"]
    assert learner.info()["trainable_parameters"] < learner.info()["num_parameters"] / 5
    frozen = {name: p.detach().clone() for name, p in learner.model.named_parameters() if not p.requires_grad}
    adapters = {name: p.detach().clone() for name, p in learner.model.named_parameters() if p.requires_grad}
    metrics = dict(learner.train_step(grpo_samples()))
    assert metrics["grad_norm"] > 0
    after = dict(learner.model.named_parameters())
    assert all(torch.equal(frozen[name], after[name]) for name in frozen)  # the base stays W0
    assert all(not torch.equal(adapters[name], after[name]) for name in adapters)


def test_tree_packed_forward_through_the_peft_wrapper_equals_peft_forward(model_dir, tmp_path):
    from rlasync.model import sequence_logprobs

    learner = Learner(model_dir, settings(tmp_path, lora()))
    packed = sequence_logprobs(learner.scorer, SEQUENCES, [1, 1], packing="tree")
    for ids, got in zip(SEQUENCES, packed):
        want = reference_logprobs(learner.peft_model, ids)  # peft's forward, eager attention of its own
        torch.testing.assert_close(got.detach(), want, atol=1e-5, rtol=0)
    base = load_base(model_dir)
    assert (reference_logprobs(base, SEQUENCES[0]) - packed[0].detach()).abs().max() > 1e-3  # the adapter acts


def test_gradient_checkpointing_trains_the_adapters(model_dir, tmp_path):
    learner = Learner(model_dir, settings(tmp_path, lora(), gradient_checkpointing=True))
    assert getattr(learner.model, "is_activation_checkpointing", None) or learner.model.is_gradient_checkpointing
    before = {n: p.detach().clone() for n, p in learner.model.named_parameters() if p.requires_grad}
    metrics = dict(learner.train_step(grpo_samples()))
    assert metrics["grad_norm"] > 0
    after = dict(learner.model.named_parameters())
    assert all(not torch.equal(before[name], after[name]) for name in before)


def load_base(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()


def engine_logprobs(engine, ids):
    result = asyncio.run(engine.score(ids, 1, top_k=1))
    return torch.tensor(result.token_logprobs)


async def sync(engine, stream):
    await engine.pause()
    await engine.load_weights(stream)
    await engine.resume()


@pytest.mark.parametrize("how", ["paused", "between_steps"])
def test_adapter_sync_gives_the_engine_the_merged_models_logprobs(model_dir, tmp_path, how):
    from rlasync.engine.torch_engine import TorchEngine

    learner = Learner(model_dir, settings(tmp_path, lora()))
    manifest = learner.weight_manifest()
    assert is_adapter_manifest(manifest) and len(manifest) == 2 * 7 * 2
    assert manifest[0].name == "model.layers.0.self_attn.q_proj.lora_A.weight" and manifest[0].shape == (4, 32)
    assert manifest[1].name == "model.layers.0.self_attn.q_proj.lora_B.weight" and manifest[1].shape == (32, 4)
    adapter_bytes = sum(entry.num_bytes for entry in manifest)
    engine = TorchEngine(
        model_dir, max_model_len=64, kv_cache_tokens=256, block_size=4, eos_token_ids=[], device="cpu", dtype="float32"
    )
    base_bytes = sum(p.numel() * p.element_size() for p in engine.model.parameters())
    assert adapter_bytes < base_bytes / 4
    for step in range(3):  # the first sync, then two more after training steps: no accumulation of deltas
        streamed = list(learner.weight_stream())
        assert [name for name, _ in streamed] == [entry.name for entry in manifest]
        if how == "paused":
            asyncio.run(sync(engine, streamed))
        else:  # the IPC sync's path: no pause, the merge queued behind the engine's steps
            engine.load_between_steps(streamed)
        reference = merged_reference(learner)
        for ids in SEQUENCES:
            torch.testing.assert_close(
                engine_logprobs(engine, ids), reference_logprobs(reference, ids), atol=1e-5, rtol=0
            )
        learner.train_step(grpo_samples(seed=step))


def test_merged_sync_sends_the_merged_weights_under_hf_names(model_dir, tmp_path):
    learner = Learner(model_dir, settings(tmp_path, lora(), lora_sync="merged"))
    manifest = learner.weight_manifest()
    reference = merged_reference(learner).state_dict()
    assert [entry.name for entry in manifest] == [n for n, _ in merged_reference(learner).named_parameters()]
    assert not is_adapter_manifest(manifest)
    for name, tensor in learner.weight_stream():
        torch.testing.assert_close(tensor, reference[name], atol=1e-6, rtol=0)
    assert merged_manifest(learner.model) == manifest and len(list(merged_stream(learner.model))) == len(manifest)


def test_merger_refuses_an_unknown_module_and_a_b_before_its_a():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2))
    merger = AdapterMerger()
    with pytest.raises(ValueError, match="no parameter 1.weight"):
        merger.load(model, [("1.lora_A.weight", torch.ones(1, 3)), ("1.lora_B.weight", torch.ones(2, 1))])
    with pytest.raises(ValueError, match="before its"):
        merger.load(model, [("0.lora_B.weight", torch.ones(2, 1))])
    w0 = model[0].weight.detach().clone()
    for scale in (1.0, 2.0):
        merger.load(model, [("0.lora_A.weight", torch.ones(1, 3)), ("0.lora_B.weight", torch.full((2, 1), scale))])
        torch.testing.assert_close(model[0].weight.detach(), w0 + scale)  # W0 + B@A, not the sum of both deltas


def test_checkpoint_is_a_peft_adapter_and_resumes_adapter_and_optimizer(model_dir, tmp_path):
    learner = Learner(model_dir, settings(tmp_path, lora()))
    learner.train_step(grpo_samples())
    checkpoint = tmp_path / "checkpoint-1"
    learner.save(checkpoint)
    files = sorted(p.name for p in checkpoint.iterdir())
    assert "adapter_model.safetensors" in files and "adapter_config.json" in files
    assert "model.safetensors" not in files and "optimizer.pt" in files
    loaded = PeftModel.from_pretrained(load_base(model_dir), str(checkpoint)).eval()
    for ids in SEQUENCES:
        torch.testing.assert_close(
            reference_logprobs(loaded, ids), reference_logprobs(learner.peft_model, ids), atol=1e-5, rtol=0
        )
    assert json.loads((checkpoint / "adapter_config.json").read_text())["base_model_name_or_path"] == model_dir
    resumed = Learner(str(checkpoint), settings(tmp_path, lora()), resume_dir=str(checkpoint))
    saved = {n: p.detach() for n, p in learner.model.named_parameters()}
    for name, param in resumed.model.named_parameters():
        torch.testing.assert_close(param.detach(), saved[name], atol=0, rtol=0)
    assert [n for n, p in resumed.model.named_parameters() if p.requires_grad]  # adapters trainable again
    state, resumed_state = learner.optimizer.state_dict()["state"], resumed.optimizer.state_dict()["state"]
    assert len(resumed_state) == len(state) == 2 * 7 * 2
    for key in state:
        torch.testing.assert_close(resumed_state[key]["exp_avg"], state[key]["exp_avg"])
    torch.manual_seed(1)
    a = dict(learner.train_step(grpo_samples(seed=3)))
    b = dict(resumed.train_step(grpo_samples(seed=3)))
    assert a["loss"] == pytest.approx(b["loss"], abs=1e-6)


def test_adapters_on_the_head_or_embeddings_are_refused():
    with pytest.raises(ValueError, match="peft_config.modules_to_save"):
        check_peft_config(lora(modules_to_save=["lm_head"]))
    with pytest.raises(ValueError, match="peft_config.target_modules.*lm_head"):
        check_peft_config(lora(target_modules=["q_proj", "lm_head"]))
    with pytest.raises(ValueError, match="embed_tokens"):
        check_peft_config(lora(target_modules=r".*(embed_tokens|q_proj)"))
    with pytest.raises(ValueError, match="use_dora"):
        check_peft_config(lora(use_dora=True))
    with pytest.raises(ValueError, match="only peft.LoraConfig"):
        check_peft_config({"r": 4})
    with pytest.raises(ValueError, match="cluster.lora_sync='full'"):
        LearnerSettings(**{**settings_fields(), "lora_sync": "full"})


def settings_fields():
    base = GRPO.learner_settings(AsyncGRPOConfig(output_dir="/tmp/x"), token_budget=8)
    return {**base.__dict__, "peft_config": lora()}


def test_vllm_engines_get_lora_options_from_the_peft_config(tmp_path):
    assert lora_engine_kwargs(lora(r=32), "torch", max_loras=2, lora_dir="d") == {}
    assert lora_engine_kwargs(lora(r=32), "vllm", max_loras=3, lora_dir="d") == {
        "enable_lora": True,
        "max_loras": 3,
        "max_lora_rank": 32,
        "lora_dir": "d",
    }
    assert lora_engine_kwargs(lora(r=24), "vllm", max_loras=2, lora_dir="d")["max_lora_rank"] == 32
    assert lora_engine_kwargs(lora(r=32), "vllm_server", max_loras=2, lora_dir="d") == {"max_loras": 2, "lora_dir": "d"}
    assert lora_engine_kwargs(None, "vllm", max_loras=2, lora_dir="d") == {}


def test_written_adapter_loads_with_peft_and_equals_the_folded_pairs(model_dir, tmp_path):
    learner = Learner(model_dir, settings(tmp_path, lora()))
    from rlasync.weights.adapter import adapter_pairs

    path = write_adapter(tmp_path / "rlasync-v1", adapter_pairs(learner.weight_stream()), base_model=model_dir)
    config = json.loads((path / "adapter_config.json").read_text())
    assert config["r"] == config["lora_alpha"] == 4  # the scaling is folded into B
    loaded = PeftModel.from_pretrained(load_base(model_dir), str(path)).eval()
    for ids in SEQUENCES:
        torch.testing.assert_close(
            reference_logprobs(loaded, ids), reference_logprobs(learner.peft_model, ids), atol=1e-5, rtol=0
        )
    assert adapter_manifest(learner.model) == learner.weight_manifest()


@pytest.mark.parametrize("wire", [None, torch.bfloat16])
def test_the_batched_adapter_copy_writes_what_the_one_at_a_time_stream_sends(model_dir, wire):
    """`adapter_stream(...).copy_into(views)` (the persistent IPC buckets' batched fill) equals the pairs the stream
    yields one at a time, bit for bit: A, and s * B computed in float32 then rounded once to the wire dtype."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from rlasync.weights.adapter import adapter_stream
    from rlasync.weights.ipc import SharedWeights

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir), lora(lora_alpha=12)).base_model.model
    manifest = adapter_manifest(model, dtype=wire)
    expected = list(adapter_stream(model, dtype=wire))
    assert [name for name, _ in expected] == [entry.name for entry in manifest]
    shared = SharedWeights.allocate(manifest, "cpu")
    try:
        stream = adapter_stream(model, dtype=wire)
        assert stream.entries() == manifest and stream.copy_into(shared.views())
        for (name, tensor), view in zip(expected, shared.views()):
            assert view.dtype == tensor.dtype and torch.equal(view, tensor), name
        started = adapter_stream(model, dtype=wire)
        next(started)
        assert not started.copy_into(shared.views())  # a started stream has no batched path
    finally:
        shared.release()
