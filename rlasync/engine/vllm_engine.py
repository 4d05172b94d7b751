"""`VLLMEngine`: the engine interface (`rlasync.engine.base.Engine`) over an in-process vLLM `AsyncLLM`.

With `rlasync.engine.vllm_engine_weights` (its weight loading) the only modules of rlasync that import vllm, and only
when a `VLLMEngine` is built or used (`pip install 'rlasync[vllm]'`). The conversion of vLLM's outputs into records
lives in `rlasync.engine.vllm_outputs` (pure, shared with `VLLMServerEngine`; re-exported here).
Written against vLLM 0.25.0 (the release pinned to the GPU machine's torch 2.11 / CUDA 13); the APIs it uses, as
they are in 0.25's source:

  construction   `AsyncLLM.from_engine_args(AsyncEngineArgs(..., logprobs_mode="processed_logprobs",
                 worker_extension_cls=..., weight_transfer_config=...), stat_loggers=[factory])`; the EngineCore runs
                 in a child process (one GPU: its worker runs in that process; tensor parallel: one process per GPU)
  generate       `AsyncLLM.generate(TokensPrompt(prompt_token_ids=...), SamplingParams(..., logprobs=N, seed=...,
                 output_kind=FINAL_ONLY, detokenize=False), request_id)`; with `logprobs_mode="processed_logprobs"`
                 the log-probs are those of the distribution sampled from (after penalties, temperature, min-p,
                 top-k/top-p; -inf outside the candidate set); `logprobs=0` returns the sampled token's only, `N > 0`
                 the top-N plus the sampled token (each `Logprob` has `.logprob` and `.rank`)
  score          `SamplingParams(max_tokens=1, prompt_logprobs=k)`: `RequestOutput.prompt_logprobs[i]` scores
                 `token_ids[i]` given the tokens before it (top-k plus the realised token; entry 0 is None). Prompt
                 log-probs are always raw `log_softmax(logits)` (temperature 1), whatever `logprobs_mode` says
  pause/resume   `engine_core.pause_scheduler_async(mode="keep", clear_cache=True)` (what `pause_generation`
                 awaits, without its 20 ms settling sleep) / `resume_generation()`: "keep" freezes
                 in-flight requests; clearing the cache (once the engine is idle) preempts the running ones, so they
                 recompute their KV under the new weights after a sync (what `TorchEngine` does by default, and what
                 docs/algorithms.md §2.3.2 describes: "each weight sync ... preempts all running requests")
  weights        `collective_rpc(method, timeout, args, kwargs)` on the worker extension of
                 `rlasync.engine.vllm_worker` (tensors inline as bytes, CUDA tensors as CUDA IPC handles; the
                 gloo weight-sync group of `rlasync.weights.broadcast`); and vLLM's own NCCL path,
                 `init_weight_transfer_engine` / `start_weight_update` / `update_weights` / `finish_weight_update`
                 (needs `weight_transfer_config={"backend": "nccl"}`; the learner sends with vLLM's
                 `NCCLWeightTransferEngine.trainer_init` + `trainer_send_weights`). vLLM's `collective_rpc` timeout is
                 not enforced by the single-process executor: the waits here are bounded by `asyncio.wait_for`
                 and, inside the worker, by the weight group's own timeout
  stats          a stat logger (`SchedulerStats.num_running_reqs / num_waiting_reqs / kv_cache_usage`,
                 `IterationStats.num_preempted_reqs`) and `cache_config.num_gpu_blocks * block_size`; by default a
                 `PrometheusStatLogger` subclass that builds no metrics, so `StatLoggerManager` adds no Prometheus
                 logger of its own (it does unless a custom logger is one)
  also in 0.25   `sleep(level)` / `wake_up(tags)` (not used: the learner and the engine share a GPU by memory
                 fractions), `is_paused()`, `reset_prefix_cache()`

Not in 0.25: sampling masks (each token's top-k/top-p candidate set; vLLM >= 0.28 with `--return-sampling-mask`).
`generate` warns once and returns `output_sampling_mask=None`, and the trainer then normalises over the full
vocabulary (docs/algorithms.md §2.4: biased when top-k/top-p filter; exact without filtering).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import secrets
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from rlasync.engine.base import EngineError, EngineStats, RequestRejectedError, SamplingParams, ScoreResult
from rlasync.engine.vllm_engine_lora import RuntimeAdapters, lora_request
from rlasync.engine.vllm_engine_weights import VLLMWeightLoading, bounded, multimodal_cache
from rlasync.engine.vllm_outputs import (  # noqa: F401 - re-exported: these lived here first
    SAMPLING_MASK_WARNING,
    score_from_prompt_logprobs,
    top_entries,
    turn_from_flat_output,
    turn_from_output,
)
from rlasync.engine.vllm_worker import DEFAULT_CHUNK_BYTES, EXTENSION_QUALNAME
from rlasync.records import TurnRecord
from rlasync.weights.adapter import adapter_base

if TYPE_CHECKING:
    from vllm.config import VllmConfig

logger = logging.getLogger(__name__)

MIN_VLLM_VERSION = (0, 25)
INSTALL_HINT = "pip install 'rlasync[vllm]'"


def import_vllm() -> Any:
    """`import vllm`, or an ImportError that says how to install it (vllm is an optional extra)."""
    try:
        import vllm
    except ImportError as exc:
        raise ImportError(
            f"the vLLM engine needs vLLM (>= {'.'.join(map(str, MIN_VLLM_VERSION))}), which is not installed "
            f"({exc}): {INSTALL_HINT}, or choose cluster.engine='torch' (the built-in engine)"
        ) from exc
    return vllm


def _version_tuple(version: str) -> tuple[int, ...]:
    parts = []
    for piece in version.split(".")[:3]:
        digits = "".join(itertools.takewhile(str.isdigit, piece))
        parts.append(int(digits or 0))
    return tuple(parts)


@functools.cache  # asked once per request: the answer is fixed per vLLM install
def _params_extras(params_class: Any) -> dict[str, bool]:
    """The `SamplingParams` fields this vLLM takes beyond 0.25's basics, set for every request: `flat_logprobs` (flat
    lists instead of a dict of `Logprob` objects per position) and `skip_clone` (each request's params are built
    for it alone, so vLLM's input processing need not deep-copy them: `deepcopy` was 7-8% of the GenerationActor's
    Python time in the sums run, bench/LOG.md 2026-12-07)."""
    fields = getattr(params_class, "__struct_fields__", None) or getattr(params_class, "__dataclass_fields__", {})
    return {name: True for name in ("flat_logprobs", "skip_clone") if name in fields}


class _Gauges:
    """What the engine's stat logger last saw (written on vLLM's output-handler task, read by `stats()`)."""

    def __init__(self) -> None:
        self.num_running = 0
        self.num_waiting = 0
        self.kv_cache_usage = 0.0
        self.num_preemptions = 0
        self.num_generated_tokens = 0


def _stat_logger_factory(gauges: _Gauges, prometheus: bool = False) -> Any:
    """A vLLM stat-logger factory feeding `gauges`.

    vLLM 0.25's `StatLoggerManager` adds its `PrometheusStatLogger` to every `AsyncLLM` that logs stats (ours must: the
    gauges come from those stats) unless a custom logger already is one. Its metrics, which nobody scrapes inside a
    GenerationActor, cost ~7% of that process's Python time in the sums run (a histogram observation and a locked
    counter per finished request, bench/LOG.md 2026-12-07), so by default our logger takes its place: a subclass that
    builds none of its metrics. With `prometheus=True` vLLM keeps its own and ours is a plain per-engine logger."""
    from vllm.v1.metrics import loggers

    def update(scheduler_stats: Any, iteration_stats: Any) -> None:
        if scheduler_stats is not None:
            gauges.num_running = int(scheduler_stats.num_running_reqs)
            gauges.num_waiting = int(scheduler_stats.num_waiting_reqs)
            gauges.kv_cache_usage = float(scheduler_stats.kv_cache_usage)
        if iteration_stats is not None:
            gauges.num_preemptions += int(getattr(iteration_stats, "num_preempted_reqs", 0))
            gauges.num_generated_tokens += int(getattr(iteration_stats, "num_generation_tokens", 0))

    if prometheus or not hasattr(loggers, "PrometheusStatLogger"):

        class RlasyncStatLogger(loggers.StatLoggerBase):
            def __init__(self, vllm_config: VllmConfig, engine_index: int = 0) -> None:
                self.engine_index = engine_index

            def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
                update(scheduler_stats, iteration_stats)

            def log_engine_initialized(self) -> None:
                pass

        return RlasyncStatLogger

    class RlasyncPrometheusStandIn(loggers.PrometheusStatLogger):
        """In Prometheus's place (vLLM then adds no other): its interface, none of its metrics."""

        def __init__(self, vllm_config: VllmConfig, engine_indexes: list[int] | None = None) -> None:
            self.engine_indexes = list(engine_indexes or [0])  # no super().__init__(): it would register the metrics

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
            update(scheduler_stats, iteration_stats)

        def record_sleep_state(self, *args: Any, **kwargs: Any) -> None:
            pass

        def log_engine_initialized(self) -> None:
            pass

        def log(self) -> None:
            pass

    return RlasyncPrometheusStandIn


