"""What a person sees while a run trains: one progress bar, a quiet start-up, a summary at the end.

    ProgressCallback   a TRL-style callback fed by the step loop: `on_step_end` moves the bar (`state.global_step`
                       of `state.max_steps`), `on_log` puts the window's numbers after it (reward, queue size,
                       staleness, step time); a tqdm bar on a terminal, else (or with `disable_tqdm=True`, TRL's
                       field) one plain line per logging step
    progress_line      the text of that line, pure: what the bar shows as its postfix and what a log file gets
    quiet_actors       the environment that silences per-actor start-up noise (weight-loading bars, transformers'
                       warnings) unless `--verbose`; it must be set before Ray starts its workers
    run_summary        the end-of-run lines: steps, final reward, wall time, where the checkpoint and metrics are

The callback reads only the `logs` dict of `on_log` and `state.global_step` / `state.max_steps` (an attribute or a
mapping key: TrainerState or the loop's dict), and `args.max_steps` (the config, TRL's `args`) when the state has none.
"""

from __future__ import annotations

import math
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from rlasync.config.base import TrainerConfig

PROGRESS_KEYS = (
    ("reward", "reward", "{:.3f}"),
    ("rollout/queue_size", "queue", "{:.0f}"),
    ("sample/staleness_mean", "stale", "{:.2f}"),
    ("perf/step_s", "step", "{:.1f}s"),
    ("eval/reward", "eval reward", "{:.3f}"),  # an evaluation's record (eval_dataset)
)
"""(metric, label, format) of the numbers after the bar, in order."""

QUIET_ENV = {
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",  # transformers' `Loading weights` bars go through huggingface_hub's switch
    "TRANSFORMERS_VERBOSITY": "error",  # its repeated warnings (generation config, tied weights, ...)
    "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
    "TOKENIZERS_PARALLELISM": "false",  # the fork warning of every actor
    "RAY_DEDUP_LOGS": "1",  # one line for the same message from N actors (Ray's default, kept explicit)
}


def quiet_actors(verbose: bool = False, environ: dict[str, str] | None = None) -> dict[str, str]:
    """Set (without overriding what the user set) the variables that silence actor start-up noise; returns those it
    set. Workers of a local Ray cluster inherit the driver's environment, so call it before Ray starts; with
    `verbose` nothing is changed."""
    environ = os.environ if environ is None else environ
    if verbose:
        return {}
    added = {key: value for key, value in QUIET_ENV.items() if key not in environ}
    environ.update(added)
    try:  # this process too (the driver loads the tokenizer and, for checks, model configs)
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()
    except ImportError:
        pass
    return added


def _value(state: Any, key: str) -> Any:
    if isinstance(state, Mapping):
        return state.get(key)
    return getattr(state, key, None)


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def format_duration(seconds: float) -> str:
    """`1h02m`, `3m05s`, `42s`."""
    seconds = max(0, int(round(seconds)))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def eta_s(step: int, max_steps: int | None, start_step: int, elapsed_s: float) -> float | None:
    """Seconds left at the mean pace of the steps this process trained; None without a horizon or a step done."""
    done = step - start_step
    if not max_steps or max_steps <= 0 or done <= 0 or elapsed_s <= 0:
        return None
    return elapsed_s / done * max(0, max_steps - step)


def metrics_text(logs: Mapping[str, Any]) -> str:
    """`reward 0.812 | queue 3 | stale 0.45 | step 9.1s` from a log record (missing or NaN values left out)."""
    parts = [f"{label} {fmt.format(logs[key])}" for key, label, fmt in PROGRESS_KEYS if _finite(logs.get(key))]
    return " | ".join(parts)


def progress_line(
    step: int, max_steps: int | None, logs: Mapping[str, Any], *, elapsed_s: float, start_step: int = 0
) -> str:
    """One plain line: `step 10/15 (67%) | ETA 45s | reward 0.870 | queue 4 | stale 0.38 | step 9.7s`."""
    head = f"step {step}"
    if max_steps and max_steps > 0:
        head += f"/{max_steps} ({100 * step / max_steps:.0f}%)"
    parts = [head]
    left = eta_s(step, max_steps, start_step, elapsed_s)
    parts.append(f"ETA {format_duration(left)}" if left is not None else f"elapsed {format_duration(elapsed_s)}")
    text = metrics_text(logs)
    return " | ".join(parts + ([text] if text else []))


