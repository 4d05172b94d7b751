"""On CUDA: `rlasync train RUN.yaml --dry-run` measures the learner rank's peak memory within 10% of a real 1-rank
training step's peak.

The dry run trains one learner rank on synthetic GRPO groups that fill its `token_budget` rows
(`rlasync.learner.dry_run.step_shape`); the real step here is the learner core a LearnerActor runs (`Learner`,
world size 1, the same settings the run's spec builds), trained on a step of groups of varied prompt and
completion lengths (as a run's samples come: prompts of 1/64 to 1/16 of a row, completions of 16 tokens up to
max_completion_length) that fill the same token count, 4 rows (gradient_accumulation_steps), packed by the
learner's own planner. Both run in fresh processes, so each
peak is its own. The model is the Qwen3-0.6B shape with random weights, bf16 mixed precision over float32 master
weights, gradient checkpointing "auto" (by memory), as configs/countdown_gpu.yaml trains.

Run through the device tool: `python3 -m pytest -q tests/gpu/test_dry_run_gpu.py -s`.
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
TOKEN_BUDGET, GROUP, MAX_COMPLETION = 8192, 8, 512

RUN_FILE = """
model: {model}
dataset: {{name: countdown, size: 64, seed: 0}}
reward_funcs: [rlasync.rewards:countdown_reward]
output_dir: {output_dir}
max_steps: 1
learning_rate: 1.0e-6
gradient_accumulation_steps: 4
gradient_checkpointing: true
dtype: auto
num_generations: {group}
max_completion_length: {max_completion}
num_sampler_logprobs: 8
token_budget: {budget}
cluster:
  num_learners: 1
  learner_num_gpus: 1
  num_generation_actors: 1
  generation_num_gpus: 1
  engine_kwargs: {{max_model_len: 2048, max_num_seqs: 64}}
"""

REAL_STEP = textwrap.dedent(
    """
    import json, sys
    import numpy as np, torch
    from rlasync.algorithms.grpo.spec import GRPO
    from rlasync.learner.learner import Learner
    from rlasync.records import RolloutSample
    from rlasync.runfile import load_run

    run = load_run(sys.argv[1], [])
    config = run.config
    settings = GRPO.learner_settings(config, token_budget=config.token_budget)
    torch.cuda.reset_peak_memory_stats()
    learner = Learner(run.model, settings, rank=0, world_size=1, device="cuda")
    vocab = learner.model.config.vocab_size
    rng = np.random.default_rng(1)
    samples, tokens, group = [], 0, 0
    while tokens < config.token_budget * config.gradient_accumulation_steps:  # one step's tokens, varied lengths
        prompt = rng.integers(5, vocab - 5, int(rng.integers(config.token_budget // 64, config.token_budget // 16)))
        for _ in range(config.num_generations):
            completion = rng.integers(5, vocab - 5, int(rng.integers(16, config.max_completion_length + 1)))
            ids = np.r_[prompt, completion]
            mask = np.r_[np.zeros(len(prompt), np.int8), np.ones(len(completion), np.int8)]
            topk = rng.integers(5, vocab - 5, (len(ids), 8))
            samples.append(RolloutSample(ids, mask, np.full(len(ids), -11.0, np.float32), float(rng.normal()),
                                         group, sampler_topk_ids=topk, sampler_topk_logprobs=np.full(topk.shape, -11.0)))
            tokens += len(completion)
        tokens += len(prompt)
        group += 1
    for _ in range(2):
        learner.train_step(samples)
    print("RESULT " + json.dumps({"peak_gib": torch.cuda.max_memory_allocated() / 2**30, "samples": len(samples)}))
    """
)


@pytest.fixture(scope="module")
def run_file(tmp_path_factory):
    from transformers import AutoModelForCausalLM, Qwen3Config

    folder = tmp_path_factory.mktemp("dry_run_gpu")
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
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder / "model")
    del model
    torch.cuda.empty_cache()
    path = folder / "run.yaml"
    path.write_text(
        RUN_FILE.format(
            model=folder / "model",
            output_dir=folder / "out",
            group=GROUP,
            max_completion=MAX_COMPLETION,
            budget=TOKEN_BUDGET,
        )
    )
    return path


def _python(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=900, env=env)


def test_the_dry_runs_measured_peak_is_within_10_percent_of_a_real_step(run_file):
    dry = _python("-m", "rlasync", "train", str(run_file), "--dry-run", "--json")
    assert dry.returncode == 0, dry.stdout[-3000:] + dry.stderr[-6000:]
    plan = json.loads(dry.stdout.strip().splitlines()[-1])
    learner = plan["learner"]
    assert learner["measured"] and plan["fits"], plan
    real = _python("-c", REAL_STEP, str(run_file))
    lines = [line for line in real.stdout.splitlines() if line.startswith("RESULT ")]
    assert real.returncode == 0 and lines, real.stdout[-3000:] + real.stderr[-6000:]
    real_peak = json.loads(lines[-1][len("RESULT ") :])["peak_gib"]
    print(f"DRY_RUN_PEAK_GIB {learner['peak_gib']:.2f} REAL_STEP_PEAK_GIB {real_peak:.2f}", learner["summary"])
    assert abs(learner["peak_gib"] - real_peak) <= 0.10 * real_peak, (learner, real_peak)
    learner_row = next(a for a in plan["actors"] if a["label"] == "learner rank 0")
    assert learner_row["memory_bytes"] >= learner["peak_gib"] * 2**30  # the peak plus the CUDA context
