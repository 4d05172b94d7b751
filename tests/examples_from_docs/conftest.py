"""Fixtures for the reference documents' examples: the integration suite's one Ray local cluster and tiny random
Llama (reused, not redefined), CPU-sized configs, and the metrics a run wrote.

Each test module copies a document's example as close to verbatim as possible; only the import line changes
(trl -> rlasync) and the sizes shrink to CPU (`cpu_fields`). Modules that ship functions or classes to the Ray
actors register themselves to be pickled by value (`pickle_by_value`): pytest imports test modules under names
the actors cannot import.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location(
    "_integration_conftest", Path(__file__).resolve().parents[1] / "integration" / "conftest.py"
)
_integration = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_integration)

ray_cluster = _integration.ray_cluster
tiny_model_dir = _integration.tiny_model_dir

CLUSTER = {
    "engine_kwargs": {"max_num_seqs": 16, "kv_cache_tokens": 2048, "max_model_len": 128},
    "collective_timeout_s": 60.0,
}


def cpu_fields(tmp_path, **changes):
    """The CPU-sized fields every document example runs with (one or two steps of a tiny model)."""
    fields = dict(
        output_dir=str(tmp_path),
        max_steps=1,
        num_generations=4,
        max_completion_length=8,
        token_budget=256,
        logging_steps=1,
        save_steps=100,
        max_staleness=2,
        gradient_checkpointing=False,
        top_k=16,
        num_sampler_logprobs=4,
        seed=0,
        cluster=CLUSTER,
    )
    fields.update(changes)
    return fields


def read_metrics(output_dir) -> list[dict]:
    path = Path(output_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def metric_keys(output_dir) -> set[str]:
    return set().union(*read_metrics(output_dir)) if read_metrics(output_dir) else set()


@pytest.fixture
def pickle_by_value(ray_cluster, request):
    """Ship the requesting test module's functions and classes to the actors by value."""
    cloudpickle = importlib.import_module("ray.cloudpickle")  # Ray's own pickler (the fixture started Ray)
    cloudpickle.register_pickle_by_value(sys.modules[request.module.__name__])
    return ray_cluster


@pytest.fixture
def docs():
    """The helpers above, for test modules (importlib import mode: they cannot import this conftest by name)."""

    class Docs:
        fields = staticmethod(cpu_fields)
        metrics = staticmethod(read_metrics)
        keys = staticmethod(metric_keys)

    return Docs
