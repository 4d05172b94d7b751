"""LoRA (peft) end to end on a Ray local cluster (CPU), tiny random Llama: AsyncGRPOTrainer with `peft_config`
trains the adapters, syncs them to the built-in engine, writes adapter checkpoints that peft loads and resumes from
one; two FSDP2 ranks (gloo) train and save a LoRA adapter."""

import json

import pytest

from tests.integration.tiny_runs import digit_reward, tiny_grpo_config

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("pickle_by_value")]
pytest.importorskip("peft")


def lora():
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0)


def make_config(tmp_path, **changes):
    return tiny_grpo_config(tmp_path, **{"max_steps": 2, "save_steps": 2, "num_sampler_logprobs": 4, **changes})


def test_lora_run_trains_adapters_syncs_them_and_resumes(ray_cluster, tiny_model_dir, tmp_path):
    import torch
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from rlasync import AsyncGRPOTrainer
    from rlasync.data import arithmetic_dataset

    trainer = AsyncGRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=digit_reward,
        args=make_config(tmp_path),
        train_dataset=arithmetic_dataset(64, seed=0),
        peft_config=lora(),
    )
    state = trainer.train()
    assert state["global_step"] == 2 and state["policy_version"] == 3  # cold sync + one adapter sync per step
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(r["perf/weight_sync_s"] > 0 for r in records if "perf/weight_sync_s" in r)
    checkpoint = tmp_path / "checkpoint-2"
    assert (checkpoint / "adapter_model.safetensors").is_file() and not (checkpoint / "model.safetensors").exists()
    adapter = load_file(str(checkpoint / "adapter_model.safetensors"))
    assert adapter and all(".lora_A." in key or ".lora_B." in key for key in adapter)
    assert any(".lora_B." in key and tensor.abs().sum() > 0 for key, tensor in adapter.items())  # B left zero
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    PeftModel.from_pretrained(base, str(checkpoint))  # peft loads it

    resumed = AsyncGRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=digit_reward,
        args=make_config(tmp_path, max_steps=3, save_steps=100),
        train_dataset=arithmetic_dataset(64, seed=0),
        peft_config=lora(),
    )
    state = resumed.train(resume_from_checkpoint=str(checkpoint))
    assert state["global_step"] == 3
    final = load_file(str(tmp_path / "checkpoint-3" / "adapter_model.safetensors"))
    assert final.keys() == adapter.keys() and any(not torch.equal(final[k], adapter[k]) for k in adapter)


def test_two_fsdp2_ranks_train_and_save_a_lora_adapter(ray_cluster, tiny_model_dir, tmp_path):
    import dataclasses

    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from actors.learner import LearnerActor
    from rlasync.algorithms.grpo.spec import GRPO
    from tests.integration.test_learner_group import make_args, make_samples

    ray = ray_cluster
    settings = GRPO.learner_settings(make_args(tmp_path), token_budget=48, peft_config=lora())
    assert dataclasses.replace(settings).peft_config is not None
    learners = [
        LearnerActor.options(num_cpus=0.25).remote(rank=rank, world_size=2, model=tiny_model_dir, settings=settings)
        for rank in range(2)
    ]
    try:
        master = ray.get(learners[0].address.remote(), timeout=120)
        infos = ray.get([learner.setup.remote(master, 60.0, None) for learner in learners], timeout=300)
        assert all(info["sharded"] for info in infos)
        assert infos[0]["trainable_parameters"] < infos[0]["num_parameters"] / 5
        manifest = ray.get(learners[0].weight_manifest.remote(), timeout=60)
        assert manifest and all(e.name.endswith((".lora_A.weight", ".lora_B.weight")) for e in manifest)
        vocab = len(json.loads(open(f"{tiny_model_dir}/vocab_words.json").read())) + 5
        refs = [ray.put(sample) for sample in make_samples(vocab)]
        first, second = ray.get([learner.train_step.remote(refs) for learner in learners], timeout=300)
        assert second == [] and dict(first)["grad_norm"] > 0
        checkpoint = tmp_path / "checkpoint-1"
        ray.get([learner.save.remote(str(checkpoint)) for learner in learners], timeout=300)
    finally:
        for learner in learners:
            ray.kill(learner)
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), str(checkpoint))
    b_weights = [p for n, p in loaded.named_parameters() if ".lora_B." in n]
    assert b_weights and any(p.abs().sum() > 0 for p in b_weights)  # trained away from peft's zero init
    assert all(torch.isfinite(p).all() for p in b_weights)
