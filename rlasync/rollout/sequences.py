"""Training sequences from a rollout's turns (docs/algorithms.md §3.3), and whether a completion was clipped.

`build_training_sequences` is the default of `AsyncRolloutLoop.build_sequences`; `reconciliation_tally` reports
what it did (forks, drift). `is_clipped` is shared by the GRPO and distillation metrics. No torch, no ray.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from rlasync.records import TopLogprobs, TrainingSequence, TurnRecord

FINISH_STOP = "stop"


def tokenizer_eos_ids(tokenizer: Any) -> frozenset[int]:
    """The tokenizer's EOS and pad ids: a completion ending on one of them was not clipped."""
    ids = {getattr(tokenizer, "eos_token_id", None), getattr(tokenizer, "pad_token_id", None)}
    return frozenset(int(token) for token in ids if token is not None)


def is_clipped(last_turn: TurnRecord | None, completion_ids: Sequence[int], eos_token_ids: Iterable[int]) -> bool:
    """Whether a (non-empty) completion did not end on EOS: the last turn's finish reason when the engine gave one,
    else its last token not in `eos_token_ids` (EOS and pad)."""
    if last_turn is not None and last_turn.finish_reason is not None:
        return last_turn.finish_reason != FINISH_STOP
    return completion_ids[-1] not in eos_token_ids


def build_training_sequences(
    turns: Sequence[TurnRecord], rollout_id: str, num_sampler_logprobs: int = 0
) -> list[TrainingSequence]:
    """Training sequences of one rollout's turns.

    A turn whose prompt starts with the tokens held so far extends the current sequence (the new prompt
    tokens as context); any other turn starts a new sequence (docs/algorithms.md §3.3). Output tokens are
    trained where `TurnRecord.output_mask` allows (all when it is None) and carry their sampler log-prob,
    top-K sampler log-probs (sorted by log-prob, padded -1 / -inf to `num_sampler_logprobs`) and candidate
    set (padded -1); context carries 0.0 / -1 / -inf. Sequences without a trained token are left out.
    """
    builders: list[_SequenceBuilder] = []
    for turn in turns:
        if not builders or not _starts_with(turn.prompt_ids, builders[-1].token_ids):
            builders.append(_SequenceBuilder())
        builder = builders[-1]
        builder.add_context(turn.prompt_ids[len(builder.token_ids) :])
        builder.add_output(turn)
    return [builder.build(rollout_id, num_sampler_logprobs) for builder in builders if builder.num_trained > 0]


def reconciliation_tally(turns: Sequence[TurnRecord]) -> tuple[int, int, int, int]:
    """`(forks, transitions, drift_total, drift_max)` of one rollout under `build_training_sequences`' rule (docs/algorithms.md §3.3,
    docs/algorithms.md §3.3): a transition is every turn after the first; it forks when its prompt does not start with
    the tokens the current sequence holds, and its drift is how many of those held tokens the new prompt re-rendered
    (0 for a transition that does not fork)."""
    held: list[int] = []
    forks = transitions = drift_total = drift_max = 0
    for index, turn in enumerate(turns):
        prompt = list(turn.prompt_ids)
        if index > 0:
            transitions += 1
            if not _starts_with(prompt, held):
                matched = _common_prefix_length(held, prompt)
                drift = len(held) - matched
                forks += 1
                drift_total += drift
                drift_max = max(drift_max, drift)
                held = []
        held = prompt + list(turn.output_ids) if not held else held + prompt[len(held) :] + list(turn.output_ids)
    return forks, transitions, drift_total, drift_max


def _common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    length = min(len(a), len(b))
    for index in range(length):
        if a[index] != b[index]:
            return index
    return length


