"""`VLLMEngine`: the engine interface (`rlasync.engine.base.Engine`) over an in-process vLLM `AsyncLLM`.

The only module of rlasync that imports vllm, and only when a `VLLMEngine` is built (`pip install 'rlasync[vllm]'`).
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
  pause/resume   `pause_generation(mode="keep", clear_cache=True)` / `resume_generation()`: "keep" freezes
                 in-flight requests; clearing the cache (once the engine is idle) preempts the running ones, so they
                 recompute their KV under the new weights after a sync (what `TorchEngine` does by default, and what
                 SPEC §2.3.2 describes: "each weight sync ... preempts all running requests")
  weights        `collective_rpc(method, timeout, args, kwargs)` on the worker extension of
                 `rlasync.engine.vllm_worker` (tensors inline as bytes, CUDA tensors as CUDA IPC handles; the
                 gloo weight-sync group of `rlasync.weights.broadcast`); and vLLM's own NCCL path,
                 `init_weight_transfer_engine` / `start_weight_update` / `update_weights` / `finish_weight_update`
                 (needs `weight_transfer_config={"backend": "nccl"}`; the learner sends with vLLM's
                 `NCCLWeightTransferEngine.trainer_init` + `trainer_send_weights`). vLLM's `collective_rpc` timeout is
                 not enforced by the single-process executor: the waits here are bounded by `asyncio.wait_for`
                 and, inside the worker, by the weight group's own timeout
  stats          a per-engine `StatLoggerBase` (`SchedulerStats.num_running_reqs / num_waiting_reqs /
                 kv_cache_usage`, `IterationStats.num_preempted_reqs`) and `cache_config.num_gpu_blocks * block_size`
  also in 0.25   `sleep(level)` / `wake_up(tags)` (not used: the learner and the engine share a GPU by memory
                 fractions), `is_paused()`, `reset_prefix_cache()`

Not in 0.25: sampling masks (each token's top-k/top-p candidate set; vLLM >= 0.28 with `--return-sampling-mask`).
`generate` warns once and returns `output_sampling_mask=None`, and the trainer then normalises over the full
vocabulary (SPEC §2.4: biased when top-k/top-p filter; exact without filtering).
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import secrets
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from rlasync.engine.base import EngineError, EngineStats, RequestRejectedError, SamplingParams, ScoreResult
from rlasync.engine.vllm_worker import (
    DEFAULT_CHUNK_BYTES,
    EXTENSION_QUALNAME,
    encode_weights,
    manifest_rows,
    nccl_update_info,
    paused_for_update,
)
from rlasync.records import TurnRecord

logger = logging.getLogger(__name__)

MIN_VLLM_VERSION = (0, 25)
INSTALL_HINT = "pip install 'rlasync[vllm]'"
SAMPLING_MASK_WARNING = (
    "vLLM {version} cannot report sampling masks (each token's top-k/top-p/min-p candidate set; that needs "
    "vLLM >= 0.28 with --return-sampling-mask): output_sampling_mask is None and the trainer normalises the "
    "log-prob ratio over the full vocabulary, which is biased while top-k/top-p/min-p filter"
)


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


# ---- vLLM outputs -> rlasync records (pure: plain objects with .logprob / .rank) -----------------------------------


def _logprob_value(entry: Any) -> float:
    return float(entry.logprob if hasattr(entry, "logprob") else entry["logprob"])


def _rank_value(entry: Any) -> int | None:
    rank = entry.rank if hasattr(entry, "rank") else entry.get("rank")
    return None if rank is None else int(rank)


def top_entries(position: Mapping[Any, Any], n: int) -> dict[int, float]:
    """The top-`n` (id -> log-prob) of one position's vLLM log-prob dict (which also holds the sampled token when it
    is outside the top-n); by rank when ranks are given, else by log-prob."""
    if n <= 0 or not position:
        return {}
    items = [(int(token), _logprob_value(entry), _rank_value(entry)) for token, entry in position.items()]
    if all(rank is not None for _, _, rank in items):
        items.sort(key=lambda item: (item[2], item[0]))
    else:
        items.sort(key=lambda item: (-item[1], item[0]))
    return {token: logprob for token, logprob, _ in items[:n]}


def turn_from_output(
    prompt_ids: list[int],
    output_ids: Sequence[int],
    logprobs: Sequence[Mapping[Any, Any] | None] | None,
    num_logprobs: int,
    finish_reason: str | None,
) -> TurnRecord:
    """A `TurnRecord` from one vLLM completion: the sampled tokens' processed log-probs and, when `num_logprobs > 0`,
    the top-N per position. Raises `EngineError` when a sampled token has no log-prob (a server without logprobs)."""
    ids = [int(t) for t in output_ids]
    if logprobs is None or len(logprobs) != len(ids):
        got = "none" if logprobs is None else f"{len(logprobs)} positions"
        raise EngineError(f"vLLM returned {len(ids)} tokens but log-probs for {got}")
    sampled: list[float] = []
    top: list[dict[int, float]] = []
    for position, (token, entry) in enumerate(zip(ids, logprobs)):
        if not entry:
            raise EngineError(f"vLLM returned no log-prob for output token {position}")
        chosen = entry.get(token, entry.get(str(token))) if isinstance(entry, Mapping) else None
        if chosen is None:
            raise EngineError(f"vLLM's log-probs of output token {position} do not include the sampled id {token}")
        sampled.append(_logprob_value(chosen))
        top.append(top_entries(entry, num_logprobs))
    return TurnRecord(
        prompt_ids=list(prompt_ids),
        output_ids=ids,
        output_log_probs=sampled,
        output_sampler_logprobs=top if num_logprobs > 0 else None,
        output_sampling_mask=None,
        finish_reason=finish_reason,
    )


def turn_from_flat_output(
    prompt_ids: list[int], output_ids: Sequence[int], flat: Any, num_logprobs: int, finish_reason: str | None
) -> TurnRecord:
    """`turn_from_output` for vLLM's `FlatLogprobs` (`SamplingParams(flat_logprobs=True)`): per position `i`, entries
    `start_indices[i]:end_indices[i]` of the flat `token_ids`/`logprobs` lists hold the sampled token first, then the
    top-N by rank. Slices instead of one dict of `Logprob` objects per token: the conversion of a finished request
    no longer holds the actor's event loop for long."""
    ids = [int(t) for t in output_ids]
    starts, ends = list(flat.start_indices), list(flat.end_indices)
    if len(starts) != len(ids) or len(ends) != len(ids):
        raise EngineError(f"vLLM returned {len(ids)} tokens but log-probs for {len(starts)} positions")
    token_ids, logprobs = flat.token_ids, flat.logprobs
    if any(end <= start for start, end in zip(starts, ends)):
        position = next(i for i, (start, end) in enumerate(zip(starts, ends)) if end <= start)
        raise EngineError(f"vLLM returned no log-prob for output token {position}")
    if [token_ids[start] for start in starts] != ids:
        position = next(i for i, (start, token) in enumerate(zip(starts, ids)) if token_ids[start] != token)
        raise EngineError(f"vLLM's log-probs of output token {position} do not include the sampled id {ids[position]}")
    sampled = [float(logprobs[start]) for start in starts]
    top = None
    if num_logprobs > 0:
        spans = [(start + 1, min(end, start + 1 + num_logprobs)) for start, end in zip(starts, ends)]
        top = [dict(zip(token_ids[first:last], logprobs[first:last])) for first, last in spans]
    return TurnRecord(
        prompt_ids=list(prompt_ids),
        output_ids=ids,
        output_log_probs=sampled,
        output_sampler_logprobs=top,
        output_sampling_mask=None,
        finish_reason=finish_reason,
    )


