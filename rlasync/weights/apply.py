"""The engine side of a weight sync: load a received stream, pausing the engine only for the copy.

    phases = await load_while_pausing(engine, group.receive(manifest), staging_bytes)

The stream's first `staging_bytes` are received (in a worker thread: the waits block) while the engine keeps
generating and, meanwhile, pauses (its step in flight finishes); once paused, the weights are copied in as the rest
of the stream arrives, and the engine resumes. The received buffers themselves are the staging: no extra copy.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any


def take_bytes(stream: Iterator[tuple[str, Any]], limit: int) -> list[tuple[str, Any]]:
    """The stream's first entries, up to `limit` bytes (none when `limit` is 0); the rest stays in the stream."""
    taken: list[tuple[str, Any]] = []
    total = 0
    while total < limit:
        entry = next(stream, None)
        if entry is None:
            break
        taken.append(entry)
        total += entry[1].numel() * entry[1].element_size()
    return taken


async def load_while_pausing(
    engine: Any,
    stream: Iterator[tuple[str, Any]],
    staging_bytes: int,
    *,
    load: Any = None,
    pausing: asyncio.Future | None = None,
) -> dict[str, float]:
    """Receive up to `staging_bytes` of `stream` while `engine` pauses, then load everything and resume; returns
    the phases' seconds: `pause_s` (until paused), `load_s` (paused until loaded), `resume_s`, `total_s`, and
    `engine_load_s` where the engine reports its own part of `load_s` (`engine_s`: vLLM's workers; the rest is the
    call's round trip).

    `load`: what `engine.load_weights` gets instead of the stream (an IPC sync's `MappedWeights`, on which an engine
    may replay a cached copy plan). `pausing`: a pause already under way (`begin_pause`, started before the ticket
    arrived); `pause_s` then counts from its start. The engine is resumed whatever happens; an error of the stream
    (a stalled sender) propagates."""
    start = time.perf_counter()
    if pausing is None:
        pausing = begin_pause(engine)
    start = min(start, getattr(pausing, "started_at", start))
    try:
        staged = await asyncio.to_thread(take_bytes, stream, staging_bytes) if staging_bytes > 0 else []
        await pausing
        paused = getattr(pausing, "paused_at", None) or time.perf_counter()
        result = await engine.load_weights(itertools.chain(staged, stream) if load is None else load)
        loaded = time.perf_counter()
    finally:
        if not pausing.done():
            pausing.cancel()
        await asyncio.gather(pausing, return_exceptions=True)
        await engine.resume()
    end = time.perf_counter()
    phases = {"pause_s": paused - start, "load_s": loaded - paused, "resume_s": end - loaded, "total_s": end - start}
    if isinstance(result, dict) and "engine_s" in result:  # an engine in another process (vLLM's workers)
        phases["engine_load_s"] = float(result["engine_s"])
    return phases


async def load_between_steps(
    engine: Any, load: Any, *, inline: bool = False, done_event: Any = None
) -> dict[str, float]:
    """Load `load` into an engine that `loads_between_steps` (the built-in engine): no pause; its copies queue
    behind the steps already launched. The phases as `load_while_pausing` names them, summing to `total_s`:
    `pause_s` until the copies began (nothing pauses: the hand-over to a worker thread and the wait for the engine's
    launch lock, `lock_wait_s`), `load_s` the copies until done, `resume_s` 0. `inline`: block this thread instead
    (a caller on an event loop of its own, as the generation actor's sync call: no worker-thread hand-over, which
    costs a GIL hand-off each way while the engine's loop is busy). `done_event` (an IPC ticket's event for this
    engine, CUDA): recorded behind the copies instead of waiting for them, `load_s` then ends once they are queued."""
    start = time.perf_counter()
    kwargs = {"done_event": done_event} if done_event is not None else {}
    if inline:
        result = engine.load_between_steps(load, **kwargs)
    else:
        result = await asyncio.to_thread(engine.load_between_steps, load, **kwargs)
    total = time.perf_counter() - start
    return {
        "pause_s": max(total - result["load_s"], 0.0),
        "load_s": result["load_s"],
        "resume_s": 0.0,
        "total_s": total,
        "lock_wait_s": result["wait_s"],
    }


def begin_pause(engine: Any) -> asyncio.Task:
    """Start pausing `engine` (a task; its `started_at` / `paused_at` are perf_counter times)."""

    async def pause() -> None:
        await engine.pause()
        task.paused_at = time.perf_counter()  # type: ignore[attr-defined]

    task = asyncio.ensure_future(pause())
    task.started_at, task.paused_at = time.perf_counter(), None  # type: ignore[attr-defined]
    return task


@contextlib.asynccontextmanager
async def paused_for_update(engine: Any) -> AsyncIterator[None]:
    """Pause `engine` for a weight update (the engine-native receiver and the vLLM engines' own weight calls) unless it already is, and resume it afterwards (also on error) only if it
    was paused here; `engine` has `is_paused`, `pause()` and `resume()`."""
    paused_here = not engine.is_paused
    if paused_here:
        await engine.pause()
    try:
        yield
    finally:
        if paused_here:
            await engine.resume()
