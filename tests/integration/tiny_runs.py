"""The tiny runs the integration and fault suites train (conftest.py's random 2-layer Llama, a few steps on the CPU):
the config fields they share, the digit reward, the arithmetic rows, the check that an epoch consumed every prompt
exactly once, and the by-value pickling that ships a test module's functions and classes to the Ray actors.

A plain module the tests import (`from tests.integration.tiny_runs import tiny_grpo_config`), not a test module."""

import sys

ENGINE_KWARGS = {"max_num_seqs": 16, "kv_cache_tokens": 2048, "max_model_len": 128}


def tiny_cluster(**entries):
    """A tiny run's `cluster`: a small built-in engine and a 60-s collective timeout; `entries` are added and win."""
    return {"engine_kwargs": dict(ENGINE_KWARGS), "collective_timeout_s": 60.0, **entries}


def _common_fields(tmp_path, cluster):
    return dict(
        output_dir=str(tmp_path),
        max_completion_length=8,
        token_budget=192,
        learning_rate=1e-2,
        logging_steps=1,
        save_steps=100,
        max_staleness=2,
        gradient_checkpointing=False,
        seed=0,
        cluster=tiny_cluster(**(cluster or {})),
    )


def tiny_grpo_fields(tmp_path, *, cluster=None, **changes):
    """The fields of a tiny GRPO run writing into `tmp_path` (groups of 4, 8-token completions, top-k 16 sampling),
    for a config class of one's own; `cluster` entries are merged into `tiny_cluster()`, the other keywords win."""
    fields = _common_fields(tmp_path, cluster)
    fields.update(num_generations=4, temperature=1.0, top_k=16)
    fields.update(changes)
    return fields


def tiny_grpo_config(tmp_path, *, cluster=None, **changes):
    """An `AsyncGRPOConfig` of `tiny_grpo_fields`."""
    from rlasync.config import AsyncGRPOConfig

    return AsyncGRPOConfig(**tiny_grpo_fields(tmp_path, cluster=cluster, **changes))


def tiny_distill_config(tmp_path, *, cluster=None, **changes):
    """An `AsyncDistillationConfig` of a tiny run (the teacher's top 4 log-probs); `cluster` and the keywords as in
    `tiny_grpo_fields`."""
    from rlasync.config import AsyncDistillationConfig

    fields = _common_fields(tmp_path, cluster)
    fields.update(teacher_top_k=4)
    fields.update(changes)
    return AsyncDistillationConfig(**fields)


def digit_reward(completions, **kwargs):
    """Share of digit words in the reply: varies within a group of random completions (a learning signal)."""
    out = []
    for completion in completions:
        words = completion[-1]["content"].split()
        out.append(sum(w.isdigit() for w in words) / max(len(words), 1))
    return out


def arithmetic_rows(n=64):
    """`n` arithmetic prompts (seed 0)."""
    from rlasync.data import arithmetic_dataset

    return arithmetic_dataset(n, seed=0)


def assert_exactly_once(queue, rows):
    """An epoch over `rows` prompts ended with every prompt in exactly one counted outcome, none left in flight."""
    outcomes = {k: v for k, v in queue["outcomes"].items() if k != "stale"}  # stale groups are leased again
    assert queue["done"] and queue["consumed_groups"] == rows and queue["first_untrained_index"] == rows
    assert sum(outcomes.values()) == rows and set(outcomes) <= {"trained", "zero_std", "filtered", "failed"}
    assert queue["queue_size"] == 0 and queue["inflight_groups"] == 0 and queue["leased_groups"] == 0
    assert outcomes.get("trained", 0) <= queue["taken_samples"] and 0 <= queue["unplanned_samples"]
    assert queue["unplanned_samples"] <= queue["taken_samples"]  # samples: trained or counted unplanned (§4.5.2)


def assert_every_taken_sample_trained(queue, records):
    """Sample level (docs/algorithms.md §4.5.2): the samples the queue handed out add up to the learners' steps
    (`batch/samples_per_step`, one record per step), and no step left one in no rank's row."""
    assert queue["unplanned_samples"] == 0 and all(r.get("batch/unplanned_count", 0) == 0 for r in records)
    assert sum(r["batch/samples_per_step"] for r in records if "batch/samples_per_step" in r) == queue["taken_samples"]


def pickle_by_value(module):
    """Ship `module`'s functions and classes (reward functions, callbacks, environments), and this module's, to the
    Ray actors by value: pytest imports test modules under names the actors cannot import. Test modules on the
    session's cluster use conftest.py's `pickle_by_value` fixture, which calls this."""
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(module)
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
