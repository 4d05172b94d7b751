"""`EnginePool`: the generation engines one rollout loop sends requests to (GRPO rollouts and distillation students).

    pool.generate(prompt_ids, sampling)  the least-loaded engine (ties: round robin), transient errors retried;
                                         `affinity=key`: the engine the key's first request went to (a group)
    pool.retrying(what, call)            any engine call (a teacher's score) through the same retry path
    pool.observe(completed)              every `stats_interval_s`: the engines' gauges to the ConcurrencyController
    pool.cap                             the controller's concurrency cap (None until it has seen stats)
    pool.place(member, members)          one of `members` pools sharing the engines (the rollout actors): send to
                                         this member's home engines (below)
    pool.add_engines / remove_engines    elastic pools: a removed engine gets no new request, its requests in
                                         flight finish (`inflight_on`), `served` counts each engine's answers
    pool.answer_report()                 per engine: its name, requests in flight, seconds since it last answered
                                         (a request or a stats call): the driver names a frozen engine from it

Affinity: requests sharing a key (the GRPO loop passes the group id) go to one engine, chosen least-loaded by
the key's first request, while it stays in the pool and answers. A group's rollouts then reach the engine in one
submission (`actors.engine_channel` gathers an event-loop turn's requests per engine) where a spread group took one
per engine, their results come back in fewer yields, the prompt is prefilled on one engine, and a multi-turn
rollout's later turns find their prefix in that engine's cache. A key is forgotten when its request fails
(the retry chooses again) and after `AFFINITY_MEMORY` newer keys.

Home engines (`place`): where `members` rollout actors share `E` engines and one count divides the other, member
`m` sends only to its home engines: engine `m mod E` when E divides `members` (each engine serves `members / E`
actors), engines `m, m + members, ...` when `members` divides E (each actor its `E / members` engines); otherwise
(and unplaced) to every engine. An engine then sends its results to fewer rollout actors: one result stream yield a
step for each (`actors.engine_channel`) where every rollout actor had requests finishing on every engine, and each
yield is Ray's work in the process that runs the engine's host side. Balance comes from the even split, not from
load: engines of unequal speed are better served unplaced (`cluster.engine_placement="any"`). A home engine whose
request failed is passed over for `FAILED_ENGINE_COOLDOWN_S` (the others take the retries and new groups); when no
home engine is left, every engine is a candidate.

A stats call that does not answer within `stats_timeout_s` is given up (the cap stays): a frozen engine must not
freeze the loop's heartbeat, which would blame the loop instead of the engine.

Retries (docs/algorithms.md §2.5): `retryable_exceptions` (`EngineError`, `TimeoutError`, `ConnectionError`) are retried up to
`max_attempts` tries with the backoff 1, 2, 4, 8, 16, 16, ... s; each retry is logged, counted in
`counters["<first word of what>_retries"]` and reported as `rollout/vllm_retry_count`. A rejected request
(`RequestRejectedError`) and the last failure propagate. No torch, no ray: an engine is anything with
`generate(prompt_ids, sampling)` (and optionally `stats()`) returning a value or an awaitable.
"""

from __future__ import annotations

import asyncio
import collections
import inspect
import logging
import time
from collections.abc import Awaitable, Callable, Hashable, Sequence
from typing import Any, TypeVar

from rlasync.engine.base import EngineError, SamplingParams
from rlasync.records import MetricItem, TurnRecord
from rlasync.rollout.concurrency import ConcurrencyController

logger = logging.getLogger(__name__)
R = TypeVar("R")
RETRY_METRIC = "rollout/vllm_retry_count"
RETRYABLE_EXCEPTIONS: tuple[type[BaseException], ...] = (EngineError, TimeoutError, ConnectionError)
AFFINITY_MEMORY = 4096  # keys remembered (least recent forgotten first): far more than groups in flight
FAILED_ENGINE_COOLDOWN_S = 10.0  # an engine whose request failed is passed over this long when others are left


