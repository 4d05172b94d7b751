"""`rlasync plot RUN_DIR`: the diagnostic panels of a run, drawn from its `metrics.jsonl` into one PNG.

    reward              reward and frac_zero_std_groups (the groups that carry no signal) over steps
    step time           the step split into rollout wait, forward/backward and weight sync, the step time on top
    queue               queue size and staleness, backpressure (seconds the rollouts were held back)
    packing             packing ratio and row fill
    log-prob gap        sampler vs learner log-prob difference (mean, max) and the KL estimate
    throughput          the learner's forward/backward tokens/s and the generated tokens/s

A metric the run did not log leaves its series out, and a panel with none of its metrics is drawn empty with a
note naming them (docs/algorithms.md §8 has the catalogue). matplotlib is an optional extra: `pip install
'rlasync[plot]'`. Nothing here imports pyplot (no GUI backend, no global figure state).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Series:
    key: str
    label: str
    right: bool = False  # on the panel's second y axis (another unit)


@dataclass(frozen=True)
class Panel:
    title: str
    series: tuple[Series, ...]
    ylabel: str = ""
    ylabel_right: str = ""
    stacked: int = 0  # the first `stacked` series are drawn as stacked areas (parts of a whole)


PANELS = (
    Panel(
        "reward",
        (Series("reward", "reward"), Series("frac_zero_std_groups", "frac zero-std groups", right=True)),
        "reward",
        "fraction",
    ),
    Panel(
        "step time",
        (
            Series("perf/rollout_wait_s", "rollout wait"),
            Series("perf/fwd_bwd_s", "fwd/bwd"),
            Series("perf/weight_sync_s", "weight sync"),
            Series("perf/step_s", "step"),
        ),
        "seconds",
        stacked=3,
    ),
    Panel(
        "queue and staleness",
        (
            Series("rollout/queue_size", "queue size"),
            Series("sample/staleness_mean", "staleness (mean)"),
            Series("rollout/backpressure_s", "backpressure s", right=True),
        ),
        "samples / versions",
        "seconds",
    ),
    Panel(
        "packing",
        (Series("batch/packing_ratio", "packing ratio"), Series("batch/row_fill_frac", "row fill", right=True)),
        "ratio",
        "fraction",
    ),
    Panel(
        "sampler vs learner log-probs",
        (
            Series("sampling/sampling_logp_difference/mean", "|Δ log p| mean"),
            Series("sampling/sampling_logp_difference/max", "|Δ log p| max", right=True),
            Series("kl", "kl"),
        ),
        "nats",
        "nats (max)",
    ),
    Panel(
        "throughput",
        (
            Series("perf/forwarded_tok_s_fwd_bwd", "learner fwd/bwd tok/s"),
            Series("rollout/generated_tokens_per_s", "generated tok/s (GRPO)"),
            Series("rollout/generated_tok_s", "generated tok/s (distillation)"),
        ),
        "tokens / s",
    ),
)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def metrics_file(run: str | Path) -> Path:
    """`run` as a metrics file: a run folder's `metrics.jsonl`, or the file itself."""
    path = Path(run)
    file = path / "metrics.jsonl" if path.is_dir() else path
    if not file.is_file():
        where = f"{path} holds no metrics.jsonl" if path.is_dir() else f"{path} does not exist"
        raise ValueError(f"rlasync plot: {where}; give a run's output_dir (where metrics.jsonl is written)")
    return file


def load_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl, one per step (the last written wins: a re-run that appended the same step
    again is not drawn twice; an evaluation's record, only `eval/` keys, joins its step's), sorted by step;
    unreadable lines are skipped."""
    by_step: dict[int, dict[str, Any]] = {}
    for line in metrics_file(path).read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and _number(record.get("step")) is not None:
            step = int(record["step"])
            evaluation = all(key == "step" or key.startswith("eval/") for key in record)
            by_step[step] = {**by_step.get(step, {}), **record} if evaluation else record
    return [by_step[step] for step in sorted(by_step)]


def series_points(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the records that have a finite `key`."""
    steps, values = [], []
    for record in records:
        value = _number(record.get(key))
        if value is not None:
            steps.append(int(record["step"]))
            values.append(value)
    return steps, values


def missing_metrics(records: list[dict[str, Any]], panel: Panel) -> list[str]:
    return [s.key for s in panel.series if not series_points(records, s.key)[0]]


def _draw(ax: Any, records: list[dict[str, Any]], panel: Panel) -> str | None:
    """Draw one panel; returns the note (missing metrics) written on it, if any."""
    ax.set_title(panel.title, fontsize=10)
    ax.set_xlabel("step", fontsize=8)
    ax.set_ylabel(panel.ylabel, fontsize=8)
    ax.grid(alpha=0.3)
    missing = missing_metrics(records, panel)
    present = [s for s in panel.series if s.key not in missing]
    if not present:
        note = "not logged: " + ", ".join(missing)
        ax.text(0.5, 0.5, note, ha="center", va="center", wrap=True, fontsize=8, color="gray", transform=ax.transAxes)
        return note
    right = ax.twinx() if any(s.right for s in present) else None
    if right is not None:
        right.set_ylabel(panel.ylabel_right, fontsize=8)
    colors = iter(f"C{i}" for i in range(10))
    handles = []
    stack = [s for s in panel.series[: panel.stacked] if s in present]
    if stack:
        steps = sorted(set().union(*(series_points(records, s.key)[0] for s in stack)))
        layers = []
        for s in stack:
            known = dict(zip(*series_points(records, s.key)))
            layers.append([known.get(step, 0.0) for step in steps])
        handles += ax.stackplot(
            steps, *layers, labels=[s.label for s in stack], alpha=0.6, colors=[next(colors) for _ in stack]
        )
    for s in present:
        if s in stack:
            continue
        target = right if s.right and right is not None else ax
        steps, values = series_points(records, s.key)
        (line,) = target.plot(
            steps,
            values,
            marker="o" if len(steps) < 30 else None,
            markersize=3,
            label=s.label,
            color=next(colors),
            linestyle="--" if s.right else "-",
        )
        handles.append(line)
    ax.legend(handles=handles, labels=[h.get_label() for h in handles], fontsize=7, loc="best")
    if missing:
        note = "not logged: " + ", ".join(missing)
        ax.text(0.01, 0.01, note, fontsize=6, color="gray", transform=ax.transAxes)
        return note
    return None


def plot_run(run: str | Path, out: str | Path | None = None, title: str | None = None) -> tuple[Path, list[str]]:
    """Render the panels of `run` (a run folder or its metrics.jsonl) into `out` (default
    `<run>/metrics.png`); returns (the PNG's path, the notes of panels with missing metrics)."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ValueError("rlasync plot needs matplotlib: pip install 'rlasync[plot]'") from None
    file = metrics_file(run)
    records = load_metrics(file)
    if not records:
        raise ValueError(f"rlasync plot: {file} has no records yet (one is written every logging_steps)")
    out_path = Path(out) if out is not None else file.with_name("metrics.png")
    figure = Figure(figsize=(12, 10), layout="constrained")
    axes = figure.subplots(3, 2).flatten()
    notes = [f"{panel.title}: {note}" for ax, panel in zip(axes, PANELS) if (note := _draw(ax, records, panel))]
    figure.suptitle(title or f"{file.parent.name}: steps {records[0]['step']}-{records[-1]['step']}", fontsize=11)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out_path, dpi=90)
    return out_path, notes


__all__ = ["PANELS", "Panel", "Series", "load_metrics", "metrics_file", "missing_metrics", "plot_run", "series_points"]
