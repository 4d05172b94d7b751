import math

import pytest

from rlasync.metrics import MetricSink, reduction_for


def reduce(pairs):
    sink = MetricSink()
    for key, value in pairs:
        sink.add(key, value)
    return sink.reduce()


def test_gauge_is_mean_and_nan_is_discarded():
    assert reduce([("perf/step_s", 1.0), ("perf/step_s", 3.0), ("perf/step_s", math.nan)]) == {"perf/step_s": 2.0}


def test_total_and_count_words_sum():
    out = reduce(
        [("sample/dropped_stale_total", 2), ("sample/dropped_stale_total", 3), ("x/y_count", 1), ("x/y_count", 1)]
    )
    assert out == {"sample/dropped_stale_total": 5.0, "x/y_count": 2.0}


def test_max_and_min_words_but_maximal_stays_a_gauge():
    out = reduce(
        [
            ("a/staleness_max", 1),
            ("a/staleness_max", 4),
            ("b/len_min", 3),
            ("b/len_min", 2),
            ("perf/maximal_s", 1),
            ("perf/maximal_s", 3),
        ]
    )
    assert out == {"a/staleness_max": 4.0, "b/len_min": 2.0, "perf/maximal_s": 2.0}


def test_only_last_path_component_counts():
    assert reduction_for("total/latency_s", 1.0) == "mean"
    assert reduction_for("tools/search/call_count", 1.0) == "sum"


def test_rate_is_ratio_of_sums_not_mean_of_ratios():
    out = reduce([("batch/packing_ratio", (200, 100)), ("batch/packing_ratio", (0, 1))])
    assert out["batch/packing_ratio"] == pytest.approx(200 / 101)


def test_rate_with_zero_denominator_is_nan():
    assert math.isnan(reduce([("batch/pad_frac", (0, 0))])["batch/pad_frac"])


def test_all_nan_key_logs_none_and_window_clears():
    sink = MetricSink()
    sink.add("reward", math.nan)
    assert sink.reduce() == {"reward": None}
    assert sink.reduce() == {}


def test_mixing_shapes_raises():
    sink = MetricSink()
    sink.add("k", 1.0)
    with pytest.raises(ValueError, match="both as a rate pair and as a float"):
        sink.add("k", (1, 2))


def test_jsonl_sink_appends_one_record_per_window_with_nan_as_null(tmp_path):
    import json

    from rlasync.metrics import JsonlSink, build_sinks

    sink = JsonlSink(tmp_path / "metrics.jsonl")
    sink.write(1, {"reward": 0.5, "loss": math.nan})
    sink.write(2, {"reward": None})
    sink.close()
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["reward"]) for r in lines] == [(1, 0.5), (2, None)] and lines[0]["loss"] is None
    with pytest.raises(ValueError, match="wandb"):
        build_sinks(tmp_path, ["wandb"])


def test_console_sink_shows_the_watched_numbers():
    import io

    from rlasync.metrics import ConsoleSink

    stream = io.StringIO()
    ConsoleSink(stream, max_steps=10).write(3, {"reward": 0.25, "perf/step_s": 1.5, "sample/staleness_mean": None})
    assert stream.getvalue().strip() == "step 3/10 | reward 0.250 | step_s 1.50"


def test_wandb_sink_logs_under_transformers_names_against_the_global_step_metric(tmp_path, monkeypatch):
    """As transformers' WandbCallback: `train/<name>` (evaluation metrics `eval/<name>`) with `train/global_step` as
    the step metric, so an evaluation logged after later steps (at the step it evaluated) is kept, where wandb drops
    a `log(step=...)` lower than one already logged."""
    import sys
    import types

    from rlasync.metrics import build_sinks

    calls = []

    class Run:
        def define_metric(self, name, **kwargs):
            calls.append(("define_metric", name, kwargs))

        def log(self, data, step=None):
            assert step is None, "a step given to wandb must only grow: the step metric carries it"
            calls.append(("log", data))

        def finish(self):
            calls.append(("finish",))

    fake = types.SimpleNamespace(run=None, init=lambda name, config: calls.append(("init", name, config)) or Run())
    monkeypatch.setitem(sys.modules, "wandb", fake)
    sinks = build_sinks(tmp_path, ["wandb"], console=False, run_name="exp-1", config={"learning_rate": 1e-6})
    sinks[-1].write(5, {"reward": 0.5, "loss": math.nan, "entropy": None})
    sinks[-1].write(3, {"eval/reward": 0.75, "eval_runtime": 2.0})  # an evaluation of step 3, finished after step 5
    for sink in sinks:
        sink.close()
    assert calls == [
        ("init", "exp-1", {"learning_rate": 1e-6}),
        ("define_metric", "train/global_step", {}),
        ("define_metric", "*", {"step_metric": "train/global_step", "step_sync": True}),
        ("log", {"train/reward": 0.5, "train/global_step": 5}),
        ("log", {"eval/reward": 0.75, "eval/runtime": 2.0, "train/global_step": 3}),
        ("finish",),
    ]


def test_tracker_names_are_transformers_rewrite_logs():
    from transformers.integrations.integration_utils import rewrite_logs

    from rlasync.metrics.sinks import tracker_names

    record = {"reward": 0.5, "rewards/acc/mean": 1.0, "eval_reward": 0.25, "perf/step_s": 2.0, "kl": math.nan}
    finite = {k: v for k, v in record.items() if not math.isnan(v)}
    assert tracker_names(record) == rewrite_logs(finite)
    assert tracker_names({"eval/reward": 0.25, "entropy": None}) == {"eval/reward": 0.25}  # ours, already named


def test_tensorboard_sink_writes_transformers_tags(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from rlasync.metrics import build_sinks

    (sink,) = [
        s for s in build_sinks(tmp_path, ["tensorboard"], console=False) if type(s).__name__ == "TensorBoardSink"
    ]
    sink.write(1, {"reward": 0.5, "loss": math.nan})
    sink.write(2, {"reward": 0.75, "eval/reward": 0.25})
    sink.close()
    (events,) = {p.parent for p in tmp_path.rglob("events.out.tfevents.*")}
    accumulator = EventAccumulator(str(events))
    accumulator.Reload()
    assert sorted(accumulator.Tags()["scalars"]) == ["eval/reward", "train/reward"]
    assert [(e.step, e.value) for e in accumulator.Scalars("train/reward")] == [(1, 0.5), (2, 0.75)]


def test_build_sinks_refuses_an_unknown_tracker(tmp_path):
    from rlasync.metrics import build_sinks

    with pytest.raises(ValueError, match="'trackio', 'mlflow', 'all' or 'none'"):
        build_sinks(tmp_path, ["comet_ml"])
