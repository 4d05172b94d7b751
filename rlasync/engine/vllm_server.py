"""`VLLMServerEngine`: the engine interface over HTTP to an external `vllm serve` (docs/design.md §1, docs/algorithms.md §2.4, §6).

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

Split by seam: the wire format (request bodies, answer parsers: `rlasync.engine.vllm_server_wire`), the HTTP client
and its retries (`rlasync.engine.vllm_server_http`), the startup check (`rlasync.engine.vllm_server_check`) and,
here, the engine: the `Engine` interface, the metrics poller and the weight-sync calls. Their public names are
re-exported here.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections.abc import Iterable, Sequence
from typing import Any

from rlasync.engine.base import EngineError, EngineStats, RequestRejectedError, SamplingParams, ScoreResult
from rlasync.engine.vllm_engine_lora import RuntimeAdapters
from rlasync.engine.vllm_outputs import SAMPLING_MASK_WARNING, score_from_prompt_logprobs
from rlasync.engine.vllm_server_check import LOGPROBS_MODE_FLAG, ServerInfo, StartupCheck  # noqa: F401
from rlasync.engine.vllm_server_http import TRANSIENT_STATUS, ServerConnection, VLLMServerError  # noqa: F401
from rlasync.engine.vllm_server_wire import (  # noqa: F401 - re-exported: these lived here first
    TOKEN_ID_PREFIX,
    completion_body,
    error_message,
    first_choice,
    parse_prometheus,
    parse_token_id,
    score_body,
    stats_from_metrics,
    turn_from_completion,
)
from rlasync.engine.vllm_worker import encode_weights, manifest_rows, nccl_update_info
from rlasync.records import TurnRecord
from rlasync.weights.adapter import peek_adapter
from rlasync.weights.apply import paused_for_update

logger = logging.getLogger(__name__)


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
        lora_dir: str | None = None,
        max_loras: int = 1,
    ) -> None:
        if not base_url.startswith(("http://", "https://")):
            raise ValueError(f"vllm_server_url={base_url!r}: must start with http:// or https://")
        self.http = ServerConnection(
            base_url,
            connect_timeout_s=connect_timeout_s,
            max_attempts=max_attempts,
            backoff_base_s=backoff_base_s,
            backoff_max_s=backoff_max_s,
            max_connections=max_connections,
        )
        self.base_url = self.http.base_url
        self.requested_model = model
        self.dtype = dtype
        self.request_timeout_s = float(request_timeout_s)
        self.control_timeout_s = float(control_timeout_s)
        self.weight_sync_timeout_s = float(weight_sync_timeout_s)
        self.startup_timeout_s = float(startup_timeout_s)
        self.metrics_interval_s = float(metrics_interval_s)
        self.chunk_bytes = int(chunk_bytes)
        self.strict = bool(strict)
        self.model_id: str | None = model
        self.max_model_len: int = int(max_model_len or 0)
        self.info: ServerInfo | None = None
        self.num_metrics_errors = 0
        self._poller: asyncio.Task | None = None
        self._stats: EngineStats | None = None
        self._stats_at = 0.0
        self._paused = False
        self._closed = False
        self._warned_mask = False
        self._num_generated_tokens = 0
        # LoRA syncs: runtime adapters written under lora_dir (a folder the server reads), loaded over HTTP
        self._adapters = RuntimeAdapters(lora_dir, max_loras, base_model=model) if lora_dir is not None else None
        if check:
            self.check_server()

    @property
    def num_retries(self) -> int:
        """Retried HTTP attempts so far (transient failures)."""
        return self.http.num_retries

    # ---- startup check (blocking, once) ----------------------------------------------------------------------------

    def check_server(self) -> ServerInfo:
        """Wait for the server (GET /v1/models, up to startup_timeout_s), then read /version, /server_info (dev mode)
        and /metrics, and confirm the logprobs mode (from /server_info, else by a one-token probe). Logs every
        finding that limits what the trainer can do; raises when the server is known to return unprocessed
        log-probs (unless strict=False)."""
        check = StartupCheck(
            self.http,
            requested_model=self.requested_model,
            dtype=self.dtype,
            strict=self.strict,
            startup_timeout_s=self.startup_timeout_s,
            control_timeout_s=self.control_timeout_s,
            request_timeout_s=self.request_timeout_s,
        )
        info = check.read()
        self.info = info
        self.model_id = info.model_id
        if not self.max_model_len:
            self.max_model_len = int(info.max_model_len or 0)
        check.report(info)
        return info

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
        holding = self._adapters.using() if self._adapters is not None else contextlib.nullcontext()
        with holding as adapter:  # the adapter stays loaded on the server until this request ends
            body = completion_body(adapter[0] if adapter is not None else self.model_id, prompt, sampling, max_tokens)
            data = await self._request("POST", "/v1/completions", body, timeout_s=self.request_timeout_s)
        turn = turn_from_completion(prompt, first_choice(data), sampling.num_logprobs)
        self._num_generated_tokens += len(turn.output_ids)
        return turn

    async def score(
        self, token_ids: Sequence[int], prompt_length: int, top_k: int, temperature: float = 1.0
    ) -> ScoreResult:
        """Teacher-forced log-probs of `token_ids[prompt_length:]` (`prompt_logprobs=top_k`, one generated token,
        discarded) at `temperature` (docs/algorithms.md §9.1's `teacher_temperature`; the server applies it to the prompt
        log-probs only when it runs `--logprobs-mode processed_logprobs`)."""
        if not temperature > 0:
            raise RequestRejectedError(f"score: temperature={temperature} must be > 0")
        ids = [int(t) for t in token_ids]
        if not 1 <= prompt_length <= len(ids):
            raise RequestRejectedError(f"score: prompt_length={prompt_length} must be in [1, {len(ids)}]")
        if top_k < 0:
            raise RequestRejectedError(f"score: top_k={top_k} must be >= 0")
        self._check_prompt(ids)
        body = score_body(self._served_model(), ids, top_k, temperature)
        data = await self._request("POST", "/v1/completions", body, timeout_s=self.request_timeout_s)
        choice = first_choice(data)
        return score_from_prompt_logprobs(ids, prompt_length, top_k, choice.get("prompt_logprobs") or [])

    async def pause(self) -> None:
        """POST /pause?mode=keep&clear_cache=true: in-flight requests are frozen; the prefix cache is dropped and
        running requests recompute under the next weights."""
        await self._request(
            "POST", "/pause?mode=keep&clear_cache=true", None, timeout_s=self.control_timeout_s, control=True
        )
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
        named_tensors, is_adapter = peek_adapter(named_tensors)
        if is_adapter:
            return await self.load_adapter(named_tensors)
        started = time.perf_counter()
        total = {"num_tensors": 0, "bytes": 0}
        for payload in encode_weights(named_tensors, chunk_bytes=self.chunk_bytes, text=True):
            results = await self._collective_rpc(
                "load_weights_payload", [json.dumps(payload)], self.weight_sync_timeout_s
            )
            total["num_tensors"] += int(results[0]["num_tensors"])
            total["bytes"] += int(results[0]["bytes"])
        total["seconds"] = time.perf_counter() - started
        return total

    def _served_model(self) -> str | None:
        """What requests name as `model`: the newest LoRA adapter once one is loaded, else the served model."""
        adapter = self._adapters.current if self._adapters is not None else None
        return adapter[0] if adapter is not None else self.model_id

    async def load_adapter(self, named_tensors: Iterable[tuple[str, Any]]) -> dict[str, Any]:
        """One LoRA sync: write the adapter under `lora_dir`, POST /v1/load_lora_adapter {lora_name, lora_path}
        (the server runs with `--enable-lora` and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1), then
        /v1/unload_lora_adapter for the oldest beyond `max_loras`."""
        if self._adapters is None:
            raise RuntimeError(
                "a LoRA adapter sync reached a VLLMServerEngine without lora_dir: set cluster.lora_dir to a folder "
                "the server can read (or cluster.lora_sync='merged')"
            )

        async def load(adapter: Any) -> None:
            body = {"lora_name": adapter[0], "lora_path": adapter[2]}
            await self._request(
                "POST", "/v1/load_lora_adapter", body, timeout_s=self.weight_sync_timeout_s, control=True, text=True
            )

        async def unload(adapter: Any) -> None:
            await self._request(
                "POST",
                "/v1/unload_lora_adapter",
                {"lora_name": adapter[0]},
                timeout_s=self.control_timeout_s,
                control=True,
                text=True,
            )

        return await self._adapters.publish(named_tensors, load=load, unload=unload)

    def stats(self) -> EngineStats:
        """The last /metrics snapshot (refreshed every metrics_interval_s in the background once requests flow)."""
        self._ensure_poller()
        base = self._stats or EngineStats(
            kv_cache_usage_frac=0.0,
            num_running=0,
            num_waiting=0,
            num_preemptions=0,
            kv_capacity_tokens=self.info.kv_capacity_tokens if self.info else 0,
            max_model_len=self.max_model_len,
        )
        age = time.monotonic() - self._stats_at if self._stats is not None else math.inf
        return EngineStats(
            kv_cache_usage_frac=base.kv_cache_usage_frac,
            num_running=base.num_running,
            num_waiting=base.num_waiting,
            num_preemptions=base.num_preemptions,
            kv_capacity_tokens=base.kv_capacity_tokens,
            max_model_len=self.max_model_len,
            extra={
                "retries": float(self.num_retries),
                "metrics_errors": float(self.num_metrics_errors),
                "metrics_age_s": age,
                "num_generated_tokens": float(self._num_generated_tokens),
            },
        )

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
        await self.http.close()

    # ---- weight sync --------------------------------------------------------------------------------------------

    async def join_weight_group(
        self,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        timeout_s: float,
        backend: str = "gloo",
        bucket_bytes: int | None = None,
    ) -> None:
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
        info = {
            "master_address": master_address,
            "master_port": int(master_port),
            "rank_offset": int(rank_offset),
            "world_size": world + int(rank_offset),
        }
        await self._request(
            "POST",
            "/init_weight_transfer_engine",
            {"init_info": info},
            timeout_s=self.weight_sync_timeout_s,
            control=True,
            attempts=1,
        )
        return world

    async def update_weights_nccl(self, manifest: Iterable[Any], packed: bool = True) -> float:
        """POST /start_weight_update, /update_weights {"update_info": manifest}, /finish_weight_update (always, so a
        failed transfer leaves no half-open update), pausing and resuming around it unless already paused. The
        learner broadcasts meanwhile (`NCCLWeightTransferEngine.trainer_send_weights`). Returns seconds."""
        info = nccl_update_info(manifest, packed)
        started = time.perf_counter()
        async with paused_for_update(self):
            await self._request(
                "POST", "/start_weight_update", None, timeout_s=self.control_timeout_s, control=True, attempts=1
            )
            try:
                await self._request(
                    "POST",
                    "/update_weights",
                    {"update_info": info},
                    timeout_s=self.weight_sync_timeout_s,
                    control=True,
                    attempts=1,
                )
            finally:
                await self._request(
                    "POST", "/finish_weight_update", None, timeout_s=self.control_timeout_s, control=True, attempts=1
                )
        return time.perf_counter() - started

    async def weight_fingerprint(self, names: Sequence[str] | None = None) -> dict[str, float]:
        args = [] if names is None else [list(names)]
        results = await self._collective_rpc("weight_fingerprint", args, self.control_timeout_s)
        return results[0] if results else {}

    # ---- internals -------------------------------------------------------------------------------------------------

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
        data = await self._request(
            "POST", "/collective_rpc", body, timeout_s=timeout_s + 30.0, control=True, attempts=1
        )
        return list((data or {}).get("results") or []) if isinstance(data, dict) else []

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

    async def _request(
        self,
        method: str,
        path: str,
        body: Any,
        *,
        timeout_s: float,
        control: bool = False,
        attempts: int | None = None,
        text: bool = False,
    ) -> Any:
        """One call through the connection (retries of transient failures: `ServerConnection.request`); starts
        the metrics poller on the caller's loop."""
        if self._closed:
            raise EngineError("VLLMServerEngine is closed")
        self._ensure_poller()
        return await self.http.request(
            method, path, body, timeout_s=timeout_s, control=control, attempts=attempts, text=text
        )
