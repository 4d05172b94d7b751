"""rlasync.learner.dry_run on the CPU: the function the dry run and tests/gpu/test_fsdp_fake_pg_gpu.py share runs
rank 0 of a 2-rank FSDP2 learner under torch's fake process group through full steps (the optimizer steps every
shard, the weight-sync gather returns each whole parameter once, the parameters are sharded), in a child process as
the GPU test runs it; the synthetic samples fill rows as asked; the analytic estimate shards the training state over
the world size and follows the checkpoint plan."""

import numpy as np
import pytest
import torch

from rlasync.learner.dry_run import (
    GIB,
    estimate_rank_memory,
    measure_in_subprocess,
    meta_model,
    step_shape,
    synthetic_samples,
)

VOCAB = 64


def tiny_config():
    from transformers import Qwen3Config

    return Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        tie_word_embeddings=True,
    )


def settings(tmp_path, token_budget=64, **fields):
    from rlasync.algorithms.grpo.spec import GRPO
    from rlasync.config import AsyncGRPOConfig

    config = AsyncGRPOConfig(output_dir=str(tmp_path / "out"), report_to="none", learning_rate=1e-5, **fields)
    return GRPO.learner_settings(config, token_budget=token_budget)


def test_one_rank_of_a_two_rank_fake_group_trains_full_steps_on_the_cpu(tmp_path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config()).save_pretrained(tmp_path / "tiny")
    prompt, completion = step_shape(64, 4, 16)
    samples = synthetic_samples(VOCAB, groups=4, group_size=4, prompt_len=prompt, completion_len=completion, top_k=8)
    result = measure_in_subprocess(str(tmp_path / "tiny"), settings(tmp_path), 2, samples, steps=2, device="cpu")
    assert result["world_size"] == 2 and len(result["losses"]) == 2 and all(np.isfinite(result["losses"]))
    assert result["optimizer_steps"] == [2] and result["trainable"] > 10
    assert result["gathered"] == result["full_numel"], "the weight gather must return each whole parameter once"
    assert result["local_numel"] <= result["full_numel"] / 2 * 1.01, "parameters are not sharded"


def test_synthetic_samples_fill_rows_of_the_token_budget():
    # rows full of completion tokens: a short prompt, then as many groups per row as max_completion_length needs
    assert step_shape(1024, 8, 4096) == (32, 124)  # one group of 32 + 8 x 124 = 1024 tokens
    assert step_shape(16384, 8, 1024) == (256, 992)  # two groups of 256 + 8 x 992 = 8192 tokens
    assert step_shape(1024, 1, 24) == (32, 21)  # 19 groups of 53: 1007 tokens
    prompt, completion = step_shape(1024, 8, 4096)
    samples = synthetic_samples(VOCAB, groups=3, group_size=8, prompt_len=prompt, completion_len=completion, top_k=4)
    assert len(samples) == 24 and {s.group_id for s in samples} == {0, 1, 2}
    assert all(len(s) == prompt + completion and s.sampler_topk_ids.shape == (len(s), 4) for s in samples)
    assert all(int(s.completion_mask.sum()) == completion for s in samples)
    assert all((s.input_ids[:prompt] == samples[8 * (i // 8)].input_ids[:prompt]).all() for i, s in enumerate(samples))
    with pytest.raises(ValueError, match="token_budget=2, group_size=8"):
        step_shape(2, 8, 16)


def test_the_estimate_shards_the_state_and_follows_the_checkpoint_plan(tmp_path):
    from transformers import Qwen3Config

    config = Qwen3Config(  # the Qwen3-0.6B shape
        hidden_size=1024,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=3072,
        vocab_size=151936,
        tie_word_embeddings=True,
    )
    model = meta_model(config, "float32")
    params = sum(p.numel() for p in model.parameters())
    s = settings(tmp_path, token_budget=8192, gradient_checkpointing=True)
    one = estimate_rank_memory(model, s, 1, gpu_bytes=None)
    eight = estimate_rank_memory(model, s, 8, gpu_bytes=None)
    head = 4 * min(2**27 // 151936, 8192) * 151936 * 4
    assert one.state_bytes == params * 16 + head  # float32 weights + grads + two AdamW moments
    assert eight.state_bytes == params * 16 // 8 + head and eight.unsharded_bytes > 0 == one.unsharded_bytes
    assert one.checkpointed_layers == 28  # no GPU: "auto" checkpoints every layer, as on the CPU
    roomy = estimate_rank_memory(model, s, 1, gpu_bytes=140 * GIB)
    tight = estimate_rank_memory(model, s, 1, gpu_bytes=20 * GIB)
    assert roomy.checkpointed_layers < tight.checkpointed_layers <= 28
    assert roomy.activation_bytes > tight.activation_bytes > one.activation_bytes * 0.99
    assert "GiB" in one.describe() and f"{one.total_bytes / GIB:.2f}" in one.describe()


def test_the_gpu_fake_group_test_builds_its_settings_and_samples_on_the_cpu():
    """tests/gpu/test_fsdp_fake_pg_gpu.py runs only on a GPU; what it hands `measure_in_subprocess` is built here."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "gpu" / "test_fsdp_fake_pg_gpu.py"
    spec = importlib.util.spec_from_file_location("fsdp_fake_pg_gpu", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    settings = module.rank_settings()
    assert settings.bf16 and settings.torch_compile and settings.token_budget == 8192 and settings.row_bucket > 0
    samples = module.rank_samples(2, VOCAB)
    assert len(samples) == 160 and {len(s) for s in samples} == {672}
