"""A learner step's rows queue on the GPU without the host waiting for it (CUDA; run with `pytest -m gpu`).

Between rows nothing reads back from the device: the row's copy to the GPU is pinned and non-blocking, the varlen
plan is made on the host, the loss metrics stay on the device until the step reads them once. Checked with torch's
sync debug mode, which raises at the first synchronising call (and names it in the traceback).
"""

import numpy as np
import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def tiny_learner_step(backend):
    from transformers import AutoModelForCausalLM, Qwen3Config

    from rlasync.algorithms.grpo.learner_step import GrpoLearnerStep
    from rlasync.algorithms.grpo.loss import LossConfig
    from rlasync.config import KernelSettings
    from rlasync.learner import OptimizerSettings, build_optimizer
    from rlasync.model import TreeScorer, enable_tree_attention

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        tie_word_embeddings=True,
    )
    model = enable_tree_attention(AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).cuda())
    scorer = TreeScorer(model, KernelSettings(tree_attention=backend))  # the learner's kernels choose the backend
    optimizer, scheduler = build_optimizer(scorer, OptimizerSettings(learning_rate=1e-3))
    return GrpoLearnerStep(scorer, optimizer, scheduler, LossConfig(score_centering=False), device="cuda")


def rows(num_rows=3, seed=0):
    from rlasync.packing import TreeRow, pack
    from rlasync.rollout import RolloutSample

    rng = np.random.default_rng(seed)
    out = []
    for _ in range(num_rows):
        row, prompt = TreeRow(), rng.integers(0, 256, 60).tolist()
        for adv in (1.0, -1.0, 0.5, -0.5):
            seq = prompt + rng.integers(0, 256, int(rng.integers(10, 40))).tolist()
            mask = [0] * 60 + [1] * (len(seq) - 60)
            row.add(RolloutSample(seq, mask, [-1.0] * len(seq), adv, 0))
        out.append(pack(row))
    return out


@pytest.mark.parametrize("backend", ["flex", "varlen"])
def test_rows_queue_without_a_device_sync(backend):
    from rlasync.algorithms.grpo.loss_metrics import resolve_metrics

    step = tiny_learner_step(backend)
    batch = rows()
    terms = [float(r.num_trained_tokens) for r in batch]
    step.step(batch, terms)  # warm-up: compiles FlexAttention, fills the allocator's caches
    torch.cuda.synchronize()
    pending = []
    torch.cuda.set_sync_debug_mode("error")
    try:
        for row, n in zip(batch, terms):
            loss, metrics = step._loss(row, n, len(batch))
            loss.backward()
            pending.append(metrics)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    records, _ = resolve_metrics(pending)
    assert len(records) == len(batch) and all(np.isfinite(r["ratio"][0]) for r in records)
