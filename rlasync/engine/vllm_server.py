"""`VLLMServerEngine`: the engine interface over HTTP to an external `vllm serve` (SPEC §1, §2.4, §6).

No vllm import here (aiohttp for the data plane, urllib for the one-time startup check). Written against vLLM
0.25.0's server; what it uses, as it is in 0.25's source:

  POST /v1/completions   token-in generation: `prompt` = token ids, `max_tokens`, `temperature`, `top_p`, `top_k`,
                         `min_p`, `repetition_penalty`, `seed`, `stop_token_ids`, `ignore_eos`, `logprobs=N`
                         (0 = the sampled token only; N > 0: top-N plus the sampled token), `return_token_ids`
                         (-> `choices[0].token_ids`), `return_tokens_as_token_ids` (-> `logprobs.tokens` and the keys
                         of `logprobs.top_logprobs` are "token_id:<id>"), `skip_special_tokens=false`. Log-probs are
                         clamped to >= -9999.0 by the server. `prompt_logprobs=k` with `max_tokens=1` for
                         teacher-forced scoring: `choices[0].prompt_logprobs[i]` = {"<id>": {"logprob", "rank",
                         "decoded_token"}} scoring token i (entry 0 is null; always raw log-probs at temperature 1).
                         Errors: {"error": {"message", "type", "param", "code"}}
  GET  /v1/models        `data[0].id` (the served name) and `data[0].max_model_len`;  GET /version -> {"version"}
  GET  /metrics          Prometheus text: `vllm:kv_cache_usage_perc` (a fraction, 0-1), `vllm:num_requests_running`,
                         `vllm:num_requests_waiting`, `vllm:num_preemptions_total` (a counter), and
                         `vllm:cache_config_info{block_size=..,num_gpu_blocks=..}` (the KV capacity), all labelled
                         by `engine`
  dev mode (VLLM_SERVER_DEV_MODE=1):
    POST /pause?mode=keep&clear_cache=true, POST /resume, GET /is_paused
    GET  /server_info?config_format=json   `vllm_config.model_config.logprobs_mode` (the startup check), ...
    GET  /get_world_size, POST /init_weight_transfer_engine {"init_info": {master_address, master_port,
         rank_offset, world_size}}, POST /start_weight_update, POST /update_weights {"update_info": {names,
         dtype_names, shapes, packed}}, POST /finish_weight_update   (vLLM's NCCL weight transfer; the server needs
         --weight-transfer-config '{"backend": "nccl"}')
    POST /collective_rpc {"method", "args", "kwargs", "timeout"} (string args): with
         --worker-extension-cls rlasync.engine.vllm_worker.WorkerExtension the server's workers join rlasync's own
         weight-sync group (`join_weight_group` / `receive_weights`) or take inline tensors (`load_weights`)

Retries: connection errors, timeouts, 5xx, 408 and 429 are retried with backoff `min(base * 2**a, max)` up to
`max_attempts` per call, then raised (`ConnectionError`, `TimeoutError`, `VLLMServerError`, all of which the rollout
loop retries again); any other 4xx is a `RequestRejectedError` carrying the server's message, never retried.
Every wait has a timeout.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlasync.engine.base import EngineError, EngineStats, RequestRejectedError, SamplingParams, ScoreResult
from rlasync.engine.vllm_engine import SAMPLING_MASK_WARNING, score_from_prompt_logprobs
from rlasync.engine.vllm_worker import encode_weights, manifest_rows, nccl_update_info, paused_for_update
from rlasync.records import TurnRecord

logger = logging.getLogger(__name__)

TRANSIENT_STATUS = frozenset({408, 429})
TOKEN_ID_PREFIX = "token_id:"
LOGPROBS_MODE_FLAG = "--logprobs-mode processed_logprobs"


class VLLMServerError(EngineError):
    """The server kept failing with a transient status (5xx, 408, 429) after every retry."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class _Transient(Exception):
    def __init__(self, kind: str, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.kind, self.status = kind, status


# ---- wire format helpers (pure) ------------------------------------------------------------------------------------


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
            ranked = sorted(((parse_token_id(k), float(v)) for k, v in (entry or {}).items()),
                            key=lambda item: (-item[1], item[0]))  # fmt: skip
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


_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)(\s+\S+)?$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Samples `(name, labels, value)` of a Prometheus text exposition (comments and malformed lines skipped)."""
    samples = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            continue
        name, _, labels, value = match.group(1), match.group(2), match.group(3), match.group(4)
        try:
            number = float(value)
        except ValueError:
            continue
        parsed = {key: raw.replace('\\"', '"').replace("\\n", "\n").replace("\\\\", "\\")
                  for key, raw in _LABEL.findall(labels or "")}  # fmt: skip
        samples.append((name, parsed, number))
    return samples


def stats_from_metrics(text: str, max_model_len: int, kv_capacity_tokens: int | None = None) -> EngineStats:
    """`EngineStats` from vLLM's /metrics: KV usage = max over engines, running/waiting/preemptions = sums (SPEC
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


