"""On CUDA: one rank of an N-rank FSDP2 learner (N = 2, 4, 8) through a full training step, on one GPU.

torch's fake process group makes this process rank 0 of an N-rank job (torchtitan's `comm.mode=fake_backend` dry
run): the sharding, the bf16 `MixedPrecisionPolicy`, the compiled decoder layers with FlexAttention tree attention,
the chunked LM head, the optimizer and the weight-sync gather (`full_tensor()` per parameter) all run as on a real
rank; only the collectives are no-ops. The model is the Qwen3-0.6B shape with random weights.

Each world size runs in its own process (a process joins one process group). The peak memory per world size is
printed as `PEAK_GIB N x` and written to $RLASYNC_FAKE_PG_OUT when set (the device stage collects it).

Run through the device tool: `python3 -m pytest -q tests/gpu/test_fsdp_fake_pg_gpu.py -s`.
"""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

REPO = Path(__file__).resolve().parents[2]

RANK_SCRIPT = textwrap.dedent(
    """
    import json, sys, time
    import numpy as np, torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    world_size, model_dir = int(sys.argv[1]), sys.argv[2]
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)

    from rlasync.algorithms.grpo.spec import GRPO
    from rlasync.config import AsyncGRPOConfig
    from rlasync.learner.learner import Learner
    from rlasync.rollout import RolloutSample
    from rlasync.weights.plan import stream_parameters

    class NoReduce:  # the fake group's all-reduce would return zeros: keep this rank's own values
        def all_reduce(self, sums, maxes):
            return sums, maxes

        def sum(self, tensor):
            return tensor

    config = AsyncGRPOConfig(output_dir="/tmp/fake_pg_out", bf16=True, torch_compile=True, score_centering=False,
                             gradient_checkpointing=True, report_to="none", learning_rate=1e-5)
    settings = GRPO.learner_settings(config, token_budget=8192)
    torch.cuda.reset_peak_memory_stats()
    learner = Learner(model_dir, settings, rank=0, world_size=world_size, device="cuda", reducer=NoReduce())
    vocab = learner.model.config.vocab_size
    rng = np.random.default_rng(0)
    samples = []
    for group in range(10 * world_size):  # 10 groups of 8 (prompt 544, completions 128) per rank's row
        prompt = rng.integers(5, vocab - 5, 544).tolist()
        for _ in range(8):
            ids = np.array(prompt + rng.integers(5, vocab - 5, 128).tolist())
            mask = np.r_[np.zeros(544, np.int8), np.ones(128, np.int8)]
            samples.append(RolloutSample(ids, mask, np.full(len(ids), -11.0, np.float32), float(rng.normal()), group))
    losses = []
    for _ in range(2):
        items = dict(learner.train_step(samples))
        losses.append(float(items["loss"]))
    # the fake reduce-scatter leaves each gradient shard as allocated, so the update itself is not checked here
    # (the gloo tests on CPU check values); what is checked is that AdamW stepped every trainable shard twice
    steps = [int(learner.optimizer.state[p]["step"]) for p in learner.scorer.parameters() if p.requires_grad]
    gathered = 0
    for name, tensor in stream_parameters(learner.model, "cuda", dtype=torch.bfloat16):
        gathered += tensor.numel()
    full = sum(p.numel() for p in learner.model.parameters())  # DTensors: the logical (whole) sizes
    local = sum(p.to_local().numel() for p in learner.model.parameters())  # this rank's shards
    print("RESULT " + json.dumps({
        "world_size": world_size, "losses": losses, "optimizer_steps": sorted(set(steps)), "trainable": len(steps),
        "gathered": gathered, "full_numel": full, "local_numel": local,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "compiled_layers": learner.info()["compiled_layers"], "mixed_precision": learner.info()["mixed_precision"],
    }), flush=True)
    """
)


@pytest.fixture(scope="module")
def qwen3_06b_dir(tmp_path_factory):
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(
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
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    path = tmp_path_factory.mktemp("qwen3_06b")
    model.save_pretrained(path)
    del model
    torch.cuda.empty_cache()
    return path


@pytest.mark.parametrize("world_size", [2, 4, 8])
def test_one_rank_of_an_fsdp2_group_trains_a_full_step(qwen3_06b_dir, world_size):
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    done = subprocess.run(
        [sys.executable, "-c", RANK_SCRIPT, str(world_size), str(qwen3_06b_dir)],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stdout[-3000:] + done.stderr[-6000:]
    result = json.loads(lines[-1][len("RESULT ") :])
    print(f"PEAK_GIB {world_size} x {result['peak_gib']:.2f}", result)
    assert all(loss == loss for loss in result["losses"]), result  # finite, not NaN
    assert result["trainable"] > 300 and result["optimizer_steps"] == [2], "AdamW must step every shard each step"
    assert result["gathered"] == result["full_numel"], "the weight gather must return each whole parameter once"
    assert result["local_numel"] <= result["full_numel"] / world_size * 1.01, "parameters are not sharded"
    assert result["mixed_precision"] and result["compiled_layers"] == 28, result
    out = os.environ.get("RLASYNC_FAKE_PG_OUT")
    if out:
        with open(out, "a") as f:
            f.write(json.dumps(result) + "\n")
