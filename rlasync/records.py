"""The data that crosses components: sampling turns, rollouts, groups, training samples, the prompt lease, the
group outcome and metric items. A leaf: it imports nothing from rlasync (every package may import it), no torch,
no ray.

Names follow TRL's asynchronous GRPO trainer (`TurnRecord`, `Rollout`, `RolloutGroup`, `TrainingSequence`,
`RolloutSample`) so that code written against TRL reads the same here. Every per-token array is numpy and
aligned with `input_ids`: the value at position `p` describes token `input_ids[p]`, which the model predicts
from the hidden state at `p - 1`.

Glossary (one name per concept):
  policy_version    the weight version of the policy that produced a sample (the trainer's version is
                    incremented by each weight sync; the cold sync makes the first served version 1).
  sampler_logprobs  log-probabilities the generation engine reported for the sampled tokens (the "old
                    policy" of the loss; TRL calls them `old_log_probs`).
  trainer_logprobs  the same quantity recomputed by the learner.
  lag_steps         trainer policy_version - sample policy_version (a.k.a. staleness).
  lease             one group's claim on a prompt (`PromptLease`), from the queue's dispatcher to a rollout loop.
  outcome           why a group ended (`GroupOutcome`): trained, zero_std, filtered, failed, stale, cancelled.
"""

from __future__ import annotations

import dataclasses
import enum
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import numpy as np

MetricValue = float | tuple[float, float]
"""A metric value: a float, or a `(numerator, denominator)` rate pair reduced as Σnum / Σden."""
MetricItem = tuple[str, MetricValue]
"""One metric as it travels: `(key, value)`, keys as in docs/algorithms.md §8.2/8.3."""
MetricsCallback = Callable[[list[MetricItem]], Any]
"""Where a component reports its metric items (a rollout actor buffers them; a test collects them)."""


class GroupOutcome(enum.StrEnum):
    """Why a group (a lease) ended; the one vocabulary of the rollout side and the queue (a `str`, so "trained"
    compares and hashes equal to `GroupOutcome.TRAINED`).

    trained    some of its samples were taken by the learner: consumed
    zero_std   dropped for zero reward std (docs/algorithms.md §2.6.3): consumed
    filtered   rejected by `filter_prompt`: consumed for the epoch
    failed     failed for good (the engine rejected its prompt, e.g. longer than max_model_len: leasing it again
               could never succeed): consumed
    stale      every sample dropped as stale at take time: the position is leased again (a new group id)
    cancelled  the loop stopped first: the lease is released and the position leased again
    """

    TRAINED = "trained"
    ZERO_STD = "zero_std"
    FILTERED = "filtered"
    FAILED = "failed"
    STALE = "stale"
    CANCELLED = "cancelled"


DROP_REASONS: tuple[GroupOutcome, ...] = (GroupOutcome.ZERO_STD, GroupOutcome.FILTERED, GroupOutcome.FAILED)
"""Outcomes of a group that ends without queued samples and still counts as consumed (`mark_dropped`)."""
RELEASE_REASONS: tuple[GroupOutcome, ...] = (GroupOutcome.FILTERED, GroupOutcome.FAILED, GroupOutcome.CANCELLED)
"""Outcomes a rollout loop reports when it hands a lease back without a scored group (`PromptSource.release`)."""


class _NoRow(Mapping[str, Any]):
    """The empty, immutable row of a lease as the dispatcher hands it out (the rollout side fills the row in);
    picklable (it travels with the lease between actors)."""

    def __getitem__(self, key: str) -> Any:
        raise KeyError(key)

    def __iter__(self) -> Iterator[str]:
        return iter(())

    def __len__(self) -> int:
        return 0

    def __repr__(self) -> str:
        return "{}"

    def __reduce__(self) -> tuple[Callable[[], _NoRow], tuple[()]]:
        return _no_row, ()


def _no_row() -> _NoRow:
    return _NO_ROW


_NO_ROW = _NoRow()


