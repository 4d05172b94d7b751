"""On CUDA: the mixed-precision learner step (bf16 autocast over float32 master weights, FlexAttention tree
attention) follows the float32 step; weights packed on the GPU are read by another process through CUDA IPC.

Run through the device tool: `python3 -m pytest -q tests/gpu`.
"""

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def tiny_model(seed=0, vocab=512):
    from transformers import AutoModelForCausalLM, Qwen3Config

    from rlasync.model import enable_tree_attention

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        tie_word_embeddings=True,
    )
    return enable_tree_attention(AutoModelForCausalLM.from_config(config).cuda())


def group(model, rng, vocab=512, prompt_len=12, completion_len=10, size=4):
    from rlasync.model import sequence_logprobs
    from rlasync.rollout import RolloutSample

    prompt = rng.integers(0, vocab, prompt_len).tolist()
    seqs = [prompt + rng.integers(0, vocab, completion_len).tolist() for _ in range(size)]
    with torch.no_grad():
        lps = sequence_logprobs(model, seqs, [prompt_len] * size, packing="none")
    samples = []
    for i, (seq, lp) in enumerate(zip(seqs, lps)):
        sampler = np.zeros(len(seq), np.float32)
        sampler[prompt_len:] = lp.float().cpu().numpy()
        mask = np.r_[np.zeros(prompt_len, np.int8), np.ones(completion_len, np.int8)]
        samples.append(RolloutSample(seq, mask, sampler, 1.0 if i % 2 else -1.0, 0))
    return samples


def test_mixed_precision_step_on_cuda_follows_the_float32_step():
    from rlasync.algorithms.grpo.learner_step import GrpoLearnerStep
    from rlasync.algorithms.grpo.loss import LossConfig
    from rlasync.learner import OptimizerSettings, build_optimizer
    from rlasync.packing import TokenBudgetBatcher, pack

    rng = np.random.default_rng(0)
    models = {"fp32": tiny_model(), "mixed": tiny_model()}
    samples = group(models["fp32"], rng)
    rows = [pack(b.rows[0]) for b in TokenBudgetBatcher(num_ranks=1, token_budget=256).plan(samples)]
    grads = {}
    for name, model in models.items():
        optimizer, scheduler = build_optimizer(model, OptimizerSettings(learning_rate=0.0, max_grad_norm=1e9))
        step = GrpoLearnerStep(
            model,
            optimizer,
            scheduler,
            LossConfig(score_centering=False),
            max_grad_norm=1e9,
            device="cuda",
            autocast_dtype=torch.bfloat16 if name == "mixed" else None,
        )
        step.optimizer.zero_grad = lambda set_to_none=True: None
        metrics = step.step(rows, [r.num_trained_tokens for r in rows])
        assert np.isfinite(float(metrics["loss"]))
        grads[name] = torch.cat([p.grad.float().flatten() for p in model.parameters()])
        assert all(p.dtype == torch.float32 for p in model.parameters())
    cosine = torch.nn.functional.cosine_similarity(grads["fp32"], grads["mixed"], dim=0)
    assert cosine > 0.98, cosine


READER = """
import json, sys, torch
from rlasync.weights.ipc import open_shared
import pickle, base64
handles = pickle.loads(base64.b64decode(sys.stdin.read()))
print(json.dumps({name: float(t.float().sum()) for name, t in open_shared(handles)}))
"""


def test_weights_packed_on_the_gpu_are_read_by_another_process_through_cuda_ipc():
    import base64
    import pickle

    from rlasync.weights import build_manifest, stream_parameters
    from rlasync.weights.ipc import SharedWeights

    model = tiny_model()
    manifest = build_manifest(model, dtype=torch.bfloat16)
    shared = SharedWeights.pack(stream_parameters(model, dtype=torch.bfloat16), manifest, "cuda", 1 << 16)
    handles = shared.handles()
    assert all(handle[0] == "cuda" for _, handle in handles)
    reader = subprocess.run(
        [sys.executable, "-c", READER],
        input=base64.b64encode(pickle.dumps(handles)).decode(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert reader.returncode == 0, reader.stderr[-3000:]
    sums = json.loads(reader.stdout)
    expected = {name: float(t.float().sum()) for name, t in stream_parameters(model, dtype=torch.bfloat16)}
    assert sums == pytest.approx(expected, rel=1e-6)
    shared.release()
