"""The wire format of vLLM's OpenAI-compatible server (0.25; endpoints listed in `rlasync.engine.vllm_server`):
request bodies of /v1/completions, and the parsers of its answers (completions in token-id mode, error bodies,
Prometheus /metrics).

Pure functions (no I/O, no vllm import): separate from the HTTP client and the engine so that they are tested on the
recorded fixtures alone (tests/unit/engine/fixtures/vllm/).
"""

from __future__ import annotations

import json
import math
from typing import Any

from rlasync.engine.base import EngineError, EngineStats, SamplingParams
from rlasync.records import TurnRecord

TOKEN_ID_PREFIX = "token_id:"


def error_message(body: str) -> str:
    """The server's error message from an error body (vLLM's {"error": {"message"}}, FastAPI's {"detail"}, dev
    endpoints' {"error": "..."}), else the body itself (shortened)."""
    try:
        data = json.loads(body)
    except (ValueError, TypeError):
        return body.strip()[:500]
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        if isinstance(error, str):
            return error
        if "detail" in data:
            return str(data["detail"])
        if "message" in data:
            return str(data["message"])
    return body.strip()[:500]


def parse_token_id(token: Any) -> int:
    """`"token_id:123"` (vLLM's return_tokens_as_token_ids) or an int -> 123."""
    if isinstance(token, int):
        return token
    text = str(token)
    if text.startswith(TOKEN_ID_PREFIX):
        return int(text[len(TOKEN_ID_PREFIX) :])
    raise EngineError(f"cannot read a token id from {text!r}: send return_tokens_as_token_ids=true")


def turn_from_completion(prompt_ids: list[int], choice: dict[str, Any], num_logprobs: int) -> TurnRecord:
    """A `TurnRecord` from `choices[0]` of a /v1/completions response (token-id mode, with logprobs)."""
    logprobs = choice.get("logprobs") or {}
    tokens = logprobs.get("tokens") or []
    if choice.get("token_ids") is not None:
        output_ids = [int(t) for t in choice["token_ids"]]
    else:
        output_ids = [parse_token_id(t) for t in tokens]
    sampled = logprobs.get("token_logprobs")
    if sampled is None or len(sampled) != len(output_ids) or any(lp is None for lp in sampled):
        raise EngineError(
            f"the server returned {len(output_ids)} tokens without a log-prob for each; the request asks for "
            "logprobs, so check the server's --max-logprobs"
        )
    top: list[dict[int, float]] | None = None
    if num_logprobs > 0:
        top = []
        for entry in logprobs.get("top_logprobs") or [None] * len(output_ids):
            ranked = sorted(
                ((parse_token_id(k), float(v)) for k, v in (entry or {}).items()), key=lambda item: (-item[1], item[0])
            )
            top.append(dict(ranked[:num_logprobs]))
        if len(top) != len(output_ids):
            raise EngineError(f"the server returned top log-probs for {len(top)} of {len(output_ids)} tokens")
    return TurnRecord(
        prompt_ids=list(prompt_ids),
        output_ids=output_ids,
        output_log_probs=[float(lp) for lp in sampled],
        output_sampler_logprobs=top,
        output_sampling_mask=None,
        finish_reason=choice.get("finish_reason"),
    )


def parse_prometheus(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Samples `(name, labels, value)` of a Prometheus text exposition, by `prometheus_client`'s parser; when the
    whole text does not parse, line by line, malformed lines skipped (one bad line does not hide the others)."""
    from prometheus_client.parser import text_string_to_metric_families

    def samples_of(chunk: str) -> list[tuple[str, dict[str, str], float]]:
        return [
            (s.name, dict(s.labels), float(s.value))
            for family in text_string_to_metric_families(chunk)
            for s in family.samples
        ]

    try:
        return samples_of(text)
    except ValueError:
        pass
    samples = []
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            try:
                samples += samples_of(line + "\n")
            except ValueError:
                continue
    return samples


def stats_from_metrics(text: str, max_model_len: int, kv_capacity_tokens: int | None = None) -> EngineStats:
    """`EngineStats` from vLLM's /metrics: KV usage = max over engines, running/waiting/preemptions = sums (docs/algorithms.md
    §2.3.2), capacity = Σ num_gpu_blocks × block_size of `vllm:cache_config_info`."""
    samples = parse_prometheus(text)

    def values(*names: str) -> list[float]:
        for name in names:
            found = [v for n, _, v in samples if n == name and math.isfinite(v)]
            if found:
                return found
        return []

    usage = values("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")
    capacity = 0
    for name, labels, _ in samples:
        if name == "vllm:cache_config_info":
            try:
                capacity += int(float(labels.get("num_gpu_blocks", "0"))) * int(float(labels.get("block_size", "0")))
            except ValueError:
                continue
    return EngineStats(
        kv_cache_usage_frac=max(usage) if usage else 0.0,
        num_running=int(sum(values("vllm:num_requests_running"))),
        num_waiting=int(sum(values("vllm:num_requests_waiting"))),
        num_preemptions=int(sum(values("vllm:num_preemptions_total", "vllm:num_preemptions"))),
        kv_capacity_tokens=capacity or int(kv_capacity_tokens or 0),
        max_model_len=max_model_len,
    )


def completion_body(
    model_id: str | None, prompt: list[int], sampling: SamplingParams, max_tokens: int
) -> dict[str, Any]:
    """The /v1/completions body of one token-in generation request (log-probs and output ids as token ids)."""
    body: dict[str, Any] = {
        "model": model_id,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "repetition_penalty": sampling.repetition_penalty,
        "n": 1,
        "seed": sampling.seed if sampling.seed is not None else random_seed(),
        "stop_token_ids": list(sampling.stop_token_ids),
        "ignore_eos": sampling.ignore_eos,
        "logprobs": sampling.num_logprobs,
        "return_token_ids": True,
        "return_tokens_as_token_ids": True,
        "skip_special_tokens": False,
        "stream": False,
    }
    if sampling.min_p is not None:
        body["min_p"] = sampling.min_p
    return body


def score_body(model_id: str | None, token_ids: list[int], top_k: int, temperature: float) -> dict[str, Any]:
    """The /v1/completions body of one teacher-forced scoring request (`prompt_logprobs=top_k`, one token)."""
    return {
        "model": model_id,
        "prompt": token_ids,
        "max_tokens": 1,
        "temperature": float(temperature),
        "prompt_logprobs": top_k,
        "seed": 0,
        "return_tokens_as_token_ids": True,
        "skip_special_tokens": False,
        "stream": False,
    }


def first_choice(data: Any) -> dict[str, Any]:
    """`choices[0]` of a completions answer, or an `EngineError` quoting the answer."""
    try:
        return data["choices"][0]
    except (KeyError, IndexError, TypeError) as exc:
        raise EngineError(f"the server's answer has no choices: {str(data)[:300]}") from exc


def random_seed() -> int:
    """A fresh 63-bit request seed (a request without one would share the server's stream)."""
    import secrets

    return secrets.randbits(63)
