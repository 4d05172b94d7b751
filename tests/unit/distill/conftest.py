"""Shared helpers of the distillation tests, handed out as fixtures (`--import-mode=importlib`: test modules
cannot import each other)."""

import numpy as np
import pytest

from rlasync.distill.samples import DistillationSample


def make_sample(prompt_len, completion_len, prompt_id=0, teacher_id="default", width=3, start_id=0, **kwargs):
    """A sample of `prompt_len + completion_len` tokens with ids `start_id, start_id+1, ...`; completion position
    `i`'s teacher row holds the candidates `[100 + i, 200 + i]` with log-probs `[-0.5, -1.5]`."""
    length = prompt_len + completion_len
    ids = np.full((length, width), -1, dtype=np.int64)
    lps = np.full((length, width), -np.inf, dtype=np.float32)
    for i in range(completion_len):
        ids[prompt_len + i, :2] = [100 + i, 200 + i]
        lps[prompt_len + i, :2] = [-0.5, -1.5]
    return DistillationSample(
        input_ids=np.arange(start_id, start_id + length),
        completion_mask=[0] * prompt_len + [1] * completion_len,
        teacher_topk_ids=ids,
        teacher_topk_logprobs=lps,
        prompt_id=prompt_id,
        teacher_id=teacher_id,
        **kwargs,
    )


@pytest.fixture
def sample_factory():
    """`sample_factory(prompt_len, completion_len, prompt_id=0, teacher_id="default", width=3, ...)`."""
    return make_sample
