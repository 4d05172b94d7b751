"""One generation request as the engine tracks it, from arrival to its `TurnRecord` (pure Python).

A request's tokens are `token_ids = prompt + output`. The KV of `token_ids[:num_computed_tokens]` is in the cache
(in `block_ids`); each step feeds the next uncomputed tokens, and once every token is computed the logits of the
last one give the next sample. A preempted request drops its blocks and recomputes all its tokens later, keeping
its output, log-probs and step counter (the index of the next token, `len(output_ids)`), so a seeded sample is
unchanged by preemption.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rlasync.engine.base import SamplingParams
from rlasync.records import TopLogprobs, TurnRecord

FINISH_STOP = "stop"
FINISH_LENGTH = "length"


@dataclass(eq=False)
class Request:
    request_id: int
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    max_output_tokens: int  # params.max_tokens clipped to what max_model_len leaves after the prompt
    stop_ids: frozenset[int]  # stop_token_ids, plus the EOS ids unless ignore_eos
    token_ids: list[int] = field(init=False)
    output_log_probs: list[float] = field(default_factory=list)
    sampler_logprobs: list[Any] | None = None  # per output token the sampler's packed top-N row (`TopLogprobs`)
    sampling_mask: list[list[int]] | None = None
    block_ids: list[int] = field(default_factory=list)
    prompt_block_keys: list[Any] = field(default_factory=list)  # prefix-cache keys of the full prompt blocks
    num_computed_tokens: int = 0
    num_pending: int = 0  # trailing placeholder tokens: sampled by a step in flight, ids not read yet (async)
    slot: int | None = None  # its row in the runner's per-slot sampling tensors while it runs (the scheduler's)
    finish_reason: str | None = None
    handle: Any = None  # the engine's completion handle (an asyncio future); opaque here

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt_ids)
        if self.params.num_logprobs > 0:
            self.sampler_logprobs = []
        if self.params.filters and self.params.return_sampling_mask:
            self.sampling_mask = []

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_ids) :]

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    def append(
        self,
        token_id: int,
        logprob: float,
        top_logprobs: Any = None,
        candidates: list[int] | None = None,
    ) -> str | None:
        """Record one sampled token (into the first pending placeholder, if any); returns the finish reason when
        this token ends the request, else None. A request that finishes drops its remaining placeholders."""
        # runs for every request at every step: locals instead of the properties
        token_ids = self.token_ids
        pending = self.num_pending
        if pending:
            token_ids[len(token_ids) - pending] = token_id
            pending -= 1
            self.num_pending = pending
        else:
            token_ids.append(token_id)
        self.output_log_probs.append(logprob)
        if self.sampler_logprobs is not None:
            self.sampler_logprobs.append(top_logprobs)
        if self.sampling_mask is not None:
            self.sampling_mask.append(candidates if candidates is not None else [])
        if token_id in self.stop_ids:
            reason = FINISH_STOP
        elif len(token_ids) - len(self.prompt_ids) - pending >= self.max_output_tokens:  # num_output_tokens - pending
            reason = FINISH_LENGTH
        else:
            return None
        if pending:
            del token_ids[len(token_ids) - pending :]
            self.num_pending = 0
        return reason

    def add_pending(self) -> None:
        """Count the token a launched step samples for this request before its id is known (asynchronous
        scheduling): a placeholder id 0 holds its place, the next step reads the real id on the device."""
        self.token_ids.append(0)
        self.num_pending += 1

    def _top_logprobs(self) -> TopLogprobs | None:
        rows = self.sampler_logprobs
        if rows is None:
            return None
        k = self.params.num_logprobs
        try:
            return TopLogprobs.from_rows(rows, k)
        except ValueError:  # rows of steps whose widest ask differed (or a step without top-N: a None row)
            width = max([len(row) // 2 for row in rows if row is not None] + [k])
            return TopLogprobs.from_rows([_widen(row, width) for row in rows], k)

    def to_turn_record(self) -> TurnRecord:
        return TurnRecord(
            prompt_ids=list(self.prompt_ids),
            output_ids=self.output_ids,
            output_log_probs=list(self.output_log_probs),
            output_sampling_mask=self.sampling_mask,
            output_sampler_logprobs=self._top_logprobs(),
            finish_reason=self.finish_reason,
        )


def _widen(row: Any, width: int) -> Any:
    """A packed top-N row (N ids, N log-probs) padded to `width` (-1 ids, -inf log-probs): steps of other widths."""
    import numpy as np

    out = np.full(2 * width, -np.inf)
    out[:width] = -1.0
    if row is not None:
        n = len(row) // 2
        out[:n], out[width : width + n] = row[:n], row[n:]
    return out
