"""The learner's kernel switches cross Ray with the settings: a LearnerActor started while the driver's environment
holds none of the old `RLASYNC_*` kernel variables runs the kernels its config names (`kernels.*`), on a CPU rank.

On the CPU "auto" would be the dense tree attention; the config asks for varlen (its CPU reference loop), and the
rank reports it resolved varlen, holds the rest of the choice, and trains a step with it."""

import json
import os

import numpy as np
import pytest

pytestmark = pytest.mark.integration

OLD_VARIABLES = (
    "RLASYNC_TREE_ATTENTION",
    "RLASYNC_FLEX_KERNEL_OPTIONS",
    "RLASYNC_HEAD_COMPILE",
    "RLASYNC_HEAD_KEEP",
    "RLASYNC_HEAD_DYNAMIC",
)


def test_a_kernel_choice_in_the_config_reaches_the_learner_rank(ray_cluster, tiny_model_dir, tmp_path, monkeypatch):
    from actors.learner import LearnerActor
    from rlasync.algorithms.grpo.spec import GRPO
    from rlasync.config import load_config
    from tests.integration.test_learner_group import make_samples

    for name in OLD_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert not any(name in os.environ for name in OLD_VARIABLES)
    config = load_config(
        None,
        [
            f"output_dir={tmp_path}",
            "max_steps=2",
            "gradient_checkpointing=false",
            "score_centering=false",
            "num_sampler_logprobs=0",
            "kernels.tree_attention=varlen",
            "kernels.head_keep=probs",
            "kernels.head_dynamic=all",
            'kernels.flex_kernel_options={"BLOCK_M1": 32}',
        ],
    )
    settings = GRPO.learner_settings(config, token_budget=64)
    ray = ray_cluster

    @ray.remote(num_cpus=0)
    def worker_variables():
        return [name for name in OLD_VARIABLES if name in os.environ]

    assert ray.get(worker_variables.remote(), timeout=120) == []  # nor do the cluster's workers hold them
    learner = LearnerActor.options(num_cpus=0.25).remote(rank=0, world_size=1, model=tiny_model_dir, settings=settings)
    try:
        info = ray.get(learner.setup.remote(None, 60.0), timeout=300)
        assert info["device"] == "cpu"
        assert info["kernels"] == {
            "tree_attention": "varlen",
            "flex_kernel_options": {"BLOCK_M1": 32},
            "head_compile": True,
            "head_keep": "probs",
            "head_dynamic": "all",
            "resolved_tree_attention": "varlen",  # the CPU default would be dense
        }
        vocab = len(json.loads(open(f"{tiny_model_dir}/vocab_words.json").read())) + 5
        refs = [ray.put(sample) for sample in make_samples(vocab, num_groups=2)]
        metrics = dict(ray.get(learner.train_step.remote(refs), timeout=300))
        assert np.isfinite(metrics["loss"]) and np.isfinite(metrics["grad_norm"])
    finally:
        ray.get(learner.close.remote(), timeout=60)
        ray.kill(learner)