class ProgressCallback:
    """The run's progress on the console (TRL's ProgressCallback / PrinterCallback in one): a tqdm bar over the steps
    when `stream` is a terminal and `disable_tqdm` is off, with the latest window's numbers after it; otherwise one
    `progress_line` per logging step. `clock` is injectable for tests."""

    def __init__(
        self, stream: TextIO | None = None, *, disable_tqdm: bool = False, clock: Any = time.monotonic
    ) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.use_bar = not disable_tqdm and bool(getattr(self.stream, "isatty", lambda: False)())
        self.clock = clock
        self.bar: Any = None
        self.start_step: int | None = None
        self.started: float | None = None
        self.max_steps: int | None = None
        self.last_logs: dict[str, Any] = {}
        self.lines: list[str] = []  # the plain lines written (a record of what the user saw)

    def _begin(self, args: TrainerConfig, state: Any) -> None:
        if self.started is not None:
            return
        max_steps = _value(state, "max_steps") or (args.max_steps if args is not None else None)
        self.max_steps = int(max_steps) if _finite(max_steps) and max_steps > 0 else None
        self.start_step = int(_value(state, "global_step") or 0)
        self.started = self.clock()
        if self.use_bar:
            from tqdm.auto import tqdm

            self.bar = tqdm(
                total=self.max_steps,
                initial=self.start_step,
                file=self.stream,
                unit="step",
                dynamic_ncols=True,
                desc="train",
            )

    def on_train_begin(self, args: TrainerConfig, state: Any, control: Any, **kwargs: Any) -> None:
        self._begin(args, state)

    def on_step_begin(self, args: TrainerConfig, state: Any, control: Any, **kwargs: Any) -> None:
        self._begin(args, state)

    def on_step_end(self, args: TrainerConfig, state: Any, control: Any, **kwargs: Any) -> None:
        self._begin(args, state)
        if self.bar is not None:
            step = int(_value(state, "global_step") or 0)
            self.bar.update(max(0, step - self.bar.n))

    def on_log(
        self, args: TrainerConfig, state: Any, control: Any, logs: Mapping[str, Any] | None = None, **kwargs: Any
    ) -> None:
        self._begin(args, state)
        self.last_logs = dict(logs or {})
        step = int(_value(state, "global_step") or 0)
        if self.bar is not None:
            self.bar.set_postfix_str(metrics_text(self.last_logs), refresh=True)
            return
        line = progress_line(
            step,
            self.max_steps,
            self.last_logs,
            elapsed_s=self.clock() - (self.started or 0.0),
            start_step=self.start_step or 0,
        )
        self.lines.append(line)
        print(line, file=self.stream, flush=True)

    def on_train_end(self, args: TrainerConfig, state: Any, control: Any, **kwargs: Any) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _last_record(metrics_file: Path) -> dict[str, Any]:
    """The last record of `metrics.jsonl` that has a reward (the final window), else the last one, else {}."""
    import json

    last: dict[str, Any] = {}
    if not metrics_file.is_file():
        return last
    for line in metrics_file.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and (_finite(record.get("reward")) or not last):
            last = record
    return last


def run_summary(output_dir: str | Path, state: Mapping[str, Any], wall_s: float) -> str:
    """The lines printed when a run ends: steps trained, final reward, wall time, the last checkpoint and the
    metrics file (with the commands that read them)."""
    out = Path(output_dir)
    metrics_file = out / "metrics.jsonl"
    last = _last_record(metrics_file)
    step = _value(state, "global_step") or last.get("step") or 0
    checkpoints = sorted(
        (p for p in out.glob("checkpoint-*") if p.name.split("-")[-1].isdigit()),
        key=lambda p: int(p.name.split("-")[-1]),
    )
    reward = last.get("reward")
    lines = [
        f"done: {step} steps in {format_duration(wall_s)}"
        + (f", final reward {reward:.3f} (steps up to {last.get('step')})" if _finite(reward) else ""),
        f"  checkpoint  {checkpoints[-1] if checkpoints else '(none written)'}",
        f"  metrics     {metrics_file}" + ("" if metrics_file.is_file() else " (none written)"),
        f"  plot        rlasync plot {out}",
    ]
    return "\n".join(lines)


__all__ = [
    "PROGRESS_KEYS",
    "QUIET_ENV",
    "ProgressCallback",
    "eta_s",
    "format_duration",
    "metrics_text",
    "progress_line",
    "quiet_actors",
    "run_summary",
]