@dataclass
class ServerInfo:
    """What the startup check learned about the server."""

    base_url: str
    version: str | None = None
    model_id: str | None = None
    max_model_len: int | None = None
    dev_mode: bool = False
    logprobs_mode: str | None = None
    logprobs_mode_source: str = "unknown"
    max_logprobs: int | None = None
    dtype: str | None = None
    worker_extension_cls: str | None = None
    weight_transfer_backend: str | None = None
    kv_capacity_tokens: int = 0
    warnings: list[str] = field(default_factory=list)


class VLLMServerEngine:
    """The engine interface over HTTP to `vllm serve` (start it with `--logprobs-mode processed_logprobs`, and with
    `VLLM_SERVER_DEV_MODE=1` for pause/resume and weight sync).

    base_url                 e.g. "http://10.0.0.5:8000"
    model                    the served model name; default the server's first (`/v1/models`); a path that the
                             server does not list is ignored with a warning
    request_timeout_s        bound of one generation/score request; control_timeout_s: pause/resume/metrics;
                             weight_sync_timeout_s: weight-transfer calls; startup_timeout_s: the readiness wait
    max_attempts, backoff_base_s, backoff_max_s    retries of transient failures (see the module docstring)
    metrics_interval_s       /metrics poll period (the stats() snapshot's age at most)
    check                    run the startup check now (blocking; `check_server()` runs it later)
    strict                   a server whose logprobs mode is known not to be processed_logprobs is an error
    """

    def __init__(
        self,
        base_url: str,
        model: str | None = None,
        *,
        dtype: str | None = None,
        max_model_len: int | None = None,
        request_timeout_s: float = 600.0,
        connect_timeout_s: float = 10.0,
        control_timeout_s: float = 300.0,
        weight_sync_timeout_s: float = 1800.0,
        startup_timeout_s: float = 600.0,
        max_attempts: int = 3,
        backoff_base_s: float = 1.0,
        backoff_max_s: float = 16.0,
        metrics_interval_s: float = 5.0,
        max_connections: int = 1024,
        chunk_bytes: int = 64 << 20,
        check: bool = True,
        strict: bool = True,
    ) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"vllm_server_url={base_url!r}: must start with http:// or https://")
        if max_attempts < 1:
            raise ValueError(f"max_attempts={max_attempts}: must be >= 1")
        self.base_url = base_url.rstrip("/")
        self.requested_model = model
        self.dtype = dtype
        self.request_timeout_s = float(request_timeout_s)
        self.connect_timeout_s = float(connect_timeout_s)
        self.control_timeout_s = float(control_timeout_s)
        self.weight_sync_timeout_s = float(weight_sync_timeout_s)
        self.startup_timeout_s = float(startup_timeout_s)
        self.max_attempts = int(max_attempts)
        self.backoff_base_s = float(backoff_base_s)
        self.backoff_max_s = float(backoff_max_s)
        self.metrics_interval_s = float(metrics_interval_s)
        self.max_connections = int(max_connections)
        self.chunk_bytes = int(chunk_bytes)
        self.strict = bool(strict)
        self.model_id: str | None = model
        self.max_model_len: int = int(max_model_len or 0)
        self.info: ServerInfo | None = None
        self.num_retries = 0
        self.num_metrics_errors = 0
        self._session: Any = None
        self._session_loop: Any = None
        self._poller: asyncio.Task | None = None
        self._stats: EngineStats | None = None
        self._stats_at = 0.0
        self._paused = False
        self._closed = False
        self._warned_mask = False
        self._num_generated_tokens = 0
        if check:
            self.check_server()

    # ---- startup check (blocking, once) ----------------------------------------------------------------------------

    def check_server(self) -> ServerInfo:
        """Wait for the server (GET /v1/models, up to startup_timeout_s), then read /version, /server_info (dev mode)
        and /metrics, and confirm the logprobs mode (from /server_info, else by a one-token probe). Logs every
        finding that limits what the trainer can do; raises when the server is known to return unprocessed
        log-probs (unless strict=False)."""
        info = ServerInfo(base_url=self.base_url)
        models = self._wait_ready()
        cards = models.get("data") or []
        ids = [card.get("id") for card in cards]
        if not cards:
            raise RuntimeError(f"vLLM server {self.base_url}: /v1/models lists no model")
        card = cards[0]
        if self.requested_model is not None and self.requested_model in ids:
            card = cards[ids.index(self.requested_model)]
        elif self.requested_model is not None:
            info.warnings.append(
                f"model {self.requested_model!r} is not among the served names {ids}; using {card.get('id')!r}"
            )
        info.model_id = str(card.get("id"))
        info.max_model_len = card.get("max_model_len")
        status, body = self._sync("GET", "/version", timeout_s=self.connect_timeout_s)
        if status == 200:
            info.version = str(json.loads(body).get("version"))
        status, body = self._sync("GET", "/server_info?config_format=json", timeout_s=self.control_timeout_s)
        if status == 200:
            info.dev_mode = True
            self._read_server_info(info, json.loads(body))
        else:
            info.warnings.append(
                "the server's dev-mode endpoints are off (/server_info answered "
                f"{status}): pause/resume and weight sync need VLLM_SERVER_DEV_MODE=1 on the server"
            )
        status, body = self._sync("GET", "/metrics", timeout_s=self.control_timeout_s)
        if status == 200:
            info.kv_capacity_tokens = stats_from_metrics(body, int(info.max_model_len or 0)).kv_capacity_tokens
        else:
            info.warnings.append(f"/metrics answered {status}: the concurrency controller gets no server load")
        if info.logprobs_mode is None:
            info.logprobs_mode, info.logprobs_mode_source = self._probe_logprobs_mode(info.model_id), "probe"
        self.info = info
        self.model_id = info.model_id
        if not self.max_model_len:
            self.max_model_len = int(info.max_model_len or 0)
        if self.dtype not in (None, "auto") and info.dtype not in (None, self.dtype):
            info.warnings.append(f"the server runs dtype {info.dtype}, the trainer asked for {self.dtype}")
        for message in info.warnings:
            logger.warning("vLLM server %s: %s", self.base_url, message)
        self._check_logprobs_mode(info)
        return info

    def _read_server_info(self, info: ServerInfo, data: dict[str, Any]) -> None:
        config = data.get("vllm_config") or {}
        if not isinstance(config, dict):
            return
        model_config = config.get("model_config") or {}
        mode = model_config.get("logprobs_mode")
        if mode is not None:
            info.logprobs_mode, info.logprobs_mode_source = str(mode), "server_info"
        info.max_logprobs = model_config.get("max_logprobs")
        info.dtype = str(model_config.get("dtype", "")).removeprefix("torch.") or None
        info.worker_extension_cls = (config.get("parallel_config") or {}).get("worker_extension_cls") or None
        transfer = config.get("weight_transfer_config")
        info.weight_transfer_backend = transfer.get("backend") if isinstance(transfer, dict) else None
        if not info.worker_extension_cls:
            info.warnings.append(
                "no --worker-extension-cls: join_weight_group/receive_weights/load_weights need "
                "--worker-extension-cls rlasync.engine.vllm_worker.WorkerExtension"
            )

    def _probe_logprobs_mode(self, model_id: str | None) -> str | None:
        """One greedy-by-top-k token: with top_k=1 a processed log-prob is exactly 0 (the only candidate), a raw one
        is below 0 (unless the model is certain, then inconclusive)."""
        body = {"model": model_id, "prompt": [0], "max_tokens": 1, "temperature": 1.0, "top_k": 1, "logprobs": 0,
                "seed": 0, "return_tokens_as_token_ids": True}  # fmt: skip
        status, text = self._sync("POST", "/v1/completions", body, timeout_s=self.request_timeout_s)
        if status != 200:
            logger.warning("vLLM server %s: the logprobs-mode probe failed (%s: %s)", self.base_url, status,
                           error_message(text))  # fmt: skip
            return None
        try:
            value = float(json.loads(text)["choices"][0]["logprobs"]["token_logprobs"][0])
        except (KeyError, IndexError, TypeError, ValueError):
            return None
        return "processed_logprobs" if abs(value) < 1e-9 else f"not processed_logprobs (top_k=1 log-prob {value:.4g})"

    def _check_logprobs_mode(self, info: ServerInfo) -> None:
        mode = info.logprobs_mode
        if mode == "processed_logprobs":
            return
        if mode is None:
            logger.warning(
                "vLLM server %s: could not confirm that it returns processed log-probs (the log-probs of the "
                "distribution it samples from). Start it with `%s`, or the importance ratios are wrong.",
                self.base_url, LOGPROBS_MODE_FLAG,
            )  # fmt: skip
            return
        message = (
            f"vLLM server {self.base_url} returns {mode} log-probs ({info.logprobs_mode_source}), not the sampler's "
            f"processed ones: restart it with `{LOGPROBS_MODE_FLAG}`"
        )
        if self.strict:
            raise ValueError(message)
        logger.warning(message)

    def _wait_ready(self) -> dict[str, Any]:
        deadline = time.monotonic() + self.startup_timeout_s
        last = "no answer"
        while True:
            try:
                status, body = self._sync("GET", "/v1/models", timeout_s=self.connect_timeout_s, raise_errors=True)
                if status == 200:
                    return json.loads(body)
                last = f"HTTP {status}: {error_message(body)}"
                if 400 <= status < 500 and status not in TRANSIENT_STATUS:
                    raise RuntimeError(f"vLLM server {self.base_url}: GET /v1/models failed ({last})")
            except (OSError, TimeoutError) as exc:
                last = f"{type(exc).__name__}: {exc}"
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"vLLM server {self.base_url} was not ready within {self.startup_timeout_s:.0f} s ({last})"
                )
            time.sleep(min(2.0, max(0.05, deadline - time.monotonic())))

    def _sync(self, method: str, path: str, body: Any = None, *, timeout_s: float,
              raise_errors: bool = False) -> tuple[int, str]:  # fmt: skip
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.base_url + path, data=data, method=method,
                                         headers={"Content-Type": "application/json"})  # fmt: skip
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                return response.status, response.read().decode("utf-8", "replace")
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode("utf-8", "replace")
        except (OSError, TimeoutError) as exc:
            if raise_errors:
                raise
            return 0, f"{type(exc).__name__}: {exc}"

    # ---- the Engine interface -------------------------------------------------------------------------------------

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> TurnRecord:
        prompt = self._check_prompt(prompt_ids)
        if sampling.filters and sampling.return_sampling_mask and not self._warned_mask:
            self._warned_mask = True
            version = self.info.version if self.info and self.info.version else "this server"
            logger.warning(SAMPLING_MASK_WARNING.format(version=version))
        max_tokens = sampling.max_tokens
        if self.max_model_len:
            max_tokens = min(max_tokens, self.max_model_len - len(prompt))
        body: dict[str, Any] = {
            "model": self.model_id,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": sampling.temperature,
            "top_p": sampling.top_p,
            "top_k": sampling.top_k,
            "repetition_penalty": sampling.repetition_penalty,
            "n": 1,
            "seed": sampling.seed if sampling.seed is not None else _random_seed(),
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
        data = await self._request("POST", "/v1/completions", body, timeout_s=self.request_timeout_s)
        turn = turn_from_completion(prompt, _first_choice(data), sampling.num_logprobs)
        self._num_generated_tokens += len(turn.output_ids)
        return turn

    async def score(
        self, token_ids: Sequence[int], prompt_length: int, top_k: int, temperature: float = 1.0
    ) -> ScoreResult:
        """Teacher-forced log-probs of `token_ids[prompt_length:]` (`prompt_logprobs=top_k`, one generated token,
        discarded) at `temperature` (SPEC §9.1's `teacher_temperature`; the server applies it to the prompt
        log-probs only when it runs `--logprobs-mode processed_logprobs`)."""
        if not temperature > 0:
            raise RequestRejectedError(f"score: temperature={temperature} must be > 0")
        ids = [int(t) for t in token_ids]
        if not 1 <= prompt_length <= len(ids):
            raise RequestRejectedError(f"score: prompt_length={prompt_length} must be in [1, {len(ids)}]")
        if top_k < 0:
            raise RequestRejectedError(f"score: top_k={top_k} must be >= 0")
        self._check_prompt(ids)
        body = {"model": self.model_id, "prompt": ids, "max_tokens": 1, "temperature": float(temperature),
                "prompt_logprobs": top_k, "seed": 0, "return_tokens_as_token_ids": True, "skip_special_tokens": False,
                "stream": False}  # fmt: skip
        data = await self._request("POST", "/v1/completions", body, timeout_s=self.request_timeout_s)
        choice = _first_choice(data)
        return score_from_prompt_logprobs(ids, prompt_length, top_k, choice.get("prompt_logprobs") or [])

    async def pause(self) -> None:
        """POST /pause?mode=keep&clear_cache=true: in-flight requests are frozen; the prefix cache is dropped and
        running requests recompute under the next weights."""
        await self._request("POST", "/pause?mode=keep&clear_cache=true", None, timeout_s=self.control_timeout_s,
                            control=True)  # fmt: skip
        self._paused = True

    async def resume(self) -> None:
        await self._request("POST", "/resume", None, timeout_s=self.control_timeout_s, control=True)
        self._paused = False

    @property
    def is_paused(self) -> bool:
        return self._paused

    async def load_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> dict[str, Any]:
        """Send tensors inline (base64 JSON over /collective_rpc, chunks of ~chunk_bytes) to the workers' extension,
        which loads them with `model.load_weights`; only while paused. Slow for big models: prefer
        `join_weight_group` + `receive_weights` (a broadcast) or vLLM's NCCL path (`update_weights_nccl`)."""
        if not self._paused:
            raise RuntimeError("VLLMServerEngine.load_weights needs a paused engine: await engine.pause() first")
        started = time.perf_counter()
        total = {"num_tensors": 0, "bytes": 0}
        for payload in encode_weights(named_tensors, chunk_bytes=self.chunk_bytes, text=True):
            results = await self._collective_rpc("load_weights_payload", [json.dumps(payload)],
                                                 self.weight_sync_timeout_s)  # fmt: skip
            total["num_tensors"] += int(results[0]["num_tensors"])
            total["bytes"] += int(results[0]["bytes"])
        total["seconds"] = time.perf_counter() - started
        return total

    def stats(self) -> EngineStats:
        """The last /metrics snapshot (refreshed every metrics_interval_s in the background once requests flow)."""
        self._ensure_poller()
        base = self._stats or EngineStats(
            kv_cache_usage_frac=0.0, num_running=0, num_waiting=0, num_preemptions=0,
            kv_capacity_tokens=self.info.kv_capacity_tokens if self.info else 0, max_model_len=self.max_model_len,
        )  # fmt: skip
        age = time.monotonic() - self._stats_at if self._stats is not None else math.inf
        return EngineStats(
            kv_cache_usage_frac=base.kv_cache_usage_frac,
            num_running=base.num_running,
            num_waiting=base.num_waiting,
            num_preemptions=base.num_preemptions,
            kv_capacity_tokens=base.kv_capacity_tokens,
            max_model_len=self.max_model_len,
            extra={"retries": float(self.num_retries), "metrics_errors": float(self.num_metrics_errors),
                   "metrics_age_s": age, "num_generated_tokens": float(self._num_generated_tokens)},
        )  # fmt: skip

    async def refresh_stats(self) -> EngineStats:
        """Read /metrics now (one attempt, control_timeout_s)."""
        text = await self._request("GET", "/metrics", None, timeout_s=self.control_timeout_s, attempts=1, text=True)
        capacity = self.info.kv_capacity_tokens if self.info else 0
        self._stats = stats_from_metrics(text, self.max_model_len, capacity)
        self._stats_at = time.monotonic()
        return self._stats

    async def close(self) -> None:
        self._closed = True
        poller, self._poller = self._poller, None
        if poller is not None and not poller.done():
            poller.cancel()
            await asyncio.gather(poller, return_exceptions=True)
        session, self._session = self._session, None
        if session is not None and self._session_loop is asyncio.get_running_loop():
            await session.close()

    # ---- weight sync --------------------------------------------------------------------------------------------

    async def join_weight_group(self, host: str, port: int, rank: int, world_size: int, timeout_s: float,
                                backend: str = "gloo", bucket_bytes: int | None = None) -> None:  # fmt: skip
        """The server's workers join rlasync's weight-sync group (learner rank 0 sends) as ranks `rank, rank+1, ...`
        (needs --worker-extension-cls rlasync.engine.vllm_worker.WorkerExtension and dev mode)."""
        args = [host, str(port), str(rank), str(world_size), str(timeout_s), backend, str(bucket_bytes)]
        await self._collective_rpc("init_weight_group", args, float(timeout_s) + 30.0)

    async def receive_weights(self, manifest: Iterable[Any]) -> dict[str, Any]:
        """The workers receive one broadcast per manifest entry and load it (pausing first unless paused)."""
        rows = json.dumps(manifest_rows(manifest))
        async with paused_for_update(self):
            results = await self._collective_rpc("receive_weights", [rows], self.weight_sync_timeout_s)
        return results[0] if results else {}

    async def init_weight_transfer(self, master_address: str, master_port: int, rank_offset: int = 1) -> int:
        """vLLM's NCCL weight transfer (dev mode, --weight-transfer-config '{"backend": "nccl"}'): GET
        /get_world_size -> W, then POST /init_weight_transfer_engine for a group of W + rank_offset ranks; the
        learner joins as rank 0 (`NCCLWeightTransferEngine.trainer_init`) at the same time. Returns W."""
        data = await self._request("GET", "/get_world_size", None, timeout_s=self.control_timeout_s, control=True)
        world = int(data["world_size"])
        info = {"master_address": master_address, "master_port": int(master_port), "rank_offset": int(rank_offset),
                "world_size": world + int(rank_offset)}  # fmt: skip
        await self._request("POST", "/init_weight_transfer_engine", {"init_info": info},
                            timeout_s=self.weight_sync_timeout_s, control=True, attempts=1)  # fmt: skip
        return world

    async def update_weights_nccl(self, manifest: Iterable[Any], packed: bool = True) -> float:
        """POST /start_weight_update, /update_weights {"update_info": manifest}, /finish_weight_update (always, so a
        failed transfer leaves no half-open update), pausing and resuming around it unless already paused. The
        learner broadcasts meanwhile (`NCCLWeightTransferEngine.trainer_send_weights`). Returns seconds."""
        info = nccl_update_info(manifest, packed)
        started = time.perf_counter()
        async with paused_for_update(self):
            await self._request("POST", "/start_weight_update", None, timeout_s=self.control_timeout_s, control=True,
                                attempts=1)  # fmt: skip
            try:
                await self._request("POST", "/update_weights", {"update_info": info},
                                    timeout_s=self.weight_sync_timeout_s, control=True, attempts=1)  # fmt: skip
            finally:
                await self._request("POST", "/finish_weight_update", None, timeout_s=self.control_timeout_s,
                                    control=True, attempts=1)  # fmt: skip
        return time.perf_counter() - started

    async def weight_fingerprint(self, names: Sequence[str] | None = None) -> dict[str, float]:
        args = [] if names is None else [list(names)]
        results = await self._collective_rpc("weight_fingerprint", args, self.control_timeout_s)
        return results[0] if results else {}

    # ---- HTTP ------------------------------------------------------------------------------------------------------

    def _check_prompt(self, prompt_ids: Sequence[int]) -> list[int]:
        if self._closed:
            raise EngineError("VLLMServerEngine is closed")
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise RequestRejectedError("empty prompt")
        if self.max_model_len and len(prompt) >= self.max_model_len:
            raise RequestRejectedError(
                f"prompt of {len(prompt)} tokens leaves no room to generate: max_model_len is {self.max_model_len}"
            )
        return prompt

    async def _collective_rpc(self, method: str, args: list[Any], timeout_s: float) -> list[Any]:
        body = {"method": method, "args": args, "timeout": timeout_s}
        data = await self._request("POST", "/collective_rpc", body, timeout_s=timeout_s + 30.0, control=True,
                                   attempts=1)  # fmt: skip
        return list((data or {}).get("results") or []) if isinstance(data, dict) else []

    def _get_session(self) -> Any:
        import aiohttp

        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._session_loop is not loop:
            # a session belongs to one event loop: a caller on a new loop (another asyncio.run) gets a new one
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=self.max_connections))
            self._session_loop = loop
        return self._session

    def _ensure_poller(self) -> None:
        if self._closed or self.metrics_interval_s <= 0:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        if self._poller is not None and not self._poller.done() and self._poller.get_loop() is loop:
            return
        self._poller = loop.create_task(self._poll_metrics())

    async def _poll_metrics(self) -> None:
        while not self._closed:
            try:
                await self.refresh_stats()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a missing /metrics must not stop generation
                self.num_metrics_errors += 1
                logger.debug("vLLM server %s: /metrics failed: %s", self.base_url, exc)
            await asyncio.sleep(self.metrics_interval_s)

    async def _request(self, method: str, path: str, body: Any, *, timeout_s: float, control: bool = False,
                       attempts: int | None = None, text: bool = False) -> Any:  # fmt: skip
        """One call with retries of transient failures; JSON (or text) of a 2xx answer."""
        if self._closed:
            raise EngineError("VLLMServerEngine is closed")
        self._ensure_poller()
        attempts = self.max_attempts if attempts is None else attempts
        for attempt in range(attempts):
            try:
                return await self._attempt(method, path, body, timeout_s, control, text)
            except _Transient as exc:
                if attempt + 1 >= attempts:
                    what = f"{method} {self.base_url}{path}"
                    message = f"{what} failed after {attempts} attempt(s): {exc}"
                    if exc.kind == "timeout":
                        raise TimeoutError(message) from exc
                    if exc.kind == "connection":
                        raise ConnectionError(message) from exc
                    raise VLLMServerError(message, exc.status) from exc
                self.num_retries += 1
                delay = min(self.backoff_base_s * 2**attempt, self.backoff_max_s)
                logger.info("vLLM server %s: %s %s failed (%s); retry %d in %.1f s", self.base_url, method, path, exc,
                            attempt + 1, delay)  # fmt: skip
                await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    async def _attempt(self, method: str, path: str, body: Any, timeout_s: float, control: bool, text: bool) -> Any:
        import aiohttp

        timeout = aiohttp.ClientTimeout(total=timeout_s, connect=min(self.connect_timeout_s, timeout_s))
        try:
            async with self._get_session().request(method, self.base_url + path, json=body, timeout=timeout) as resp:
                payload = await resp.text()
                status = resp.status
        except TimeoutError as exc:
            raise _Transient("timeout", f"no answer within {timeout_s:.0f} s") from exc
        except aiohttp.ClientError as exc:  # connection refused/reset, server disconnected, payload errors
            raise _Transient("connection", f"{type(exc).__name__}: {exc}") from exc
        if 200 <= status < 300:
            if text:
                return payload
            return json.loads(payload) if payload.strip() else None
        message = error_message(payload)
        if status >= 500 or status in TRANSIENT_STATUS:
            raise _Transient("status", f"HTTP {status}: {message}", status)
        if control and status == 404:
            raise RuntimeError(
                f"{method} {self.base_url}{path}: HTTP 404 ({message}); the server needs VLLM_SERVER_DEV_MODE=1 "
                "(pause/resume and weight-sync endpoints)"
            )
        if control:
            raise RuntimeError(f"{method} {self.base_url}{path}: HTTP {status}: {message}")
        raise RequestRejectedError(f"vLLM server rejected {method} {path} (HTTP {status}): {message}")


def _first_choice(data: Any) -> dict[str, Any]:
    try:
        return data["choices"][0]
    except (KeyError, IndexError, TypeError) as exc:
        raise EngineError(f"the server's answer has no choices: {str(data)[:300]}") from exc


def _random_seed() -> int:
    import secrets

    return secrets.randbits(63)