class PromptLease(NamedTuple):
    """One group's claim on a prompt, from the queue's dispatcher to a rollout loop (the same type on both sides).

    group_id:   unique per lease (a global counter from 0 on every start; a re-leased position gets a new one)
    row_index:  the dataset row to generate from
    row:        that row's columns (filled on the rollout side; empty as the dispatcher hands it out)
    epoch:      the pass over the dataset this prompt belongs to (0-based)
    waited_s:   seconds a source that gates admission itself held this lease back (`rollout/backpressure_s`)
    position:   the absolute prompt position, `epoch × num_rows + row_index` (the space of `prompt_index`;
                -1 when the lease did not come from a dispatcher)
    """

    group_id: int
    row_index: int
    row: Mapping[str, Any] = _NO_ROW
    epoch: int = 0
    waited_s: float = 0.0
    position: int = -1

    @classmethod
    def coerce(cls, value: Any) -> PromptLease:
        """`value` as a lease: a `PromptLease` as it is, a tuple `(group_id, row_index, row, epoch[, waited_s])` from
        a user's prompt source converted."""
        return value if isinstance(value, cls) else cls(*value)


def new_rollout_id() -> str:
    """A random hex id for a rollout (TRL uses uuid4 hex)."""
    return uuid.uuid4().hex


class TopLogprobs(Sequence):
    """Per output token, the sampler's top-N processed log-probs, held as two ranked arrays (`ids` int64 and
    `logprobs` float64, [T, N], best first; a token with fewer than N candidates is padded with -1 / -inf). It reads
    as the list of dicts `TurnRecord.output_sampler_logprobs` names (item `t` is `{id: log-prob}` of token t's finite
    entries), but it is built, pickled and turned into training arrays without a Python dict per token: the built-in
    engine returns it (a short completion with 8 log-probs per token is mostly such dicts otherwise). It holds one
    float64 block, [T, 2N] (ids, then log-probs: the engine's packed rows, `from_rows`), split when read."""

    __slots__ = ("_packed", "_k", "_ids", "_logprobs")

    def __init__(self, ids: Any, logprobs: Any) -> None:
        ids, logprobs = np.asarray(ids, dtype=np.int64), np.asarray(logprobs, dtype=np.float64)
        if ids.ndim != 2 or ids.shape != logprobs.shape:
            raise ValueError(
                f"TopLogprobs needs ids and logprobs of the same [tokens, N] shape, got {ids.shape} and "
                f"{logprobs.shape}"
            )
        self._packed, self._k, self._ids, self._logprobs = np.hstack([ids, logprobs]), ids.shape[1], None, None

    @classmethod
    def from_rows(cls, rows: list[Any], k: int) -> TopLogprobs:
        """From one float64 row per token, all of one width 2n: `n` ranked ids, then their `n` log-probs (the
        engine's packed sampler output); the first `k` <= `n` are kept, a -inf entry's id read as -1."""
        if not rows:
            return cls._of_packed(np.empty((0, 2 * k)), k)
        packed = np.array(rows)  # ~3x faster than np.stack on a request's few short rows
        if packed.dtype != np.float64 or packed.ndim != 2 or packed.shape[1] < 2 * k:
            raise ValueError(f"TopLogprobs.from_rows needs float64 rows of one width >= {2 * k}")
        return cls._of_packed(packed, k)

    @classmethod
    def _of_packed(cls, packed: Any, k: int) -> TopLogprobs:
        top = cls.__new__(cls)
        top._packed, top._k, top._ids, top._logprobs = packed, k, None, None
        return top

    def _split(self) -> None:
        n = self._packed.shape[1] // 2
        logprobs = self._packed[:, n : n + self._k]
        ids = self._packed[:, : self._k].astype(np.int64)
        ids[logprobs == -np.inf] = -1
        self._ids, self._logprobs = ids, logprobs

    @property
    def ids(self) -> np.ndarray:
        if self._ids is None:
            self._split()
        return self._ids

    @property
    def logprobs(self) -> np.ndarray:
        if self._logprobs is None:
            self._split()
        return self._logprobs

    def __len__(self) -> int:
        return self._packed.shape[0]

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        logprobs = self.logprobs[index].tolist()
        return {token: lp for token, lp in zip(self.ids[index].tolist(), logprobs) if lp != -np.inf}

    def __eq__(self, other: object) -> bool:
        if isinstance(other, TopLogprobs):
            return np.array_equal(self.ids, other.ids) and np.array_equal(self.logprobs, other.logprobs)
        if isinstance(other, list | tuple):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __reduce__(self) -> tuple[Any, ...]:  # raw bytes: a few microseconds, where small ndarrays take ~13
        return (_top_logprobs_from_bytes, (self._packed.tobytes(), *self._packed.shape, self._k))

    def __repr__(self) -> str:
        return f"TopLogprobs({len(self)} tokens x {self._k})"


def _top_logprobs_from_bytes(data: bytes, rows: int, width: int, k: int) -> TopLogprobs:
    return TopLogprobs._of_packed(np.frombuffer(data, dtype=np.float64).reshape(rows, width), k)


