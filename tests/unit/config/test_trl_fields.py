"""Our configs against TRL 1.16's (tests/data/trl_1_16_config_fields.json, written by tools/trl_config_fields.py):
every TRL field exists with TRL's default, a non-default value of an unsupported field is refused by name, and the
cheap ones are honoured."""

import dataclasses
import json
import logging
from pathlib import Path

import pytest

from rlasync.config import AsyncDistillationConfig, AsyncGRPOConfig
from rlasync.config.trl_fields import UNSUPPORTED

TRL = json.loads((Path(__file__).parents[2] / "data" / "trl_1_16_config_fields.json").read_text())
CLASSES = [AsyncGRPOConfig, AsyncDistillationConfig]
# Where the reference document of AsyncGRPOTrainer (what our users read) gives another default than the 1.16 wheel,
# the document's wins; each such field is listed with its reason.
DOCUMENT_DEFAULTS = {
    ("AsyncGRPOConfig", "vllm_server_timeout"): "the document: 1800 s bounds readiness, requests and weight calls",
    ("AsyncGRPOConfig", "remove_unused_columns"): "the document: False (either value is accepted, same behaviour)",
}
# Where rlasync's default differs from TRL's on purpose (README "TRL compatibility", docs/algorithms.md §5.5); each
# field with its reason. TRL's value, given explicitly, keeps TRL's meaning.
DIFFERENT_ON_PURPOSE = {
    "torch_compile": "None = auto: the learner compiles its layers on CUDA (about 2x faster), eager on the CPU",
}


def _defaults(cls):
    out = {}
    for f in dataclasses.fields(cls):
        out[f.name] = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    return out


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_every_trl_field_is_accepted_with_trls_default(cls):
    trl, ours = TRL[cls.__name__], _defaults(cls)
    missing = sorted(set(trl) - set(ours))
    assert not missing, f"{cls.__name__} lacks TRL 1.16's fields: {missing}"
    # TRL's teacher_server_urls=None becomes our default dict in __post_init__; output_dir None too
    different = {
        k: (ours[k], trl[k])
        for k in trl
        if ours[k] != trl[k]
        and trl[k] != "<required>"
        and (cls.__name__, k) not in DOCUMENT_DEFAULTS
        and k not in DIFFERENT_ON_PURPOSE
    }
    assert not different, f"{cls.__name__} defaults differ from TRL 1.16's (ours, TRL's): {different}"


def test_the_json_is_trl_1_16():
    assert TRL["trl_version"].startswith("1.16")
    assert len(TRL["AsyncGRPOConfig"]) > 130 and "fork_threshold_tokens" in TRL["AsyncGRPOConfig"]


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_a_trl_config_dict_builds(cls):
    """A TRL YAML / asdict of TRL's config, at its defaults, builds ours."""
    values = {k: v for k, v in TRL[cls.__name__].items() if v != "<required>"}
    values.pop("vllm_server_timeout")  # 240 and TRL's request/weight timeouts: fine either way
    config = cls(**values)
    assert config.optim == "adamw_torch_fused"
    assert config.torch_compile is False  # TRL's value given explicitly keeps TRL's meaning: eager layers


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_the_defaults_that_differ_on_purpose_do_differ(cls):
    trl, ours = TRL[cls.__name__], _defaults(cls)
    assert all(ours[name] != trl[name] for name in DIFFERENT_ON_PURPOSE), "list only what differs"


@pytest.mark.parametrize("name", sorted(UNSUPPORTED))
def test_an_unsupported_field_is_refused_by_name(name):
    default = _defaults(AsyncGRPOConfig)[name]
    if isinstance(default, bool):
        other = not default
    elif isinstance(default, int | float):
        other = default + 3
    elif isinstance(default, str):
        other = default + "_x"
    elif isinstance(default, list):
        other = ["loss"]
    else:
        other = {"x": 1} if name.endswith(("config", "kwargs")) else "x"
    with pytest.raises(ValueError, match=rf"{name}=.* is not supported by rlasync"):
        AsyncGRPOConfig(**{name: other})


def test_off_values_of_unset_defaults_are_accepted():
    config = AsyncGRPOConfig(
        debug=[], tf32=False, include_num_input_tokens_seen=False, ddp_find_unused_parameters=False
    )
    assert config.debug == []
    with pytest.raises(ValueError, match="tf32=True is not supported by rlasync"):
        AsyncGRPOConfig(tf32=True)


