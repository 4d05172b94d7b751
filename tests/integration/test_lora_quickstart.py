"""Slow (marked `slow`): the CPU quickstart (configs/quickstart.yaml: SmolLM2-135M-Instruct, one-digit addition)
with LoRA r=32 on every linear layer of the decoder and adapter syncs to the built-in engine; the reward rises over
the run, and the final checkpoint is an adapter that peft loads on the base model."""

import json

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.usefixtures("pickle_by_value")]
pytest.importorskip("peft")


def test_smollm2_lora_quickstart_reward_rises(ray_cluster, tmp_path):
    from peft import LoraConfig, PeftModel
    from transformers import AutoModelForCausalLM

    from rlasync import AsyncGRPOTrainer
    from rlasync.config.load import apply_overrides, build_config, read_yaml
    from rlasync.data import build_dataset
    from rlasync.model.registry import resolve_model
    from rlasync.rewards import last_number_reward

    data = apply_overrides(read_yaml("configs/quickstart.yaml"), [f"output_dir={tmp_path}", "learning_rate=2e-4"])
    model, dataset = data.pop("model"), build_dataset(data.pop("dataset"))
    data.pop("reward_funcs")
    config = build_config(data)
    trainer = AsyncGRPOTrainer(
        model=model,
        reward_funcs=last_number_reward,
        args=config,
        train_dataset=dataset,
        peft_config=LoraConfig(r=32, lora_alpha=64, target_modules="all-linear", lora_dropout=0.0),
    )
    state = trainer.train()
    assert state["global_step"] == config.max_steps
    rewards = [json.loads(line)["reward"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    print("LoRA quickstart rewards per logging window:", rewards)
    assert len(rewards) >= 3 and rewards[-1] > rewards[0] + 0.2
    final = tmp_path / f"checkpoint-{config.max_steps}"
    base = AutoModelForCausalLM.from_pretrained(resolve_model(model))
    PeftModel.from_pretrained(base, str(final))