def score_from_prompt_logprobs(
    token_ids: Sequence[int], prompt_length: int, top_k: int, prompt_logprobs: Sequence[Mapping[Any, Any] | None]
) -> ScoreResult:
    """A `ScoreResult` from vLLM's `prompt_logprobs` (entry i scores `token_ids[i]`; keys are ids or id strings)."""
    if len(prompt_logprobs) < len(token_ids):
        raise EngineError(f"vLLM returned prompt log-probs for {len(prompt_logprobs)} of {len(token_ids)} tokens")
    topk_ids: list[list[int]] = []
    topk_logprobs: list[list[float]] = []
    token_logprobs: list[float] = []
    for i in range(prompt_length, len(token_ids)):
        entry = prompt_logprobs[i] or {}
        realised = int(token_ids[i])
        chosen = entry.get(realised, entry.get(str(realised)))
        if chosen is None:
            raise EngineError(f"vLLM's prompt log-probs at position {i} do not include the realised id {realised}")
        token_logprobs.append(_logprob_value(chosen))
        top = top_entries(entry, top_k)
        topk_ids.append(list(top))
        topk_logprobs.append(list(top.values()))
    return ScoreResult(topk_ids=topk_ids, topk_logprobs=topk_logprobs, token_logprobs=token_logprobs)


@functools.cache  # asked once per request: the answer is fixed per vLLM install
def _has_flat_logprobs(params_class: Any) -> bool:
    """Whether this vLLM's `SamplingParams` takes `flat_logprobs` (flat lists instead of a dict per position)."""
    fields = getattr(params_class, "__struct_fields__", None) or getattr(params_class, "__dataclass_fields__", {})
    return "flat_logprobs" in fields


