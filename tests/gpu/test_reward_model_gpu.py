"""On CUDA: a reward model (docs/rewards.md §2) loads on the GPU in bf16 by default ("auto") and scores as the
fp32 CPU reference does within bf16's precision, batched and one by one alike; the bf16 batch keeps the order.

Run through the device tool: `python3 -m pytest -q tests/gpu/test_reward_model_gpu.py`.
"""

import asyncio

import pytest
import torch

from tests.unit.rewards.test_reward_model import COMPLETIONS, PROMPTS, save_tiny_reward_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_auto_is_bf16_on_the_gpu_and_matches_the_cpu_in_fp32(tmp_path):
    from rlasync.rewards import RewardModel

    folder = save_tiny_reward_model(tmp_path / "rm")
    gpu = RewardModel(folder, batch_size=2)
    scores = asyncio.run(gpu(prompts=PROMPTS, completions=COMPLETIONS))
    scorer = gpu._scorer
    assert scorer.device == "cuda" and scorer.dtype == torch.bfloat16
    assert next(scorer.model.parameters()).is_cuda
    reference = RewardModel(folder, device="cpu", dtype="float32").load()
    expected = reference.score(list(zip(PROMPTS, COMPLETIONS)))
    assert scores == pytest.approx(expected, abs=0.05, rel=0.05)
    one_by_one = [scorer.score([(p, c)])[0] for p, c in zip(PROMPTS, COMPLETIONS)]
    assert scores == pytest.approx(one_by_one, abs=0.02, rel=0.02)
