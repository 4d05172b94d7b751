"""The startup check of `VLLMServerEngine` (blocking, once): wait for `vllm serve`, read what it runs and confirm
that it returns the sampler's processed log-probs (from dev mode's /server_info, else by a one-token probe).

Separate from the engine because it is a one-shot, synchronous (urllib) conversation whose only product is a
`ServerInfo`; the engine then runs on aiohttp and never comes back here.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from rlasync.engine.vllm_server_http import TRANSIENT_STATUS, ServerConnection
from rlasync.engine.vllm_server_wire import error_message, stats_from_metrics

logger = logging.getLogger(__name__)

LOGPROBS_MODE_FLAG = "--logprobs-mode processed_logprobs"


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


class StartupCheck:
    """The startup check against `conn`'s server: `read()` gathers a `ServerInfo`, `report(info)` logs its findings
    and refuses (`ValueError`, when `strict`) a server known to return unprocessed log-probs.

    requested_model   the served name asked for (None: the server's first); dtype: the trainer's, compared
    startup_timeout_s the readiness wait; control_timeout_s / request_timeout_s: of the reads and of the probe
    """

    def __init__(
        self,
        conn: ServerConnection,
        *,
        requested_model: str | None,
        dtype: str | None,
        strict: bool,
        startup_timeout_s: float,
        control_timeout_s: float,
        request_timeout_s: float,
    ) -> None:
        self.conn = conn
        self.base_url = conn.base_url
        self.requested_model = requested_model
        self.dtype = dtype
        self.strict = strict
        self.connect_timeout_s = conn.connect_timeout_s
        self.startup_timeout_s = float(startup_timeout_s)
        self.control_timeout_s = float(control_timeout_s)
        self.request_timeout_s = float(request_timeout_s)
        self._sync = conn.sync

    def read(self) -> ServerInfo:
        """Wait for the server (GET /v1/models, up to startup_timeout_s), then read /version, /server_info (dev mode)
        and /metrics, and learn the logprobs mode (from /server_info, else by a one-token probe)."""
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
        return info

    def report(self, info: ServerInfo) -> None:
        """Log every finding that limits what the trainer can do; refuse a server known to return unprocessed
        log-probs (unless strict=False)."""
        if self.dtype not in (None, "auto") and info.dtype not in (None, self.dtype):
            info.warnings.append(f"the server runs dtype {info.dtype}, the trainer asked for {self.dtype}")
        for message in info.warnings:
            logger.warning("vLLM server %s: %s", self.base_url, message)
        self._check_logprobs_mode(info)

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
        body = {
            "model": model_id,
            "prompt": [0],
            "max_tokens": 1,
            "temperature": 1.0,
            "top_k": 1,
            "logprobs": 0,
            "seed": 0,
            "return_tokens_as_token_ids": True,
        }
        status, text = self._sync("POST", "/v1/completions", body, timeout_s=self.request_timeout_s)
        if status != 200:
            logger.warning(
                "vLLM server %s: the logprobs-mode probe failed (%s: %s)", self.base_url, status, error_message(text)
            )
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
                self.base_url,
                LOGPROBS_MODE_FLAG,
            )
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