def retry_backoff_s(attempt: int) -> float:
    """Seconds to wait before retry number `attempt` (0-based): 1, 2, 4, 8, 16, 16, ... (docs/algorithms.md §2.5)."""
    return float(min(2 ** min(attempt, 4), 16))


async def resolve(value: Any) -> Any:
    """Await `value` if it is awaitable (a coroutine, a future, a Ray ObjectRef); else return it."""
    return await value if inspect.isawaitable(value) else value


class EnginePool:
    """Engine choice, retries with backoff and load statistics for one loop (see the module docstring).

    engines:          1..E engines
    max_concurrent:   the configured concurrency ceiling the controller starts from
    emit:             where retry counts and engine gauges go (`MetricsCallback`)
    counters:         the loop's counters (retries are counted there)
    stats_interval_s: seconds between stats polls; None never polls (the cap then stays None)
    stats_timeout_s:  a stats call unanswered within this is given up (logged; the cap stays)
    controller:       a ConcurrencyController to use; else one is built from the first stats
    """

    def __init__(
        self,
        engines: Any | Sequence[Any],
        *,
        max_concurrent: int,
        emit: Callable[[list[MetricItem]], Any],
        counters: collections.Counter[str] | None = None,
        max_attempts: int = 30,
        retryable_exceptions: tuple[type[BaseException], ...] = RETRYABLE_EXCEPTIONS,
        stats_interval_s: float | None = 5.0,
        stats_timeout_s: float = 10.0,
        controller: ConcurrencyController | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
    ) -> None:
        self.engines: list[Any] = list(engines) if isinstance(engines, Sequence) else [engines]
        if not self.engines:
            raise ValueError("an engine pool needs at least one engine")
        self.max_concurrent = max_concurrent
        self.max_attempts = max_attempts
        self.retryable_exceptions = retryable_exceptions
        self.stats_interval_s, self.stats_timeout_s = stats_interval_s, stats_timeout_s
        self.controller = controller
        self.counters = counters if counters is not None else collections.Counter()
        self._emit, self._clock, self._sleep = emit, clock, sleep
        self._load: dict[int, int] = {id(engine): 0 for engine in self.engines}  # id(engine) -> requests in flight
        self._served: dict[int, int] = {id(engine): 0 for engine in self.engines}  # id(engine) -> requests answered
        self._inflight: dict[int, tuple[Any, float]] = {}  # request number -> (engine, start time)
        self._joined: dict[int, float] = {id(engine): clock() for engine in self.engines}
        self._answered: dict[int, float] = {}  # id(engine) -> when it last answered a request or a stats call
        self._affinity: collections.OrderedDict[Hashable, Any] = collections.OrderedDict()  # key -> its engine
        self._placement: tuple[int, int] | None = None  # (member, members): `place`
        self._home: list[Any] | None = None  # the home engines, recomputed when the engines or placement change
        self._failed_at: dict[int, float] = {}  # id(engine) -> when a request on it last failed
        self._request_numbers = 0
        self._next = 0
        self._next_stats_at = -float("inf")

    @property
    def cap(self) -> int | None:
        """The controller's concurrency cap, or None while there is no controller."""
        return self.controller.cap if self.controller is not None else None

    @property
    def load(self) -> list[int]:
        """Requests in flight per engine."""
        return [self._load[id(engine)] for engine in self.engines]

    def add_engines(self, engines: Sequence[Any]) -> None:
        """New engines take requests from now on (elastic pools)."""
        for engine in engines:
            if any(engine is known for known in self.engines):
                continue
            self.engines.append(engine)
            self._load.setdefault(id(engine), 0)
            self._served.setdefault(id(engine), 0)
            self._joined.setdefault(id(engine), self._clock())
        self._home = None

    def remove_engines(self, engines: Sequence[Any]) -> None:
        """These engines get no new request (a retry picks another one); their requests in flight finish."""
        gone = {id(engine) for engine in engines}
        kept = [engine for engine in self.engines if id(engine) not in gone]
        if not kept:
            raise ValueError("an engine pool needs at least one engine: add the new engines before removing the last")
        self.engines[:] = kept
        self._next %= len(kept)
        self._home = None

    def place(self, member: int | None, members: int = 1) -> None:
        """Make this pool member `member` of `members` pools that share its engines (module docstring: home
        engines); None: every engine is a candidate."""
        if member is not None and not 0 <= member < members:
            raise ValueError(f"place(member={member}, members={members}): member must be in [0, members)")
        self._placement = None if member is None else (member, members)
        self._home = None

    @property
    def home(self) -> list[Any]:
        """The engines this pool sends new groups to while they are healthy (all of them unless placed evenly)."""
        if self._home is None:
            self._home = home_engines(self.engines, self._placement)
        return self._home

    def inflight_on(self, engine: Any) -> int:
        """Requests still unanswered by `engine` (also after it was removed)."""
        return self._load.get(id(engine), 0)

    def served(self, engine: Any) -> int:
        """Requests `engine` answered (successfully) since it joined this pool."""
        return self._served.get(id(engine), 0)

    async def generate(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        what: str = "generation",
        affinity: Hashable | None = None,
    ) -> TurnRecord:
        """One request to the least-loaded engine, or with `affinity` to the engine of the key's earlier requests
        (module docstring); transient errors retried (each retry chooses an engine again and resends the same
        request, seed included)."""
        return await self.retrying(what, lambda: self._on_engine(list(prompt_ids), sampling, affinity))

    async def retrying(self, what: str, call: Callable[[], Awaitable[R]]) -> R:
        """`call()` with `retryable_exceptions` retried (see the module docstring); `what` names it in logs and
        counters ("generation" -> `counters["generation_retries"]`)."""
        attempt = 0
        while True:
            try:
                return await call()
            except self.retryable_exceptions as exc:
                if attempt + 1 >= self.max_attempts:
                    raise
                delay = retry_backoff_s(attempt)
                logger.warning(
                    "%s request failed (%s: %s); retry %d in %.0f s", what, type(exc).__name__, exc, attempt + 1, delay
                )
                self.counters[f"{what.split()[0]}_retries"] += 1
                self._emit([(RETRY_METRIC, 1.0)])
                attempt += 1
                await self._sleep(delay)

    def _choose(self, affinity: Hashable | None) -> Any:
        """The key's engine while it is in the pool, else the least-loaded candidate (ties: round robin),
        remembered. Candidates: the home engines not cooling down after a failure, else every such engine, else all."""
        if affinity is not None:
            engine = self._affinity.get(affinity)
            if engine is not None and any(engine is known for known in self.engines):
                self._affinity.move_to_end(affinity)
                return engine
        candidates = self.home
        if self._failed_at:
            candidates = self._healthy(candidates) or self._healthy(self.engines) or self.engines
        count = len(candidates)
        start, self._next = self._next % count, self._next + 1
        index = min(((start + k) % count for k in range(count)), key=lambda i: self._load[id(candidates[i])])
        engine = candidates[index]
        if affinity is not None:
            self._affinity[affinity] = engine
            self._affinity.move_to_end(affinity)
            if len(self._affinity) > AFFINITY_MEMORY:
                self._affinity.popitem(last=False)
        return engine

    def _healthy(self, engines: list[Any]) -> list[Any]:
        """`engines` without those whose request failed within FAILED_ENGINE_COOLDOWN_S (forgotten after it)."""
        now = self._clock()
        for key in [key for key, at in self._failed_at.items() if now - at >= FAILED_ENGINE_COOLDOWN_S]:
            del self._failed_at[key]
        return [engine for engine in engines if id(engine) not in self._failed_at]

    async def _on_engine(
        self, prompt_ids: list[int], sampling: SamplingParams, affinity: Hashable | None
    ) -> TurnRecord:
        engine = self._choose(affinity)  # held: the pool may drop it (elastic) while this request runs
        self._load[id(engine)] += 1
        number, self._request_numbers = self._request_numbers, self._request_numbers + 1
        self._inflight[number] = (engine, self._clock())
        try:
            record = await resolve(engine.generate(prompt_ids, sampling))
            self._served[id(engine)] += 1
            self._answered[id(engine)] = self._clock()
            return record
        except self.retryable_exceptions:
            self._failed_at[id(engine)] = self._clock()  # passed over for a while (when others are left)
            if affinity is not None and self._affinity.get(affinity) is engine:
                del self._affinity[affinity]  # the retry (and the key's next requests) choose again
            raise
        finally:
            self._load[id(engine)] -= 1
            del self._inflight[number]

    def oldest_request(self) -> dict[str, float] | None:
        """`{"engine": index, "age_s": seconds}` of the oldest generation request still unanswered (None: none),
        for the rollout actor's health and the watchdog's reason."""
        if not self._inflight:
            return None
        engine, started = min(self._inflight.values(), key=lambda entry: entry[1])
        index = next((i for i, known in enumerate(self.engines) if known is engine), -1)  # -1: removed since
        return {"engine": index, "name": engine_name(engine, index), "age_s": self._clock() - started}

    def answer_report(self) -> list[dict[str, Any]]:
        """Per engine of the pool: `name`, `inflight` (requests unanswered), `answered_age_s` (seconds since it last
        answered a request or a stats call; None: never since it joined) and `joined_age_s`."""
        now = self._clock()
        return [
            {
                "name": engine_name(engine, index),
                "inflight": self._load.get(id(engine), 0),
                "answered_age_s": now - self._answered[id(engine)] if id(engine) in self._answered else None,
                "joined_age_s": now - self._joined.get(id(engine), now),
            }
            for index, engine in enumerate(self.engines)
        ]

    async def observe(self, completed: int) -> None:
        """Every `stats_interval_s`: feed the engines' gauges to the concurrency controller (built from the first
        stats); `completed` is the loop's count of finished tasks. Engines without `stats()` disable polling."""
        now = self._clock()
        if self.stats_interval_s is None or now < self._next_stats_at:
            return
        self._next_stats_at = now + self.stats_interval_s
        try:
            if not all(callable(getattr(engine, "stats", None)) for engine in self.engines):
                raise NotImplementedError("an engine has no stats()")
            stats = []
            for engine in self.engines:
                try:
                    stats.append(await asyncio.wait_for(resolve(engine.stats()), self.stats_timeout_s))
                except TimeoutError:
                    raise TimeoutError(
                        f"{engine_name(engine, len(stats))} did not answer a stats call within "
                        f"{self.stats_timeout_s:g} s"
                    ) from None
                self._answered[id(engine)] = self._clock()
        except NotImplementedError as exc:
            logger.warning("engines report no load stats (%s); concurrency stays at max_concurrent_rollouts", exc)
            self.stats_interval_s = None
            return
        except self.retryable_exceptions as exc:
            logger.warning("reading engine stats failed (%s: %s); keeping the concurrency cap", type(exc).__name__, exc)
            return
        if self.controller is None:
            self.controller = ConcurrencyController.from_stats(self.max_concurrent, stats)
        self._emit(self.controller.observe(stats, completed))


def home_engines(engines: list[Any], placement: tuple[int, int] | None) -> list[Any]:
    """Member `m` of `members`' home engines among `engines` (module docstring): `[engines[m % E]]` when E divides
    `members`, `engines[m % members::members]` when `members` divides E, else all of them."""
    count = len(engines)
    if placement is None or count == 0:
        return list(engines)
    member, members = placement
    if members % count == 0:
        return [engines[member % count]]
    if count % members == 0:
        return list(engines[member % members :: members])
    return list(engines)


def engine_name(engine: Any, index: int) -> str:
    """How an engine is named in reports: its `name` (an EngineChannel's: "generation actor 0"), else its index."""
    name = getattr(engine, "name", None)
    return name if isinstance(name, str) and name else f"engine {index}"


__all__ = ["RETRY_METRIC", "EnginePool", "engine_name", "home_engines", "resolve", "retry_backoff_s"]
