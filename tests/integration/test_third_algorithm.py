"""A third algorithm, defined here and registered with one call, trains end to end on CPU through the real actors
(queue, rollout, generation, learner): REINFORCE with a leave-one-out baseline.

    advantage_i = r_i - mean of the other rewards of its group         (the rollout loop's `compute_advantages`)
    loss        = -Σ advantage · log π(token) / trained tokens          (the learner objective's step; no clipping)

Nothing in rlasync/ or actors/ changes for it: the spec names its config class, loop, objective, loss settings and
group size, and the Cluster, the settings and the trainer ask the spec. The classes are pickled by value (the Ray
workers cannot import this test module).
"""

import math
import time
from dataclasses import dataclass

import numpy as np
import pytest

from rlasync.algorithms import registry
from rlasync.algorithms.grpo.learner_step import GrpoLearnerStep
from rlasync.algorithms.grpo.loop import AsyncRolloutLoop
from rlasync.algorithms.grpo.objective import GrpoObjective
from rlasync.algorithms.spec import Algorithm
from rlasync.config import AsyncGRPOConfig
from rlasync.learner.step import apply_update, step_metrics
from rlasync.model import packed_row_to_tensors, packed_token_scores
from rlasync.trainers import AsyncGRPOTrainer
from tests.integration.tiny_runs import digit_reward, tiny_grpo_fields

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("pickle_by_value")]

NUM_GENERATIONS = 4


# ---- the algorithm's folder, in one test module ---------------------------------------------------------------


@dataclass
class ReinforceConfig(AsyncGRPOConfig):
    """REINFORCE-LOO reads GRPO's fields (`num_generations`, sampling, the learner's optimizer)."""


@dataclass(frozen=True)
class ReinforceLoss:
    """The loss has no knobs: no clipping, no importance ratio."""


def leave_one_out(rewards: np.ndarray) -> np.ndarray:
    rewards = np.asarray(rewards, dtype=np.float64)
    return rewards - (rewards.sum() - rewards) / (len(rewards) - 1)


class LeaveOneOutLoop(AsyncRolloutLoop):
    """GRPO's rollout loop with the leave-one-out baseline instead of the group normalisation."""

    def compute_advantages(self, group):
        return leave_one_out(group.rewards)


class ReinforceStep(GrpoLearnerStep):
    """One optimizer step of -Σ A·logprob over the step's trained tokens (the rows' global term count)."""

    def step(self, rows, global_terms, *, rate_pairs=False):
        self.model.train()
        started, total = time.perf_counter(), 0.0
        for row, terms in zip(rows, global_terms, strict=True):
            tensors = packed_row_to_tensors(row, self.device)
            scores = packed_token_scores(self.model, tensors, temperature=self.temperature)
            loss = -(tensors.advantages * scores.logprobs).sum() / float(terms)
            loss.backward()
            total += float(loss.detach())
        fwd_bwd_s = time.perf_counter() - started
        grad_norm, optimizer_s = apply_update(self)
        out = step_metrics(self, total, grad_norm, 0.0, fwd_bwd_s, optimizer_s, len(rows))
        out["reinforce/pg_loss"] = total
        return out


class ReinforceObjective(GrpoObjective):
    """GRPO's tree-packed rows, REINFORCE's step; checks on the learner that every whole group it trains carries
    the leave-one-out advantages of its rewards (`reinforce/loo_max_error`, `reinforce/loo_groups`)."""

    loss_cls = ReinforceLoss

    def build(self, parts):
        super().build(parts)
        self.step_core = ReinforceStep(
            parts.scorer,
            parts.optimizer,
            parts.scheduler,
            None,
            temperature=self.settings.temperature,
            max_grad_norm=self.settings.max_grad_norm,
            device=parts.device,
            clip_grad_norm=parts.clip_grad_norm,
        )

    def plan(self, samples):
        groups = {}
        for sample in samples:
            groups.setdefault(sample.group_id, []).append(sample)
        errors = []
        for group in groups.values():
            if len(group) == NUM_GENERATIONS:
                rewards = np.array([s.metrics["reward_trained"] for s in group])
                advantages = np.array([s.advantage for s in group])
                errors.append(float(np.max(np.abs(advantages - leave_one_out(rewards)))))
        self.loo = (max(errors) if errors else math.nan, float(len(errors)))
        return super().plan(samples)

    def step(self, rows):
        out = self.step_core.step(rows.rows, rows.global_terms)
        out["reinforce/loo_max_error"], out["reinforce/loo_groups"] = self.loo
        return out


def reinforce_loss(config):
    return ReinforceLoss()


def num_generations(config):
    return int(config.num_generations)


REINFORCE_LOO = Algorithm(
    name="reinforce_loo",
    config_cls=ReinforceConfig,
    loop_cls=LeaveOneOutLoop,
    objective=ReinforceObjective,
    loss=reinforce_loss,
    group_size=num_generations,
    reward_actors=True,
)


class ReinforceTrainer(AsyncGRPOTrainer):
    algorithm_name = "reinforce_loo"
    loop_cls = LeaveOneOutLoop


# ---- the test ---------------------------------------------------------------------------------------------------


def test_leave_one_out_is_the_mean_of_the_others():
    assert leave_one_out(np.array([1.0, 0.0, 0.0, 1.0])).tolist() == pytest.approx([2 / 3, -2 / 3, -2 / 3, 2 / 3])


def test_a_test_defined_algorithm_trains_three_steps_through_the_real_actors(ray_cluster, tiny_model_dir, tmp_path):
    from rlasync.data import arithmetic_dataset

    registry.register(REINFORCE_LOO)  # the one registry call
    assert registry.get("reinforce_loo") is REINFORCE_LOO
    config = ReinforceConfig(
        **tiny_grpo_fields(tmp_path, max_steps=3, num_generations=NUM_GENERATIONS, cluster={"num_reward_actors": 1})
    )
    assert registry.for_config(config) is REINFORCE_LOO
    trainer = ReinforceTrainer(
        model=tiny_model_dir, reward_funcs=digit_reward, args=config, train_dataset=arithmetic_dataset(64, seed=0)
    )
    output = trainer.train()

    assert output.global_step == 3 and trainer.state.global_step == 3
    records = [r for r in trainer.state.log_history if "loss" in r and "step" in r]
    assert [r["step"] for r in records] == [1, 2, 3]
    for record in records:
        assert record["reinforce/pg_loss"] == pytest.approx(record["loss"])  # the step the learner ran is ours
        assert not any(key.startswith(("clip_ratio/", "sampling/")) for key in record)  # no GRPO loss metrics
    checked = [r for r in records if r["reinforce/loo_groups"] > 0]
    assert checked, "no whole group reached the learner"
    assert max(r["reinforce/loo_max_error"] for r in checked) < 1e-6  # advantages: r_i - mean(others)
    assert any(abs(r["loss"]) > 0 for r in records) and all(math.isfinite(r["grad_norm"]) for r in records)
