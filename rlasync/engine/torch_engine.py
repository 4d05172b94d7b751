"""`TorchEngine`: the built-in generation engine (continuous batching over a paged KV cache, CPU and GPU).

    generate() ──► Request ──► Scheduler.waiting
                                   │  engine loop (one asyncio task, started on first use):
                                   │    wait for work ─► [model lock] schedule ─► runner step in a worker thread
                                   │    (decoder on the flat batch, LM head on sampled rows, sampler)
                                   │    ─► append tokens, check stops ─► resolve finished requests' futures
                                   ▼
                              TurnRecord

Requests join and leave between steps. Every forward (a step, `score`) holds the model lock, and `pause()` takes it
after setting the paused flag, so when `pause()` returns the step in flight has finished and none starts until
`resume()`. A step that raises fails the requests it held with `EngineError` (never a silent hang); the loop goes on.

Weights and in-flight KV: `load_weights` (paused only) copies in place, then by default
(`kv_on_weight_update="recompute"`) preempts every running request: its KV was computed by the old weights, so it
recomputes its prompt and its tokens so far under the new ones when resumed. Tokens already sampled keep the
log-probs they were sampled with; every later token is sampled from, and reports, the new policy on a consistent
context. This is what docs/algorithms.md §2.3.2 describes for vLLM ("each weight sync preempts all running requests") and it is
counted in `num_preemptions`. `"keep"` (vLLM's keep mode) keeps the stale KV: no recomputation, but later tokens
are conditioned on old-policy keys/values that the trainer will never reproduce.

Asynchronous scheduling (`async_scheduling`): step N+1 is planned and launched before step N's results are read.

    schedule N ─► launch N ─► placeholders ─► schedule N+1 ─► launch N+1 (ids of N fed back on the device)
                                                   ─► collect N (wait, read ids) ─► append / finish ─► schedule N+2 ...

The scheduler plans step N+1 assuming every request that samples in step N produced one token: `Request.add_pending`
holds its place with a placeholder, and step N+1's input id for it is copied on the device from step N's sampled ids
(`ChunkInput.feedback_row`). A request whose step-N token is its last by length gets no placeholder (nothing to
compute for it in N+1); one that stops at step N (a stop id, known only once N is read) is finished then: its step
N+1 token is discarded, its placeholders dropped and its blocks and slot freed. Since every token is sampled from
the same logits with the same (seed, step) as in a synchronous run, both give the same tokens and log-probs. Steps
run back to back while the model lock is held; the loop drains (reads the step in flight and launches none) when
the engine is paused, when someone waits for the lock (`score`, `pause`, `load_weights`), or before a step with a
repetition penalty (its seen-token mask needs the ids on the host), so a paused engine never has a step in flight.

Loads between steps (`load_between_steps`, the weight sync's path over CUDA IPC): no pause. A lock guards the
launch of every step (and a synchronous step's whole run); the load takes it, enqueues its copies on the stream the
steps run on, right behind the step(s) already launched, and counts a new weights epoch, then waits (without the
lock) until its copies are done. The steps launched before it read the old weights (stream order), every later one
the new. The loop, under the same lock before planning a step, sees the epoch change: it reads the steps in flight,
then (`kv_on_weight_update="recompute"`) preempts every running request and clears the prefix cache, as a paused
load does. So the load waits for the launch in progress (host time) and the GPU's work already queued, not for the
loop to reach a drained state (reading both steps in flight and recording their tokens: host time that grows with the
running requests).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import secrets
import threading
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from rlasync.engine.base import EngineError, EngineStats, RequestRejectedError, SamplingParams, ScoreResult
from rlasync.engine.cuda_graphs import decode_batch_sizes
from rlasync.engine.engine_build import build_model, build_pool, choose_engine_layout, eos_ids
from rlasync.engine.kv_cache import BlockAllocator
from rlasync.engine.mixed_graphs import mixed_token_counts
from rlasync.engine.request import Request
from rlasync.engine.runner import (
    ChunkInput,
    LaunchedStep,
    ModelRunner,
    SampledToken,
    SampleSpec,
    check_engine_support,
)
from rlasync.engine.scheduler import Scheduler, SchedulerOutput
from rlasync.engine.warm_up import LaunchRecord, dummy_jobs, run_jobs, warm_up
from rlasync.engine.weights import PlannedLoader, load_sync
from rlasync.records import TurnRecord
from rlasync.weights.adapter import AdapterMerger

logger = logging.getLogger(__name__)

DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048  # CPU; on CUDA 8192 (fewer, fuller prefill steps, as vLLM's throughput default)
DEFAULT_CUDA_MAX_NUM_BATCHED_TOKENS = 8192
FINISH_ABORT = "abort"
FINISH_ERROR = "error"


class _EmptyStep(RuntimeError):
    """The scheduler planned nothing although requests wait and nothing is in flight (a bug: fails every request)."""

    def __init__(self, scheduler: Scheduler) -> None:
        super().__init__(
            f"scheduler made an empty step with {scheduler.num_waiting} waiting and {scheduler.num_running} running "
            "requests"
        )


@dataclass(slots=True)
class InFlight:
    """A launched step of the overlapped loop whose sampled ids are not read yet."""

    output: SchedulerOutput
    step: LaunchedStep
    rows: dict[Request, int] = field(default_factory=dict)  # request -> its row in the step's sampled ids


class TorchEngine:
    """The built-in engine (`rlasync.engine.base.Engine`) for Llama, Qwen2 and Qwen3 causal LMs.

    model                  a model path / hub id, or an already-built transformers `PreTrainedModel`
    dtype                  weights and KV cache dtype; default bfloat16 on CUDA, float32 on CPU (a built model keeps
                           its own dtype unless one is given)
    device                 default "cuda" when available, else "cpu"
    max_model_len          prompt + output limit per request; default the model's max_position_embeddings
    kv_cache_tokens        KV budget in tokens (rounded up to whole blocks); default: `gpu_memory_utilization` of
                           the GPU's memory minus what is already used, or 1 GiB of KV on CPU, at most
                           max_num_seqs * max_model_len; never below max_model_len (a lone request always fits)
    block_size             tokens per KV block; default 16, or on CUDA the first of 16, 256 that the paged
                           FlashAttention kernel accepts
    max_num_seqs           most requests running at once
    max_num_batched_tokens token budget of one step (longer prefills are chunked); default 8192 on CUDA, 2048 on CPU;
                           with CUDA graphs of mixed steps, a step that has running requests is held to the largest
                           graph (2048 tokens by default) so that it replays one (`Scheduler.graphed_step_tokens`)
    eos_token_ids          default the generation config's eos_token_id (or the model config's)
    kv_on_weight_update    "recompute" (default) or "keep": see the module docstring
    attention_backend      "auto" (on CUDA: FlashAttention varlen over the paged pool in 16-bit when a probe of it
                           passes, else our Triton kernel when its probe passes, else "reference": gather + SDPA,
                           the CPU path; a fallback is logged), "varlen", "triton" or "reference"
    enable_prefix_caching  share the KV of full prompt blocks between requests with the same prompt prefix (a GRPO
                           group prefills its prompt once); cleared by every weight load
    cuda_graphs            capture decode steps as CUDA graphs, padded to a few batch sizes (triton and varlen backends)
    mixed_cuda_graphs      with `cuda_graphs`, capture mixed steps (prefill chunks with decodes) too, padded to a few
                           token counts up to 1024 (`mixed_graphs.py`): in RL rollouts most steps hold a prefill
    async_scheduling       plan and launch step N+1 while step N runs, its sampled ids fed back on the device
                           (module docstring; same tokens and log-probs); None (default): on for CUDA, off on CPU
                           (where it overlaps nothing). On one H200 it gives 1.5x new tokens/s at 256 concurrent
    compiled_sampler       sample through the torch.compile'd sampler (`sampler_compiled.py`: same tokens and
                           log-probs); None (default): on for CUDA (1.17x new tokens/s at 256 concurrent on one
                           H200, 1.45x with 8 log-probs), off on CPU; a failed compile falls back to eager, logged
    launch_on_loop         with `async_scheduling`, launch each step on the event loop rather than in a worker thread
                           (the step's collect, which waits for the GPU, stays in the thread): one thread handoff of
                           the GIL fewer per step, the loop held for the launch's host work (a few ms); off by
                           default (an A/B for a GIL-bound GenerationActor: `--set
                           cluster.engine_kwargs.launch_on_loop=true`)
    compiled_layers        compile each decoder layer with inductor before the CUDA graphs capture them (fused
                           norms, rotary and activations: `runner.compile_engine_layers`); off by default (its A/B
                           against vLLM is `bench/engine_vs_vllm.py --compiled-layers`); a failed compile falls back
                           to eager layers, logged
    fused_layers           paged steps through `fused_decoder.FusedDecoder`: each layer's norms, residual adds,
                           rotary embedding, q/k norms, KV writes and SiLU in four Triton kernels around the same
                           projections (`triton_layers`); None (default): on for CUDA where the model allows it and
                           `compiled_layers` is off, after a start-up check against transformers' layers (a
                           disagreement turns it off, logged)
    loads_between_steps    a weight sync over CUDA IPC loads between steps without a pause (`load_between_steps`);
                           False: the sync pauses the engine first, as every other transport does (an A/B)
    """

    def __init__(
        self,
        model: str | torch.nn.Module,
        *,
        dtype: str | torch.dtype | None = None,
        device: str | torch.device | None = None,
        max_model_len: int | None = None,
        kv_cache_tokens: int | None = None,
        block_size: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int | None = None,
        eos_token_ids: Sequence[int] | int | None = None,
        gpu_memory_utilization: float = 0.9,
        kv_on_weight_update: Literal["recompute", "keep"] = "recompute",
        attention_backend: Literal["auto", "varlen", "triton", "reference"] = "auto",
        cuda_graphs: bool = True,
        enable_prefix_caching: bool = True,
        mixed_cuda_graphs: bool = True,
        async_scheduling: bool | None = None,
        compiled_sampler: bool | None = None,
        compiled_layers: bool = False,
        launch_on_loop: bool = False,
        fused_layers: bool | None = None,
        loads_between_steps: bool = True,
    ) -> None:
        if kv_on_weight_update not in ("recompute", "keep"):
            raise ValueError(f"kv_on_weight_update={kv_on_weight_update!r}: use 'recompute' or 'keep'")
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if self.device.type == "cuda" and self.device.index is None:  # pin "cuda" to the GPU current now
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.model = build_model(model, dtype, self.device)
        self._adapter = AdapterMerger()  # LoRA syncs: W = W0 + s*B@A over the base weights kept at the first one
        self._loader = PlannedLoader()  # IPC syncs: the first one's copies recorded, then replayed in one batch
        check_engine_support(self.model)
        config = self.model.config
        self.max_model_len = int(max_model_len or config.max_position_embeddings)
        self.eos_token_ids = eos_ids(self.model, eos_token_ids)
        self.kv_on_weight_update = kv_on_weight_update
        backend, block_size = choose_engine_layout(self.model, self.device, attention_backend, block_size)
        pool = build_pool(
            self.model,
            self.device,
            block_size,
            self.max_model_len,
            kv_cache_tokens,
            gpu_memory_utilization,
            max_num_seqs,
        )
        self.block_size = block_size
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        cuda = self.device.type == "cuda"
        self.async_scheduling = cuda if async_scheduling is None else bool(async_scheduling)
        self.launch_on_loop = bool(launch_on_loop)
        self.loads_between_steps = bool(loads_between_steps)  # an IPC weight sync loads between steps, no pause
        self._lock_waiters = 0  # callers waiting for the model lock: an overlapped run of steps drains for them
        self._steps_lock = threading.Lock()  # held to launch a step (a synchronous one: to run it) or enqueue a load
        self._weights_epoch = 0  # loads between steps so far (changed under `_steps_lock`)
        self._kv_epoch = 0  # the epoch the running requests' KV and the prefix cache were computed under (loop only)
        if max_num_batched_tokens is None:
            max_num_batched_tokens = DEFAULT_CUDA_MAX_NUM_BATCHED_TOKENS if cuda else DEFAULT_MAX_NUM_BATCHED_TOKENS
        graphs = cuda_graphs and cuda
        self._runner = ModelRunner(
            self.model,
            pool,
            self.device,
            max_model_len=self.max_model_len,
            backend=backend,
            cuda_graph_sizes=decode_batch_sizes(max_num_seqs) if graphs else (),
            mixed_graph_tokens=(mixed_token_counts(max_num_batched_tokens) if graphs and mixed_cuda_graphs else ()),
            max_num_seqs=max_num_seqs,
            compiled_sampler=compiled_sampler,
            compiled_layers=compiled_layers,
            fused_layers=fused_layers,
        )
        allocator = BlockAllocator(pool.num_blocks, block_size, enable_caching=enable_prefix_caching)
        mixed = self._runner.mixed  # None without CUDA graphs of mixed steps (or when their capture failed)
        self._scheduler = Scheduler(
            allocator, max_num_seqs, max_num_batched_tokens, mixed.max_tokens if mixed is not None else None
        )
        self._request_ids = itertools.count()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._closed = False
        self._num_steps = 0
        self.launches = LaunchRecord()  # the longest step launch, the slow ones (a kernel built mid-run)
        self._num_generated_tokens = 0

    # ---- the Engine interface -------------------------------------------------------------------------------------

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> TurnRecord:
        prompt = self._check_prompt(prompt_ids)
        self._bind()
        request = Request(
            request_id=next(self._request_ids),
            prompt_ids=prompt,
            params=sampling,
            seed=sampling.seed if sampling.seed is not None else secrets.randbits(63),
            max_output_tokens=min(sampling.max_tokens, self.max_model_len - len(prompt)),
            stop_ids=frozenset(sampling.stop_token_ids) | (frozenset() if sampling.ignore_eos else self.eos_token_ids),
        )
        request.handle = self._loop.create_future()
        self._scheduler.add(request)
        self._wake.set()
        try:
            return await request.handle
        except asyncio.CancelledError:
            if not request.is_finished:
                request.finish_reason = FINISH_ABORT
                self._scheduler.finish(request)
            raise

    async def score(
        self, token_ids: Sequence[int], prompt_length: int, top_k: int, temperature: float = 1.0
    ) -> ScoreResult:
        """Teacher-forced log-probs of `token_ids[prompt_length:]` under softmax(logits / `temperature`): per position
        the top-k (id, log-prob) pairs by rank and the realised token's log-prob. Waits while the engine is paused."""
        ids = self._check_score_request(token_ids, prompt_length, top_k)
        if not temperature > 0:
            raise RequestRejectedError(f"score: temperature={temperature} must be > 0")
        self._bind()
        while True:
            await self._resumed.wait()
            async with self._exclusive():
                if self._scheduler.paused:
                    continue
                return await asyncio.to_thread(self._score, ids, prompt_length, top_k, temperature)

    def _score(self, ids: list[int], prompt_length: int, top_k: int, temperature: float) -> ScoreResult:
        with self._steps_lock:  # no load between steps changes the weights under this forward
            return self._runner.score(ids, prompt_length, top_k, temperature)

    async def pause(self) -> None:
        """Stop scheduling; returns once the forward in flight (if any) has finished. Requests are kept."""
        self._bind()
        self._scheduler.paused = True
        self._resumed.clear()
        async with self._exclusive():
            pass

    async def resume(self) -> None:
        self._bind()
        self._scheduler.paused = False
        self._resumed.set()
        self._wake.set()

    @property
    def is_paused(self) -> bool:
        return self._scheduler.paused

    async def load_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        """Copy weights in place by HF parameter names; only while paused (`await pause()` first)."""
        self._bind()
        if not self._scheduler.paused:
            raise RuntimeError("TorchEngine.load_weights needs a paused engine: await engine.pause() first")
        async with self._exclusive():
            try:
                await asyncio.to_thread(self._load, named_tensors)
                if self.kv_on_weight_update == "recompute":
                    self._scheduler.preempt_all()
            finally:
                self._scheduler.allocator.clear_cache()  # cached prefixes hold the old weights' KV

    def _load(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        """Full weights, a LoRA adapter (merged into the kept base weights), or persistent IPC buckets (a replayed
        copy plan); returns once the copies are done (`rlasync.engine.weights.load_sync`)."""
        with self._steps_lock:
            load_sync(self.model, named_tensors, self._adapter, self._loader, self.device)

    def load_between_steps(self, named_tensors: Iterable[tuple[str, Any]], done_event: Any = None) -> dict[str, float]:
        """Copy weights in place without pausing (any thread; blocking, so call it through `asyncio.to_thread`): the
        copies are queued behind the steps already launched and every later step reads the new weights; running
        requests are preempted before the next step (module docstring). Returns once the copies are done (the sender
        may overwrite its buckets then), or on CUDA with `done_event` (the sender's interprocess event, which it waits
        for before refilling) once they are queued and the event recorded behind them: `wait_s` until the launch
        lock was free, `load_s` from then until done or queued (done: the GPU's queued steps included)."""
        if self._closed:
            raise EngineError("TorchEngine is closed")
        started = time.perf_counter()
        cuda = self.device.type == "cuda"
        with self._steps_lock:
            locked = time.perf_counter()
            with torch.cuda.device(self.device) if cuda else contextlib.nullcontext():
                load_sync(self.model, named_tensors, self._adapter, self._loader, self.device, wait=False)
                done_event = _recorded(done_event, self.device) if cuda and done_event is not None else None
                done = torch.cuda.Event() if cuda and done_event is None else None
                if done is not None:
                    done.record(torch.cuda.current_stream(self.device))
            self._weights_epoch += 1
        if done is not None:
            done.synchronize()
        return {"wait_s": locked - started, "load_s": time.perf_counter() - locked}

    def _catch_up_weights(self) -> None:
        """After a load between steps (none in flight now): the running requests' KV and the cached prefixes were
        computed by the old weights: preempt them (recompute) and clear the prefix cache, as a paused load does."""
        epoch = self._weights_epoch
        if epoch == self._kv_epoch:
            return
        self._kv_epoch = epoch
        if self.kv_on_weight_update == "recompute":
            self._scheduler.preempt_all()
        self._scheduler.allocator.clear_cache()

    async def _hold_steps(self) -> None:
        """Take the launch lock from the loop (a load holds it only while it queues its copies; polled, so a
        cancelled loop never leaves it taken)."""
        while not self._steps_lock.acquire(blocking=False):
            await asyncio.sleep(0.0002)

    def stats(self) -> EngineStats:
        """The load gauges, and in `extra` cumulative counts: steps, generated tokens, prompt tokens served from the
        prefix cache and, with CUDA graphs, the steps that ran the decoder eagerly (`num_eager_steps`: a step no
        graph held, several times slower for a small model; `rollout/engine_eager_step_frac`); and `fused_layers`,
        1.0 when the decoder runs fused (`rollout/engine_fused_layers_frac`: a start-up check that turned them off
        shows in the run's metrics, not only in a worker's log); `launch_max_s` / `num_slow_launches`: `LaunchRecord`'s."""
        allocator = self._scheduler.allocator
        extra = {
            "num_steps": float(self._num_steps),
            "num_generated_tokens": float(self._num_generated_tokens),
            "prefix_cache_hit_tokens": float(self._scheduler.num_prefix_hit_tokens),
            "fused_layers": float(bool(self._runner.fused_layers)),
            "launch_max_s": self.launches.max_s,
            "num_slow_launches": float(self.launches.slow),
        }
        runner = self._runner
        if runner.graphs is not None or runner.mixed is not None:
            extra["num_eager_steps"] = float(runner.eager_steps)
        return EngineStats(
            kv_cache_usage_frac=allocator.usage_frac,
            num_running=self._scheduler.num_running,
            num_waiting=self._scheduler.num_waiting,
            num_preemptions=self._scheduler.num_preemptions,
            kv_capacity_tokens=allocator.capacity_tokens,
            max_model_len=self.max_model_len,
            extra=extra,
        )

    @property
    def runner(self) -> ModelRunner:
        """The model runner (read it, or wrap its `launch` / `logits` to time them: the benches' instrumentation)."""
        return self._runner

    def runner_info(self) -> dict[str, Any]:
        """What the model runner chose (read-only): attention backend, KV block size, decode CUDA graphs, mixed-step
        CUDA graphs and the bound they set on a step with running requests (None: none), compiled sampler and layers."""
        runner = self._runner
        return {
            "attention_backend": runner.backend,
            "block_size": self.block_size,
            "cuda_graphs": runner.graphs is not None,
            "mixed_cuda_graphs": runner.mixed is not None,
            "graphed_step_tokens": self._scheduler.graphed_step_tokens,
            "compiled_sampler": bool(runner.compiled_sampler),
            "compiled_layers": runner.compiled_layers,
            "fused_layers": runner.fused_layers,
        }

    def warm_up(self, sampling: Sequence[SamplingParams]) -> float:
        """Build at start-up what the first steps would (`rlasync.engine.warm_up`); its seconds, 0: nothing to do."""
        return warm_up(self, sampling)

    def warm_steps(self, sampling: Sequence[SamplingParams], num_requests: int | None = None, **options: Any) -> float:
        """A dummy GRPO-shaped batch through the real steps (`warm_up.dummy_jobs`); its seconds, 0 if paused or busy."""
        scheduler = self._scheduler
        if scheduler.paused or scheduler.has_work or not sampling:
            return 0.0
        count = scheduler.max_num_seqs * 5 // 4 if num_requests is None else num_requests  # so that requests wait
        jobs = dummy_jobs(sampling, count, self.vocab_size, self.max_model_len, **options)
        try:
            with self.launches.warming():
                return run_jobs(self.generate, jobs)
        finally:
            scheduler.allocator.clear_cache()  # the dummy prompts' blocks: no later request shares them

    def bound_steps(self, tokens: int | None) -> None:
        """Hold a step that has running requests to `tokens` (None: only `max_num_batched_tokens` bounds it), as the
        engine does with its largest mixed-step CUDA graph; a bench that installs stand-in graphs sets theirs."""
        if tokens is not None and tokens < 1:
            raise ValueError(f"bound_steps({tokens}): a number of tokens >= 1, or None")
        self._scheduler.graphed_step_tokens = tokens

    def set_compiled_sampler(self, on: bool) -> None:
        """Sample through the compiled (True) or eager (False) sampler from the next step on: an A/B in one engine.
        Read at each sampler call, so switch while the engine is idle."""
        self._runner.compiled_sampler = bool(on)

    async def close(self) -> None:
        """Stop the engine loop and fail every pending request with `EngineError`; later calls raise it too."""
        self._closed = True
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        self._fail_all(EngineError("TorchEngine was closed"))

    # ---- requests -------------------------------------------------------------------------------------------------

    def _check_prompt(self, prompt_ids: Sequence[int]) -> list[int]:
        if self._closed:
            raise EngineError("TorchEngine is closed")
        prompt = [int(token) for token in prompt_ids]
        if not prompt:
            raise RequestRejectedError("empty prompt: give at least one token")
        if len(prompt) >= self.max_model_len:
            raise RequestRejectedError(
                f"prompt of {len(prompt)} tokens leaves no room to generate: max_model_len is {self.max_model_len}"
            )
        self._check_token_range(prompt)
        return prompt

    def _check_score_request(self, token_ids: Sequence[int], prompt_length: int, top_k: int) -> list[int]:
        if self._closed:
            raise EngineError("TorchEngine is closed")
        ids = [int(token) for token in token_ids]
        if not 1 <= prompt_length < len(ids):
            raise RequestRejectedError(
                f"score: prompt_length={prompt_length} must be in [1, {len(ids)}) for {len(ids)} tokens"
            )
        if len(ids) > self.max_model_len:
            raise RequestRejectedError(f"score: {len(ids)} tokens exceed max_model_len={self.max_model_len}")
        if top_k < 0:
            raise RequestRejectedError(f"score: top_k={top_k} must be >= 0")
        self._check_token_range(ids)
        return ids

    def _check_token_range(self, ids: list[int]) -> None:
        bad = [token for token in ids if not 0 <= token < self.vocab_size]
        if bad:
            raise RequestRejectedError(f"token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")

    def _finish(self, request: Request, reason: str) -> None:
        request.finish_reason = reason
        self._scheduler.finish(request)
        if not request.handle.done():
            request.handle.set_result(request.to_turn_record())

    def _fail(self, request: Request, error: BaseException) -> None:
        request.finish_reason = FINISH_ERROR
        self._scheduler.finish(request)
        if request.handle is not None and not request.handle.done():
            request.handle.set_exception(error)

    def _fail_all(self, error: BaseException) -> None:
        for request in [*self._scheduler.running, *self._scheduler.waiting]:
            self._fail(request, error)

    # ---- the engine loop ------------------------------------------------------------------------------------------

    @contextlib.asynccontextmanager
    async def _exclusive(self) -> AsyncIterator[None]:
        """The model lock for a caller other than the loop (counted: the loop stops overlapping steps for it)."""
        self._lock_waiters += 1
        acquired = False
        try:
            async with self._model_lock:
                self._lock_waiters, acquired = self._lock_waiters - 1, True
                yield
        finally:
            if not acquired:  # cancelled while waiting
                self._lock_waiters -= 1

    def _bind(self) -> None:
        """Start the loop task on the running event loop (first use, or a new event loop once the old one is gone)."""
        if self._closed:
            raise EngineError("TorchEngine is closed")
        loop = asyncio.get_running_loop()
        if self._loop is loop and self._task is not None and not self._task.done():
            return
        if self._loop is not None and self._loop is not loop:
            if not self._loop.is_closed() and self._scheduler.has_work:
                raise EngineError("TorchEngine is serving requests on another event loop")
            self._fail_all(EngineError("the event loop of this request was closed"))
        if self._loop is not loop:
            self._loop = loop
            self._wake = asyncio.Event()
            self._resumed = asyncio.Event()
            self._model_lock = asyncio.Lock()
            if not self._scheduler.paused:
                self._resumed.set()
        self._wake.set()
        self._task = loop.create_task(self._run_loop(), name="TorchEngine loop")

    async def _run_loop(self) -> None:
        try:
            while True:
                if self._scheduler.paused or not self._scheduler.has_work:
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                async with self._model_lock:
                    if self._scheduler.paused:
                        continue
                    if self.async_scheduling:
                        await self._run_overlapped()
                    else:
                        await self._step_once()
                await asyncio.sleep(0)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug in the loop itself: fail every request loudly, the next call restarts it
            logger.exception("TorchEngine loop stopped")
            self._fail_all(EngineError(f"TorchEngine loop stopped: {exc!r}"))

    async def _step_once(self) -> None:
        await self._hold_steps()
        try:
            self._catch_up_weights()
            output = self._scheduler.schedule()
            if not output.chunks:
                raise _EmptyStep(self._scheduler)
            chunk_inputs = [self._chunk_input(chunk) for chunk in output.chunks]
            try:
                sampled = await asyncio.to_thread(self._runner.execute, chunk_inputs)
            except Exception as exc:
                self._fail_steps(exc, output)
                return
        finally:
            self._steps_lock.release()
        self._num_steps += 1
        self._scheduler.complete(output)
        self._append_all(output.chunks, sampled)

    async def _run_overlapped(self) -> None:
        """Run steps with the model lock held, each launched before the previous one is read, until none is left to
        launch and the last is read (module docstring). A failed step fails the requests of the steps in flight."""
        scheduler = self._scheduler
        inflight: InFlight | None = None
        launched: InFlight | None = None
        output = SchedulerOutput()
        try:
            while True:
                launched, output = None, SchedulerOutput()
                drain = scheduler.paused or self._lock_waiters > 0 or (inflight is not None and self._needs_host_ids())
                if not drain:
                    await self._hold_steps()
                    try:
                        if self._weights_epoch != self._kv_epoch and inflight is not None:
                            drain = True  # loaded between steps: read the steps in flight first
                        else:
                            self._catch_up_weights()
                            output = scheduler.schedule()
                            if output.chunks:
                                launched = await self._launch(output, inflight)
                            elif inflight is None:
                                raise _EmptyStep(scheduler)
                    finally:
                        self._steps_lock.release()
                if inflight is not None:
                    sampled = await asyncio.to_thread(self._runner.collect, inflight.step)
                    self._append_all(inflight.output.chunks, sampled)
                inflight = launched
                if inflight is None:
                    return
                await asyncio.sleep(0)  # let new requests in
        except (asyncio.CancelledError, _EmptyStep):
            raise
        except Exception as exc:
            self._fail_steps(exc, inflight, launched, output)

    def _needs_host_ids(self) -> bool:
        return any(r.params.repetition_penalty != 1.0 for r in self._scheduler.running)

    async def _launch(self, output: SchedulerOutput, previous: InFlight | None) -> InFlight:
        """Launch one step of the overlapped loop; a request decoding in `previous` takes its input id from there."""
        inputs = [self._overlapped_input(chunk, previous) for chunk in output.chunks]
        prior = previous.step if previous else None
        eager_before = self._runner.eager_steps
        if self.launch_on_loop:
            step, seconds = self._timed_launch(inputs, prior)
        else:
            step, seconds = await asyncio.to_thread(self._timed_launch, inputs, prior)
        self.launches.note(seconds, inputs, self._runner.eager_steps > eager_before, self._num_steps + 1)
        launched = InFlight(output, step)
        rows = launched.rows
        for chunk in output.chunks:
            if not chunk.samples:
                continue
            request = chunk.request
            rows[request] = len(rows)
            token_ids = request.token_ids
            if len(token_ids) - len(request.prompt_ids) + 1 < request.max_output_tokens:  # not its last by length
                request.add_pending()
        self._scheduler.complete(output)
        self._num_steps += 1
        return launched

    def _timed_launch(self, inputs: list[ChunkInput], prior: Any) -> tuple[Any, float]:
        started = time.perf_counter()  # the runner's own seconds, not the hand-off to a worker thread and back
        return self._runner.launch(inputs, prior), time.perf_counter() - started

    def _overlapped_input(self, chunk: Any, previous: InFlight | None) -> ChunkInput:
        request = chunk.request
        pending = request.num_pending
        if not pending:
            return self._chunk_input(chunk)
        if pending != 1 or chunk.start + chunk.num_tokens != len(request.token_ids) or previous is None:
            raise RuntimeError(
                f"request {request.request_id}: a step covers {request.num_pending} token(s) still in flight "
                f"(chunk {chunk.start}:{chunk.end} of {request.num_tokens})"
            )
        return self._chunk_input(chunk, previous.rows[request])

    def _fail_steps(self, exc: Exception, *steps: InFlight | SchedulerOutput | None) -> None:
        """A step raised: fail the unfinished requests of `steps` (the loop goes on)."""
        logger.exception("TorchEngine step failed")
        self._scheduler.allocator.clear_cache()  # blocks registered for these steps may hold no KV
        error = EngineError(f"TorchEngine step failed: {exc!r}")
        error.__cause__ = exc
        for step in steps:
            if step is None:
                continue
            for chunk in (step.output if isinstance(step, InFlight) else step).chunks:
                if not chunk.request.is_finished:
                    self._fail(chunk.request, error)

    def _append_all(self, chunks: Sequence[Any], sampled: Sequence[SampledToken | None]) -> None:
        """Record a step's sampled tokens (None: the chunk did not sample) and finish the requests they end."""
        for chunk, token in zip(chunks, sampled):
            if token is None:
                continue
            request = chunk.request
            if request.finish_reason is not None:  # finished (or aborted) while the step ran
                continue
            self._num_generated_tokens += 1
            reason = request.append(*token)  # (token_id, logprob, top_logprobs, candidates)
            if reason is not None:
                self._finish(request, reason)

    @staticmethod
    def _chunk_input(chunk: Any, feedback_row: int | None = None) -> ChunkInput:
        request = chunk.request
        sample = None
        start = chunk.start
        token_ids = request.token_ids
        if chunk.samples:
            params = request.params
            seen = list(token_ids) if params.repetition_penalty != 1.0 else None
            step = len(token_ids) - len(request.prompt_ids)  # num_output_tokens
            sample = SampleSpec(params, request.seed, step, seen, request.slot)
        # the block list itself, not a copy: it only changes in `schedule()` (between steps), and a request dropped
        # during the step gets a new, empty list
        return ChunkInput(token_ids[start : start + chunk.num_tokens], start, request.block_ids, sample, feedback_row)


def _recorded(event: Any, device: torch.device) -> Any:
    """`event` (a sender's interprocess event) recorded on the current stream, or None when it cannot be (the caller
    then waits for its copies itself)."""
    try:
        event.record(torch.cuda.current_stream(device))
    except RuntimeError as exc:
        logger.warning("TorchEngine: could not record the weight sync's copy event (%s); waiting for the copies", exc)
        return None
    return event
