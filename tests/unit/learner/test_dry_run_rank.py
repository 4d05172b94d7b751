"""rlasync.learner.dry_run on the CPU: the function the dry run and tests/gpu/test_fsdp_fake_pg_gpu.py share runs
rank 0 of a 2-rank FSDP2 learner under torch's fake process group through full steps (the optimizer steps every
shard, the weight-sync gather returns each whole parameter once, the parameters are sharded), in a child process as
the GPU test runs it; the synthetic samples fill rows as asked; the analytic estimate shards the training state over
the world size, follows the learner's checkpoint plan, and lies within 5% of the peaks measured on an H200 (read from
bench/results/fsdp_fake_pg_h200.json), each of its terms checked on its own."""

import dataclasses

import numpy as np
import pytest
import torch

from rlasync.driver.dry_run import DEFAULT_GPU_MEMORY_GIB
from rlasync.learner.dry_run import (
    GIB,
    estimate_rank_memory,
    lm_head_bytes,
    measure_in_subprocess,
    meta_model,
    step_shape,
    synthetic_samples,
    terms_per_row,
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


def qwen3_06b():
    from transformers import Qwen3Config

    return Qwen3Config(  # the Qwen3-0.6B shape
        hidden_size=1024,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=3072,
        vocab_size=151936,
        tie_word_embeddings=True,
    )


def test_the_estimate_shards_the_state_and_follows_the_checkpoint_plan(tmp_path):
    model = meta_model(qwen3_06b(), "float32")
    params = sum(p.numel() for p in model.parameters())
    s = settings(tmp_path, token_budget=8192, gradient_checkpointing=True)
    one = estimate_rank_memory(model, s, 1, gpu_bytes=None)
    eight = estimate_rank_memory(model, s, 8, gpu_bytes=None)
    assert one.state_bytes == params * 16  # float32 weights + grads + two AdamW moments
    assert eight.state_bytes == params * 16 // 8 and eight.unsharded_bytes > 0 == one.unsharded_bytes
    assert one.checkpointed_layers == 28  # no GPU: "auto" checkpoints every layer, as on the CPU
    roomy = estimate_rank_memory(model, s, 1, gpu_bytes=140 * GIB)
    tight = estimate_rank_memory(model, s, 1, gpu_bytes=20 * GIB)
    assert roomy.checkpointed_layers < tight.checkpointed_layers <= 28
    assert roomy.activation_bytes > tight.activation_bytes > one.activation_bytes * 0.99
    assert "GiB" in one.describe() and f"{one.total_bytes / GIB:.2f}" in one.describe()


def _gpu_test_module():
    """tests/gpu/test_fsdp_fake_pg_gpu.py (it runs only on a GPU; its settings, samples and model shape are plain)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "gpu" / "test_fsdp_fake_pg_gpu.py"
    spec = importlib.util.spec_from_file_location("fsdp_fake_pg_gpu", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ESTIMATE_TOLERANCE = 0.05  # the estimate lies within 5% of the measured peak (0.3-0.8% low on the H200 runs)


def test_the_cpu_estimate_is_within_5_percent_of_the_peaks_measured_on_an_h200():
    """The recorded runs (bench/results/fsdp_fake_pg_h200.json, made by tests/gpu/test_fsdp_fake_pg_gpu.py):
    estimated on the meta device with the same settings, model shape and rows (packed by the learner's planner)."""
    import json
    from pathlib import Path

    from rlasync.algorithms.grpo.objective import GrpoObjective
    from rlasync.model.row_shapes import padded_length
    from rlasync.packing.layout import pack

    record = Path(__file__).resolve().parents[3] / "bench" / "results" / "fsdp_fake_pg_h200.json"
    measured = json.loads(record.read_text())["peak_gib_by_world_size"]
    assert "H200" in json.loads(record.read_text())["hardware"]
    gpu = _gpu_test_module()
    s = gpu.rank_settings()
    model = meta_model(gpu.qwen3_06b_config(), s.dtype)
    assert set(measured) == {"2", "4", "8"}
    for world_size, peak_gib in measured.items():
        n = int(world_size)
        rows = [pack(row) for row in GrpoObjective(s, 0, n).plan(gpu.rank_samples(n, 151936))]  # rank 0's rows
        assert {padded_length(len(r.input_ids), s.row_bucket) for r in rows} == {s.token_budget}  # full rows
        terms = max(len(r.target_ids) for r in rows)
        estimate = estimate_rank_memory(model, s, n, gpu_bytes=DEFAULT_GPU_MEMORY_GIB * GIB, terms_per_row=terms)
        assert estimate.checkpointed_layers == 0 and estimate.compiled, estimate.describe()  # as the H200 ran it
        assert estimate.total_bytes / GIB == pytest.approx(peak_gib, rel=ESTIMATE_TOLERANCE), (n, estimate.describe())


def test_the_activations_are_bf16_under_fsdp_and_keep_a_float32_residual_under_autocast(tmp_path):
    from rlasync.model.checkpointing import compiled_activation_bytes_per_token

    model = meta_model(qwen3_06b(), "float32")
    s = settings(tmp_path, token_budget=8192, bf16=True, torch_compile=True, gradient_checkpointing_layers=0)
    hidden, layer = 1024, sum(p.numel() for p in model.model.layers[0].parameters())
    extras = 8192 * hidden * 2 + 100 * hidden * 2  # the final norm's input and the head's input
    two = estimate_rank_memory(model, s, 2, gpu_bytes=140 * GIB, terms_per_row=100)
    full, _ = compiled_activation_bytes_per_token(model.config, 2, 2)  # FSDP2's policy: all bf16
    assert two.activation_bytes == int(28 * full * 8192 + extras)
    one = estimate_rank_memory(model, s, 1, gpu_bytes=140 * GIB, terms_per_row=100)
    full, _ = compiled_activation_bytes_per_token(model.config, 2, 4)  # autocast: float32 residual, bf16 weight copies
    assert one.activation_bytes == int(28 * (full * 8192 + 2 * layer) + 8192 * hidden * 4 + 100 * hidden * 2)
    eager = estimate_rank_memory(model, dataclasses.replace(s, torch_compile=False), 2, gpu_bytes=140 * GIB)
    assert eager.activation_bytes > 1.4 * two.activation_bytes and not eager.compiled and two.compiled


def test_fsdp_keeps_the_root_and_two_layers_gathered_in_the_compute_dtype(tmp_path):
    model = meta_model(qwen3_06b(), "float32")
    s = settings(tmp_path, token_budget=8192, bf16=True)
    layer = sum(p.numel() for p in model.model.layers[0].parameters())
    root = sum(p.numel() for p in model.parameters()) - 28 * layer  # tied embedding/head + final norm
    assert root == 151936 * 1024 + 1024
    assert estimate_rank_memory(model, s, 4, gpu_bytes=140 * GIB).unsharded_bytes == (root + 2 * layer) * 2
    assert estimate_rank_memory(model, s, 4, gpu_bytes=None).unsharded_bytes == (root + 2 * layer) * 4  # no policy
    assert estimate_rank_memory(model, s, 1, gpu_bytes=140 * GIB).unsharded_bytes == 0


# "auto" for the Qwen3-0.6B shape (float32 master weights, bf16=True: FSDP2's bf16 policy at 2/4/8 ranks), one
# row of `token_budget` tokens: decoder layers checkpointed at 2 / 4 / 8 ranks on a GPU of 24 / 48 / 80 / 141 GiB.
PLAN_TABLE = {
    # token_budget, compiled layers: {GiB: (2, 4, 8 ranks)}
    (8192, True): {24: (0, 0, 0), 48: (0, 0, 0), 80: (0, 0, 0), 141: (0, 0, 0)},  # was 18 / 16 / 15 at 24 GiB
    (8192, False): {24: (7, 3, 0), 48: (0, 0, 0), 80: (0, 0, 0), 141: (0, 0, 0)},  # eager layers keep ~3x more
    (32768, True): {24: (21, 19, 18), 48: (5, 3, 3), 80: (0, 0, 0), 141: (0, 0, 0)},  # long rows must checkpoint
}


@pytest.mark.parametrize(("token_budget", "compiled"), list(PLAN_TABLE))
def test_the_learners_auto_plan_for_the_qwen3_shape_by_gpu_and_ranks(tmp_path, monkeypatch, token_budget, compiled):
    """The learner's own plan (`plan_for_model` on a CUDA device whose memory is faked) and the dry run's estimate
    (`estimate_rank_memory`) checkpoint the same layers (one function gives both their figures), as tabled:

        token_budget  layers    24 GiB        48 GiB      80 GiB   141 GiB     (at 2 / 4 / 8 ranks)
        8192          compiled  0 / 0 / 0     0 / 0 / 0   0        0           (the float32 eager figures: 18/16/15)
        8192          eager     7 / 3 / 0     0 / 0 / 0   0        0
        32768         compiled  21 / 19 / 18  5 / 3 / 3   0        0

    The budget is GiB x MEMORY_FRACTION: the plan's counted peak (training state, FSDP2's gathered root and layers, the
    row's head inputs, the head's reserve, the layers' activations) stays within it; the whole estimate, with the LM
    head keeping logits in what is free, stays under GiB x (1 + MEMORY_FRACTION) / 2 (half the margin left); and one
    checkpointed layer fewer would not fit."""
    from rlasync.model.checkpointing import MEMORY_FRACTION, plan_for_model, training_state_bytes

    model = meta_model(qwen3_06b(), "float32")
    s = settings(tmp_path, token_budget=token_budget, bf16=True, torch_compile=compiled)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    for gib, counts in PLAN_TABLE[(token_budget, compiled)].items():
        monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None, gib=gib: (gib * GIB, gib * GIB))
        for world_size, count in zip((2, 4, 8), counts):
            plan = plan_for_model(
                model,
                "auto",
                device=torch.device("cuda"),
                tokens=token_budget,
                mixed=True,
                world_size=world_size,
                compiled=compiled,
            )
            estimate = estimate_rank_memory(model, s, world_size, gpu_bytes=gib * GIB)
            where = (gib, world_size, plan.describe(), estimate.describe())
            assert len(plan.layers) == count == estimate.checkpointed_layers, where
            assert estimate.compiled == compiled and plan.fits, where
            budget = gib * GIB * MEMORY_FRACTION
            reserved = training_state_bytes(model, world_size=world_size, mixed=True, tokens=token_budget)
            assert reserved + plan.estimate_bytes <= budget, where
            assert estimate.total_bytes - estimate.head_bytes <= budget, where
            assert estimate.total_bytes <= gib * GIB * (1 + MEMORY_FRACTION) / 2, where
            if count:  # the fewest: one layer fewer overflows the budget
                fewer = dataclasses.replace(s, gradient_checkpointing_layers=count - 1)
                over = estimate_rank_memory(model, fewer, world_size, gpu_bytes=gib * GIB)
                head_reserve = reserved - (estimate.state_bytes + estimate.unsharded_bytes)
                head_reserve -= token_budget * 1024 * 4  # the row's final-norm and head inputs (bf16 each)
                assert over.total_bytes - over.head_bytes + head_reserve > budget, where


def test_one_rank_plans_with_autocasts_figures_and_fits_its_budget(tmp_path):
    """One rank: autocast (a float32 residual stream, bf16 weight copies saved): 8192-token rows on 24 GiB need
    7 checkpointed layers (the float32 state is not sharded), 48 GiB none."""
    from rlasync.model.checkpointing import MEMORY_FRACTION

    model = meta_model(qwen3_06b(), "float32")
    s = settings(tmp_path, token_budget=8192, bf16=True, torch_compile=True)
    small = estimate_rank_memory(model, s, 1, gpu_bytes=24 * GIB)
    assert small.checkpointed_layers == 7 and small.total_bytes - small.head_bytes <= 24 * GIB * MEMORY_FRACTION
    assert estimate_rank_memory(model, s, 1, gpu_bytes=48 * GIB).checkpointed_layers == 0
    assert (
        estimate_rank_memory(model, settings(tmp_path, token_budget=8192), 1, gpu_bytes=None).checkpointed_layers == 28
    )
    off = settings(tmp_path, token_budget=8192, gradient_checkpointing=False)
    assert estimate_rank_memory(model, off, 1, gpu_bytes=24 * GIB).checkpointed_layers == 0


def test_the_lm_head_keeps_a_rows_logits_on_a_large_gpu_and_chunks_on_a_small_one():
    from rlasync.model.checkpointing import HEAD_BUFFERS
    from rlasync.model.head import default_chunk_size, plan_chunk_size, plan_kept_chunks

    vocab, hidden, terms = 151936, 1024, 5120
    logits = terms * vocab * 2
    big = lm_head_bytes(terms, vocab, hidden, matmul_bytes=2, weight_bytes=2, free_bytes=120 * GIB)
    assert big == 2 * logits + vocab * hidden * 2  # kept logits + their grad + the bf16 weight's grad (one chunk)
    small = lm_head_bytes(terms, vocab, hidden, matmul_bytes=2, weight_bytes=2, free_bytes=4 * GIB)
    # as the head sizes itself: chunks of free/8 of working memory, the first chunks kept within free/4
    chunk = plan_chunk_size(terms, vocab, torch.device("cpu"), chunk_bytes=4 * GIB // 8)
    kept = plan_kept_chunks(terms, chunk, vocab, torch.bfloat16, 4 * GIB // 4)
    assert 1 <= kept < -(-terms // chunk) and chunk < terms
    # the kept chunks, a recomputed chunk's logits and its grad, a float32 accumulator for the weight's grad
    assert small == kept * chunk * vocab * 2 + 2 * chunk * vocab * 2 + vocab * hidden * 4 < big
    autocast = lm_head_bytes(terms, vocab, hidden, matmul_bytes=2, weight_bytes=4, free_bytes=120 * GIB)
    assert autocast == 2 * logits + vocab * hidden * 4 + vocab * hidden * 2  # float32 weight grad + its bf16 copy
    eager = lm_head_bytes(terms, vocab, hidden, matmul_bytes=2, weight_bytes=2, free_bytes=120 * GIB, compiled=False)
    assert eager == big + 2 * terms * vocab * 4  # the eager passes' float32 temporaries
    cpu = lm_head_bytes(terms, vocab, hidden, matmul_bytes=4, weight_bytes=4, free_bytes=None)
    cpu_chunk = plan_chunk_size(terms, vocab, torch.device("cpu"))  # default_chunk_size terms, evened out
    assert cpu_chunk <= default_chunk_size(vocab) < terms
    assert cpu == HEAD_BUFFERS * cpu_chunk * vocab * 4 + vocab * hidden * 4


def test_terms_per_row_count_the_completion_tokens_of_whole_groups():
    assert terms_per_row(8192, 8, 544, 128) == 5 * 8 * 128  # the H200 runs' rows: 5 groups of 544 + 8 x 128
    assert terms_per_row(1024, 8, 32, 124) == 992  # step_shape's one group of 32 + 8 x 124
    assert terms_per_row(100, 8, 64, 128) == 100  # a group larger than the row: at most the row


def test_the_gpu_fake_group_test_builds_its_settings_and_samples_on_the_cpu():
    """tests/gpu/test_fsdp_fake_pg_gpu.py runs only on a GPU; what it hands `measure_in_subprocess` is built here."""
    module = _gpu_test_module()
    settings = module.rank_settings()
    assert settings.bf16 and settings.torch_compile and settings.token_budget == 8192 and settings.row_bucket > 0
    samples = module.rank_samples(2, VOCAB)
    assert len(samples) == 160 and {len(s) for s in samples} == {672}
