"""vLLM outputs -> rlasync records: `TurnRecord` from a completion's log-probs (dicts of `Logprob` per position, or
vLLM's `FlatLogprobs`) and `ScoreResult` from `prompt_logprobs`.

Pure functions over plain objects with `.logprob` / `.rank` (or dicts with those keys): no vllm import, so both vLLM
adapters (`VLLMEngine` in-process, `VLLMServerEngine` over HTTP) share them and the tests run them without vLLM.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rlasync.engine.base import EngineError, ScoreResult
from rlasync.records import TurnRecord

SAMPLING_MASK_WARNING = (
    "vLLM {version} cannot report sampling masks (each token's top-k/top-p/min-p candidate set; that needs "
    "vLLM >= 0.28 with --return-sampling-mask): output_sampling_mask is None and the trainer normalises the "
    "log-prob ratio over the full vocabulary, which is biased while top-k/top-p/min-p filter"
)


def _logprob_value(entry: Any) -> float:
    return float(entry.logprob if hasattr(entry, "logprob") else entry["logprob"])


def _rank_value(entry: Any) -> int | None:
    rank = entry.rank if hasattr(entry, "rank") else entry.get("rank")
    return None if rank is None else int(rank)


def top_entries(position: Mapping[Any, Any], n: int) -> dict[int, float]:
    """The top-`n` (id -> log-prob) of one position's vLLM log-prob dict (which also holds the sampled token when it
    is outside the top-n); by rank when ranks are given, else by log-prob."""
    if n <= 0 or not position:
        return {}
    items = [(int(token), _logprob_value(entry), _rank_value(entry)) for token, entry in position.items()]
    if all(rank is not None for _, _, rank in items):
        items.sort(key=lambda item: (item[2], item[0]))
    else:
        items.sort(key=lambda item: (-item[1], item[0]))
    return {token: logprob for token, logprob, _ in items[:n]}


def turn_from_output(
    prompt_ids: list[int],
    output_ids: Sequence[int],
    logprobs: Sequence[Mapping[Any, Any] | None] | None,
    num_logprobs: int,
    finish_reason: str | None,
) -> TurnRecord:
    """A `TurnRecord` from one vLLM completion: the sampled tokens' processed log-probs and, when `num_logprobs > 0`,
    the top-N per position. Raises `EngineError` when a sampled token has no log-prob (a server without logprobs)."""
    ids = [int(t) for t in output_ids]
    if logprobs is None or len(logprobs) != len(ids):
        got = "none" if logprobs is None else f"{len(logprobs)} positions"
        raise EngineError(f"vLLM returned {len(ids)} tokens but log-probs for {got}")
    sampled: list[float] = []
    top: list[dict[int, float]] = []
    for position, (token, entry) in enumerate(zip(ids, logprobs)):
        if not entry:
            raise EngineError(f"vLLM returned no log-prob for output token {position}")
        chosen = entry.get(token, entry.get(str(token))) if isinstance(entry, Mapping) else None
        if chosen is None:
            raise EngineError(f"vLLM's log-probs of output token {position} do not include the sampled id {token}")
        sampled.append(_logprob_value(chosen))
        top.append(top_entries(entry, num_logprobs))
    return TurnRecord(
        prompt_ids=list(prompt_ids),
        output_ids=ids,
        output_log_probs=sampled,
        output_sampler_logprobs=top if num_logprobs > 0 else None,
        output_sampling_mask=None,
        finish_reason=finish_reason,
    )


def turn_from_flat_output(
    prompt_ids: list[int], output_ids: Sequence[int], flat: Any, num_logprobs: int, finish_reason: str | None
) -> TurnRecord:
    """`turn_from_output` for vLLM's `FlatLogprobs` (`SamplingParams(flat_logprobs=True)`): per position `i`, entries
    `start_indices[i]:end_indices[i]` of the flat `token_ids`/`logprobs` lists hold the sampled token first, then the
    top-N by rank. Slices instead of one dict of `Logprob` objects per token: the conversion of a finished request
    no longer holds the actor's event loop for long."""
    ids = [int(t) for t in output_ids]
    starts, ends = list(flat.start_indices), list(flat.end_indices)
    if len(starts) != len(ids) or len(ends) != len(ids):
        raise EngineError(f"vLLM returned {len(ids)} tokens but log-probs for {len(starts)} positions")
    token_ids, logprobs = flat.token_ids, flat.logprobs
    if any(end <= start for start, end in zip(starts, ends)):
        position = next(i for i, (start, end) in enumerate(zip(starts, ends)) if end <= start)
        raise EngineError(f"vLLM returned no log-prob for output token {position}")
    if [token_ids[start] for start in starts] != ids:
        position = next(i for i, (start, token) in enumerate(zip(starts, ids)) if token_ids[start] != token)
        raise EngineError(f"vLLM's log-probs of output token {position} do not include the sampled id {ids[position]}")
    sampled = [float(logprobs[start]) for start in starts]
    top = None
    if num_logprobs > 0:
        spans = [(start + 1, min(end, start + 1 + num_logprobs)) for start, end in zip(starts, ends)]
        top = [dict(zip(token_ids[first:last], logprobs[first:last])) for first, last in spans]
    return TurnRecord(
        prompt_ids=list(prompt_ids),
        output_ids=ids,
        output_log_probs=sampled,
        output_sampler_logprobs=top,
        output_sampling_mask=None,
        finish_reason=finish_reason,
    )


def score_from_prompt_logprobs(
    token_ids: Sequence[int], prompt_length: int, top_k: int, prompt_logprobs: Sequence[Mapping[Any, Any] | None]
) -> ScoreResult:
    """A `ScoreResult` from vLLM's `prompt_logprobs` (entry i scores `token_ids[i]`; keys are ids or id strings)."""
    if len(prompt_logprobs) < len(token_ids):
        raise EngineError(f"vLLM returned prompt log-probs for {len(prompt_logprobs)} of {len(token_ids)} tokens")
    topk_ids: list[list[int]] = []
    topk_logprobs: list[list[float]] = []
    token_logprobs: list[float] = []
    for i in range(prompt_length, len(token_ids)):
        entry = prompt_logprobs[i] or {}
        realised = int(token_ids[i])
        chosen = entry.get(realised, entry.get(str(realised)))
        if chosen is None:
            raise EngineError(f"vLLM's prompt log-probs at position {i} do not include the realised id {realised}")
        token_logprobs.append(_logprob_value(chosen))
        top = top_entries(entry, top_k)
        topk_ids.append(list(top))
        topk_logprobs.append(list(top.values()))
    return ScoreResult(topk_ids=topk_ids, topk_logprobs=topk_logprobs, token_logprobs=token_logprobs)
