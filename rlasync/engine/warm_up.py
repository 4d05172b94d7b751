"""What the built-in engine builds at start-up rather than in its first steps, and the record of launches that build
anyway.

A kernel that is compiled the first time a step needs it (inductor's sampler variants, a Triton kernel for a step
shape the CUDA graphs' capture never launched, an eager step's kernels) makes that step's launch take tenths of a
second, and the launch holds the engine's launch lock, which a weight sync waits for: on a fresh machine the sums
run's first syncs after the start waited 0.26-0.72 s for such launches (steady syncs: 15-30 ms). So a generation
actor, while the cluster starts (beside the learners' set-up, before it freezes its heap), calls `warm_up`:

  * the compiled sampler samples once for each of the run's `SamplingParams` on dummy logits (its variants compile);
  * on CUDA, `warm_steps`: a dummy batch shaped as GRPO's through the real steps (1.25 x `max_num_seqs` requests, so
    requests wait and are admitted as others finish: mixed steps, then decode steps of many batch sizes; groups of 8
    sharing a random prompt; 1-16 new tokens each, EOS ignored). It runs on its own event loop in a worker thread (the
    caller may be inside one), then drops the prefix cache it filled and resets the launch record.

A launch of `SLOW_LAUNCH_S` or more afterwards is logged with the step's shape (`note_launch`, the first
`SLOW_LAUNCHES_LOGGED`), and the engine's stats carry the longest (`rollout/engine_launch_max_s`).
"""

from __future__ import annotations

import asyncio
import logging
import random
import threading
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from rlasync.engine.base import SamplingParams
from rlasync.engine.runner import SampleSpec

if TYPE_CHECKING:
    from rlasync.engine.torch_engine import TorchEngine

logger = logging.getLogger("rlasync.engine.torch_engine")  # the engine's own log

SLOW_LAUNCH_S = 0.1
SLOW_LAUNCHES_LOGGED = 20


def warm_up(engine: TorchEngine, sampling: Sequence[SamplingParams]) -> float:
    """The compiled sampler's variants for `sampling`, then on CUDA `warm_steps` (a failure there is logged: the real
    steps build instead). The seconds it took; 0 on the CPU without the compiled sampler (nothing to build)."""
    started = time.perf_counter()
    runner = engine.runner
    if runner.compiled_sampler:
        with torch.inference_mode():
            logits = torch.zeros(2, engine.vocab_size, device=engine.device)
            for params in sampling:
                seen = [0] if params.repetition_penalty != 1.0 else None
                specs = [SampleSpec(params, seed=row, step=0, seen_ids=seen) for row in range(2)]
                runner.sample_tensors(logits, specs)
        if engine.device.type == "cuda":
            torch.cuda.synchronize(engine.device)
    if engine.device.type == "cuda" and sampling:
        try:
            warm_steps(engine, sampling)
        except Exception as exc:  # the dummy run's own trouble: the real steps report theirs as they come
            logger.warning("TorchEngine: the start-up's dummy steps failed (%r); the first steps build instead", exc)
    elif not runner.compiled_sampler:
        return 0.0
    return time.perf_counter() - started


def warm_steps(
    engine: TorchEngine,
    sampling: Sequence[SamplingParams],
    num_requests: int | None = None,
    prompt_tokens: tuple[int, int] = (8, 64),
    max_tokens: int = 16,
    group: int = 8,
    seed: int = 0,
) -> float:
    """The dummy run (module docstring): `num_requests` (default 1.25 x `max_num_seqs`) with random prompts of
    `prompt_tokens` tokens in groups of `group`, 1 to `max_tokens` new tokens each, sampled as `sampling` (cycled).
    The seconds it took; 0 when the engine is paused or already serving (nothing is run then)."""
    scheduler = engine._scheduler
    if scheduler.paused or scheduler.has_work or not sampling:
        return 0.0
    rng = random.Random(seed)
    count = num_requests if num_requests is not None else scheduler.max_num_seqs * 5 // 4
    low, high = prompt_tokens
    high = max(1, min(high, engine.max_model_len - max_tokens))
    jobs: list[tuple[list[int], SamplingParams]] = []
    while len(jobs) < count:
        prompt = [rng.randrange(engine.vocab_size) for _ in range(rng.randint(min(low, high), high))]
        for _ in range(min(group, count - len(jobs))):
            params = sampling[len(jobs) % len(sampling)]
            new = max(1, min(rng.randint(1, max_tokens), engine.max_model_len - len(prompt)))
            jobs.append((prompt, replace(params, max_tokens=new, ignore_eos=True, seed=rng.getrandbits(63))))

    async def run() -> None:
        await asyncio.gather(*(engine.generate(prompt, params) for prompt, params in jobs))

    failure: list[BaseException] = []

    def in_thread() -> None:
        try:
            asyncio.run(run())
        except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread below
            failure.append(exc)

    started = time.perf_counter()
    engine._warming = True
    try:
        worker = threading.Thread(target=in_thread, name="TorchEngine warm steps")
        worker.start()
        worker.join()
    finally:
        engine._warming = False
        scheduler.allocator.clear_cache()  # the dummy prompts' blocks: no later request shares them
        engine._launch_max_s, engine._slow_launches = 0.0, 0
    if failure:
        raise failure[0]
    return time.perf_counter() - started


def note_launch(engine: TorchEngine, seconds: float, inputs: Sequence[Any], eager: bool) -> None:
    """Record a step launch's time in `engine`; log a slow one (a kernel built mid-run) with the step's shape."""
    engine._launch_max_s = max(engine._launch_max_s, seconds)
    if seconds < SLOW_LAUNCH_S or engine._warming:
        return
    engine._slow_launches += 1
    if engine._slow_launches > SLOW_LAUNCHES_LOGGED:
        return
    lengths = [len(chunk.token_ids) for chunk in inputs]
    kind = "eager" if eager else ("decode" if max(lengths) == 1 else "mixed")
    logger.warning(
        "TorchEngine: step %d took %.0f ms to launch (%s step: %d requests, %d tokens, longest chunk %d, %d sampling):"
        " a kernel built for a shape or variant the start-up did not warm; a weight sync waits for such a launch",
        engine._num_steps + 1,
        seconds * 1e3,
        kind,
        len(inputs),
        sum(lengths),
        max(lengths),
        sum(chunk.sample is not None for chunk in inputs),
    )
