"""driver.spec: the step plan the queue composes steps with (docs/algorithms.md §4.5.1), from the config, the
algorithm and the model."""


def test_the_step_plan_follows_the_config():
    from rlasync.algorithms.distill.spec import DISTILL
    from rlasync.algorithms.grpo.spec import GRPO
    from rlasync.config import AsyncGRPOConfig
    from rlasync.driver.spec import step_plan

    config = AsyncGRPOConfig(output_dir="/tmp/unused", token_budget=256, gradient_accumulation_steps=2)
    plan = step_plan(config, GRPO, 2, 256)
    assert (plan.num_ranks, plan.token_budget, plan.micro_batches) == (2, 256, 2)
    assert plan.new_batcher().token_budget == 256 and plan.new_batcher().num_ranks == 2
    distill = step_plan(config, DISTILL, 1, 256)
    assert type(distill.new_batcher()).__module__ == "rlasync.algorithms.distill.batching"
    assert step_plan(config, GRPO, 1, 0) is None  # a fixed sample count per step
    config.max_staleness = 0
    assert step_plan(config, GRPO, 1, 256) is None  # synchronous: a step takes what its version generated


def test_rows_of_a_model_with_linear_attention_share_nothing_in_the_step_plan(tmp_path):
    from transformers import LlamaConfig, Qwen3NextConfig

    from rlasync.driver.spec import model_shares_prefixes

    Qwen3NextConfig(num_hidden_layers=4).save_pretrained(tmp_path / "hybrid")
    LlamaConfig(num_hidden_layers=2).save_pretrained(tmp_path / "llama")
    assert not model_shares_prefixes(str(tmp_path / "hybrid"))
    assert model_shares_prefixes(str(tmp_path / "llama"))
    assert model_shares_prefixes(str(tmp_path / "missing"))  # unreadable here: the learner decides, rows share