@dataclass(frozen=True, slots=True)
class TurnRecord:
    """One sampling request to a generation engine and what it returned.

    `prompt_ids` is the full prompt rendered for this turn (all earlier turns included). `output_log_probs`
    holds the processed log-probability of each output token (after temperature and top-k/top-p/min-p
    filtering, normalised over the candidate set). `output_mask` marks per output token whether it is
    trained (1) or kept as context only (0); `None` trains all. `output_sampling_mask` gives, per output
    token, the candidate ids the sampler could have drawn (`None` = whole vocabulary).
    `output_sampler_logprobs` gives, per output token, the sampler's top-N processed log-probs keyed by id (a list
    of dicts, or a `TopLogprobs`, which reads the same).
    """

    prompt_ids: list[int]
    output_ids: list[int]
    output_log_probs: list[float] = field(default_factory=list)
    output_mask: list[int] | None = None
    output_sampling_mask: list[list[int]] | None = None
    output_sampler_logprobs: list[dict[int, float]] | TopLogprobs | None = None
    finish_reason: str | None = None

    def __post_init__(self) -> None:
        n = len(self.output_ids)
        for name in ("output_log_probs", "output_mask", "output_sampling_mask", "output_sampler_logprobs"):
            value = getattr(self, name)
            if value is None or (name == "output_log_probs" and len(value) == 0):
                continue
            if len(value) != n:
                raise ValueError(
                    f"TurnRecord.{name} has {len(value)} entries but output_ids has {n}: "
                    "give one entry per output token"
                )


@dataclass(slots=True)
class Rollout:
    """One full conversation for a prompt: every sampling request it made is in `turns`.

    `reward` is added to the other reward sources of its group (`None` = no contribution).
    """

    completion: list[dict[str, Any]]
    completion_ids: list[int]
    turns: list[TurnRecord]
    tool_call_count: int = 0
    tool_failure_count: int = 0
    reward: float | None = None
    rollout_id: str = field(default_factory=new_rollout_id)


def _as_array(value: Any, dtype: Any) -> np.ndarray:
    array = np.asarray(value, dtype=dtype)
    if array.ndim == 0:
        raise ValueError("expected a 1-D sequence, got a scalar")
    return array


@dataclass(frozen=True, slots=True)
class TrainingSequence:
    """One training row built from a rollout (a multi-turn rollout may fork into several).

    input_ids:         [L] int64, prompt included
    completion_mask:   [L] int8, 1 = the token is trained (a loss term), 0 = context
    sampler_logprobs:  [L] float32, sampler log-prob of each trained token, 0.0 on context
    sampler_topk_ids / sampler_topk_logprobs: [L, K] int64 / float32, the sampler's top-K processed
                       log-probs at each trained token (-1 / -inf where absent); `None` when not requested
    sampling_mask:     [L, C] int64, the candidate ids of each trained token under top-k/top-p (-1 pad);
                       `None` = whole vocabulary
    """

    input_ids: np.ndarray
    completion_mask: np.ndarray
    sampler_logprobs: np.ndarray
    rollout_id: str = field(default_factory=new_rollout_id)
    sampler_topk_ids: np.ndarray | None = None
    sampler_topk_logprobs: np.ndarray | None = None
    sampling_mask: np.ndarray | None = None

    def __post_init__(self) -> None:
        _check_token_arrays(self, "TrainingSequence")


@dataclass(slots=True)
class RolloutGroup:
    """The `num_generations` rollouts of one prompt, scored together (TRL's RolloutGroup)."""

    prompts: list[Any]
    completions: list[list[dict[str, Any]]]
    completions_ids: list[list[int]]
    completions_sequences: list[list[TrainingSequence]]
    group_id: int
    policy_version: int
    row_index: int = -1
    tool_call_counts: list[int] = field(default_factory=list)
    tool_failure_counts: list[int] = field(default_factory=list)
    env_rewards: list[tuple[str, float] | None] = field(default_factory=list)
    rollout_rewards: list[float | None] = field(default_factory=list)
    reward_kwargs: dict[str, list[Any]] = field(default_factory=dict)
    rewards: np.ndarray | None = None  # [G] float64 weighted summed rewards (reward_weights), NaN where unscored
    reward_table: Any = None
    """The per-source rewards behind `rewards` (`rlasync.rewards.calling.RewardTable`: `names`, `values` [C, G]
    unweighted with NaN where not scored, `weights` [C] or None), set with `rewards` before `compute_advantages(group)`
    is called: a hook that treats the reward functions separately (GDPO's decoupled normalisation,
    `rlasync.advantages.decoupled_group_advantages`) reads it here."""
    queued_at: float = 0.0

    def __len__(self) -> int:
        return len(self.completions)

    @property
    def model_version(self) -> int:
        """TRL's name of `policy_version` (the policy version when the group's first rollout started)."""
        return self.policy_version


