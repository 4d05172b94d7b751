"""`ServerConnection`: the HTTP client of `VLLMServerEngine` (aiohttp for the data plane, urllib for the blocking
startup calls), with its retry policy.

Retries: connection errors, timeouts, 5xx, 408 and 429 are retried with backoff `min(base * 2**a, max)` up to
`max_attempts` per call, then raised (`ConnectionError`, `TimeoutError`, `VLLMServerError`, all of which the rollout
loop retries again); any other 4xx is a `RequestRejectedError` carrying the server's message, never retried; a
control call (pause/resume, weight sync) that fails is a `RuntimeError` (404: the server lacks dev mode). Every wait
has a timeout. Separate from the engine so that transport, retries and error mapping are one piece, and the engine
only says what to ask.
"""

from __future__ import annotations

import asyncio
import json
import logging
import urllib.error
import urllib.request
from typing import Any

from rlasync.engine.base import EngineError, RequestRejectedError
from rlasync.engine.vllm_server_wire import error_message

logger = logging.getLogger(__name__)

TRANSIENT_STATUS = frozenset({408, 429})


class VLLMServerError(EngineError):
    """The server kept failing with a transient status (5xx, 408, 429) after every retry."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class _Transient(Exception):
    def __init__(self, kind: str, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.kind, self.status = kind, status


class ServerConnection:
    """HTTP calls to one `vllm serve` at `base_url`: `request` (async, retried) and `sync` (blocking, one attempt).

    An aiohttp session belongs to one event loop: a caller on a new loop (another `asyncio.run`) gets a new one.
    `num_retries` counts the retried attempts (reported in the engine's stats)."""

    def __init__(
        self,
        base_url: str,
        *,
        connect_timeout_s: float = 10.0,
        max_attempts: int = 3,
        backoff_base_s: float = 1.0,
        backoff_max_s: float = 16.0,
        max_connections: int = 1024,
    ) -> None:
        if max_attempts < 1:
            raise ValueError(f"max_attempts={max_attempts}: must be >= 1")
        self.base_url = base_url.rstrip("/")
        self.connect_timeout_s = float(connect_timeout_s)
        self.max_attempts = int(max_attempts)
        self.backoff_base_s = float(backoff_base_s)
        self.backoff_max_s = float(backoff_max_s)
        self.max_connections = int(max_connections)
        self.num_retries = 0
        self._session: Any = None
        self._session_loop: Any = None

    async def request(
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
        """One call with retries of transient failures; JSON (or text) of a 2xx answer."""
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
                logger.info(
                    "vLLM server %s: %s %s failed (%s); retry %d in %.1f s",
                    self.base_url,
                    method,
                    path,
                    exc,
                    attempt + 1,
                    delay,
                )
                await asyncio.sleep(delay)
        raise AssertionError("unreachable")

    def sync(
        self, method: str, path: str, body: Any = None, *, timeout_s: float, raise_errors: bool = False
    ) -> tuple[int, str]:
        """A blocking call (the startup check): `(status, body)`; status 0 and the error text when no answer came,
        unless `raise_errors`."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            self.base_url + path, data=data, method=method, headers={"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                return response.status, response.read().decode("utf-8", "replace")
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode("utf-8", "replace")
        except (OSError, TimeoutError) as exc:
            if raise_errors:
                raise
            return 0, f"{type(exc).__name__}: {exc}"

    async def close(self) -> None:
        """Close the session if it belongs to the running loop (a session of a finished loop is dropped)."""
        session, self._session = self._session, None
        if session is not None and self._session_loop is asyncio.get_running_loop():
            await session.close()

    def _get_session(self) -> Any:
        import aiohttp

        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._session_loop is not loop:
            self._session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=self.max_connections))
            self._session_loop = loop
        return self._session

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
