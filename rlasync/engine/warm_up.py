"""What the built-in engine builds at start-up rather than in its first steps, and the record of launches that build
anyway.

A kernel that is compiled the first time a step needs it (inductor's sampler variants, a Triton kernel for a step
shape the CUDA graphs' capture never launched, an eager step's kernels) makes that step's launch take tenths of a
second, and the launch holds the engine's launch lock, which a weight sync waits for: on a fresh machine the sums
run's first syncs after the start waited 0.26-0.72 s for the launch lock (steady syncs: 15-30 ms). So a generation
actor, while the cluster starts (beside the learners' set-up, before it freezes its heap), calls `warm_up`:

  * the compiled sampler samples once for each of the run's `SamplingParams` on dummy logits (its variants compile);
  * on CUDA, the engine's `warm_steps`: a dummy batch shaped as GRPO's through the real steps (`dummy_jobs`: 1.25 x
    `max_num_seqs` requests, so requests wait and are admitted as others finish: mixed steps, then decode steps of
    many batch sizes; groups of 8 sharing a random prompt; 1-16 new tokens each, EOS ignored), run on its own event
    loop in a worker thread (`run_jobs`: the caller may be inside one); the engine then drops the prefix cache it
    filled and resets its `LaunchRecord`.

A launch of `SLOW_LAUNCH_S` or more afterwards is logged with the step's shape (`LaunchRecord.note`, the first
`SLOW_LAUNCHES_LOGGED`), and the engine's stats carry the longest (`rollout/engine_launch_max_s`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any

import torch

from rlasync.engine.base import SamplingParams
from rlasync.engine.runner import SampleSpec

logger = logging.getLogger("rlasync.engine.torch_engine")  # the engine's own log

SLOW_LAUNCH_S = 0.1
SLOW_LAUNCHES_LOGGED = 20


class LaunchRecord:
    """An engine's step launches: the longest so far (`max_s`), how many took `SLOW_LAUNCH_S` or more (`slow`);
    while `warming()` (the start-up's dummy steps) slow ones are expected: neither logged nor kept."""

    def __init__(self) -> None:
        self.max_s = 0.0
        self.slow = 0
        self._warming = False

    @contextlib.contextmanager
    def warming(self) -> Iterator[None]:
        self._warming = True
        try:
            yield
        finally:
            self._warming = False
            self.max_s, self.slow = 0.0, 0

    def note(self, seconds: float, inputs: Sequence[Any], eager: bool, step: int) -> None:
        """Record step `step`'s launch (its chunk inputs; `eager`: no CUDA graph held it); log a slow one."""
        if self._warming:
            return
        self.max_s = max(self.max_s, seconds)
        if seconds < SLOW_LAUNCH_S:
            return
        self.slow += 1
        if self.slow > SLOW_LAUNCHES_LOGGED:
            return
        lengths = [len(chunk.token_ids) for chunk in inputs]
        kind = "eager" if eager else ("decode" if max(lengths) == 1 else "mixed")
        logger.warning(
            "TorchEngine: step %d took %.0f ms to launch (%s step: %d requests, %d tokens, longest chunk %d, "
            "%d sampling): on CUDA most likely a kernel built for a shape or variant the start-up did not warm (on "
            "the CPU a launch includes the step's compute); a weight sync waits for such a launch",
            step,
            seconds * 1e3,
            kind,
            len(inputs),
            sum(lengths),
            max(lengths),
            sum(chunk.sample is not None for chunk in inputs),
        )


def warm_up(engine: Any, sampling: Sequence[SamplingParams]) -> float:
    """The compiled sampler's variants for `sampling`, then on CUDA `engine.warm_steps` (a failure there is logged:
    the real steps build instead). The seconds it took; 0 on the CPU without the compiled sampler (nothing to build)."""
    started = time.perf_counter()
    runner, device = engine.runner, engine.device
    if runner.compiled_sampler:
        with torch.inference_mode():
            logits = torch.zeros(2, engine.vocab_size, device=device)
            for params in sampling:
                seen = [0] if params.repetition_penalty != 1.0 else None
                specs = [SampleSpec(params, seed=row, step=0, seen_ids=seen) for row in range(2)]
                runner.sample_tensors(logits, specs)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    if device.type == "cuda" and sampling:
        try:
            engine.warm_steps(sampling)
        except Exception as exc:  # the dummy run's own trouble: the real steps report theirs as they come
            logger.warning("TorchEngine: the start-up's dummy steps failed (%r); the first steps build instead", exc)
    elif not runner.compiled_sampler:
        return 0.0
    return time.perf_counter() - started


def dummy_jobs(
    sampling: Sequence[SamplingParams],
    count: int,
    vocab_size: int,
    max_model_len: int,
    prompt_tokens: tuple[int, int] = (8, 64),
    max_tokens: int = 16,
    group: int = 8,
    seed: int = 0,
) -> list[tuple[list[int], SamplingParams]]:
    """`count` (prompt ids, params) requests: random prompts of `prompt_tokens` tokens in groups of `group`, each
    request with 1 to `max_tokens` new tokens (EOS ignored, seeded), sampled as `sampling` (cycled)."""
    rng = random.Random(seed)
    low, high = prompt_tokens
    high = max(1, min(high, max_model_len - max_tokens))
    jobs: list[tuple[list[int], SamplingParams]] = []
    while len(jobs) < count:
        prompt = [rng.randrange(vocab_size) for _ in range(rng.randint(min(low, high), high))]
        for _ in range(min(group, count - len(jobs))):
            params = sampling[len(jobs) % len(sampling)]
            new = max(1, min(rng.randint(1, max_tokens), max_model_len - len(prompt)))
            jobs.append((prompt, replace(params, max_tokens=new, ignore_eos=True, seed=rng.getrandbits(63))))
    return jobs


def run_jobs(generate: Callable[..., Any], jobs: Sequence[tuple[list[int], SamplingParams]]) -> float:
    """`generate(prompt, params)` for every job at once, on a new event loop in a worker thread (the caller may be
    inside a running loop); re-raises the first failure here. The seconds it took."""
    failure: list[BaseException] = []

    async def run() -> None:
        await asyncio.gather(*(generate(prompt, params) for prompt, params in jobs))

    def in_thread() -> None:
        try:
            asyncio.run(run())
        except BaseException as exc:  # noqa: BLE001 - raised in the caller's thread below
            failure.append(exc)

    started = time.perf_counter()
    worker = threading.Thread(target=in_thread, name="TorchEngine warm steps")
    worker.start()
    worker.join()
    if failure:
        raise failure[0]
    return time.perf_counter() - started
