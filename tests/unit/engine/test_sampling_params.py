"""SamplingParams from the typed trainer configs: GRPO's (top log-probs and the sampling mask), a distillation
student's (neither), per-request seeds, and the import direction (rlasync.config never imports rlasync.engine)."""

import ast
from pathlib import Path

import pytest

from rlasync.config import AsyncDistillationConfig, AsyncGRPOConfig
from rlasync.engine import SamplingParams


def test_from_config_reads_the_grpo_generation_fields():
    config = AsyncGRPOConfig(
        max_completion_length=33,
        temperature=0.7,
        top_k=20,
        top_p=0.9,
        min_p=0.05,
        repetition_penalty=1.1,
        num_sampler_logprobs=5,
    )
    sampling = SamplingParams.from_config(config, seed=11)
    assert sampling == SamplingParams(
        max_tokens=33,
        temperature=0.7,
        top_k=20,
        top_p=0.9,
        min_p=0.05,
        repetition_penalty=1.1,
        seed=11,
        num_logprobs=5,
        return_sampling_mask=True,
    )


def test_for_student_asks_for_no_logprobs_and_no_mask():
    config = AsyncDistillationConfig(max_completion_length=12, temperature=0.5, top_k=4, repetition_penalty=1.2)
    sampling = SamplingParams.for_student(config, seed=3)
    assert (sampling.max_tokens, sampling.temperature, sampling.top_k, sampling.repetition_penalty) == (12, 0.5, 4, 1.2)
    assert (sampling.seed, sampling.num_logprobs, sampling.return_sampling_mask) == (3, 0, False)


def test_with_seed_changes_only_the_seed_and_still_validates():
    base = SamplingParams.from_config(AsyncGRPOConfig(top_k=8, num_sampler_logprobs=2))
    seeded = base.with_seed(42)
    assert seeded.seed == 42 and base.seed is None
    assert seeded == SamplingParams.from_config(AsyncGRPOConfig(top_k=8, num_sampler_logprobs=2), seed=42)
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)


def test_the_config_package_does_not_import_the_engine():
    """engine.base annotates with rlasync.config's types; the reverse import would be a cycle."""
    import rlasync.config

    imported = set()
    for path in Path(rlasync.config.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                imported.add(node.module)
            elif isinstance(node, ast.Import):
                imported.update(alias.name for alias in node.names)
    assert imported and not any(name.startswith("rlasync.engine") for name in imported)