class VLLMEngine(VLLMWeightLoading):
    """The engine interface over an in-process vLLM `AsyncLLM` (one per GenerationActor, on the actor's GPU(s)).

    model                   HF folder or hub id (what `vllm` loads)
    dtype                   "auto" / None (the checkpoint's), "bfloat16", "float16", "float32"
    max_model_len           prompt + output limit; default the model's
    gpu_memory_utilization  fraction of the GPU's memory vLLM may take (weights + KV cache); lower it when a
                            learner shares the GPU
    max_num_seqs            concurrent sequences (vLLM's scheduler limit)
    max_logprobs            largest `num_logprobs` accepted (vLLM rejects more)
    seed                    engine seed; default a random one, so that engines never share a random stream
    use_request_seeds       pass each request's seed to vLLM (reproducible per request; a request without one gets
                            a random one). Off by default: vLLM 0.25 samples seeded requests one by one (3-25% fewer
                            tokens/s than its batched sampler), and the engine's own seed (random unless given) already
                            keeps data-parallel engines from decoding alike (docs/algorithms.md §2.4)
    clear_cache_on_pause    drop the prefix cache on pause and recompute running requests under the new weights
    sync_without_pause      an IPC weight sync swaps the weights between two of vLLM's steps (one utility call) and
                            preempts the running requests after, instead of pausing and resuming vLLM's scheduler
                            around it: two round trips through vLLM's front end fewer per sync (`pause`)
    direct_sync             an IPC weight sync does not cross vLLM's front end at all: one message through a socket
                            of the worker's own, applied at the worker's next step (`rlasync.engine.vllm_door`);
                            implies `sync_without_pause`
    prometheus_metrics      keep vLLM's Prometheus metrics in the actor's process (off: nobody scrapes them there,
                            and they cost the front end ~7% of its Python time; our own gauges feed `stats()`)
    weight_transfer_backend None, or "nccl" for vLLM's own NCCL weight transfer (`init_weight_transfer`)
    rpc_timeout_s           bound of every weight-loading call; control_timeout_s: of pause/resume
    **engine_args           any other `vllm.AsyncEngineArgs` field (e.g. enforce_eager, compilation_config,
                            tensor_parallel_size, enable_prefix_caching)
    """

    def __init__(
        self,
        model: str,
        *,
        dtype: str | None = None,
        max_model_len: int | None = None,
        gpu_memory_utilization: float = 0.9,
        max_num_seqs: int = 256,
        max_logprobs: int = 20,
        seed: int | None = None,
        use_request_seeds: bool = False,
        clear_cache_on_pause: bool = True,
        prometheus_metrics: bool = False,
        sync_without_pause: bool = False,
        direct_sync: bool = False,
        weight_transfer_backend: str | None = None,
        rpc_timeout_s: float = 600.0,
        control_timeout_s: float = 300.0,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        lora_dir: str | None = None,
        **engine_args: Any,
    ) -> None:
        if not isinstance(model, str):
            raise TypeError(f"VLLMEngine needs a model path or hub id, got {type(model).__name__}")
        model = adapter_base(model)  # a LoRA checkpoint: vLLM serves the base, the adapter arrives by sync
        self._adapters: RuntimeAdapters | None = None  # LoRA syncs: runtime adapters (rlasync.engine.vllm_engine_lora)
        if lora_dir is not None:
            if not engine_args.get("enable_lora"):
                raise ValueError(
                    "VLLMEngine(lora_dir=...) receives LoRA adapters: start it with enable_lora=True, "
                    "max_loras and max_lora_rank (rlasync.weights.adapter.lora_engine_kwargs)"
                )
            self._adapters = RuntimeAdapters(lora_dir, int(engine_args.get("max_loras", 1)), base_model=model)
        self.use_request_seeds = bool(use_request_seeds)
        self.clear_cache_on_pause = bool(clear_cache_on_pause)
        self.prometheus_metrics = bool(prometheus_metrics)
        self.direct_sync = bool(direct_sync)
        self.sync_without_pause = bool(sync_without_pause) or self.direct_sync
        self._door = None  # the worker's sync door (`direct_sync`), opened with the weight transport
        self._door_loop = None
        self.door_counts = {}
        self.rpc_timeout_s = float(rpc_timeout_s)
        self.control_timeout_s = float(control_timeout_s)
        self.chunk_bytes = int(chunk_bytes)
        self.weight_transfer_backend = weight_transfer_backend
        self._gauges = _Gauges()
        args: dict[str, Any] = {
            "model": model,
            "dtype": dtype or "auto",
            "gpu_memory_utilization": gpu_memory_utilization,
            "max_num_seqs": max_num_seqs,
            "max_logprobs": max_logprobs,
            "seed": secrets.randbits(31) if seed is None else int(seed),
            "logprobs_mode": "processed_logprobs",
            "worker_extension_cls": EXTENSION_QUALNAME,
            "disable_log_stats": True,  # no periodic log lines; the stats still flow to our logger (`_build`)
            **engine_args,
        }
        if max_model_len is not None:
            args["max_model_len"] = int(max_model_len)
        if weight_transfer_backend is not None:
            args["weight_transfer_config"] = {"backend": weight_transfer_backend}
        if args["logprobs_mode"] != "processed_logprobs":
            raise ValueError("VLLMEngine needs logprobs_mode='processed_logprobs' (the sampler's log-probs)")
        self.vllm_version = "unknown"
        started = time.perf_counter()
        self._llm = self._build(args)
        self.startup_s = time.perf_counter() - started
        config = self._llm.vllm_config
        self.max_model_len = int(config.model_config.max_model_len)
        self.max_logprobs = int(config.model_config.max_logprobs)
        self.model = model
        self._request_ids = itertools.count()
        self._paused = False  # between pause() and resume() (a weight sync)
        self._held = False  # vLLM's scheduler itself paused (always, unless sync_without_pause)
        self._closed = False
        self._warned_mask = False
        self._num_generated_tokens = 0

    def _build(self, args: dict[str, Any]) -> Any:
        """Start vLLM: `AsyncLLM.from_engine_args(AsyncEngineArgs(**args))` with our stat logger (blocks while the
        EngineCore loads the model, profiles memory and captures CUDA graphs)."""
        vllm = import_vllm()
        self.vllm_version = str(getattr(vllm, "__version__", "unknown"))
        if _version_tuple(self.vllm_version) < MIN_VLLM_VERSION:
            logger.warning("VLLMEngine is written for vLLM >= 0.25; found %s", self.vllm_version)
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        factory = _stat_logger_factory(self._gauges, prometheus=self.prometheus_metrics)
        return AsyncLLM.from_engine_args(AsyncEngineArgs(**args), stat_loggers=[factory])

    # ---- the Engine interface -------------------------------------------------------------------------------------

    def _vllm_params(self, sampling: SamplingParams, max_tokens: int) -> Any:
        from vllm import SamplingParams as VllmSamplingParams
        from vllm.sampling_params import RequestOutputKind

        if sampling.filters and sampling.return_sampling_mask and not self._warned_mask:
            self._warned_mask = True
            logger.warning(SAMPLING_MASK_WARNING.format(version=self.vllm_version))
        seed = None
        if self.use_request_seeds:
            seed = sampling.seed if sampling.seed is not None else secrets.randbits(63)
        return VllmSamplingParams(
            n=1,
            max_tokens=max_tokens,
            temperature=sampling.temperature,
            top_k=max(sampling.top_k, 0),
            top_p=sampling.top_p,
            min_p=sampling.min_p or 0.0,
            repetition_penalty=sampling.repetition_penalty,
            seed=seed,
            stop_token_ids=list(sampling.stop_token_ids),
            ignore_eos=sampling.ignore_eos,
            logprobs=sampling.num_logprobs,
            detokenize=False,
            skip_special_tokens=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
            **_params_extras(VllmSamplingParams),
        )

    async def generate(self, prompt_ids: Sequence[int], sampling: SamplingParams) -> TurnRecord:
        prompt = self._check_prompt(prompt_ids)
        if sampling.num_logprobs > self.max_logprobs:
            raise RequestRejectedError(
                f"num_logprobs={sampling.num_logprobs} exceeds the engine's max_logprobs={self.max_logprobs}: "
                "raise engine_kwargs.max_logprobs"
            )
        params = self._vllm_params(sampling, min(sampling.max_tokens, self.max_model_len - len(prompt)))
        output = await self._run(prompt, params)
        completion = output.outputs[0]
        self._num_generated_tokens += len(completion.token_ids)
        convert = turn_from_flat_output if hasattr(completion.logprobs, "start_indices") else turn_from_output
        return convert(
            prompt, completion.token_ids, completion.logprobs, sampling.num_logprobs, completion.finish_reason
        )

    async def score(
        self, token_ids: Sequence[int], prompt_length: int, top_k: int, temperature: float = 1.0
    ) -> ScoreResult:
        """Teacher-forced log-probs of `token_ids[prompt_length:]` via vLLM's `prompt_logprobs`, at `temperature`
        (applied by vLLM to the prompt log-probs only under `logprobs_mode="processed_logprobs"`)."""
        if not temperature > 0:
            raise RequestRejectedError(f"score: temperature={temperature} must be > 0")
        from vllm import SamplingParams as VllmSamplingParams
        from vllm.sampling_params import RequestOutputKind

        ids = [int(t) for t in token_ids]
        if not 1 <= prompt_length <= len(ids):
            raise RequestRejectedError(f"score: prompt_length={prompt_length} must be in [1, {len(ids)}]")
        if top_k < 0 or top_k > self.max_logprobs:
            raise RequestRejectedError(f"score: top_k={top_k} must be in [0, max_logprobs={self.max_logprobs}]")
        if len(ids) >= self.max_model_len:
            raise RequestRejectedError(
                f"score: {len(ids)} tokens leave no room under max_model_len={self.max_model_len}"
            )
        params = VllmSamplingParams(
            max_tokens=1,
            temperature=float(temperature),
            prompt_logprobs=top_k,
            detokenize=False,
            seed=0,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        output = await self._run(ids, params)
        return score_from_prompt_logprobs(ids, prompt_length, top_k, output.prompt_logprobs or [])

    async def pause(self, *, via_pause_generation: bool = False) -> None:
        """Freeze scheduling (in-flight requests are kept) and, by default, drop the prefix cache so running requests
        recompute under the weights loaded next. Returns when no forward runs.

        With `sync_without_pause` the pause is only this engine's state: vLLM keeps stepping, and a sync from
        persistent IPC buckets (`load_flat`) swaps the weights between two of its steps instead (one utility call,
        which the EngineCore runs between steps), then preempts the running requests (their KV and any output frame
        in flight are the old weights'). Any other load (per tensor, an adapter, a broadcast) pauses vLLM first.

        Asks the EngineCore directly (`engine_core.pause_scheduler_async`, what `AsyncLLM.pause_generation` awaits):
        0.25's `pause_generation` then sleeps 20 ms so that the last step's outputs reach their requests first, which
        it says correctness does not need, and which is 20 ms of every weight sync. Those outputs still arrive; a
        request's policy version is its group's at the start, so nothing is mislabelled. A vLLM without that method,
        or `via_pause_generation=True` (vLLM's own path, for an A/B), gets `pause_generation`."""
        if self.sync_without_pause and not via_pause_generation:
            self._paused = True
            return
        await self._hold(via_pause_generation)

    async def _hold(self, via_pause_generation: bool = False) -> None:
        """Pause vLLM's scheduler itself (what `pause` does unless `sync_without_pause`)."""
        llm = self._llm
        core = getattr(llm, "engine_core", None)
        if via_pause_generation or core is None or not hasattr(core, "pause_scheduler_async"):
            paused = llm.pause_generation(mode="keep", clear_cache=self.clear_cache_on_pause)
        else:
            paused = self._pause_scheduler(llm, core)
        await bounded(paused, self.control_timeout_s, "pause")
        self._paused = self._held = True

    async def _pause_scheduler(self, llm: Any, core: Any) -> None:
        if self.clear_cache_on_pause and multimodal_cache(llm) is not None:
            await llm.renderer.clear_mm_cache_async()  # multimodal inputs cached on this side (vLLM does the same)
        await core.pause_scheduler_async(mode="keep", clear_cache=self.clear_cache_on_pause)

    async def resume(self) -> None:
        if self._held:
            await bounded(self._llm.resume_generation(), self.control_timeout_s, "resume")
            self._held = False
        self._paused = False

    @property
    def is_paused(self) -> bool:
        return self._paused

    def stat_loggers(self) -> list[str]:
        """The class names of the stat loggers vLLM built (by default one, ours, in Prometheus's place)."""
        manager = getattr(self._llm, "logger_manager", None)
        return [type(stat_logger).__name__ for stat_logger in getattr(manager, "stat_loggers", [])]

    def stats(self) -> EngineStats:
        gauges = self._gauges
        cache = self._llm.vllm_config.cache_config
        capacity = int(cache.num_gpu_blocks or 0) * int(cache.block_size or 0)
        return EngineStats(
            kv_cache_usage_frac=gauges.kv_cache_usage,
            num_running=gauges.num_running,
            num_waiting=gauges.num_waiting,
            num_preemptions=gauges.num_preemptions,
            kv_capacity_tokens=capacity,
            max_model_len=self.max_model_len,
            extra={
                "num_generated_tokens": float(self._num_generated_tokens),
                # the sync door's loads (`direct_sync`): applied at a step, on a nudge (idle), cache resets refused
                **{f"sync_door_{k}": float(v) for k, v in self.door_counts.items()},
            },
        )

    async def close(self) -> None:
        """Shut the EngineCore down (its GPU memory is freed); later requests raise `EngineError`."""
        if not self._closed:
            self._closed = True
            self.close_door()
            self._llm.shutdown()

    # ---- internals ----------------------------------------------------------------------------------------------

    def _check_prompt(self, prompt_ids: Sequence[int]) -> list[int]:
        if self._closed:
            raise EngineError("VLLMEngine is closed")
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise RequestRejectedError("empty prompt")
        if len(prompt) >= self.max_model_len:
            raise RequestRejectedError(
                f"prompt of {len(prompt)} tokens leaves no room to generate: max_model_len is {self.max_model_len}"
            )
        return prompt

    async def _run(self, prompt: list[int], params: Any) -> Any:
        from vllm import TokensPrompt
        from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError

        request_id = f"rlasync-{next(self._request_ids)}-{secrets.token_hex(4)}"
        final = None
        holding = self._adapters.using() if self._adapters is not None else contextlib.nullcontext()
        try:
            with holding as adapter:  # the adapter stays loaded (and its folder kept) until this request ends
                async for output in self._llm.generate(
                    TokensPrompt(prompt_token_ids=prompt), params, request_id, lora_request=lora_request(adapter)
                ):
                    final = output
        except ValueError as exc:  # vLLM's request validation
            raise RequestRejectedError(f"vLLM rejected the request: {exc}") from exc
        except EngineDeadError as exc:
            raise EngineError(f"the vLLM engine died: {exc}") from exc
        except EngineGenerateError as exc:
            raise EngineError(f"vLLM generation failed: {exc.__cause__ or exc}") from exc
        if final is None or not final.finished:
            raise EngineError(f"vLLM request {request_id} ended without a final output")
        if final.outputs and final.outputs[0].finish_reason == "abort":
            raise EngineError(f"vLLM request {request_id} was aborted")
        return final

    async def _rpc(self, method: str, *args: Any, timeout_s: float | None = None) -> list[Any]:
        timeout = self.rpc_timeout_s if timeout_s is None else timeout_s
        return await bounded(self._llm.collective_rpc(method, timeout=timeout, args=args), timeout, method)
