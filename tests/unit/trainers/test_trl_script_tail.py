"""The Trainer API a TRL script uses around `train()`: the tail of TRL's own `trl/scripts/grpo.py` runs unchanged
against a finished run (the run itself faked: `fake_launch` writes a real tiny final checkpoint), and each helper
does what transformers' does (log_metrics, save_metrics, save_state, create_model_card, callback_handler,
accelerator, optimizer / lr_scheduler descriptions, model and processing_class right after construction)."""

import json
import types

import pytest
import torch
from transformers import TrainerCallback, TrainerState
from transformers.trainer_callback import CallbackHandler

from rlasync.config import AsyncGRPOConfig
from rlasync.driver.model_proxy import LazyModel
from rlasync.rewards import last_number_reward
from rlasync.trainers import AsyncGRPOTrainer
from rlasync.trainers.surface import estimated_max_steps
from tests.unit.trainers.test_trainer_surface import ROWS, fake_launch, tiny_model_dir  # noqa: F401 (fixtures)


def trl_grpo_script_tail(trainer, training_args, script_args):
    # Copied verbatim from TRL's trl/scripts/grpo.py (huggingface/trl, commit 0fa368b3a26e), everything after
    # `trainer.train()` in `main()`; only this function's signature is ours.

    # Log training complete
    trainer.accelerator.print("✅ Training completed.")

    # Save and push to Hub
    trainer.save_model(training_args.output_dir)
    trainer.accelerator.print(f"💾 Model saved to {training_args.output_dir}.")

    if training_args.push_to_hub:
        trainer.push_to_hub(dataset_name=script_args.dataset_name)
        trainer.accelerator.print(f"🤗 Model pushed to the Hub in https://huggingface.co/{trainer.hub_model_id}.")


def transformers_metrics_tail(trainer, train_result):
    """The common ending of transformers / TRL example scripts (run_clm.py, older TRL scripts)."""
    metrics = train_result.metrics
    metrics["train_samples"] = len(trainer.train_dataset)
    trainer.log_metrics("train", metrics)
    trainer.save_metrics("train", metrics)
    trainer.save_state()
    if trainer.is_world_process_zero():
        trainer.create_model_card(model_name="tiny-grpo", dataset_name="trl-lib/DeepMath-103K", tags=["math"])


def make(tmp_path, model="some/model", **changes):
    args = AsyncGRPOConfig(output_dir=str(tmp_path), **{"max_steps": 2, **changes})
    return AsyncGRPOTrainer(model=model, reward_funcs=last_number_reward, args=args, train_dataset=ROWS)


def test_trl_grpo_script_tail_runs_after_a_finished_run(tmp_path, fake_launch, capsys):  # noqa: F811
    out = tmp_path / "out"
    trainer = make(out, push_to_hub=False, hub_model_id="me/tiny-grpo")
    result = trainer.train()
    training_args, script_args = trainer.args, types.SimpleNamespace(dataset_name="trl-lib/DeepMath-103K")
    trl_grpo_script_tail(trainer, training_args, script_args)
    printed = capsys.readouterr().out
    assert "✅ Training completed." in printed and f"💾 Model saved to {out}." in printed
    assert (out / "config.json").is_file() and (out / "tokenizer_config.json").is_file()

    training_args.push_to_hub = True  # the script's push branch
    trl_grpo_script_tail(trainer, training_args, script_args)
    printed = capsys.readouterr().out
    assert "🤗 Model pushed to the Hub in https://huggingface.co/me/tiny-grpo." in printed
    pushed = out / "hub" / "me" / "tiny-grpo"
    card = (pushed / "README.md").read_text()
    assert "trl-lib/DeepMath-103K" in card and "AsyncGRPOTrainer" in card and (pushed / "config.json").is_file()

    transformers_metrics_tail(trainer, result)
    printed = capsys.readouterr().out
    assert "***** train metrics *****" in printed and "train_samples" in printed
    saved = json.loads((out / "train_results.json").read_text())
    assert saved["train_samples"] == len(ROWS) and saved["train_loss"] == 0.25
    assert json.loads((out / "all_results.json").read_text())["train_loss"] == 0.25
    state = TrainerState.load_from_json(str(out / "trainer_state.json"))
    assert state.global_step == 2 and state.log_history[-1]["loss"] == 0.25
    card = (out / "README.md").read_text()
    assert card.startswith('---\nbase_model: "some/model"') and '"math"' in card and "final `loss`: 0.25" in card


def test_save_metrics_combined_merges_and_uncombined_does_not(tmp_path):
    trainer = make(tmp_path)
    trainer.save_metrics("train", {"a": 1.0})
    trainer.save_metrics("eval", {"b": 2.0})
    trainer.save_metrics("test", {"c": 3.0}, combined=False)
    assert json.loads((tmp_path / "all_results.json").read_text()) == {"a": 1.0, "b": 2.0}
    assert json.loads((tmp_path / "test_results.json").read_text()) == {"c": 3.0}


