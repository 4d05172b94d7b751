import dataclasses
from pathlib import Path

import pytest

from rlasync.config import (
    AsyncDistillationConfig,
    AsyncGRPOConfig,
    apply_overrides,
    build_config,
    load_config,
    parse_override,
)

REPO = Path(__file__).resolve().parents[3]

# docs/algorithms.md §10.2 defaults, plus the TrainingArguments defaults TRL overrides.
SEED_DEFAULTS = {
    "model_init_kwargs": None,
    "dtype": "float32",
    "trust_remote_code": False,
    "router_aux_loss_coef": None,
    "num_generations": 8,
    "max_completion_length": 2048,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": None,
    "chat_template_kwargs": None,
    "max_tool_calling_iterations": None,
    "vllm_server_base_url": "http://localhost:8000",
    "vllm_server_timeout": 1800.0,
    "epsilon": 0.2,
    "epsilon_high": None,
    "score_centering": True,
    "vllm_importance_sampling_clip_min": 0.5,
    "vllm_importance_sampling_clip_max": 5.0,
    "num_sampler_logprobs": 8,
    "token_budget": None,
    "max_concurrent_rollouts": 512,
    "max_staleness": 4,
    "weight_sync_steps": 1,
    "rollout_worker_timeout": 300.0,
    "log_completions": False,
    "num_completions_to_print": None,
    "logging_steps": 1,
    "gradient_checkpointing": True,
    "bf16": True,
    "learning_rate": 1e-6,
    "lr_scheduler_type": "constant",
    "ignore_data_skip": True,
    "remove_unused_columns": False,
}


def test_every_seed_field_exists_with_its_default():
    config = AsyncGRPOConfig()
    for name, default in SEED_DEFAULTS.items():
        assert getattr(config, name) == default, name


def test_subclass_written_as_in_the_seed_works_and_keeps_validation():
    @dataclasses.dataclass
    class CurriculumConfig(AsyncGRPOConfig):
        pass_rate_cap: float = 0.9

    config = CurriculumConfig(learning_rate=1e-5)
    assert config.pass_rate_cap == 0.9 and config.learning_rate == 1e-5
    loaded = build_config({"pass_rate_cap": "0.5", "num_generations": "4"}, CurriculumConfig)
    assert isinstance(loaded, CurriculumConfig) and loaded.pass_rate_cap == 0.5 and loaded.num_generations == 4
    with pytest.raises(ValueError, match="num_generations"):
        CurriculumConfig(num_generations=1)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"top_p": 0.0}, "top_p"),
        ({"min_p": 1.5}, "min_p"),
        ({"dtype": "fp32"}, "dtype"),
        ({"num_generations": 1}, "num_generations"),
        ({"temperature": 0.0}, "temperature"),
        ({"vllm_importance_sampling_clip_min": 2.0, "vllm_importance_sampling_clip_max": 1.0}, "clip_max"),
        ({"score_centering": True, "num_sampler_logprobs": 0}, "num_sampler_logprobs"),
        ({"max_staleness": -1}, "max_staleness"),
        ({"lr_scheduler_type": "cosyne"}, "lr_scheduler_type"),
        ({"bf16": True, "fp16": True}, "fp16"),
        ({"queue_maxsize": 5}, "queue_maxsize"),
        ({"per_device_train_batch_size": 0}, "per_device_train_batch_size"),
        ({"model_init_kwargs": "{not json"}, "model_init_kwargs"),
        ({"masked_token_centering": "maybe"}, "masked_token_centering"),
    ],
)
def test_bad_values_name_the_field(changes, field):
    with pytest.raises(ValueError, match=field):
        AsyncGRPOConfig(**changes)


def test_liger_is_refused():
    with pytest.raises(NotImplementedError, match="use_liger_kernel"):
        AsyncGRPOConfig(use_liger_kernel=True)


def test_json_strings_become_dicts():
    config = AsyncGRPOConfig(model_init_kwargs='{"dtype": "bfloat16"}')
    assert config.model_init_kwargs == {"dtype": "bfloat16"} and config.bf16 is True


