"""`AsyncDistillationConfig`: docs/algorithms.md §10.3 defaults and the §11 validation errors."""

import dataclasses
import logging

import pytest

import rlasync
from rlasync.config import AsyncDistillationConfig, AsyncGRPOConfig, ClusterConfig, build_config, load_config

# docs/algorithms.md §10.3 (TRL 1.16) defaults
DEFAULTS = {
    "model_init_kwargs": None,
    "dtype": "float32",
    "trust_remote_code": False,
    "ignore_data_skip": True,
    "learning_rate": 1e-6,
    "logging_steps": 1,
    "lr_scheduler_type": "linear",
    "max_completion_length": 2048,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": None,
    "repetition_penalty": 1.0,
    "chat_template_kwargs": None,
    "vllm_server_base_url": "http://localhost:8000",
    "vllm_server_timeout": 240.0,
    "teacher_server_urls": {"default": "http://localhost:8001"},
    "request_timeout": 600,
    "weight_sync_timeout": 1800,
    "beta": 0.0,
    "teacher_temperature": 1.0,
    "teacher_top_k": 8,
    "add_tail_bucket": True,
    "token_budget": None,
    "max_inflight_tasks": -1,
    "max_staleness": 4,
    "queue_maxsize": 1024,
    "weight_sync_steps": 1,
    "heartbeat_stale_after_s": 300.0,
    "log_completions": False,
    "log_completions_steps": 100,
    "num_completions_to_print": None,
    "gradient_checkpointing": True,
    "bf16": True,
    "use_liger_kernel": False,
}


def test_every_field_has_its_spec_default():
    config = AsyncDistillationConfig()
    for name, default in DEFAULTS.items():
        assert getattr(config, name) == default, name
    assert isinstance(config.cluster, ClusterConfig)
    assert config.output_dir == "trainer_output"


def test_grpo_only_fields_are_absent():
    names = {f.name for f in dataclasses.fields(AsyncDistillationConfig)}
    for grpo_only in ("num_generations", "epsilon", "score_centering", "num_sampler_logprobs"):
        assert grpo_only not in names


def test_shared_fields_keep_grpo_defaults_except_the_documented_ones():
    grpo = {f.name: f for f in dataclasses.fields(AsyncGRPOConfig)}
    differ = {"lr_scheduler_type", "vllm_server_timeout", "remove_unused_columns"}  # TRL 1.16's: True
    for f in dataclasses.fields(AsyncDistillationConfig):
        if f.name in grpo and f.name not in differ and f.default is not dataclasses.MISSING:
            assert f.default == grpo[f.name].default, f.name


def test_default_teacher_dict_is_not_shared_between_instances():
    a, b = AsyncDistillationConfig(), AsyncDistillationConfig()
    a.teacher_server_urls["other"] = "http://h:1"
    assert b.teacher_server_urls == {"default": "http://localhost:8001"}


def test_teachers_from_a_json_string_and_mopd_helpers():
    config = AsyncDistillationConfig(teacher_server_urls='{"math": "http://a:8001", "code": "http://b:8001"}')
    assert config.teacher_server_urls == {"math": "http://a:8001", "code": "http://b:8001"}
    assert config.teacher_ids == ["math", "code"] and config.num_teachers == 2 and config.is_multi_teacher
    assert not AsyncDistillationConfig().is_multi_teacher


def test_loader_accepts_json_strings_and_dotted_teacher_keys(tmp_path):
    loaded = build_config({"teacher_server_urls": '{"a": "http://x:1"}', "beta": "0.5"}, AsyncDistillationConfig)
    assert loaded.teacher_server_urls == {"a": "http://x:1"} and loaded.beta == 0.5
    path = tmp_path / "distill.yaml"
    path.write_text("teacher_top_k: 32\nteacher_server_urls:\n  math: http://m:8001\n")
    config = load_config(path, ["teacher_server_urls.code=http://c:8001", "beta=1.0"], AsyncDistillationConfig)
    assert config.teacher_server_urls == {"math": "http://m:8001", "code": "http://c:8001"}
    assert config.teacher_top_k == 32 and config.beta == 1.0
    with pytest.raises(ValueError, match=r"beta must be in \[0.0, 1.0\], got 2.0"):
        build_config({"beta": 2}, AsyncDistillationConfig)
    with pytest.raises(ValueError, match="did you mean 'teacher_top_k'"):
        build_config({"teacher_topk": 4}, AsyncDistillationConfig)


@pytest.mark.parametrize("beta", [-0.01, 1.01, float("nan")])
def test_beta_outside_unit_interval_raises_the_spec_message(beta):
    with pytest.raises(ValueError, match=r"^beta must be in \[0\.0, 1\.0\], got "):
        AsyncDistillationConfig(beta=beta)


