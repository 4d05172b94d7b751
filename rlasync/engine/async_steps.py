"""Asynchronous scheduling of the built-in engine: step N+1 is planned and launched before step N's results are read.

    schedule N ─► launch N ─► placeholders ─► schedule N+1 ─► launch N+1 (ids of N fed back on the device)
                                                   ─► collect N (wait, read ids) ─► append / finish ─► schedule N+2 ...

The scheduler plans step N+1 assuming every request that samples in step N produced one token: `Request.add_pending`
holds its place with a placeholder, and step N+1's input id for it is copied on the device from step N's sampled ids
(`ChunkInput.feedback_row`). A request whose step-N token is its last by length gets no placeholder (nothing to
compute for it in N+1); one that stops at step N (a stop id, known only once N is read) is finished then: its step
N+1 token is discarded, its placeholders dropped and its blocks and slot freed. Since every token is sampled from
the same logits with the same (seed, step) as in a synchronous run, both give the same tokens and log-probs.

Steps run back to back while the model lock is held; the loop drains (reads the step in flight and launches none)
when the engine is paused, when someone waits for the lock (`score`, `pause`, `load_weights`), or before a step with
a repetition penalty (its seen-token mask needs the ids on the host), so a paused engine never has a step in flight.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rlasync.engine.base import EngineError
from rlasync.engine.request import Request
from rlasync.engine.runner import ChunkInput, LaunchedStep
from rlasync.engine.scheduler import SchedulerOutput

if TYPE_CHECKING:
    from rlasync.engine.torch_engine import TorchEngine

logger = logging.getLogger(__name__)


class _EmptyStep(RuntimeError):
    """The scheduler planned nothing although requests wait and nothing is in flight (a bug: fails every request)."""


@dataclass(slots=True)
class InFlight:
    output: SchedulerOutput
    step: LaunchedStep
    rows: dict[Request, int] = field(default_factory=dict)  # request -> its row in the step's sampled ids


def _needs_host_ids(engine: TorchEngine) -> bool:
    return any(r.params.repetition_penalty != 1.0 for r in engine._scheduler.running)


def _inputs(engine: TorchEngine, output: SchedulerOutput, previous: InFlight | None) -> list[ChunkInput]:
    inputs = []
    for chunk in output.chunks:
        chunk_input = engine._chunk_input(chunk)
        request = chunk.request
        if request.num_pending:
            if request.num_pending != 1 or chunk.end != request.num_tokens or previous is None:
                raise RuntimeError(
                    f"request {request.request_id}: a step covers {request.num_pending} token(s) still in flight "
                    f"(chunk {chunk.start}:{chunk.end} of {request.num_tokens})"
                )
            chunk_input = ChunkInput(
                chunk_input.token_ids,
                chunk_input.start,
                chunk_input.block_ids,
                chunk_input.sample,
                previous.rows[request],
            )
        inputs.append(chunk_input)
    return inputs


async def _launch(engine: TorchEngine, output: SchedulerOutput, previous: InFlight | None) -> InFlight:
    inputs = _inputs(engine, output, previous)
    step = await asyncio.to_thread(engine._runner.launch, inputs, previous.step if previous else None)
    launched = InFlight(output, step)
    row = 0
    for chunk in output.chunks:
        if not chunk.samples:
            continue
        request = chunk.request
        launched.rows[request] = row
        row += 1
        if request.num_output_tokens + 1 < request.max_output_tokens:  # not its last token by length
            request.add_pending()
    engine._scheduler.complete(output)
    engine._num_steps += 1
    return launched


async def run_overlapped(engine: TorchEngine) -> None:
    """Run steps with the model lock held, each launched before the previous one is read, until none is left to
    launch and the last is read (module docstring). A failed step fails the requests of the steps in flight."""
    scheduler = engine._scheduler
    inflight: InFlight | None = None
    launched: InFlight | None = None
    output = SchedulerOutput()
    try:
        while True:
            launched, output = None, SchedulerOutput()
            drain = scheduler.paused or engine._lock_waiters > 0 or (inflight is not None and _needs_host_ids(engine))
            if not drain:
                output = scheduler.schedule()
                if output.chunks:
                    launched = await _launch(engine, output, inflight)
                elif inflight is None:
                    raise _EmptyStep(
                        f"scheduler made an empty step with {scheduler.num_waiting} waiting and "
                        f"{scheduler.num_running} running requests"
                    )
            if inflight is not None:
                sampled = await asyncio.to_thread(engine._runner.collect, inflight.step)
                for chunk, token in zip(inflight.output.chunks, sampled):
                    engine._append(chunk.request, token)
            inflight = launched
            if inflight is None:
                return
            await asyncio.sleep(0)  # let new requests in
    except (asyncio.CancelledError, _EmptyStep):
        raise
    except Exception as exc:
        _fail_steps(engine, exc, inflight, launched, output)


def _fail_steps(engine: TorchEngine, exc: Exception, *steps: InFlight | SchedulerOutput | None) -> None:
    logger.exception("TorchEngine step failed")
    engine._scheduler.allocator.clear_cache()  # blocks registered for these steps may hold no KV
    error = EngineError(f"TorchEngine step failed: {exc!r}")
    error.__cause__ = exc
    for step in steps:
        if step is None:
            continue
        for chunk in (step.output if isinstance(step, InFlight) else step).chunks:
            if not chunk.request.is_finished:
                engine._fail(chunk.request, error)