def test_model_and_processing_class_right_after_construction(tmp_path, tiny_model_dir):  # noqa: F811
    trainer = make(tmp_path, model=tiny_model_dir)
    model = trainer.model
    assert isinstance(model, LazyModel) and not model.is_loaded  # nothing loaded by construction
    assert model.config.num_hidden_layers == 2 and model.is_loaded  # loaded on first use
    assert isinstance(trainer.accelerator.unwrap_model(model), torch.nn.Module)
    tokenizer = trainer.processing_class
    assert tokenizer("1 + 1")["input_ids"] and trainer.given_processing_class is None
    given = make(tmp_path, model=tiny_model_dir)
    given.processing_class = tokenizer
    assert given.processing_class is tokenizer and given.given_processing_class is tokenizer


def test_accelerator_is_the_driver_process(tmp_path, capsys):
    accelerator = make(tmp_path, cluster={"num_learners": 2}).accelerator
    assert accelerator.is_main_process and accelerator.is_local_main_process and accelerator.process_index == 0
    assert accelerator.num_processes == 2 and accelerator.device == torch.device("cpu")
    accelerator.wait_for_everyone()
    accelerator.print("hello")
    assert capsys.readouterr().out == "hello\n"
    layer = torch.nn.Linear(2, 2)
    assert accelerator.unwrap_model(layer) is layer
    accelerator.save({"w": torch.ones(2)}, tmp_path / "w.pt")
    assert torch.load(tmp_path / "w.pt")["w"].sum() == 2


def test_callback_handler_shares_the_trainers_callbacks(tmp_path):
    class Seen(TrainerCallback):
        def __init__(self):
            self.events = []

        def on_push_begin(self, args, state, control, model=None, **kwargs):
            self.events.append(("push", isinstance(model, LazyModel)))

    trainer = make(tmp_path)
    handler = trainer.callback_handler
    assert isinstance(handler, CallbackHandler)
    seen = Seen()
    handler.add_callback(seen)
    assert trainer.callbacks[-1] is seen  # one list
    handler.on_push_begin(trainer.args, trainer.state, trainer.control)
    assert seen.events == [("push", True)]
    assert "Seen" in handler.callback_list


def test_optimizer_and_scheduler_describe_what_the_learners_hold(tmp_path):
    trainer = make(tmp_path, learning_rate=3e-5, weight_decay=0.01, warmup_steps=0.5, lr_scheduler_type="cosine")
    optimizer, scheduler = trainer.optimizer, trainer.lr_scheduler
    assert optimizer.name == "AdamW" and optimizer.param_groups[0]["lr"] == 3e-5
    assert optimizer.defaults["weight_decay"] == 0.01 and "learner actors" in repr(optimizer)
    assert scheduler.name == "LambdaLR" and scheduler.lr_scheduler_type == "cosine"
    assert scheduler.num_training_steps == 2 and scheduler.num_warmup_steps == 1 and scheduler.get_last_lr() == [3e-5]
    sgd = AsyncGRPOTrainer(
        model="some/model",
        reward_funcs=last_number_reward,
        args=AsyncGRPOConfig(output_dir=str(tmp_path), max_steps=2),
        train_dataset=ROWS,
        optimizers=(torch.optim.SGD, None),
    )
    assert sgd.optimizer.name == "SGD"


def test_is_world_process_zero_and_push_to_hub_refuses_unknown_kwargs(tmp_path):
    trainer = make(tmp_path)
    assert trainer.is_world_process_zero() and trainer.is_local_process_zero()
    with pytest.raises(TypeError, match=r"unexpected keyword arguments \['datset_name'\]"):
        trainer.push_to_hub(datset_name="x")
    assert trainer.hub_model_id == tmp_path.name  # transformers' default: the output_dir's name


def test_max_steps_is_estimated_for_an_epoch_run():
    config = AsyncGRPOConfig(max_steps=-1, num_train_epochs=2, num_generations=4, per_device_train_batch_size=8)
    queue = types.SimpleNamespace(num_rows=10, num_epochs=2.0)
    assert estimated_max_steps(config, queue) == 10  # 2 x 10 x 4 samples / 8 per step
    assert estimated_max_steps(config, types.SimpleNamespace(num_rows=0, num_epochs=1.0)) == 0  # streaming: unknown


def test_processing_class_of_a_model_object_without_a_tokenizer_says_what_to_pass(tmp_path):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    trainer = make(tmp_path, model=AutoModelForCausalLM.from_config(config))
    assert isinstance(trainer.model, torch.nn.Module)  # a model object is returned as given
    with pytest.raises(ValueError, match="pass processing_class=tokenizer"):
        _ = trainer.processing_class
