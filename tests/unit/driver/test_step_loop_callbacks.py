"""The StepLoop's callbacks are transformers' callbacks: TrainerState / TrainerControl, every event TRL's trainer
fires with transformers' arguments, PrinterCallback and ProgressCallback work, control.should_save / should_log are
honoured, logging_first_step, save_strategy="no" (save_steps None), and the documents' throughput metrics."""

import asyncio

import pytest
from transformers import PrinterCallback, ProgressCallback, TrainerCallback, TrainerControl, TrainerState

from rlasync.driver import Checkpointer, StepLoop, StepSettings
from rlasync.driver.model_proxy import LazyModel, latest_checkpoint_source
from rlasync.driver.step_loop import EVENTS
from rlasync.metrics.perf import StepPerf, peak_flops
from tests.unit.driver.test_step_loop import FakeFleet, FakeQueue, FakeWeights, Journal, RecordingSink


class TokenLearners:
    def __init__(self):
        self.steps = 0

    async def train_step(self, refs):
        self.steps += 1
        return [
            ("loss", 0.5),
            ("batch/forwarded_tokens_per_step", 100.0),
            ("batch/trained_tokens_per_step", 40.0),
            ("perf/fwd_bwd_s", 0.5),
            ("batch/microbatches_per_step", 2.0),
        ]

    async def save(self, directory, tokenizer):
        from pathlib import Path

        (Path(directory) / "model.safetensors").write_text("weights")


class Recorder(TrainerCallback):
    def __init__(self):
        self.events, self.kwargs = [], {}

    def __getattribute__(self, name):
        if name.startswith("on_"):

            def record(args, state, control, **kwargs):
                assert isinstance(state, TrainerState) and isinstance(control, TrainerControl)
                self.events.append((name, state.global_step))
                self.kwargs[name] = kwargs
                return object.__getattribute__(self, "hook")(name, state, control, kwargs)

            return record
        return object.__getattribute__(self, name)

    def hook(self, name, state, control, kwargs):
        return None


def make(tmp_path, callbacks, horizon=3, logging_steps=1, save_steps=100, logging_first_step=False, perf=None):
    journal = Journal()
    settings = StepSettings(
        horizon=horizon,
        tokens_per_step=10,
        logging_steps=logging_steps,
        save_steps=save_steps,
        logging_first_step=logging_first_step,
        hang_timeout_s=42.0,
        poll_s=0.0,
    )
    sink = RecordingSink()
    loop = StepLoop(
        settings,
        queue=FakeQueue(journal, num_samples=100),
        learners=TokenLearners(),
        weights=FakeWeights(journal),
        fleet=FakeFleet(journal, None),
        checkpointer=Checkpointer(tmp_path),
        sinks=[sink],
        callbacks=callbacks,
        callback_args="the-config",
        state={},
        tokenizer="tok",
        perf=perf,
    )
    return loop, sink


def test_every_event_with_transformers_arguments(tmp_path):
    recorder = Recorder()
    loop, sink = make(tmp_path, [recorder], horizon=2, save_steps=2)
    state = asyncio.run(loop.run())
    names = [name for name, _ in recorder.events]
    assert names == [
        "on_train_begin",
        "on_epoch_begin",
        "on_step_begin",
        "on_substep_end",  # two micro-batches: one substep, then the optimizer step
        "on_pre_optimizer_step",
        "on_optimizer_step",
        "on_step_end",
        "on_log",
        "on_step_begin",
        "on_substep_end",
        "on_pre_optimizer_step",
        "on_optimizer_step",
        "on_step_end",
        "on_log",
        "on_save",
        "on_epoch_end",
        "on_train_end",
    ]
    assert [step for name, step in recorder.events if name == "on_step_end"] == [1, 2]
    assert set(names) == set(EVENTS)  # every event the loop documents fires
    assert [step for name, step in recorder.events if name == "on_optimizer_step"] == [0, 1]  # before global_step += 1
    for kwargs in recorder.kwargs.values():
        assert kwargs["processing_class"] == "tok" and {
            "model",
            "optimizer",
            "lr_scheduler",
            "train_dataloader",
        } <= set(kwargs)
    assert recorder.kwargs["on_step_end"]["metrics"]["loss"] == 0.5  # the step's metrics, for a progress display
    assert recorder.kwargs["on_log"]["logs"]["loss"] == 0.5
    ts = loop.state
    assert ts.global_step == 2 and ts.max_steps == 2 and ts.is_world_process_zero
    assert [entry["step"] for entry in ts.log_history] == [1, 2] and ts.log_history[0]["loss"] == 0.5
    assert state["global_step"] == 2  # the run's own dict


def test_transformers_printer_and_progress_callbacks_run(tmp_path, capsys):
    loop, _ = make(tmp_path, [PrinterCallback(), ProgressCallback()], horizon=3)
    asyncio.run(loop.run())
    out = capsys.readouterr()
    assert out.out.count("'loss': '0.5'") >= 3  # PrinterCallback prints each log (ProgressCallback formats it)
    assert "3/3" in out.out + out.err  # ProgressCallback's bar reached max_steps


