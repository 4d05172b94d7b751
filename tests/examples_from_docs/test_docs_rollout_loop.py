"""The rollout-loop customisation of TRL's AsyncGRPOTrainer document ("Customising the rollout loop": the
curriculum `loop_cls` whose hooks read `self.config.<own field>` from a config subclass) and the loop's public
surface as the document's API reference lists it (hooks, signatures, attributes, the records' fields)."""

import asyncio
import inspect
from dataclasses import dataclass, fields

import numpy as np
import pytest

# --- document, "Customising the rollout loop" (import line: trl -> rlasync) --------------------------------------
from rlasync import AsyncGRPOConfig, AsyncGRPOTrainer
from rlasync.trainer.async_grpo_trainer import AsyncRolloutLoop


@dataclass
class CurriculumConfig(AsyncGRPOConfig):
    pass_rate_cap: float = 0.9


class CurriculumRolloutLoop(AsyncRolloutLoop):
    def filter_prompt(self, row_index, row, epoch):
        return self.pass_rates.get(row_index, 0.0) < self.config.pass_rate_cap

    async def setup(self):
        self.pass_rates = {}

    def compute_advantages(self, group):
        scored = group.rewards[~np.isnan(group.rewards)]
        if len(scored):
            self.pass_rates[group.row_index] = float(np.mean(scored > 0))
        return super().compute_advantages(group)


class CurriculumTrainer(AsyncGRPOTrainer):
    loop_cls = CurriculumRolloutLoop


# --- end of the document's example -------------------------------------------------------------------------------


def digit_share(completions, **kwargs):
    """Not in the document: a reward with spread within a group of random completions (see the reward tests)."""
    out = []
    for completion in completions:
        words = completion[-1]["content"].split()
        out.append(sum(w.isdigit() for w in words) / max(len(words), 1))
    return out


class _NoEngine:
    """Never asked to generate: the hooks are called directly."""

    async def generate(self, prompt_ids, sampling):  # pragma: no cover - not reached
        raise AssertionError("not used")

    def stats(self):
        return None


class _Tokenizer:
    eos_token_id = 2
    pad_token_id = 0
    all_special_tokens = []


def _loop(cls, config):
    return cls(
        config=config,
        tokenizer=_Tokenizer(),
        engine=_NoEngine(),
        prompt_source=None,
        sink=None,
        reward_funcs=digit_share,
    )


def _group(row_index, rewards):
    from rlasync.trainer.async_grpo_trainer import RolloutGroup

    n = len(rewards)
    return RolloutGroup(
        prompts=[[]] * n,
        completions=[[]] * n,
        completions_ids=[[]] * n,
        completions_sequences=[[]] * n,
        group_id=0,
        policy_version=0,
        row_index=row_index,
        rewards=np.asarray(rewards, dtype=np.float64),
    )


def test_curriculum_hooks_read_the_config_subclass_field_and_the_tokenizer(tmp_path):
    config = CurriculumConfig(output_dir=str(tmp_path), num_generations=4, pass_rate_cap=0.5)
    loop = _loop(CurriculumRolloutLoop, config)
    assert loop.config is config and loop.config.pass_rate_cap == 0.5 and isinstance(loop.tokenizer, _Tokenizer)
    asyncio.run(loop.setup())
    assert loop.filter_prompt(3, {"prompt": []}, 0)  # no pass rate yet
    advantages = loop.compute_advantages(_group(3, [1.0, 1.0, 0.0, np.nan]))
    assert loop.pass_rates == {3: pytest.approx(2 / 3)}
    np.testing.assert_allclose(advantages[3], 0.0)  # NaN reward: advantage 0 (the default's rule, via super())
    assert not loop.filter_prompt(3, {"prompt": []}, 1)  # 2/3 >= cap 0.5: solved, not sampled again
    assert loop.filter_prompt(4, {"prompt": []}, 1)


@pytest.mark.integration
def test_curriculum_trainer_runs_its_loop_cls_on_the_actors(pickle_by_value, tiny_model_dir, tmp_path, docs):
    """The trainer subclass's `loop_cls` is the loop the rollout actors build (its `setup` ran before the first
    `filter_prompt`, which reads `self.pass_rates`), with the config subclass's field."""
    from rlasync.data import arithmetic_dataset

    trainer = CurriculumTrainer(
        model=tiny_model_dir,
        reward_funcs=digit_share,
        args=CurriculumConfig(**docs.fields(tmp_path, max_steps=2)),
        train_dataset=arithmetic_dataset(16, seed=0),
    )
    trainer.train()
    assert trainer.loop_cls is CurriculumRolloutLoop
    records = docs.metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2]
    assert "reward" in set().union(*records)


# --- the loop's public surface, as the document's API reference names it -----------------------------------------

DOCUMENTED_HOOKS = {
    # name: (parameters after self, defaults, is a coroutine function)
    "filter_prompt": (["row_index", "row", "epoch"], {}, False),
    "generate_one": (["prompt", "tools", "group_id"], {"group_id": 0}, True),
    "generate_one_turn": (["prompt_ids"], {}, True),
    "compute_advantages": (["group"], {}, False),
    "setup": ([], {}, True),
    "close": ([], {}, True),
}


@pytest.mark.parametrize("name", sorted(DOCUMENTED_HOOKS))
def test_documented_hooks_have_the_documented_signatures(name):
    params, defaults, is_async = DOCUMENTED_HOOKS[name]
    method = getattr(AsyncRolloutLoop, name)
    signature = inspect.signature(method)
    names = [p for p in signature.parameters if p != "self"]
    assert names == params, f"{name}{signature}"
    for param, default in defaults.items():
        assert signature.parameters[param].default == default, f"{name}: {param} defaults to {default}"
    assert inspect.iscoroutinefunction(method) is is_async, f"{name} should {'' if is_async else 'not '}be async"


def test_loop_attributes_config_and_tokenizer(tmp_path):
    config = AsyncGRPOConfig(output_dir=str(tmp_path), num_generations=2)
    loop = _loop(AsyncRolloutLoop, config)
    assert loop.config is config and loop.tokenizer.eos_token_id == 2
    assert loop.reward_funcs == [digit_share]


@pytest.mark.parametrize(
    "record, documented",
    [
        (
            "Rollout",
            ["completion", "completion_ids", "turns", "tool_call_count", "tool_failure_count", "reward", "rollout_id"],
        ),
        (
            "TurnRecord",
            [
                "prompt_ids",
                "output_ids",
                "output_log_probs",
                "output_mask",
                "output_sampling_mask",
                "output_sampler_logprobs",
            ],
        ),
        (
            "RolloutGroup",
            [
                "prompts",
                "reward_kwargs",
                "completions",
                "completions_ids",
                "completions_sequences",
                "tool_call_counts",
                "tool_failure_counts",
                "group_id",
                "row_index",
                "env_rewards",
                "rollout_rewards",
                "queued_at",
                "rewards",
            ],
        ),
    ],
)
def test_records_carry_the_documented_fields(record, documented):
    import rlasync.trainer.async_grpo_trainer as module

    names = {f.name for f in fields(getattr(module, record))}
    assert not set(documented) - names, sorted(set(documented) - names)


def test_rollout_group_model_version_is_the_policy_version():
    """The document's `RolloutGroup.model_version` is rlasync's `policy_version` (one name per concept): both read."""
    group = _group(0, [1.0, 0.0])
    assert group.model_version == group.policy_version == 0
