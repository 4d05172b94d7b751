"""Where one reduced record per logging window goes: `<output_dir>/metrics.jsonl` (always), TensorBoard, Weights &
Biases, Trackio and/or MLflow when `report_to` names them, and (on request; the trainers use
`rlasync.console.ProgressCallback` instead) a one-line console summary.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any, Protocol, TextIO

from rlasync.config.vocab import REPORT_ALL, Tracker, parse_report_to

logger = logging.getLogger(__name__)

Record = dict[str, float | None]
GLOBAL_STEP = "train/global_step"  # the step metric of transformers' tracker callbacks

CONSOLE_KEYS = (
    ("reward", "reward", "{:.3f}"),
    ("rollout/queue_size", "queue", "{:.0f}"),
    ("sample/staleness_mean", "stale", "{:.2f}"),
    ("perf/step_s", "step_s", "{:.2f}"),
    ("perf/wall_clock_trained_tokens_per_s", "tok/s", "{:.0f}"),
    ("loss", "loss", "{:.4f}"),
)


def check_report_to(report_to: str | list[str] | None) -> list[Tracker]:
    """`report_to` (the names checked by `rlasync.config.vocab.parse_report_to`, as the config does) as the list of
    `Tracker`s to open, checked before any actor starts: each one's package is importable; "all" becomes the
    trackers whose package is installed."""
    names = parse_report_to(report_to)
    if REPORT_ALL in names:
        return [t for t in Tracker if t in names or _importable(t.traits.module)]
    for tracker in names:
        if not _importable(tracker.traits.module):
            raise ValueError(
                f"report_to includes {tracker.value!r} but {tracker.traits.module} is not installed: "
                f"pip install 'rlasync[{tracker.traits.extra}]' (or drop it from report_to)"
            )
    return names


def _importable(module: str) -> bool:
    if module in sys.modules:
        return True
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


class RecordSink(Protocol):
    def write(self, step: int, record: Record) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    """Appends `{"step": ..., "time": ..., **record}` lines to a file (NaN/None written as null).

    `resume_step`: a run that starts at that step (its checkpoint's, 0 for a fresh run) first drops the records of
    later steps (logged by an interrupted run after its checkpoint, or by an earlier run in this output_dir, e.g. a
    notebook cell run again): this run writes them again, so each step has one record. The dropped lines are kept
    in `<name>.replaced` and a warning says so."""

    def __init__(self, path: str | Path, resume_step: int | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if resume_step is not None and self.path.is_file():
            self._truncate_after(resume_step)
        self._file = self.path.open("a")

    def _truncate_after(self, step: int) -> None:
        kept, dropped = [], []
        for line in self.path.read_text().splitlines():
            try:
                later = json.loads(line).get("step", 0) > step
            except (ValueError, AttributeError, TypeError):
                later = False  # not ours to judge: keep it
            (dropped if later else kept).append(line + "\n")
        if not dropped:
            return
        replaced = self.path.with_name(self.path.name + ".replaced")
        replaced.write_text("".join(dropped))
        logger.warning(
            "%s: %d records of steps after %d (an earlier run in this output_dir) are replaced by this "
            "run's; the old lines are in %s",
            self.path,
            len(dropped),
            step,
            replaced,
        )
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text("".join(kept))
        tmp.replace(self.path)

    def write(self, step: int, record: Record) -> None:
        clean = {k: (None if v is None or (isinstance(v, float) and math.isnan(v)) else v) for k, v in record.items()}
        self._file.write(json.dumps({"step": step, "time": time.time(), **clean}) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


def tracker_names(record: Record) -> dict[str, float]:
    """The finite values of `record` under the names transformers' tracker callbacks give a Trainer's logs (their
    `rewrite_logs`): `train/<name>`, except evaluation metrics, which stay `eval/<name>` (`eval_<name>` becomes
    `eval/<name>`). A TRL run and an rlasync run logged to one project share their panels."""
    named = {}
    for key, value in finite_values(record).items():
        if key.startswith("eval/"):
            named[key] = value
        elif key.startswith("eval_"):
            named["eval/" + key[len("eval_") :]] = value
        else:
            named["train/" + key] = value
    return named


class TensorBoardSink:
    """TensorBoard scalars under transformers' names (`tracker_names`) at their step."""

    def __init__(self, log_dir: str | Path, resume_step: int | None = None) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:  # tensorboard is an optional extra
            raise ValueError(
                "report_to includes 'tensorboard' but tensorboard is not installed: pip install 'rlasync[tensorboard]'"
            ) from exc
        purge = None if resume_step is None else resume_step + 1  # a resumed run's steps replace the old ones
        self._writer = SummaryWriter(log_dir=str(log_dir), purge_step=purge)

    def write(self, step: int, record: Record) -> None:
        for key, value in tracker_names(record).items():
            self._writer.add_scalar(key, value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    """Weights & Biases as transformers' WandbCallback logs: every metric under `tracker_names` against the step
    metric `train/global_step` (`define_metric(..., step_sync=True)`), not wandb's own step. An evaluation finishes in
    the background and is logged after later steps with the step it evaluated: wandb drops a `log(step=...)` lower
    than one already logged, while a step metric may go back. The run is named `run_name` and carries the config."""

    def __init__(self, run_name: str | None = None, config: dict[str, Any] | None = None) -> None:
        try:
            import wandb
        except ImportError as exc:
            raise ValueError(
                "report_to includes 'wandb' but wandb is not installed: pip install 'rlasync[wandb]'"
            ) from exc
        self._wandb = wandb
        self._run = wandb.init(name=run_name, config=config) if wandb.run is None else wandb.run
        if getattr(self._run, "define_metric", None):
            self._run.define_metric(GLOBAL_STEP)
            self._run.define_metric("*", step_metric=GLOBAL_STEP, step_sync=True)

    def write(self, step: int, record: Record) -> None:
        self._run.log({**tracker_names(record), GLOBAL_STEP: step})

    def close(self) -> None:
        self._run.finish()


def finite_values(record: Record) -> dict[str, float]:
    """The entries of `record` that hold a number (None and NaN left out): what a sink logs."""
    return {k: v for k, v in record.items() if v is not None and not (isinstance(v, float) and math.isnan(v))}


class TrackioSink:
    """Trackio (TRL's default tracker; local dashboard `trackio show`): project `TRACKIO_PROJECT` (default
    "rlasync"), the run named `run_name`, the config attached; one `log` per record, under `tracker_names` with
    `train/global_step` in it (transformers' TrackioCallback)."""

    def __init__(self, run_name: str | None = None, config: dict[str, Any] | None = None) -> None:
        import os

        import trackio

        self._run = trackio.init(project=os.environ.get("TRACKIO_PROJECT", "rlasync"), name=run_name, config=config)

    def write(self, step: int, record: Record) -> None:
        self._run.log({**tracker_names(record), GLOBAL_STEP: step})

    def close(self) -> None:
        self._run.finish()


class MlflowSink:
    """MLflow: a run named `run_name` (the config as its params, flattened), metrics at their steps. Without
    `MLFLOW_TRACKING_URI` the store is the folder `<output_dir>/mlruns` (`mlflow ui --backend-store-uri
    <output_dir>/mlruns`; MLflow 3 keeps that file store in maintenance mode behind `MLFLOW_ALLOW_FILE_STORE`, set
    here; a database store needs the full `mlflow`, not `mlflow-skinny`)."""

    def __init__(
        self, output_dir: str | Path, run_name: str | None = None, config: dict[str, Any] | None = None
    ) -> None:
        import os

        import mlflow

        self._mlflow = mlflow
        if not os.environ.get("MLFLOW_TRACKING_URI"):
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            mlflow.set_tracking_uri((Path(output_dir).resolve() / "mlruns").as_uri())
        self._run = mlflow.start_run(run_name=run_name)
        params = {key: str(value)[:500] for key, value in _flatten(config or {}).items()}
        for start in range(0, len(params), 100):  # mlflow takes at most 100 params a call
            mlflow.log_params(dict(list(params.items())[start : start + 100]))

    def write(self, step: int, record: Record) -> None:
        self._mlflow.log_metrics({k: float(v) for k, v in finite_values(record).items()}, step=step)

    def close(self) -> None:
        self._mlflow.end_run()


def _flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in config.items():
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


class ConsoleSink:
    """One compact line per record: the numbers a person watches while a run trains."""

    def __init__(self, stream: TextIO | None = None, max_steps: int | None = None) -> None:
        self._stream = stream or sys.stderr
        self._max_steps = max_steps

    def write(self, step: int, record: Record) -> None:
        total = f"/{self._max_steps}" if self._max_steps and self._max_steps > 0 else ""
        parts = [f"step {step}{total}"]
        for key, label, fmt in CONSOLE_KEYS:
            value = record.get(key)
            if value is not None and not (isinstance(value, float) and math.isnan(value)):
                parts.append(f"{label} {fmt.format(value)}")
        print(" | ".join(parts), file=self._stream, flush=True)

    def close(self) -> None:
        pass


def build_sinks(
    output_dir: str | Path,
    report_to: list[str] | None,
    *,
    console: bool = True,
    run_name: str | None = None,
    config: dict[str, Any] | None = None,
    resume_step: int | None = None,
    **kwargs: Any,
) -> list:
    """The sinks for a run: metrics.jsonl always; TensorBoard (under `<output_dir>/runs/<run_name>` when named) and
    Weights & Biases / Trackio / MLflow when asked ("all": those installed); the console on request. `resume_step`: the run resumes from
    that step's checkpoint (records of later steps already written are replaced, not duplicated)."""
    report_to = check_report_to(report_to)
    sinks: list = [JsonlSink(Path(output_dir) / "metrics.jsonl", resume_step=resume_step)]
    if Tracker.TENSORBOARD in report_to:
        runs = Path(output_dir) / "runs"
        sinks.append(TensorBoardSink(runs / run_name if run_name else runs, resume_step=resume_step))
    if Tracker.WANDB in report_to:
        sinks.append(WandbSink(run_name, config))
    if Tracker.TRACKIO in report_to:
        sinks.append(TrackioSink(run_name, config))
    if Tracker.MLFLOW in report_to:
        sinks.append(MlflowSink(output_dir, run_name, config))
    if console:
        sinks.append(ConsoleSink(max_steps=kwargs.get("max_steps")))
    return sinks
