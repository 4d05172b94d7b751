"""bench/screening_sim.py: the Beta fit round-trips, and its screening figures match a Monte Carlo run of the rule."""

import gzip
import json
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "bench"))

import screening_sim  # noqa: E402


@pytest.mark.parametrize(("mean", "zero_spread"), [(0.94, 0.85), (0.5, 0.3), (0.2, 0.5)])
def test_fit_beta_reproduces_the_mean_and_the_zero_spread_share(mean, zero_spread):
    a, b = screening_sim.fit_beta(mean, zero_spread, 8)
    p = np.random.default_rng(1).beta(a, b, 400_000)  # the fitted distribution, sampled: its mean and P(8 equal)
    assert p.mean() == pytest.approx(mean, abs=3e-3)
    assert (p**8 + (1 - p) ** 8).mean() == pytest.approx(zero_spread, abs=3e-3)


def test_fit_beta_refuses_what_no_beta_gives():
    assert screening_sim.fit_beta(0.5, 0.001, 8) is None  # below independent draws at p = 0.5 (2 / 256)
    assert screening_sim.fit_beta(1.0, 1.0, 8) is None


def _monte_carlo(a: float, b: float, group_size: int, k: int, prompts: int = 200_000) -> dict[str, float]:
    """The rule itself, prompt by prompt: draw p, k rewards, continue only when they differ."""
    rng = np.random.default_rng(0)
    p = rng.beta(a, b, prompts)
    rewards = rng.random((prompts, group_size)) < p[:, None]
    spread_k = rewards[:, :k].any(1) & ~rewards[:, :k].all(1)
    spread_full = rewards.any(1) & ~rewards.all(1)
    rollouts = k * prompts + spread_k.sum() * (group_size - k)
    return {
        "kept_frac": spread_k.mean(),
        "rollouts_per_kept": rollouts / spread_k.sum(),
        "informative_lost": (spread_full & ~spread_k).sum() / spread_full.sum(),
        "unscreened_rollouts_per_kept": group_size * prompts / spread_full.sum(),
    }


@pytest.mark.parametrize("k", [2, 4])
def test_screening_figures_match_a_monte_carlo_of_the_rule(k):
    a, b = screening_sim.fit_beta(0.9, 0.7, 8)
    got = screening_sim.screening(a, b, 8, k)
    base = screening_sim.screening(a, b, 8, 8)
    want = _monte_carlo(a, b, 8, k)
    assert got["kept_frac"] == pytest.approx(want["kept_frac"], rel=0.03)
    assert got["rollouts_per_kept"] == pytest.approx(want["rollouts_per_kept"], rel=0.03)
    assert got["informative_lost"] == pytest.approx(want["informative_lost"], rel=0.03)
    assert base["rollouts_per_kept"] == pytest.approx(want["unscreened_rollouts_per_kept"], rel=0.03)
    assert base["informative_lost"] == 0.0


def test_main_reads_gzipped_metrics_and_bounds_the_wait(tmp_path):
    rows = [
        {"step": 1, "reward": 0.3, "frac_zero_std_groups": 0.2, "perf/rollout_wait_s": 0.1, "perf/step_s": 0.5},
        {"step": 2, "reward": 0.95, "frac_zero_std_groups": 0.85, "perf/rollout_wait_s": 0.9, "perf/step_s": 1.2},
        {"step": 3, "reward": 0.95},  # no zero-spread share: skipped
    ]
    metrics = tmp_path / "m.jsonl.gz"
    with gzip.open(metrics, "wt") as handle:
        handle.write("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "r.json"
    assert screening_sim.main(["--metrics", str(metrics), "--screen", "3", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [s["step"] for s in result["steps"]] == [1, 2]
    late = result["summary"]["k3_late"]
    assert result["summary"]["late_steps"] == 1
    assert late["rollout_wait_frac_run"] == pytest.approx(0.75)
    assert late["rollout_saving_mean"] > 1.0
    assert late["rollout_wait_frac_best_case"] == pytest.approx(1 - 0.25 * late["rollout_saving_mean"])
    with pytest.raises(SystemExit):
        screening_sim.main(["--metrics", str(metrics), "--screen", "8"])