class _SequenceBuilder:
    """Per-token lists of one training sequence under construction."""

    def __init__(self) -> None:
        self.token_ids: list[int] = []
        self.mask: list[int] = []
        self.logprobs: list[float] = []
        self.topk: list[Mapping[int, float] | None] = []
        self.candidates: list[Sequence[int] | None] = []
        self.has_topk = False
        self.has_candidates = False

    @property
    def num_trained(self) -> int:
        return sum(self.mask)

    def add_context(self, token_ids: Sequence[int]) -> None:
        count = len(token_ids)
        self.token_ids += token_ids
        self.mask += [0] * count
        self.logprobs += [0.0] * count
        self.topk += [None] * count
        self.candidates += [None] * count

    def add_output(self, turn: TurnRecord) -> None:
        count = len(turn.output_ids)
        mask = [int(bool(m)) for m in turn.output_mask] if turn.output_mask is not None else [1] * count
        if any(mask) and len(turn.output_log_probs) != count:
            raise ValueError(
                f"a turn with {count} output tokens has {len(turn.output_log_probs)} output_log_probs: trained "
                "tokens need the sampler's log-prob of every output token"
            )
        self.token_ids += turn.output_ids
        self.mask += mask
        self.logprobs += [lp if m else 0.0 for lp, m in zip(turn.output_log_probs or [0.0] * count, mask)]
        topk = turn.output_sampler_logprobs
        self.has_topk |= topk is not None
        if isinstance(topk, TopLogprobs):  # arrays: a position keeps (its source, its row), ranked at build
            self.topk += [(topk, j) if mask[j] else None for j in range(count)]
        else:
            self.topk += [topk[j] if topk is not None and mask[j] else None for j in range(count)]
        candidates = turn.output_sampling_mask
        self.has_candidates |= candidates is not None
        self.candidates += [candidates[j] if candidates is not None and mask[j] else None for j in range(count)]

    def build(self, rollout_id: str, num_sampler_logprobs: int) -> TrainingSequence:
        length = len(self.token_ids)
        topk_ids = topk_logprobs = sampling_mask = None
        if num_sampler_logprobs > 0 and self.has_topk:
            topk_ids = np.full((length, num_sampler_logprobs), -1, dtype=np.int64)
            topk_logprobs = np.full((length, num_sampler_logprobs), -np.inf, dtype=np.float32)
            from_arrays: dict[int, tuple[TopLogprobs, list[int], list[int]]] = {}
            for position, entry in enumerate(self.topk):
                if isinstance(entry, tuple):
                    source, row = entry
                    held = from_arrays.setdefault(id(source), (source, [], []))
                    held[1].append(position)
                    held[2].append(row)
                elif entry:
                    ranked = sorted(entry.items(), key=lambda item: (-item[1], item[0]))[:num_sampler_logprobs]
                    topk_ids[position, : len(ranked)] = [token for token, _ in ranked]
                    topk_logprobs[position, : len(ranked)] = [logprob for _, logprob in ranked]
            for source, positions, rows in from_arrays.values():
                ids, logprobs = source.ids[rows], source.logprobs[rows]
                order = np.lexsort((ids, -logprobs), axis=-1)  # the dicts' rule: log-prob down, then id; pads last
                width = min(num_sampler_logprobs, ids.shape[1])
                topk_ids[positions, :width] = np.take_along_axis(ids, order, -1)[:, :width]
                topk_logprobs[positions, :width] = np.take_along_axis(logprobs, order, -1)[:, :width]
        if self.has_candidates:
            width = max([len(c) for c in self.candidates if c is not None] + [1])
            sampling_mask = np.full((length, width), -1, dtype=np.int64)
            for position, entry in enumerate(self.candidates):
                if entry:
                    sampling_mask[position, : len(entry)] = entry
        return TrainingSequence(
            input_ids=np.asarray(self.token_ids, dtype=np.int64),
            completion_mask=np.asarray(self.mask, dtype=np.int8),
            sampler_logprobs=np.asarray(self.logprobs, dtype=np.float32),
            rollout_id=rollout_id,
            sampler_topk_ids=topk_ids,
            sampler_topk_logprobs=topk_logprobs,
            sampling_mask=sampling_mask,
        )


def _starts_with(token_ids: Sequence[int], prefix: Sequence[int]) -> bool:
    return len(token_ids) >= len(prefix) and list(token_ids[: len(prefix)]) == list(prefix)


__all__ = ["FINISH_STOP", "build_training_sequences", "is_clipped", "reconciliation_tally", "tokenizer_eos_ids"]
