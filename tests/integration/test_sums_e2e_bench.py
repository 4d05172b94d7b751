"""bench/sums_e2e.py end to end on CPUs: the command it builds trains (configs/quickstart.yaml, 2 steps, logged every
step, its own local Ray in a subprocess) and the JSON carries the keys computed from that run's metrics.jsonl."""

import json
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

import sums_e2e  # noqa: E402


def test_a_short_run_gives_the_keys_from_its_metrics(tmp_path):
    out = tmp_path / "sums_e2e.json"
    argv = ["--config", str(REPO / "configs" / "quickstart.yaml"), "--engines", "torch", "--steps", "2"]
    argv += ["--run-root", str(tmp_path / "runs"), "--out", str(out), "--threshold", "0", "--window", "1"]
    argv += ["--set", "token_budget=256", "--set", "max_completion_length=12"]
    sums_e2e.main(argv)
    results = json.loads(out.read_text())
    assert "torch" not in results  # a variant merges beside the default, not over it
    result = results["torch_token_budget_256_max_completion_length_12"]
    assert result["sets"] == ["token_budget=256", "max_completion_length=12"]
    assert result["returncode"] == 0 and result["last_step"] == 2 and result["weight_sync_max_is_per_step"]
    # threshold 0 over a 1-step window: reached at step 1, after the command started and before it ended
    assert result["step_at_reward_0"] == 1 and 0 < result["seconds_to_reward_0"] < result["wall_s"]
    assert result["weight_sync_max_s"] >= result["weight_sync_median_s"] > 0
    assert 0 < result["rollout_wait_frac"] <= 1
    assert result["checkpoint"].endswith("checkpoint-2") and Path(result["checkpoint"]).is_dir()
    assert "logging_steps=1" in result["command"] and "cluster.engine=torch" in result["command"]
