"""A TRL user's recipe on a real CPU run (Ray local cluster, tiny random Llama, 2 steps): TRL's sampling settings
without top_k (`top_p=0.95`: the candidate sets are the nuclei, renormalised on the learners), every callback event
TRL's Trainer fires with a model that loads, and then the tail of TRL's own `trl/scripts/grpo.py` unchanged."""

import json
import types

import pytest
from transformers import TrainerCallback, TrainerState

from tests.integration.test_trainer import make_config
from tests.integration.tiny_runs import arithmetic_rows, digit_reward
from tests.unit.trainers.test_trl_script_tail import transformers_metrics_tail, trl_grpo_script_tail

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("pickle_by_value")]


class Events(TrainerCallback):
    def __init__(self):
        self.names, self.max_steps, self.model_layers = [], [], None

    def __getattribute__(self, name):
        if name.startswith("on_"):

            def record(args, state, control, **kwargs):
                self.names.append(name)
                self.max_steps.append(state.max_steps)
                if name == "on_train_end":  # the model is a proxy of the final checkpoint: it loads
                    self.model_layers = kwargs["model"].config.num_hidden_layers

            return record
        return object.__getattribute__(self, name)


def test_trl_script_tail_after_a_real_run_with_top_p_alone(ray_cluster, tiny_model_dir, tmp_path):
    from rlasync import AsyncGRPOTrainer

    events = Events()
    config = make_config(tmp_path, max_steps=2, top_k=0, top_p=0.95, push_to_hub=False, hub_model_id="me/tiny-grpo")
    trainer = AsyncGRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=digit_reward,
        args=config,
        train_dataset=arithmetic_rows(),
        callbacks=[events],
    )
    assert trainer.processing_class.chat_template  # usable before train(): the model's tokenizer
    result = trainer.train()
    assert result.global_step == 2

    # every event TRL's Trainer fires in a run, in order within a step; the model loaded in on_train_end
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    for name in ("on_pre_optimizer_step", "on_optimizer_step", "on_step_begin", "on_step_end", "on_log", "on_save"):
        assert events.names.count(name) >= 1, name
    first_step = events.names[events.names.index("on_step_begin") : events.names.index("on_step_end") + 1]
    assert first_step[-3:] == ["on_pre_optimizer_step", "on_optimizer_step", "on_step_end"]
    substeps = sum(int(r["batch/microbatches_per_step"]) - 1 for r in records)  # one per micro-batch but the last
    assert events.names.count("on_substep_end") == substeps
    assert events.names[0] == "on_init_end" and set(events.max_steps[1:]) == {2}  # 0 at init, as transformers
    assert events.model_layers == 2
    assert all(r["loss"] == r["loss"] for r in records)  # finite losses over the nucleus candidate sets

    # TRL's script tail, verbatim, with its push branch
    config.push_to_hub = True
    trl_grpo_script_tail(trainer, config, types.SimpleNamespace(dataset_name="trl-lib/DeepMath-103K"))
    assert (tmp_path / "config.json").is_file() and (tmp_path / "hub" / "me" / "tiny-grpo" / "README.md").is_file()
    transformers_metrics_tail(trainer, result)
    assert TrainerState.load_from_json(str(tmp_path / "trainer_state.json")).global_step == 2
    assert json.loads((tmp_path / "all_results.json").read_text())["train_samples"] == len(trainer.train_dataset)
    assert "final `loss`" in (tmp_path / "README.md").read_text()
