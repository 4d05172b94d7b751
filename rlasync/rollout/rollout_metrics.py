"""The GRPO rollout side's per-rollout and per-group metric items (docs/algorithms.md §8.2/8.3 keys). Pure functions."""

from __future__ import annotations

from collections.abc import Iterable

from rlasync.records import MetricItem, Rollout, RolloutGroup, TrainingSequence
from rlasync.rollout.scoring import ScoredGroup
from rlasync.rollout.sequences import is_clipped, reconciliation_tally


def rollout_metrics(
    rollout: Rollout, sequences: list[TrainingSequence], duration_s: float, eos_token_ids: Iterable[int]
) -> list[MetricItem]:
    """Duration, turns, samples per rollout, lengths, clipping and (multi-turn) the reconciliation tally."""
    length = float(len(rollout.completion_ids))
    num_turns = float(len(rollout.turns))
    items: list[MetricItem] = [
        ("rollout/duration_s", duration_s),
        ("rollout/turns_mean", (num_turns, 1.0)),
        ("rollout/turns_max", num_turns),
        ("rollout/samples_per_rollout", (float(len(sequences)), 1.0)),
        ("completions/mean_length", (length, 1.0)),
        ("completions/max_length", length),
        ("completions/min_length", length),
    ]
    forks, transitions, drift_total, drift_max = reconciliation_tally(rollout.turns)
    if transitions:
        items += [
            ("rollout/fork_frac", (float(forks), float(transitions))),
            ("rollout/drift_tokens_mean", (float(drift_total), float(transitions))),
            ("rollout/drift_tokens_max", float(drift_max)),
        ]
    if rollout.completion_ids:
        clipped = is_clipped(rollout.turns[-1] if rollout.turns else None, rollout.completion_ids, eos_token_ids)
        items.append(("completions/clipped_ratio", (float(clipped), 1.0)))
        if not clipped:
            items += [
                ("completions/mean_terminated_length", length),
                ("completions/max_terminated_length", length),
                ("completions/min_terminated_length", length),
            ]
    return items


def group_metrics(
    group: RolloutGroup,
    scored: ScoredGroup,
    score_s: float,
    tokens_rate: tuple[float, float],
    num_inflight: int,
    tools: bool = False,
) -> list[MetricItem]:
    """Concurrency, scoring time, generated tokens per second since the last group, duplicates, the scorer's; with
    `tools` (the trainer has tools), `tools/call_frequency` (calls per rollout) and `tools/failure_frequency` (failed
    / all calls: NaN, so not logged, in a window without calls) over every rollout, dropped groups included."""
    seen: set[tuple[int, ...]] = set()
    duplicates = 0
    for ids in group.completions_ids:
        duplicates += tuple(ids) in seen
        seen.add(tuple(ids))
    items: list[MetricItem] = []
    if tools:
        calls = float(sum(group.tool_call_counts))
        items += [
            ("tools/call_frequency", (calls, float(len(group)))),
            ("tools/failure_frequency", (float(sum(group.tool_failure_counts)), calls)),
        ]
    return items + [
        ("rollout/concurrency", float(num_inflight)),
        ("rollout/score_s", score_s),
        ("rollout/generated_tokens_per_s", tokens_rate),  # this actor's; the driver logs the system's (metrics/perf.py)
        ("rollout/generated_tokens_total", tokens_rate[0]),  # summed over actors: the system's tokens per window
        ("completions/duplicate_frac", duplicates / len(group)),
        *scored.metrics,
    ]


__all__ = ["group_metrics", "rollout_metrics"]