@dataclass(frozen=True, slots=True)
class RolloutSample:
    """What the learner trains on: one training sequence with its advantage and provenance.

    Per-token arrays follow `TrainingSequence`. `advantage` is the conversation's advantage, stamped
    unchanged on every row the conversation produced. `metrics` holds per-sample scalars (`reward`,
    `reward_std`, `rewards/<name>`, ...) that the collator averages.
    """

    input_ids: np.ndarray
    completion_mask: np.ndarray
    sampler_logprobs: np.ndarray
    advantage: float
    group_id: int
    policy_version: int = 0
    row_index: int = -1
    sampler_topk_ids: np.ndarray | None = None
    sampler_topk_logprobs: np.ndarray | None = None
    sampling_mask: np.ndarray | None = None
    metrics: Mapping[str, float] = field(default_factory=dict)
    prompt: Any = None
    completion: Any = None
    enqueued_at: float = 0.0
    rollout_id: str = ""

    def __post_init__(self) -> None:
        _check_token_arrays(self, "RolloutSample")

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_trained_tokens(self) -> int:
        return int(self.completion_mask.sum())

    def replace(self, **changes: Any) -> RolloutSample:
        return dataclasses.replace(self, **changes)


class PackableSample(Protocol):
    """What tree packing reads of a sample (`rlasync.packing`): a `RolloutSample` has this shape. Per-token arrays
    follow `RolloutSample`; `len(sample)` is the number of tokens."""

    input_ids: np.ndarray
    completion_mask: np.ndarray
    sampler_logprobs: np.ndarray
    advantage: float
    group_id: int
    sampler_topk_ids: np.ndarray | None
    sampler_topk_logprobs: np.ndarray | None
    sampling_mask: np.ndarray | None
    metrics: Mapping[str, float]

    def __len__(self) -> int: ...

    @property
    def num_trained_tokens(self) -> int: ...


def _check_token_arrays(record: Any, kind: str) -> None:
    """Coerce per-token fields to their dtypes and check every per-token array shares `len(input_ids)`."""
    coerce = object.__setattr__  # frozen dataclasses: normalise in place once, at construction
    coerce(record, "input_ids", _as_array(record.input_ids, np.int64))
    coerce(record, "completion_mask", _as_array(record.completion_mask, np.int8))
    coerce(record, "sampler_logprobs", _as_array(record.sampler_logprobs, np.float32))
    n = record.input_ids.shape[0]
    for name in ("completion_mask", "sampler_logprobs"):
        if getattr(record, name).shape != (n,):
            raise ValueError(
                f"{kind}.{name} has shape {getattr(record, name).shape} but input_ids has {n} tokens: "
                "every per-token array must have one entry per token of input_ids"
            )
    for name, dtype in (
        ("sampler_topk_ids", np.int64),
        ("sampler_topk_logprobs", np.float32),
        ("sampling_mask", np.int64),
    ):
        value = getattr(record, name)
        if value is None:
            continue
        value = np.asarray(value, dtype=dtype)
        if value.ndim != 2 or value.shape[0] != n:
            raise ValueError(f"{kind}.{name} must have shape [{n}, K] (one row per token), got {value.shape}")
        coerce(record, name, value)
    if (record.sampler_topk_ids is None) != (record.sampler_topk_logprobs is None):
        raise ValueError(f"{kind}: give both sampler_topk_ids and sampler_topk_logprobs, or neither")
    if record.sampler_topk_ids is not None and record.sampler_topk_ids.shape != record.sampler_topk_logprobs.shape:
        raise ValueError(f"{kind}: sampler_topk_ids and sampler_topk_logprobs must have the same shape")


__all__ = [
    "DROP_REASONS",
    "RELEASE_REASONS",
    "GroupOutcome",
    "MetricItem",
    "MetricValue",
    "MetricsCallback",
    "PackableSample",
    "PromptLease",
    "Rollout",
    "RolloutGroup",
    "RolloutSample",
    "TopLogprobs",
    "TrainingSequence",
    "TurnRecord",
    "new_rollout_id",
]