def test_enum_values_at_the_default_are_accepted():
    from transformers.trainer_utils import IntervalStrategy, SaveStrategy

    config = AsyncGRPOConfig(eval_strategy=IntervalStrategy.NO, save_strategy=SaveStrategy.NO, max_steps=4)
    assert config.save_strategy == "no"
    with pytest.raises(ValueError, match="save_strategy='epoch' is not supported"):
        AsyncGRPOConfig(save_strategy="epoch")


def test_ratios_of_max_steps_for_logging_and_saving():
    config = AsyncGRPOConfig(max_steps=50, logging_steps=0.1, save_steps=0.25)
    assert config.steps_of("logging_steps", 50) == 5 and config.steps_of("save_steps", 50) == 13  # ceil(12.5)
    assert AsyncGRPOConfig(save_steps=20.0).save_steps == 20 and isinstance(
        AsyncGRPOConfig(save_steps=20.0).save_steps, int
    )
    with pytest.raises(ValueError, match="logging_steps=0.1 is a fraction of max_steps, but max_steps=-1"):
        AsyncGRPOConfig(logging_steps=0.1)
    with pytest.raises(ValueError, match="save_steps=2.5: a value above 1 is a step count"):
        AsyncGRPOConfig(save_steps=2.5)
    distill = AsyncDistillationConfig(logging_steps=0.5)  # the horizon is the epoch ceiling
    assert distill.steps_of("logging_steps", 7) == 4


def test_optim_and_its_arguments():
    assert AsyncGRPOConfig(optim="sgd", optim_args="momentum=0.9,nesterov=true").optimizer_kwargs() == {
        "momentum": 0.9,
        "nesterov": True,
    }
    with pytest.raises(ValueError, match="optim='adamw_bnb_8bit' is not supported: choose one of"):
        AsyncGRPOConfig(optim="adamw_bnb_8bit")
    with pytest.raises(ValueError, match="optim_args='momentum': write it as 'key=value"):
        AsyncGRPOConfig(optim_args="momentum")


def test_gradient_checkpointing_kwargs_only_use_reentrant():
    assert AsyncGRPOConfig(gradient_checkpointing_kwargs={"use_reentrant": True}).use_reentrant is True
    assert AsyncGRPOConfig().use_reentrant is False
    with pytest.raises(ValueError, match=r"gradient_checkpointing_kwargs: \['preserve_rng_state'\] not supported"):
        AsyncGRPOConfig(gradient_checkpointing_kwargs={"preserve_rng_state": False})


def test_trl_only_grpo_fields_are_honoured_or_refused():
    assert AsyncGRPOConfig(max_inflight_tasks=64).max_concurrent_rollouts == 64
    assert AsyncGRPOConfig(heartbeat_stale_after_s=30.0).rollout_worker_timeout == 30.0
    with pytest.raises(ValueError, match="heartbeat_stale_after_s=30.0 and rollout_worker_timeout=60.0"):
        AsyncGRPOConfig(heartbeat_stale_after_s=30.0, rollout_worker_timeout=60.0)
    with pytest.raises(ValueError, match="router_aux_loss_coef=0.001 is not supported"):
        AsyncGRPOConfig(router_aux_loss_coef=0.001)
    with pytest.raises(ValueError, match="fork_threshold_tokens=64 is not supported"):
        AsyncGRPOConfig(fork_threshold_tokens=64)
    assert AsyncGRPOConfig(fork_threshold_tokens=0).fork_threshold_tokens == 0
    assert AsyncGRPOConfig(remove_unused_columns=True).remove_unused_columns is True
    config = AsyncGRPOConfig(vllm_server_timeout=100.0)  # the document's single timeout...
    assert (config.request_timeout, config.weight_sync_timeout) == (100.0, 100.0)
    config = AsyncGRPOConfig(vllm_server_timeout=100.0, request_timeout=30)  # ...unless TRL's own field is given
    assert (config.request_timeout, config.weight_sync_timeout) == (30, 100.0)
    for cls in CLASSES:
        with pytest.raises(ValueError, match="queue_maxsize=64 is not supported: the StalenessQueue is bounded"):
            cls(queue_maxsize=64)


def test_log_level_sets_the_rlasync_loggers():
    logger = logging.getLogger("rlasync")
    before = logger.level
    try:
        AsyncGRPOConfig(log_level="debug")
        assert logger.level == logging.DEBUG
    finally:
        logger.setLevel(before)
    with pytest.raises(ValueError, match="log_level='loud'"):
        AsyncGRPOConfig(log_level="loud")