@pytest.mark.parametrize("beta", [0.0, 0.25, 1.0])
def test_beta_inside_unit_interval_is_accepted(beta):
    assert AsyncDistillationConfig(beta=beta).beta == beta


def test_empty_teacher_server_urls_raises_the_spec_message():
    with pytest.raises(ValueError, match=r"^teacher_server_urls must have at least one entry\.$"):
        AsyncDistillationConfig(teacher_server_urls={})
    with pytest.raises(ValueError, match="at least one entry"):
        AsyncDistillationConfig(teacher_server_urls="{}")


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"teacher_server_urls": {"a": "localhost:8001"}}, "teacher_server_urls"),
        ({"teacher_server_urls": "[1, 2]"}, "teacher_server_urls"),
        ({"teacher_server_urls": "{not json"}, "teacher_server_urls"),
        ({"teacher_temperature": 0.0}, "teacher_temperature"),
        ({"teacher_top_k": -1}, "teacher_top_k"),
        ({"dtype": "fp32"}, "dtype"),
        ({"temperature": 0.0}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"max_completion_length": 0}, "max_completion_length"),
        ({"request_timeout": 0}, "request_timeout"),
        ({"weight_sync_timeout": -1}, "weight_sync_timeout"),
        ({"vllm_server_timeout": 0}, "vllm_server_timeout"),
        ({"max_staleness": -1}, "max_staleness"),
        ({"max_inflight_tasks": 0}, "max_inflight_tasks"),
        ({"queue_maxsize": 0}, "queue_maxsize"),
        ({"log_completions_steps": 0}, "log_completions_steps"),
        ({"heartbeat_stale_after_s": 0}, "heartbeat_stale_after_s"),
        ({"num_completions_to_print": -1}, "num_completions_to_print"),
        ({"lr_scheduler_type": "cosyne"}, "lr_scheduler_type"),
        ({"bf16": True, "fp16": True}, "fp16"),
        ({"per_device_train_batch_size": 0}, "per_device_train_batch_size"),
        ({"max_steps": 0}, "max_steps"),
        ({"model_init_kwargs": "{not json"}, "model_init_kwargs"),
    ],
)
def test_bad_values_name_the_field(changes, field):
    with pytest.raises(ValueError, match=field):
        AsyncDistillationConfig(**changes)


def test_top_p_does_not_need_top_k_here():
    # unlike GRPO (stored candidate sets), the student's sampler log-probs are not used by distillation
    config = AsyncDistillationConfig(top_p=0.9, min_p=0.1)
    assert config.top_p == 0.9 and config.top_k == 0


def test_liger_is_refused():
    with pytest.raises(NotImplementedError, match="use_liger_kernel"):
        AsyncDistillationConfig(use_liger_kernel=True)


def test_ignore_data_skip_is_forced(caplog):
    with caplog.at_level(logging.WARNING):
        config = AsyncDistillationConfig(ignore_data_skip=False)
    assert config.ignore_data_skip is True
    assert "ignore_data_skip" in caplog.text


def test_cluster_dicts_are_built():
    config = AsyncDistillationConfig(bf16=False, cluster={"num_learners": 2}, report_to="tensorboard")
    assert config.bf16 is False and config.cluster.num_learners == 2 and config.report_to == ["tensorboard"]


def test_derived_inflight_and_step_ceiling():
    config = AsyncDistillationConfig(per_device_train_batch_size=4, gradient_accumulation_steps=2, max_staleness=3)
    assert config.samples_per_step(num_processes=2) == 16
    assert config.resolved_max_inflight_tasks(num_processes=2) == 3 * 16
    assert AsyncDistillationConfig(max_staleness=0).resolved_max_inflight_tasks() == 8  # max(S, 1) × 8
    assert AsyncDistillationConfig(max_inflight_tasks=5).resolved_max_inflight_tasks() == 5
    # ⌈epochs × len / samples_per_step⌉, not inflated
    assert AsyncDistillationConfig(num_train_epochs=1.5, per_device_train_batch_size=4).resolved_max_steps(10) == 4
    assert AsyncDistillationConfig(max_steps=7).resolved_max_steps(10_000) == 7


def test_to_dict_round_trips_and_subclasses_keep_validation():
    config = AsyncDistillationConfig(beta=0.5, teacher_server_urls={"a": "http://a:1", "b": "http://b:1"})
    data = config.to_dict()
    assert (
        data["teacher_server_urls"] == {"a": "http://a:1", "b": "http://b:1"} and data["cluster"]["num_learners"] == 1
    )
    assert build_config(data, AsyncDistillationConfig) == config

    @dataclasses.dataclass
    class MyConfig(AsyncDistillationConfig):
        extra: int = 3

    assert MyConfig(beta=1.0).extra == 3
    with pytest.raises(ValueError, match="beta must be in"):
        MyConfig(beta=3.0)


def test_lazy_top_level_export():
    assert rlasync.AsyncDistillationConfig is AsyncDistillationConfig