def test_control_should_save_and_should_log_from_a_callback(tmp_path):
    class SaveAtOne(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 1:
                control.should_save = True
                control.should_log = True

    loop, sink = make(tmp_path, [SaveAtOne()], horizon=3, logging_steps=10)
    asyncio.run(loop.run())
    assert [s for s, _ in sink.records] == [1, 3]  # should_log at 1, the final window at 3
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-3"]


def test_a_returned_control_replaces_the_loops(tmp_path):
    class Stop(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            return TrainerControl(should_training_stop=True)

    loop, _ = make(tmp_path, [Stop()], horizon=5)
    assert asyncio.run(loop.run())["global_step"] == 1


def test_logging_first_step_and_no_periodic_saves(tmp_path):
    loop, sink = make(tmp_path, [], horizon=4, logging_steps=3, save_steps=None, logging_first_step=True)
    asyncio.run(loop.run())
    assert [s for s, _ in sink.records] == [1, 3, 4]
    assert [p.name for p in tmp_path.glob("checkpoint-*")] == ["checkpoint-4"]  # only the final model


def test_the_documents_throughput_metrics(tmp_path):
    loop, sink = make(tmp_path, [], horizon=3, perf=StepPerf(num_params=1000, peak_flops_per_device=1e6))
    asyncio.run(loop.run())
    first, second = sink.records[0][1], sink.records[1][1]
    assert first["num_tokens"] == 100 and second["num_tokens"] == 200  # forwarded so far
    assert first["perf/fwd_bwd_forwarded_tokens_per_s"] == pytest.approx(200.0)  # 100 tokens / 0.5 s
    assert first["perf/fwd_bwd_mfu"] == pytest.approx(100 * 6 * 1000 * 200 / 1e6)
    assert "perf/wall_clock_forwarded_tokens_per_s" not in first  # the first step has no wall-clock time
    step_s = second["perf/step_s"]
    assert second["perf/wall_clock_forwarded_tokens_per_s"] == pytest.approx(100 / step_s)
    assert second["perf/wall_clock_trained_tokens_per_s"] == pytest.approx(40 / step_s)
    assert second["perf/wall_clock_mfu"] == pytest.approx(100 * 6 * 1000 * (100 / step_s) / 1e6)


def test_mfu_is_omitted_without_a_known_peak(tmp_path):
    loop, sink = make(tmp_path, [], horizon=2)
    asyncio.run(loop.run())
    assert not any(k.endswith("_mfu") for _, r in sink.records for k in r)
    assert peak_flops("NVIDIA H200") == 989e12 and peak_flops("NVIDIA H100 PCIe") == 756e12
    assert peak_flops("cpu") is None and peak_flops(None) is None


def test_trainer_log_during_a_run_joins_the_next_window(tmp_path):
    inbox = []

    class LogFromCallback(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            inbox.append({"my/metric": float(state.global_step)})  # what trainer.log does during a run

    loop, sink = make(tmp_path, [LogFromCallback()], horizon=2)
    loop.log_inbox = inbox
    asyncio.run(loop.run())
    assert [r["my/metric"] for _, r in sink.records] == [1.0, 2.0] and inbox == []


def test_the_model_is_a_proxy_of_the_latest_checkpoint(tmp_path, monkeypatch):
    """Callbacks get a LazyModel: nothing loads unless a callback reads it; then the newest complete checkpoint
    (the initial model before the first save), re-loaded when a newer one appears."""
    loaded = []
    monkeypatch.setattr("rlasync.driver.model_proxy.load_plain", lambda path, dtype: loaded.append(path) or path)

    class ReadsModel(TrainerCallback):
        def __init__(self):
            self.seen = []

        def on_step_begin(self, args, state, control, model=None, **kwargs):
            assert isinstance(model, LazyModel)
            self.seen.append(model.resolve())

    reader = ReadsModel()
    loop, _ = make(tmp_path, [reader], horizon=3, save_steps=1)
    loop.model = LazyModel(latest_checkpoint_source(tmp_path, "initial-model"))  # as StepLoop(initial_model=...)
    asyncio.run(loop.run())
    assert [str(seen).rsplit("/", 1)[-1] for seen in reader.seen] == ["initial-model", "checkpoint-1", "checkpoint-2"]
    assert len(loaded) == 3
    untouched, _ = make(tmp_path / "other", [Recorder()], horizon=1)
    asyncio.run(untouched.run())
    assert not untouched.model.is_loaded  # a callback that never reads model costs nothing


def test_max_steps_in_an_epoch_run(tmp_path):
    """Without a horizon: the trainer's estimate, raised when the run passes it, the final step at the end."""
    seen = []

    class Watch(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            seen.append(state.max_steps)

    loop, _ = make(tmp_path, [Watch()], horizon=None)
    loop.trainer_state.max_steps = 5  # what the trainer estimated from the dataset and the step size
    asyncio.run(loop.run())
    steps = loop.state.global_step
    assert steps > 5 and seen[:4] == [5, 5, 5, 5] and seen[4] == 6  # step 5 reached the estimate: one more
    assert loop.state.max_steps == steps  # the run's length, once known
