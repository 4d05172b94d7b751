"""transformers' Trainer surface of the async trainers, with a fake launch (no Ray): TrainerState / callbacks
(add / remove / pop, on_init_end), TrainOutput, trainer.model loaded lazily from the final checkpoint, save_model,
push_to_hub offline, log, optimizers=(...) turned into what the learner builds."""

import json
import sys
import types

import pytest
import torch
from transformers import PrinterCallback, TrainerCallback, TrainerState
from transformers.trainer_utils import TrainOutput

from rlasync.config import AsyncGRPOConfig
from rlasync.learner.step import OptimizerSettings, build_optimizer
from rlasync.rewards import last_number_reward
from rlasync.trainers import AsyncGRPOTrainer
from rlasync.trainers.optimizers import optimizer_overrides
from tests.integration import conftest as integration_fixtures

tiny_model_dir = integration_fixtures.tiny_model_dir  # the tiny random Llama fixture

ROWS = [{"prompt": [{"role": "user", "content": f"What is {i} + 1?"}], "answer": str(i + 1)} for i in range(10)]


class Init(TrainerCallback):
    def __init__(self):
        self.events = []

    def on_init_end(self, args, state, control, **kwargs):
        self.events.append(("init", isinstance(state, TrainerState), kwargs["processing_class"]))

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.events.append(("log", dict(logs)))


def trainer(tmp_path, callbacks=None, optimizers=(None, None), **changes):
    args = AsyncGRPOConfig(output_dir=str(tmp_path), **{"max_steps": 2, **changes})
    return AsyncGRPOTrainer(
        model="some/model",
        reward_funcs=last_number_reward,
        args=args,
        train_dataset=ROWS,
        callbacks=callbacks,
        optimizers=optimizers,
    )


