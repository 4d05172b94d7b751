"""Run files: config fields + model, dataset, reward_funcs; overrides reach every key; errors name the key."""

import pytest

from rlasync.data import build_dataset
from rlasync.rewards import last_number_reward
from rlasync.runfile import import_object, load_run

RUN = """
model: tiny/model
dataset: {name: arithmetic, size: 8, seed: 1, max_operand: 9}
reward_funcs: [rlasync.rewards:last_number_reward]
learning_rate: 1.0e-5
cluster: {num_learners: 1}
"""


def write(tmp_path, text):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


def test_run_file_loads_with_overrides(tmp_path):
    spec = load_run(write(tmp_path, RUN), ["max_steps=2", "dataset.size=4", "cluster.num_generation_actors=2"])
    assert spec.model == "tiny/model" and spec.config.max_steps == 2 and spec.config.learning_rate == 1e-5
    assert spec.config.cluster.num_generation_actors == 2
    assert spec.build_reward_funcs() == [last_number_reward]
    pytest.importorskip("datasets")
    assert len(build_dataset(spec.dataset)) == 4


@pytest.mark.parametrize(
    "drop, replace, match",
    [
        ("model: tiny/model\n", "", "model"),
        ("dataset: {name: arithmetic, size: 8, seed: 1, max_operand: 9}\n", "dataset: {name: nope}\n", "dataset.name"),
        (
            "reward_funcs: [rlasync.rewards:last_number_reward]\n",
            "reward_funcs: [last_number_reward]\n",
            "reward_funcs",
        ),
        ("learning_rate: 1.0e-5\n", "learning_rat: 1.0e-5\n", "learning_rate"),
    ],
    ids=["no_model", "bad_dataset", "bad_reward", "typo"],
)
def test_run_file_errors_name_the_key(tmp_path, drop, replace, match):
    with pytest.raises(ValueError, match=match):
        load_run(write(tmp_path, RUN.replace(drop, replace)))


def test_import_object_errors():
    with pytest.raises(ValueError, match="has no attribute"):
        import_object("rlasync.rewards:nope")
    with pytest.raises(ValueError, match="cannot import"):
        import_object("rlasync.nope:x")
    with pytest.raises(ValueError, match="module:attribute"):
        import_object("rlasync.rewards")


def test_unknown_dataset_name():
    with pytest.raises(ValueError, match="dataset.name"):
        build_dataset({"name": "nope"})


def test_distillation_run_file_selects_the_distillation_config(tmp_path):
    from rlasync.config import AsyncDistillationConfig

    text = "trainer: distillation\nmodel: tiny/student\nteacher_model: {math: tiny/teacher}\n"
    text += "dataset: {name: arithmetic, size: 8, seed: 1}\nbeta: 0.5\nteacher_top_k: 4\n"
    spec = load_run(write(tmp_path, text), ["max_steps=3"])
    assert isinstance(spec.config, AsyncDistillationConfig) and spec.trainer == "distillation"
    assert spec.config.beta == 0.5 and spec.config.max_steps == 3 and spec.teacher_model == {"math": "tiny/teacher"}
    with pytest.raises(ValueError, match="reward_funcs"):
        load_run(write(tmp_path, text + "reward_funcs: [rlasync.rewards:last_number_reward]\n"))
    with pytest.raises(ValueError, match="trainer: distillation"):
        load_run(write(tmp_path, RUN + "teacher_model: tiny/teacher\n"))
    with pytest.raises(ValueError, match="trainer='ppo'"):
        load_run(write(tmp_path, RUN + "trainer: ppo\n"))


def test_distill_quickstart_config_loads():
    from pathlib import Path

    path = Path(__file__).resolve().parents[3] / "configs" / "distill_quickstart.yaml"
    spec = load_run(path)
    assert spec.trainer == "distillation" and spec.teacher_model == "smollm2-135m-instruct"
    assert spec.config.teacher_ids == ["default"]