@pytest.mark.parametrize("config_cls", [AsyncGRPOConfig, AsyncDistillationConfig])
def test_fp16_is_refused_with_bf16_named(config_cls):
    with pytest.raises(ValueError, match=r"fp16=True is not supported.*use bf16=True"):
        config_cls(fp16=True)
    with pytest.raises(ValueError, match=r"fp16=True is not supported"):
        config_cls(fp16=True, bf16=False)
    assert config_cls(fp16=False, bf16=False).bf16 is False


def test_unknown_key_suggests_the_closest_field():
    with pytest.raises(ValueError, match="did you mean 'learning_rate'"):
        build_config({"learnig_rate": 1e-5})


def test_type_errors_name_the_field():
    with pytest.raises(ValueError, match="max_staleness"):
        build_config({"max_staleness": "soon"})


def test_dotted_overrides_parse_yaml_values():
    assert parse_override("a.b=true") == ("a.b", True)
    assert parse_override("x=[1, 2]") == ("x", [1, 2])
    assert apply_overrides({"a": {"b": 1}, "c": 2}, ["a.b=3", "d=null"]) == {"a": {"b": 3}, "c": 2, "d": None}
    with pytest.raises(ValueError, match="key=value"):
        parse_override("learning_rate")


def test_load_config_from_yaml_with_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("learning_rate: 1.0e-5\nnum_generations: 4\n")
    config = load_config(path, ["learning_rate=3e-6", "max_steps=2"])
    assert config.learning_rate == 3e-6 and config.num_generations == 4 and config.max_steps == 2


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("**/*.yaml")), ids=lambda p: p.name)
def test_every_yaml_under_configs_loads(path):
    """Run files (with `model:`) load with the run-file loader; plain configs with load_config."""
    import yaml

    from rlasync.runfile import load_run

    data = yaml.safe_load(path.read_text()) or {}
    if data.get("trainer") == "distillation":
        from rlasync.config import AsyncDistillationConfig

        spec = load_run(path)
        assert isinstance(spec.config, AsyncDistillationConfig) and not spec.reward_funcs
    elif "model" in data:
        spec = load_run(path)
        assert isinstance(spec.config, AsyncGRPOConfig) and spec.reward_funcs
        assert all(callable(func) for func in spec.build_reward_funcs())
    else:
        assert isinstance(load_config(path), AsyncGRPOConfig)


def test_config_show_resolves_run_files_and_plain_configs(capsys):
    import json

    from rlasync.cli import main

    assert (
        main(
            [
                "config",
                "show",
                str(REPO / "configs" / "countdown_gpu.yaml"),
                "--set",
                "model=some/model",
                "--set",
                "learning_rate=3e-6",
            ]
        )
        == 0
    )
    shown = json.loads(capsys.readouterr().out)
    assert shown["model"] == "some/model" and shown["learning_rate"] == 3e-6
    assert shown["reward_funcs"] == ["rlasync.rewards:countdown_reward"] and shown["cluster"]["learner_num_gpus"] == 1
    assert main(["config", "show", str(REPO / "configs" / "base.yaml")]) == 0
    assert "model" not in json.loads(capsys.readouterr().out)
    assert main(["config", "show", str(REPO / "configs" / "countdown_gpu.yaml"), "--set", "learning_rat=1"]) == 2
    assert "learning_rate" in capsys.readouterr().err  # the unknown key's closest field is suggested


def test_model_init_kwargs_choose_the_learner_dtype_and_reach_from_pretrained(caplog):
    import torch

    from rlasync.model.loading import model_init_options

    assert model_init_options(None, "auto") == ("float32", {})  # training weights: float32 unless asked
    assert model_init_options(None, "bfloat16") == ("bfloat16", {})
    assert model_init_options({"dtype": "bfloat16", "revision": "main"}, "float32") == (
        "bfloat16",
        {"revision": "main"},
    )
    assert model_init_options({"torch_dtype": torch.float16}, "float32") == ("float16", {})
    assert model_init_options({}, "auto", trust_remote_code=True) == ("float32", {"trust_remote_code": True})
    dtype, kwargs = model_init_options({"attn_implementation": "sdpa"}, "float32")
    assert kwargs == {} and "attn_implementation" in caplog.text
    with pytest.raises(ValueError, match="model_init_kwargs dtype"):
        model_init_options({"dtype": "int8"}, "float32")