class _Gauges:
    """What the engine's stat logger last saw (written on vLLM's output-handler task, read by `stats()`)."""

    def __init__(self) -> None:
        self.num_running = 0
        self.num_waiting = 0
        self.kv_cache_usage = 0.0
        self.num_preemptions = 0
        self.num_generated_tokens = 0


def _stat_logger_factory(gauges: _Gauges) -> Any:
    """A vLLM per-engine stat-logger factory feeding `gauges` (the class derives from vLLM's `StatLoggerBase`)."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class RlasyncStatLogger(StatLoggerBase):
        def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
            self.engine_index = engine_index

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
            if scheduler_stats is not None:
                gauges.num_running = int(scheduler_stats.num_running_reqs)
                gauges.num_waiting = int(scheduler_stats.num_waiting_reqs)
                gauges.kv_cache_usage = float(scheduler_stats.kv_cache_usage)
            if iteration_stats is not None:
                gauges.num_preemptions += int(getattr(iteration_stats, "num_preempted_reqs", 0))
                gauges.num_generated_tokens += int(getattr(iteration_stats, "num_generation_tokens", 0))

        def log_engine_initialized(self) -> None:
            pass

    return RlasyncStatLogger


class VLLMEngine:
    """The engine interface over an in-process vLLM `AsyncLLM` (one per GenerationActor, on the actor's GPU(s)).

    model                   HF folder or hub id (what `vllm` loads)
    dtype                   "auto" / None (the checkpoint's), "bfloat16", "float16", "float32"
    max_model_len           prompt + output limit; default the model's
    gpu_memory_utilization  fraction of the GPU's memory vLLM may take (weights + KV cache); lower it when a
                            learner shares the GPU
    max_num_seqs            concurrent sequences (vLLM's scheduler limit)
    max_logprobs            largest `num_logprobs` accepted (vLLM rejects more)
    seed                    engine seed; default a random one, so that engines never share a random stream
    use_request_seeds       pass `SamplingParams.seed` to vLLM (reproducible per request, SPEC §2.4); vLLM 0.25
                            samples seeded requests one by one, so False trades that for speed (the engine's own
                            random stream, distinct per engine, is used instead)
    clear_cache_on_pause    drop the prefix cache on pause and recompute running requests under the new weights
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
        use_request_seeds: bool = True,
        clear_cache_on_pause: bool = True,
        weight_transfer_backend: str | None = None,
        rpc_timeout_s: float = 600.0,
        control_timeout_s: float = 300.0,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        **engine_args: Any,
    ) -> None:
        if not isinstance(model, str):
            raise TypeError(f"VLLMEngine needs a model path or hub id, got {type(model).__name__}")
        self.use_request_seeds = bool(use_request_seeds)
        self.clear_cache_on_pause = bool(clear_cache_on_pause)
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
            "disable_log_stats": True,  # only our stat logger: no Prometheus registry in the actor
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
        self._paused = False
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

        return AsyncLLM.from_engine_args(AsyncEngineArgs(**args), stat_loggers=[_stat_logger_factory(self._gauges)])

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
            **({"flat_logprobs": True} if _has_flat_logprobs(VllmSamplingParams) else {}),
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
            max_tokens=1, temperature=float(temperature), prompt_logprobs=top_k, detokenize=False, seed=0,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )  # fmt: skip
        output = await self._run(ids, params)
        return score_from_prompt_logprobs(ids, prompt_length, top_k, output.prompt_logprobs or [])

    async def pause(self) -> None:
        """Freeze scheduling (in-flight requests are kept) and, by default, drop the prefix cache so running requests
        recompute under the weights loaded next. Returns when no forward runs."""
        await self._bounded(
            self._llm.pause_generation(mode="keep", clear_cache=self.clear_cache_on_pause),
            self.control_timeout_s, "pause",
        )  # fmt: skip
        self._paused = True

    async def resume(self) -> None:
        await self._bounded(self._llm.resume_generation(), self.control_timeout_s, "resume")
        self._paused = False

    @property
    def is_paused(self) -> bool:
        return self._paused

    async def load_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> dict[str, Any]:
        """Load `(HF name, tensor)` pairs in place through the workers' `model.load_weights`; only while paused.

        CUDA tensors travel as CUDA IPC handles (no copy; the worker must be on the same GPU), others inline in
        chunks of ~`chunk_bytes`. Returns `{"num_tensors", "bytes", "seconds"}`."""
        if not self._paused:
            raise RuntimeError("VLLMEngine.load_weights needs a paused engine: await engine.pause() first")
        import torch

        started = time.perf_counter()
        total = {"num_tensors": 0, "bytes": 0}
        keepalive: list[Any] = []
        try:
            for payload in encode_weights(named_tensors, chunk_bytes=self.chunk_bytes, cuda_ipc=True,
                                          keepalive=keepalive):  # fmt: skip
                if keepalive:
                    torch.cuda.synchronize()  # the sender's writes land before the worker reads the handles
                results = await self._rpc("load_weights_payload", payload)
                total["num_tensors"] += int(results[0]["num_tensors"])  # every worker loads the same tensors
                total["bytes"] += int(results[0]["bytes"])
                if keepalive:
                    keepalive.clear()
                    torch.cuda.ipc_collect()  # release the copies the worker has let go of
        finally:
            keepalive.clear()
        total["seconds"] = time.perf_counter() - started
        return total

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
            extra={"num_generated_tokens": float(self._num_generated_tokens)},
        )

    async def close(self) -> None:
        """Shut the EngineCore down (its GPU memory is freed); later requests raise `EngineError`."""
        if not self._closed:
            self._closed = True
            self._llm.shutdown()

    # ---- weight sync --------------------------------------------------------------------------------------------

    async def join_weight_group(self, host: str, port: int, rank: int, world_size: int, timeout_s: float,
                                backend: str = "gloo", bucket_bytes: int | None = None) -> None:  # fmt: skip
        """The workers join rlasync's weight-sync group (`rlasync.weights.broadcast`, learner rank 0 sends) as ranks
        `rank, rank + 1, ...` (one per worker), over `backend` ("gloo": through the CPU; "nccl": into the workers'
        GPUs, the sender on another GPU). Returns when every rank has joined."""
        await self._rpc("init_weight_group", host, int(port), int(rank), int(world_size), float(timeout_s), backend,
                        bucket_bytes, timeout_s=float(timeout_s) + 30.0)  # fmt: skip

    async def receive_weights(self, manifest: Iterable[Any]) -> dict[str, Any]:
        """Receive one broadcast per manifest entry in the workers and load it (pausing first unless already
        paused, and resuming then). A stalled sender fails the group's wait with `TimeoutError`."""
        rows = manifest_rows(manifest)
        async with paused_for_update(self):
            results = await self._rpc("receive_weights", rows)
        return results[0] if results else {}

    async def init_weight_transfer(self, master_address: str, master_port: int, rank_offset: int,
                                   world_size: int) -> None:  # fmt: skip
        """vLLM's own NCCL path: the workers join a NCCL group with the learner (rank 0), as ranks from `rank_offset`.
        The learner calls `NCCLWeightTransferEngine.trainer_init({...})` at the same time. Needs
        `weight_transfer_backend="nccl"`."""
        self._need_backend("nccl")
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        info = {"master_address": master_address, "master_port": int(master_port), "rank_offset": int(rank_offset),
                "world_size": int(world_size)}  # fmt: skip
        await self._bounded(self._llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=info)),
                            self.rpc_timeout_s, "init_weight_transfer_engine")  # fmt: skip

    async def update_weights_nccl(self, manifest: Iterable[Any], packed: bool = True) -> float:
        """Receive a NCCL broadcast of the manifest's tensors from the learner (vLLM's `update_weights`), pausing
        and resuming around it unless already paused; the learner sends with
        `NCCLWeightTransferEngine.trainer_send_weights(iterator, {"group": ..., "packed": packed})`. Returns seconds."""
        self._need_backend("nccl")
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        info = nccl_update_info(manifest, packed)
        started = time.perf_counter()
        async with paused_for_update(self):
            await self._bounded(self._llm.start_weight_update(), self.control_timeout_s, "start_weight_update")
            try:
                await self._bounded(self._llm.update_weights(WeightTransferUpdateRequest(update_info=info)),
                                    self.rpc_timeout_s, "update_weights")  # fmt: skip
            finally:
                await self._bounded(self._llm.finish_weight_update(), self.control_timeout_s, "finish_weight_update")
        return time.perf_counter() - started

    async def weight_fingerprint(self, names: Sequence[str] | None = None) -> dict[str, float]:
        results = await self._rpc("weight_fingerprint", list(names) if names is not None else None)
        return results[0] if results else {}

    # ---- internals ----------------------------------------------------------------------------------------------

    def _need_backend(self, backend: str) -> None:
        if self.weight_transfer_backend != backend:
            raise RuntimeError(
                f"vLLM's weight transfer needs VLLMEngine(weight_transfer_backend={backend!r}) "
                f"(this engine has {self.weight_transfer_backend!r})"
            )

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
        try:
            async for output in self._llm.generate(TokensPrompt(prompt_token_ids=prompt), params, request_id):
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
        return await self._bounded(self._llm.collective_rpc(method, timeout=timeout, args=args), timeout, method)

    @staticmethod
    async def _bounded(awaitable: Any, timeout_s: float, what: str) -> Any:
        try:
            return await asyncio.wait_for(awaitable, timeout_s)
        except TimeoutError as exc:
            raise TimeoutError(f"vLLM {what} did not finish within {timeout_s:.0f} s") from exc