@pytest.fixture
def fake_launch(monkeypatch, tiny_model_dir):
    """launch writes a final checkpoint holding a real tiny model, logs one window, and returns the run state."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    def launch(spec, *, state, actor_ids):
        step = spec.start_step + 2
        final = spec.config.output_dir + f"/checkpoint-{step}"
        AutoModelForCausalLM.from_pretrained(tiny_model_dir).save_pretrained(final)
        AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(final)
        for name in ("optimizer.pt", "rollout_state.json"):
            open(f"{final}/{name}", "w").write("{}")
        open(f"{final}/trainer_state.json", "w").write(json.dumps({"global_step": step}))
        spec.trainer_state.global_step = step
        spec.trainer_state.log_history.append({"loss": 0.25, "step": step})
        state.update(global_step=step, policy_version=step + 1, queue={"done": False})
        return dict(state)

    monkeypatch.setitem(sys.modules, "actors.cluster", types.SimpleNamespace(launch=launch))
    monkeypatch.setattr("rlasync.trainers.preflight.run_preflight", lambda trainer: None)


def test_callbacks_state_and_the_add_remove_pop_methods(tmp_path):
    init = Init()
    t = trainer(tmp_path, callbacks=[init, PrinterCallback])
    assert init.events == [("init", True, None)]  # on_init_end with transformers' arguments
    assert isinstance(t.state, TrainerState) and t.state.global_step == 0 and t.state.is_world_process_zero
    assert isinstance(t.callbacks[1], PrinterCallback)  # a class is instantiated, as transformers
    popped = t.pop_callback(PrinterCallback)
    assert isinstance(popped, PrinterCallback) and t.pop_callback(PrinterCallback) is None
    t.add_callback(popped)
    t.remove_callback(popped)
    assert t.callbacks == [init]


def test_train_returns_a_train_output_and_the_model_is_the_trained_one(tmp_path, fake_launch):
    t = trainer(tmp_path)
    assert t.model.source_path == "some/model" and not t.model.is_loaded  # before train(): the argument, lazily
    out = t.train()
    assert isinstance(out, TrainOutput) and out.global_step == 2 and out.training_loss == 0.25
    assert out.metrics["policy_version"] == 3 and out.metrics["train_loss"] == 0.25 and "train_runtime" in out.metrics
    assert out["queue"] == {"done": False} and out["global_step"] == 2  # the earlier dict return still reads
    assert t.state.global_step == 2 and t.run_state["policy_version"] == 3
    assert t._trained_model is None  # lazy: nothing loaded yet
    model = t.model
    assert isinstance(model, torch.nn.Module) and t.model is model  # loaded once, from checkpoint-2
    assert model.config._attn_implementation != "rlasync_tree"


def test_save_model_and_push_to_hub_offline(tmp_path, fake_launch, caplog):
    t = trainer(tmp_path / "run", hub_model_id="me/tiny-grpo")
    t.train()
    saved = tmp_path / "saved"
    assert t.save_model(str(saved)) == str(saved)
    names = {p.name for p in saved.iterdir()}
    assert (
        "config.json" in names and "tokenizer_config.json" in names and any(n.endswith(".safetensors") for n in names)
    )
    assert not names & {"optimizer.pt", "rollout_state.json", "trainer_state.json"}
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(saved)
    with caplog.at_level("WARNING"):
        path = t.push_to_hub()
    assert path == str(tmp_path / "run" / "hub" / "me/tiny-grpo") and "no network" in caplog.text
    assert (tmp_path / "run" / "hub" / "me" / "tiny-grpo" / "README.md").is_file()
    local = tmp_path / "local-hub"
    t.args.hub_model_id = str(local)
    assert t.push_to_hub() == str(local) and (local / "config.json").is_file()


def test_push_to_hub_true_pushes_at_the_end_of_train(tmp_path, fake_launch):
    t = trainer(tmp_path, push_to_hub=True)
    t.train()
    assert (tmp_path / "hub" / tmp_path.name / "config.json").is_file()


def test_log_outside_and_during_a_run(tmp_path):
    init = Init()
    t = trainer(tmp_path, callbacks=[init])
    t.log({"my/metric": 3})
    assert t.state.log_history == [{"my/metric": 3.0, "step": 0}] and init.events[-1] == ("log", {"my/metric": 3.0})
    t._training = True
    t.log({"my/metric": 4})
    assert t._log_inbox == [{"my/metric": 4.0}]  # the StepLoop records it into the next window


def test_optimizers_become_what_the_learner_builds():
    assert optimizer_overrides((None, None)) == {}
    assert optimizer_overrides((torch.optim.SGD, None)) == {"optimizer_cls": torch.optim.SGD}
    assert optimizer_overrides(((torch.optim.SGD, {"lr": 0.1}), None))["optimizer_kwargs"] == {"lr": 0.1}
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    rebuilt = optimizer_overrides((opt, None))
    assert rebuilt["optimizer_cls"] is torch.optim.SGD and rebuilt["optimizer_kwargs"]["momentum"] == 0.9
    settings = OptimizerSettings(**rebuilt)
    built, _ = build_optimizer(torch.nn.Linear(3, 2), settings)
    assert type(built) is torch.optim.SGD and built.param_groups[0]["lr"] == 0.05
    two = torch.optim.SGD([{"params": [model.weight], "lr": 0.1}, {"params": [model.bias], "lr": 0.2}])
    with pytest.raises(ValueError, match="2 parameter groups with different hyper-parameters"):
        optimizer_overrides((two, None))
    with pytest.raises(ValueError, match="a LambdaLR object cannot cross to the learner actors"):
        optimizer_overrides((None, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)))
    factory = optimizer_overrides((torch.optim.SGD, lambda o: torch.optim.lr_scheduler.StepLR(o, 1, 0.5)))
    built, scheduler = build_optimizer(torch.nn.Linear(3, 2), OptimizerSettings(**factory))
    assert isinstance(scheduler, torch.optim.lr_scheduler.StepLR)
    with pytest.raises(ValueError, match="optimizers=3: give a pair"):
        optimizer_overrides(3)


def test_optimizers_reach_the_spec(tmp_path, fake_launch, monkeypatch):
    seen = []
    fake = sys.modules[
        "actors.cluster"
    ]  # the fake module installed by fake_launch (`import a.b` may bind the real one)

    launch = fake.launch
    monkeypatch.setattr(fake, "launch", lambda spec, **kw: (seen.append(spec), launch(spec, **kw))[1])
    trainer(tmp_path, optimizers=(torch.optim.SGD, None)).train()
    assert seen[0].learner.optimizer_overrides == {"optimizer_cls": torch.optim.SGD}


@pytest.mark.parametrize("optim", ["adamw_torch", "adamw_torch_fused", "sgd", "adafactor", "adagrad", "rmsprop"])
def test_optim_names_build_torch_optimizers(optim):
    config = AsyncGRPOConfig(optim=optim, learning_rate=1e-3, optim_args="eps=1e-6" if optim == "adamw_torch" else None)
    built, _ = build_optimizer(torch.nn.Linear(3, 2), OptimizerSettings.from_config(config))
    expected = {
        "adamw_torch": "AdamW",
        "adamw_torch_fused": "AdamW",
        "sgd": "SGD",
        "adafactor": "Adafactor",
        "adagrad": "Adagrad",
        "rmsprop": "RMSprop",
    }[optim]
    assert type(built).__name__ == expected and built.param_groups[0]["lr"] == 1e-3
    if optim == "adamw_torch_fused":
        assert built.defaults["fused"] is True
    if optim == "adamw_torch":
        assert built.defaults["eps"] == 1e-6
