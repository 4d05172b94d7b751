"""`RemoteReward`: a reward function that asks an HTTP server (a reward model served elsewhere) for the rewards.

    reward = RemoteReward("http://rm-host:8000/classify", name="helpfulness")        # vLLM, `vllm serve <rm>`
    reward = RemoteReward("http://judge:9000/score")                                 # the plain JSON protocol
    AsyncGRPOTrainer(..., reward_funcs=[reward, last_number_reward])

It follows the reward calling convention (`rlasync.rewards.calling`): called once per group with keyword lists
`prompts`, `completions`, `completion_ids` and the dataset columns, it returns one float (or None) per completion; its
`__call__` is a coroutine, so a rollout actor runs many groups' requests concurrently on its event loop.

Protocols (`protocol=`, inferred from the URL's last path segment when left out: `/classify` → "vllm-classify",
`/pooling` → "vllm-pooling", anything else → "json"):

* "json": POST `{"prompts": [...], "completions": [...], "<column>": [...], ...}` (one entry per completion: the
  prompt and completion as the trainer holds them, chat message lists for conversational data; every dataset column
  unless `columns=` picks some; `completion_ids` with `send_completion_ids=True`; `extra_body` merged in) →
  `{"rewards": [float | null, ...]}`, exactly one finite number or null (not scored) per completion.
* "vllm-classify" / "vllm-pooling": the `/classify` and `/pooling` endpoints of `vllm serve` running a
  sequence-classification reward model. By default each completion is one request `{"messages": prompt + completion}`
  (the server renders it with the reward model's own chat template); with `render=f`, `f(prompt, completion) -> str`
  makes the texts and a batch goes as one request `{"input": [text, ...]}`. `use_activation=False` (the default) asks
  for the raw score (vLLM applies a sigmoid/softmax otherwise); the reward is entry `label_index` of the
  response's `data[i].probs` (classify) or `data[i].data` (pooling, a sequence-level vector).

Transport: one `aiohttp.ClientSession` per process, created lazily inside the running event loop (re-created if the
loop changed; it never travels: a pickled `RemoteReward` arrives without session and with zeroed counters, so each
Ray actor has its own); at most `max_connections` requests in flight, the others waiting for a free connection;
`timeout_s` per attempt, counted once it has its connection; a group's completions are split into requests of at most
`batch_size` completions, sent concurrently.

Failures: connection errors (refused, reset, disconnected), timeouts, HTTP 5xx / 429 / 408 and malformed responses
(not JSON, a missing key, the wrong number of rewards, a value that is not a finite number) are retried up to
`max_retries` times with exponential backoff and jitter (`backoff_s * 2**k`, at most `max_backoff_s`, times a random
factor in [0.5, 1]; a numeric `Retry-After` header is honoured up to `max_backoff_s`). Other 4xx statuses are not
retried (the request itself is wrong). A request that still fails raises `RemoteRewardError` naming the URL, the
attempts and the last cause: the group fails as with any raising reward function, never with a silent 0 or None.
Counters (`reward.stats`, per process: requests, attempts, retries, failures, timeouts, connection_errors,
http_errors, malformed, completions) count what this copy of the object did; the calling convention has no channel
for per-function metrics, so they are not logged automatically.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import numbers
import random
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from rlasync.rewards.calling import ProcessLocal, RewardFunctionError

if TYPE_CHECKING:
    import aiohttp

logger = logging.getLogger(__name__)

PROTOCOLS = ("json", "vllm-classify", "vllm-pooling")
RETRY_STATUSES = frozenset({408, 429})
BODY_EXCERPT_CHARS = 200


class RemoteRewardError(RewardFunctionError):
    """A remote reward request failed after its retries (or with a status that is not retried).

    url:      the endpoint
    attempts: how many times the request was sent
    cause:    the last failure (an aiohttp error, a `TimeoutError`, a `RemoteRewardHTTPError` or a
              `RemoteRewardResponseError`)
    """

    def __init__(self, message: str, *, url: str, attempts: int, cause: BaseException) -> None:
        super().__init__(message)
        self.url = url
        self.attempts = attempts
        self.cause = cause


class RemoteRewardHTTPError(Exception):
    """The server answered with an error status (the cause inside a `RemoteRewardError`)."""

    def __init__(self, status: int, body: str, retry_after_s: float | None = None) -> None:
        super().__init__(f"HTTP {status}: {_excerpt(body)}")
        self.status = status
        self.retry_after_s = retry_after_s


class RemoteRewardResponseError(ValueError):
    """The server's answer breaks the protocol: not JSON, a missing key, the wrong number of rewards, a value that
    is not a finite number (the cause inside a `RemoteRewardError`)."""


@dataclass(slots=True)
class RemoteRewardStats:
    """What one copy of a `RemoteReward` did (per process: each Ray actor counts its own).

    requests:          requests made (one per batch; each may take several attempts)
    attempts:          HTTP requests sent, retries included
    retries:           attempts after a failed one
    failures:          requests that gave up (each raised a `RemoteRewardError`)
    timeouts:          attempts that ran past `timeout_s`
    connection_errors: attempts that could not connect or lost the connection
    http_errors:       attempts answered with an error status
    malformed:         attempts answered with a response that breaks the protocol
    completions:       completions scored (rewards returned)
    """

    requests: int = 0
    attempts: int = 0
    retries: int = 0
    failures: int = 0
    timeouts: int = 0
    connection_errors: int = 0
    http_errors: int = 0
    malformed: int = 0
    completions: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


class RemoteReward(ProcessLocal):
    """A reward function scored by an HTTP server (see the module docstring for the protocols and failures).

    url:                 the endpoint, e.g. "http://host:8000/classify" or "http://host:9000/score"
    protocol:            "json", "vllm-classify" or "vllm-pooling"; None infers it from the URL's last path segment
    name:                the reward's column and metric name (`rewards/<name>/mean`); default "remote_reward"
    model:               sent as "model" (vLLM protocols; vLLM needs it only when it serves several models)
    batch_size:          at most this many completions per request
    max_connections:     connections open at once to the server (per process)
    timeout_s:           the limit of one attempt, connection to last byte
    max_retries:         attempts after the first on a retryable failure
    backoff_s, max_backoff_s: the first retry's delay and the cap of the exponential backoff
    headers:             extra HTTP headers (e.g. {"Authorization": "Bearer ..."})
    extra_body:          merged into every request body (e.g. {"truncate_prompt_tokens": 4096})
    columns:             json protocol: the dataset columns to send (None: all of them)
    send_completion_ids: json protocol: also send each completion's token ids
    render:              vLLM protocols: `render(prompt, completion) -> str` sends batched texts instead of one
                         chat-message request per completion (must pickle to reach Ray actors)
    use_activation:      vLLM protocols: False (raw score), True (sigmoid/softmax), None (the server's default)
    label_index:         vLLM protocols: which entry of the returned vector is the reward
    """

    def __init__(
        self,
        url: str,
        *,
        protocol: str | None = None,
        name: str = "remote_reward",
        model: str | None = None,
        batch_size: int = 64,
        max_connections: int = 16,
        timeout_s: float = 60.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        max_backoff_s: float = 10.0,
        headers: Mapping[str, str] | None = None,
        extra_body: Mapping[str, Any] | None = None,
        columns: Sequence[str] | None = None,
        send_completion_ids: bool = False,
        render: Callable[[Any, Any], str] | None = None,
        use_activation: bool | None = False,
        label_index: int = 0,
    ) -> None:
        self.url = _checked_url(url)
        self.protocol = _checked_protocol(protocol, self.url)
        if not isinstance(name, str) or not name:
            raise ValueError(f"RemoteReward: name={name!r} must be a non-empty string (the reward's metric name)")
        self.__name__ = name
        self.model = model
        self.batch_size = _positive_int("batch_size", batch_size)
        self.max_connections = _positive_int("max_connections", max_connections)
        self.timeout_s = _positive_float("timeout_s", timeout_s)
        if isinstance(max_retries, bool) or not isinstance(max_retries, int) or max_retries < 0:
            raise ValueError(f"RemoteReward: max_retries={max_retries!r} must be an int >= 0")
        self.max_retries = max_retries
        self.backoff_s = _positive_float("backoff_s", backoff_s, allow_zero=True)
        self.max_backoff_s = _positive_float("max_backoff_s", max_backoff_s, allow_zero=True)
        self.headers = dict(headers or {})
        self.extra_body = dict(extra_body or {})
        if isinstance(columns, str):
            raise ValueError(f"RemoteReward: columns={columns!r} must be a list of column names, e.g. ['answer']")
        self.columns = None if columns is None else tuple(columns)
        self.send_completion_ids = bool(send_completion_ids)
        if render is not None and not callable(render):
            raise ValueError(f"RemoteReward: render={render!r} must be a function render(prompt, completion) -> str")
        if self.protocol == "json" and render is not None:
            raise ValueError("RemoteReward: render= applies to the vLLM protocols; the json protocol sends the data")
        self.render = render
        self.use_activation = use_activation
        if isinstance(label_index, bool) or not isinstance(label_index, int) or label_index < 0:
            raise ValueError(f"RemoteReward: label_index={label_index!r} must be an int >= 0")
        self.label_index = label_index
        self._reset_process_state()

    _process_state = ("stats", "_session", "_session_loop", "_slots")

    def _reset_process_state(self) -> None:
        self.stats = RemoteRewardStats()
        self._session: aiohttp.ClientSession | None = None
        self._session_loop: asyncio.AbstractEventLoop | None = None
        self._slots: asyncio.Semaphore | None = None  # one per session: a request waits here, not on the clock

    def __repr__(self) -> str:
        return f"RemoteReward({self.url!r}, protocol={self.protocol!r}, name={self.__name__!r})"

    # ---- the reward function ----------------------------------------------------------------------------------

    async def __call__(
        self,
        *,
        prompts: Sequence[Any],
        completions: Sequence[Any],
        completion_ids: Sequence[Sequence[int]] = (),
        **columns: Any,
    ) -> list[float | None]:
        """One reward (None: not scored) per completion; raises `RemoteRewardError` when a request fails."""
        if len(prompts) != len(completions):
            raise ValueError(
                f"{len(prompts)} prompts for {len(completions)} completions; pass one prompt per completion"
            )
        bodies = self._request_bodies(list(prompts), list(completions), list(completion_ids), columns)
        rewards = [reward for batch in await self._post_all(bodies) for reward in batch]
        self.stats.completions += len(rewards)
        return rewards

    async def _post_all(self, bodies: list[tuple[bytes, int]]) -> list[list[float | None]]:
        """Send the requests concurrently; the first failure cancels the others and is raised as it is."""
        if len(bodies) == 1:
            return [await self._post(*bodies[0])]
        tasks = [asyncio.ensure_future(self._post(body, count)) for body, count in bodies]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def aclose(self) -> None:
        """Close this process's session if it belongs to the running loop (a later call opens a new one)."""
        session, loop = self._session, self._session_loop
        self._session, self._session_loop, self._slots = None, None, None
        if session is not None and not session.closed and loop is asyncio.get_running_loop():
            await session.close()

    # ---- requests ---------------------------------------------------------------------------------------------

    def _request_bodies(
        self, prompts: list[Any], completions: list[Any], completion_ids: list[Any], columns: Mapping[str, Any]
    ) -> list[tuple[bytes, int]]:
        """The JSON bodies of one call and how many rewards each must return."""
        if self.protocol == "json":
            sent = self._sent_columns(columns, len(completions))
            if self.send_completion_ids:
                sent["completion_ids"] = [list(map(int, ids)) for ids in completion_ids]
            bodies = []
            for start in range(0, len(completions), self.batch_size):
                chunk = slice(start, start + self.batch_size)
                body = {"prompts": prompts[chunk], "completions": completions[chunk]}
                body.update({key: values[chunk] for key, values in sent.items()})
                bodies.append((self._encode({**self.extra_body, **body}), len(completions[chunk])))
            return bodies
        vllm_fields: dict[str, Any] = {**self.extra_body}
        if self.model is not None:
            vllm_fields["model"] = self.model
        if self.use_activation is not None:
            vllm_fields["use_activation"] = self.use_activation
        if self.render is None:
            return [
                (self._encode({**vllm_fields, "messages": _as_messages(prompt, "user") + _as_messages(completion)}), 1)
                for prompt, completion in zip(prompts, completions, strict=True)
            ]
        texts = [self._rendered(prompt, completion) for prompt, completion in zip(prompts, completions, strict=True)]
        batches = [texts[start : start + self.batch_size] for start in range(0, len(texts), self.batch_size)]
        return [(self._encode({**vllm_fields, "input": batch}), len(batch)) for batch in batches]

    def _sent_columns(self, columns: Mapping[str, Any], count: int) -> dict[str, list[Any]]:
        names = list(columns) if self.columns is None else list(self.columns)
        missing = [name for name in names if name not in columns]
        if missing:
            raise ValueError(
                f"RemoteReward '{self.__name__}': columns={list(self.columns or ())} names {missing}, which the "
                f"dataset does not have (its columns: {sorted(columns)})"
            )
        sent = {}
        for name in names:
            values = list(columns[name])
            if len(values) != count:
                raise ValueError(f"column {name!r} has {len(values)} values for {count} completions")
            sent[name] = values
        return sent

    def _rendered(self, prompt: Any, completion: Any) -> str:
        text = self.render(prompt, completion)  # type: ignore[misc]
        if not isinstance(text, str):
            raise TypeError(f"RemoteReward '{self.__name__}': render returned {type(text).__name__}; return a str")
        return text

    def _encode(self, body: Mapping[str, Any]) -> bytes:
        try:
            return json.dumps(body, allow_nan=False).encode()
        except (TypeError, ValueError) as exc:
            hint = " (pick JSON-friendly columns with columns=[...])" if self.protocol == "json" else ""
            raise TypeError(
                f"RemoteReward '{self.__name__}': the request for {self.url} is not JSON-serialisable: {exc}{hint}"
            ) from exc

    def _get_session(self) -> tuple[aiohttp.ClientSession, asyncio.Semaphore]:
        """This process's session and its connection slots, made in (and bound to) the running loop; new ones if the
        loop changed."""
        import aiohttp  # on first use: importing rlasync.rewards stays light

        loop = asyncio.get_running_loop()
        if self._session is None or self._session.closed or self._session_loop is not loop:
            # A session of another loop is left behind: it cannot be closed from here (its loop is gone or belongs
            # to another thread). Callers that run one loop after another close theirs with `await aclose()`.
            connector = aiohttp.TCPConnector(limit=self.max_connections, limit_per_host=self.max_connections)
            timeout = aiohttp.ClientTimeout(total=self.timeout_s)
            headers = {"Content-Type": "application/json", "Accept": "application/json", **self.headers}
            self._session = aiohttp.ClientSession(connector=connector, timeout=timeout, headers=headers)
            self._session_loop = loop
            self._slots = asyncio.Semaphore(self.max_connections)
        return self._session, self._slots  # type: ignore[return-value]

    async def _post(self, body: bytes, count: int) -> list[float | None]:
        """Send one request with retries; the `count` rewards it returns."""
        import aiohttp

        self.stats.requests += 1
        attempts = 1 + self.max_retries
        for attempt in range(1, attempts + 1):
            self.stats.attempts += 1
            try:
                return await self._attempt(body, count)
            except (
                TimeoutError,
                ConnectionError,
                aiohttp.ClientError,
                RemoteRewardHTTPError,
                RemoteRewardResponseError,
            ) as exc:
                cause = exc
                self._count(exc)
                retryable = not isinstance(exc, RemoteRewardHTTPError) or _retryable_status(exc.status)
                if not retryable or attempt == attempts:
                    break
                delay = self._backoff(attempt, exc)
                logger.info(
                    "remote reward %s: attempt %d/%d failed (%s); retrying in %.2fs",
                    self.url,
                    attempt,
                    attempts,
                    _describe(exc),
                    delay,
                )
                self.stats.retries += 1
                await asyncio.sleep(delay)
        self.stats.failures += 1
        again = "" if retryable else " (not retried: the server refused the request itself)"
        raise RemoteRewardError(
            f"remote reward '{self.__name__}' at {self.url} failed after {attempt} attempt(s){again}; "
            f"last cause: {_describe(cause)}",
            url=self.url,
            attempts=attempt,
            cause=cause,
        ) from cause

    async def _attempt(self, body: bytes, count: int) -> list[float | None]:
        session, slots = self._get_session()
        async with slots:  # `timeout_s` starts once a connection is free: waiting for one is not a timeout
            async with session.post(self.url, data=body) as response:
                text = await response.text()
                if response.status >= 400:
                    raise RemoteRewardHTTPError(response.status, text, _retry_after_s(response.headers))
        try:
            payload = json.loads(text)
        except ValueError:
            raise RemoteRewardResponseError(f"the response is not JSON: {_excerpt(text)!r}") from None
        if self.protocol == "json":
            return _json_rewards(payload, count)
        return _vllm_rewards(payload, count, self.protocol, self.label_index)

    def _count(self, exc: BaseException) -> None:
        if isinstance(exc, TimeoutError):
            self.stats.timeouts += 1
        elif isinstance(exc, RemoteRewardHTTPError):
            self.stats.http_errors += 1
        elif isinstance(exc, RemoteRewardResponseError):
            self.stats.malformed += 1
        else:
            self.stats.connection_errors += 1

    def _backoff(self, attempt: int, exc: BaseException) -> float:
        delay = min(self.max_backoff_s, self.backoff_s * 2 ** (attempt - 1)) * random.uniform(0.5, 1.0)
        retry_after = getattr(exc, "retry_after_s", None)
        if retry_after is not None:
            delay = max(delay, min(retry_after, self.max_backoff_s))
        return delay


# ---- response checks -------------------------------------------------------------------------------------------


def _json_rewards(payload: Any, count: int) -> list[float | None]:
    """`{"rewards": [float | null, ...]}` with exactly `count` entries."""
    if not isinstance(payload, dict) or "rewards" not in payload:
        got = f"keys {sorted(payload)}" if isinstance(payload, dict) else type(payload).__name__
        raise RemoteRewardResponseError(f'expected {{"rewards": [...]}}; got {got}')
    rewards = payload["rewards"]
    if not isinstance(rewards, list):
        raise RemoteRewardResponseError(f'"rewards" is {type(rewards).__name__}; expected a list of {count} numbers')
    if len(rewards) != count:
        raise RemoteRewardResponseError(f"{len(rewards)} rewards for {count} completions")
    return [None if value is None else _number(value, f"rewards[{index}]") for index, value in enumerate(rewards)]


def _vllm_rewards(payload: Any, count: int, protocol: str, label_index: int) -> list[float | None]:
    """vLLM's `{"data": [{"index": i, "probs": [...]}, ...]}` (classify) or `{"data": [{"index": i, "data":
    [...]}, ...]}` (pooling): entry `label_index` of each result's vector, in `index` order."""
    data = payload.get("data") if isinstance(payload, dict) else None
    if not isinstance(data, list):
        got = f"keys {sorted(payload)}" if isinstance(payload, dict) else type(payload).__name__
        raise RemoteRewardResponseError(f'expected vLLM\'s {{"data": [...]}}; got {got}')
    if len(data) != count:
        raise RemoteRewardResponseError(f"{len(data)} results for {count} inputs")
    key = "probs" if protocol == "vllm-classify" else "data"
    by_index: dict[int, Any] = {}
    for item in data:
        if not isinstance(item, dict) or not isinstance(item.get("index"), int) or key not in item:
            raise RemoteRewardResponseError(f'each result needs "index" and "{key}"; got {_excerpt(repr(item))}')
        by_index[item["index"]] = item[key]
    if sorted(by_index) != list(range(count)):
        raise RemoteRewardResponseError(f"result indices {sorted(by_index)}; expected 0..{count - 1}")
    rewards = []
    for index in range(count):
        vector = by_index[index]
        if isinstance(vector, list) and vector and isinstance(vector[0], list):
            raise RemoteRewardResponseError(
                f"result {index} is one vector per token; serve a sequence-level (classification) pooler"
            )
        if not isinstance(vector, list) or label_index >= len(vector):
            raise RemoteRewardResponseError(
                f"result {index}: {key}={_excerpt(repr(vector))} has no entry label_index={label_index}"
            )
        rewards.append(_number(vector[label_index], f"result {index} {key}[{label_index}]"))
    return rewards


def _number(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise RemoteRewardResponseError(f"{where} is {value!r}; expected a finite number (or null: not scored)")
    return float(value)


# ---- helpers ---------------------------------------------------------------------------------------------------


def _as_messages(value: Any, role: str = "assistant") -> list[Any]:
    """A prompt or completion as chat messages (a plain string becomes one message of `role`)."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    return list(value)


def _retryable_status(status: int) -> bool:
    return status >= 500 or status in RETRY_STATUSES


def _retry_after_s(headers: Mapping[str, str]) -> float | None:
    try:
        value = float(headers.get("Retry-After", ""))
    except ValueError:
        return None
    return value if math.isfinite(value) and value >= 0 else None


def _describe(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return f"no answer within the request timeout ({type(exc).__name__})"
    if isinstance(exc, RemoteRewardHTTPError):
        return str(exc)
    if isinstance(exc, RemoteRewardResponseError):
        return f"malformed response: {exc}"
    return f"{type(exc).__name__}: {exc}"


def _excerpt(text: str) -> str:
    text = text.strip()
    return text if len(text) <= BODY_EXCERPT_CHARS else text[:BODY_EXCERPT_CHARS] + "..."


def _checked_url(url: Any) -> str:
    parsed = urllib.parse.urlsplit(url) if isinstance(url, str) else None
    if parsed is None or parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ValueError(
            f"RemoteReward: url={url!r} must be an http(s) URL of the endpoint, e.g. http://host:8000/classify"
        )
    return url


def _checked_protocol(protocol: str | None, url: str) -> str:
    if protocol is None:
        last = urllib.parse.urlsplit(url).path.rstrip("/").rsplit("/", 1)[-1]
        return {"classify": "vllm-classify", "pooling": "vllm-pooling"}.get(last, "json")
    if protocol not in PROTOCOLS:
        raise ValueError(f"RemoteReward: protocol={protocol!r}; expected one of {list(PROTOCOLS)}")
    return protocol


def _positive_int(field: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"RemoteReward: {field}={value!r} must be an int >= 1")
    return value


def _positive_float(field: str, value: Any, *, allow_zero: bool = False) -> float:
    ok = isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or value < 0 or (value == 0 and not allow_zero):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValueError(f"RemoteReward: {field}={value!r} must be a number {bound}")
    return float(value)
