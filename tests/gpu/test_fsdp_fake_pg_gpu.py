"""On CUDA: one rank of an N-rank FSDP2 learner (N = 2, 4, 8) through a full training step, on one GPU.

torch's fake process group makes this process rank 0 of an N-rank job (torchtitan's `comm.mode=fake_backend` dry
run): the sharding, the bf16 `MixedPrecisionPolicy`, the compiled decoder layers with FlexAttention tree attention,
the chunked LM head, the optimizer and the weight-sync gather (`full_tensor()` per parameter) all run as on a real
rank; only the collectives are no-ops. The model is the Qwen3-0.6B shape with random weights.

The rank runs through `rlasync.learner.dry_run.measure_in_subprocess` (what `rlasync train --dry-run` runs): each
world size in its own process (a process joins one process group). The peak memory per world size is
printed as `PEAK_GIB N x` and appended to the file `--fake-pg-out` names (tests/gpu/conftest.py; the device stage
collects it).

Run through the device tool: `python3 -m pytest -q tests/gpu/test_fsdp_fake_pg_gpu.py -s`.
"""

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def rank_settings(token_budget: int = 8192):
    """bf16 mixed precision, compiled layers, gradient checkpointing, 8192-token rows (the bench's settings)."""
    from rlasync.algorithms.grpo.spec import GRPO
    from rlasync.config import AsyncGRPOConfig

    config = AsyncGRPOConfig(
        output_dir="/tmp/fake_pg_out",
        bf16=True,
        torch_compile=True,
        score_centering=False,
        gradient_checkpointing=True,
        report_to="none",
        learning_rate=1e-5,
    )
    return GRPO.learner_settings(config, token_budget=token_budget)


def rank_samples(world_size: int, vocab_size: int):
    """10 groups of 8 (prompt 544, completions 128) per rank's row."""
    from rlasync.learner.dry_run import synthetic_samples

    return synthetic_samples(vocab_size, groups=10 * world_size, group_size=8, prompt_len=544, completion_len=128)


def qwen3_06b_config():
    """The Qwen3-0.6B shape (tests/unit/learner/test_dry_run_rank.py estimates this rank's memory from it)."""
    from transformers import Qwen3Config

    return Qwen3Config(
        hidden_size=1024,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=3072,
        vocab_size=151936,
        tie_word_embeddings=True,
        max_position_embeddings=40960,
        rope_theta=1_000_000.0,
    )


@pytest.fixture(scope="module")
def qwen3_06b_dir(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    config = qwen3_06b_config()
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path = tmp_path_factory.mktemp("qwen3_06b")
    model.save_pretrained(path)
    del model
    torch.cuda.empty_cache()
    return path


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_one_rank_of_an_fsdp2_group_trains_a_full_step(qwen3_06b_dir, world_size, fake_pg_out):
    from rlasync.learner.dry_run import measure_in_subprocess

    samples = rank_samples(world_size, 151936)
    result = measure_in_subprocess(str(qwen3_06b_dir), rank_settings(), world_size, samples, steps=2)
    print(f"PEAK_GIB {world_size} x {result['peak_gib']:.2f}", result)
    assert all(loss == loss for loss in result["losses"]), result  # finite, not NaN
    assert result["trainable"] > 300 and result["optimizer_steps"] == [2], "AdamW must step every shard each step"
    assert result["gathered"] == result["full_numel"], "the weight gather must return each whole parameter once"
    assert result["local_numel"] <= result["full_numel"] / world_size * 1.01, "parameters are not sharded"
    assert result["mixed_precision"] and result["compiled_layers"] == 28, result
    fake_pg_out(result)


SMALL_GPU_GIB = 24  # an RTX 4090 / L4 / A10-class budget: what the H200 leaves free around a ballast


@pytest.mark.slow  # on purpose only: bench/device_runs.sh ckplan_small
def test_on_a_24_gib_gpu_the_auto_plan_checkpoints_what_it_must_and_the_step_fits(qwen3_06b_dir, fake_pg_out):
    """Rank 0 of 2 with 32768-token rows on ~24 GiB (the rest of the H200 held by a ballast in this process, as a
    colocated engine would hold it): "auto" plans from the memory free (the learner's own figures: compiled layers,
    FSDP2's bf16 policy), checkpoints some but not all layers (the dry run's estimate on 24 GiB: 21 of 28, 19.7 GiB),
    and the steps run without running out of memory, the peak near the estimate."""
    from rlasync.learner.dry_run import GIB, estimate_rank_memory, measure_in_subprocess, meta_model, synthetic_samples

    settings = rank_settings(token_budget=32768)
    samples = synthetic_samples(151936, groups=40, group_size=8, prompt_len=544, completion_len=128)  # 20 a row
    torch.cuda.empty_cache()
    free, _ = torch.cuda.mem_get_info()
    ballast = torch.empty(max(0, free - SMALL_GPU_GIB * GIB), dtype=torch.uint8, device="cuda")
    try:
        result = measure_in_subprocess(str(qwen3_06b_dir), settings, 2, samples, steps=2)
    finally:
        del ballast
        torch.cuda.empty_cache()
    model = meta_model(qwen3_06b_config(), "float32")
    estimate = estimate_rank_memory(model, settings, 2, gpu_bytes=SMALL_GPU_GIB * GIB, terms_per_row=20 * 8 * 128)
    result.update({"gpu_gib": SMALL_GPU_GIB, "token_budget": 32768, "estimate_gib": estimate.total_bytes / GIB})
    print(f"PEAK_GIB small {result['peak_gib']:.2f} estimate {estimate.describe()}", result)
    fake_pg_out(result)
    assert all(loss == loss for loss in result["losses"]) and result["optimizer_steps"] == [2], result
    assert 0 < result["checkpointed_layers"] < 28, result
    assert abs(result["checkpointed_layers"] - estimate.checkpointed_layers) <= 2, (result, estimate.describe())
    assert result["peak_gib"] <= SMALL_GPU_GIB, result
    assert result["peak_gib"] == pytest.approx(estimate.total_bytes / GIB, rel=0.10), (result, estimate.describe())
