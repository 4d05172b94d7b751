"""Runs one engine step on the model: the flat batch through the decoder, the LM head on the sampled rows, the sampler.

Input is plain data snapshotted by the engine loop (`ChunkInput` per scheduled request), output is plain data
(`SampledToken` per request that samples this step), so the step can run in a worker thread while the event loop
keeps accepting requests. Only the last position of each request that samples goes through the LM head (no
[N, vocab] logits). `score` is a plain teacher-forced forward (no KV pool) for `Engine.score`.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from rlasync.engine.base import SamplingParams, ScoreResult
from rlasync.engine.cuda_graphs import DecodeGraphs
from rlasync.engine.fused_decoder import CHECK_TOLERANCE, FusedDecoder, check_fused, fusable
from rlasync.engine.mixed_graphs import MixedGraphs
from rlasync.engine.paged_attention import ATTENTION_NAME, KVPool, build_metadata
from rlasync.engine.sampler_compiled import resolve_compiled_sampler
from rlasync.engine.slot_sampling import SlotSampling, host_to_device

logger = logging.getLogger(__name__)

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
SCORE_CHUNK_ROWS = 256  # LM-head rows per chunk in `score`: bounds the [rows, vocab] float32 logits


# `SampleSpec` and `ChunkInput` are never changed once made; they are not frozen dataclasses only because a frozen
# one's `__init__` costs ~5x a plain one's, and the engine makes one of each per request per step


@dataclass(slots=True)
class SampleSpec:
    params: SamplingParams
    seed: int
    step: int  # index of the token being generated within its request (counter-based randomness)
    seen_ids: list[int] | None  # prompt + output so far, only when a repetition penalty applies
    slot: int | None = None  # the request's row in the per-slot sampling tensors (None: built for this step)


@dataclass(slots=True)
class ChunkInput:
    """One request's part of a step: `token_ids` at positions `start...`, its blocks, and what to sample."""

    token_ids: list[int]
    start: int
    block_ids: list[int]
    sample: SampleSpec | None
    feedback_row: int | None = None  # the last input token is row r of the previous launched step's sampled ids


@dataclass(slots=True)
class LaunchedStep:
    """A step whose work is queued on the device (`ModelRunner.launch`); `collect` reads its results."""

    samples: list[bool]  # per chunk: whether it samples
    params: list[SamplingParams]
    result: Any = None  # the sampler's SampleResult (device tensors), None when no chunk samples
    packed: torch.Tensor | None = None  # `pack_result`, on the host (pinned, filled asynchronously on CUDA)
    ready: Any = None  # a CUDA event recorded after the copy to `packed`


class SampledToken(NamedTuple):
    """One request's sampled token (a named tuple: one is made per request and step, so it is cheap to build)."""

    token_id: int
    logprob: float
    top_logprobs: Any  # the top-N processed log-probs: a float64 row of N ranked ids then their log-probs (-inf pads)
    candidates: list[int] | None  # the candidate set when top-k/top-p/min-p filter and it was asked for


def compile_engine_layers(model: torch.nn.Module) -> None:
    """The engine's `compiled_layers`: each decoder layer compiled by inductor (its norms, rotary embedding, residual
    adds and MLP activation fused into a few kernels around the projections), shapes dynamic so that one compile
    serves every step size; the paged attention between those regions stays out of the compiled graphs (registered
    through `torch.compiler.disable`). The CUDA graphs then capture the compiled layers. Inductor's cache is the one
    the learner keeps (`use_compile_cache`), so a second run loads what the first compiled."""
    from rlasync.model.checkpointing import decoder_layers
    from rlasync.model.compilation import use_compile_cache

    use_compile_cache()
    for layer in decoder_layers(model):
        layer.compile(dynamic=True)


def check_engine_support(model: torch.nn.Module) -> None:
    """Refuse (`ValueError`) a model the engine cannot run exactly."""
    config = model.config
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"TorchEngine supports {list(SUPPORTED_MODEL_TYPES)} models, got model_type={model_type!r}")
    layer_types = set(getattr(config, "layer_types", None) or ["full_attention"])
    if not layer_types <= {"full_attention", "sliding_attention"}:
        raise ValueError(f"TorchEngine supports full and sliding attention layers only, got {sorted(layer_types)}")


class ModelRunner:
    """Runs steps of `model` over `pool` with the paged attention `backend` ("reference", "triton" or "varlen").
    `cuda_graph_sizes` (triton and varlen only): batch sizes whose decode steps are captured as CUDA graphs;
    empty = eager. `mixed_graph_tokens`: token counts whose mixed steps (prefill chunks with decodes, at most
    `max_num_seqs` requests) are captured too (`mixed_graphs.py`). A capture that fails is logged and those steps
    run eagerly. `compiled_sampler`: sample through `sampler_compiled` (inductor-fused; same results; None = on for
    CUDA); a compile that fails is logged once and the eager sampler takes over. `fused_layers`: paged steps through
    `fused_decoder.FusedDecoder` (the layers' elementwise work in Triton kernels; None = on for CUDA where the model
    allows it and `compiled_layers` is off), after a start-up check against transformers' layers that turns it off,
    logged, if they disagree."""

    def __init__(
        self,
        model: torch.nn.Module,
        pool: KVPool,
        device: torch.device,
        *,
        max_model_len: int,
        backend: str = "reference",
        cuda_graph_sizes: Sequence[int] = (),
        mixed_graph_tokens: Sequence[int] = (),
        max_num_seqs: int = 256,
        compiled_sampler: bool | None = None,
        compiled_layers: bool = False,
        fused_layers: bool | None = None,
    ) -> None:
        check_engine_support(model)
        model.set_attn_implementation(ATTENTION_NAME)
        if model.config._attn_implementation != ATTENTION_NAME:
            raise ValueError(f"{type(model).__name__} kept attn_implementation={model.config._attn_implementation!r}")
        self.model = model
        self.decoder = model.get_decoder()
        self.head = model.get_output_embeddings()
        self.pool = pool
        self.device = device
        self.vocab_size = int(self.head.weight.shape[0])
        # a 4D attention_mask is returned unchanged by transformers: no [N, N] mask is built for a paged step
        self._no_mask = torch.zeros(1, 1, 0, 0, dtype=torch.bool, device=device)
        if backend not in ("reference", "varlen", "triton"):
            raise ValueError(f"unknown paged attention backend {backend!r}")
        self.backend = backend
        self.slots = SlotSampling(max_num_seqs, device)
        self.compiled_sampler = resolve_compiled_sampler(compiled_sampler, device)
        self.compiled_layers = bool(compiled_layers)
        if self.compiled_layers:
            compile_engine_layers(model)
        self.fused_layers = self._fuse(fused_layers, backend)
        self.graphs = None
        if cuda_graph_sizes and backend in ("varlen", "triton"):
            self.graphs = self._capture(
                "decode steps",
                lambda: DecodeGraphs(
                    self.decoder,
                    self.logits,
                    pool,
                    device,
                    cuda_graph_sizes,
                    max_model_len,
                    self._no_mask,
                    backend,
                    warm_every_size=self.compiled_layers or self.fused_layers,
                ),
            )
        self.eager_steps = 0  # steps whose decoder ran eagerly (no CUDA graph held them; on the CPU: every step)
        self.mixed = None
        if mixed_graph_tokens and backend in ("varlen", "triton"):
            self.mixed = self._capture(
                "mixed steps",
                lambda: MixedGraphs(
                    self.decoder,
                    self.logits,
                    pool,
                    device,
                    mixed_graph_tokens,
                    max_num_seqs,
                    max_model_len,
                    self._no_mask,
                    backend,
                ),
            )

    def _fuse(self, requested: bool | None, backend: str) -> bool:
        """Whether paged steps run through `FusedDecoder` (`fused_layers`); if so, `self.decoder` is it."""
        if requested is False or (requested is None and (self.device.type != "cuda" or self.compiled_layers)):
            return False
        if self.compiled_layers:
            raise ValueError(
                "fused_layers=True and compiled_layers=True: choose one (the fused layers are not compiled)"
            )
        reason = fusable(self.model)
        if reason is not None:
            if requested:
                raise ValueError(f"fused_layers=True: this model cannot take them ({reason}); use fused_layers=None")
            logger.info("engine layers run unfused: %s", reason)
            return False
        fused = FusedDecoder(self.decoder)
        tokens = min(16, self.pool.block_size * self.pool.num_blocks)
        meta = build_metadata(
            self.pool, [0], [tokens], [list(range(-(-tokens // self.pool.block_size)))], self.device, backend
        )
        ids = torch.arange(tokens, device=self.device)[None] % self.vocab_size
        try:
            with _on_device(self.device):
                error = check_fused(fused, meta, ids, self._no_mask)
        except Exception:  # a kernel that does not build or launch here: the layers stay transformers'
            logger.exception("fused engine layers failed their start-up check; running transformers' layers")
            return False
        if not error < CHECK_TOLERANCE:
            logger.warning(
                "fused engine layers disagree with transformers' (relative error %.3g over a %d-token step); "
                "running transformers' layers", error, tokens,
            )  # fmt: skip
            return False
        self.decoder = fused
        return True

    def _capture(self, what: str, build: Callable[[], Any]) -> Any:
        """`build()` (a set of CUDA graphs, captured on construction); a compile failure of the compiled layers
        turns them back to eager (`_compile_failed`) and captures again; another failure leaves `what` eager
        (None), logged."""
        for _ in range(2):
            try:
                with _on_device(self.device):
                    return build()
            except RuntimeError as exc:
                if not self._compile_failed(exc):
                    logger.exception("CUDA graph capture of %s failed: they run eagerly", what)
                    return None
        return None

    def _compile_failed(self, exc: BaseException) -> bool:
        """Whether `exc` is a failed compile of the compiled layers; if so they run eagerly from now on (warned)."""
        from rlasync.model.attention import _compile_errors
        from rlasync.model.loading import uncompile_decoder_layers

        if not self.compiled_layers or not isinstance(exc, _compile_errors()):
            return False
        uncompile_decoder_layers(self.model)
        self.compiled_layers = False
        logger.warning("compiled decoder layers failed (%s: %s); running them eagerly", type(exc).__name__, exc)
        return True

    # ---- one engine step ----------------------------------------------------------------------------------------

    def execute(self, chunks: Sequence[ChunkInput]) -> list[SampledToken | None]:
        """Run one step; returns, per chunk, its sampled token (None for a prefill chunk that does not sample)."""
        return self.collect(self.launch(chunks))

    def launch(self, chunks: Sequence[ChunkInput], previous: LaunchedStep | None = None) -> LaunchedStep:
        """Queue one step on the device and return without waiting for it (on CUDA); chunks with a `feedback_row`
        take their last input token from `previous`'s sampled ids on the device.

        Runs in a worker thread (or on the event loop: the engine's `launch_on_loop`): the engine's GPU is made
        current here (a thread starts on GPU 0, and Triton launches on the current device)."""
        with torch.inference_mode(), _on_device(self.device):
            logits = self.forward(chunks, previous.result.token_ids if previous and previous.result else None)
            specs = [chunk.sample for chunk in chunks if chunk.sample is not None]
            step = LaunchedStep([chunk.sample is not None for chunk in chunks], [spec.params for spec in specs])
            if not specs:
                return step
            step.result = self.sample_tensors(logits, specs)
            packed = pack_result(step.result)
            if packed.is_cuda:
                step.packed = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
                step.packed.copy_(packed, non_blocking=True)
                step.ready = torch.cuda.Event()
                step.ready.record()
            else:
                step.packed = packed
            return step

    def collect(self, step: LaunchedStep) -> list[SampledToken | None]:
        """Wait for a launched step and return, per chunk, its sampled token (None where it does not sample)."""
        if step.result is None:
            return [None] * len(step.samples)
        if step.ready is not None:
            step.ready.synchronize()
        sampled = unpack_packed(step.packed, step.result, step.params)
        if len(sampled) == len(step.samples):  # every chunk samples (a decode step)
            return sampled
        rows = iter(sampled)
        return [next(rows) if samples else None for samples in step.samples]

    def forward(self, chunks: Sequence[ChunkInput], feedback_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [S, V] float32 at the last position of each chunk that samples (S of them), in chunk order;
        `feedback_ids` [R] (device): the previous step's sampled ids, read by chunks with a `feedback_row`."""
        starts = [chunk.start for chunk in chunks]
        lengths = [len(chunk.token_ids) for chunk in chunks]
        block_ids = [chunk.block_ids for chunk in chunks]
        feedback = self._feedback(chunks, lengths, feedback_ids)
        graphs = self.graphs
        if graphs is not None and max(lengths) == 1 and len(chunks) <= graphs.max_batch_size:
            logits = graphs.run_decode([chunk.token_ids[0] for chunk in chunks], starts, block_ids, feedback)
            sampling = [i for i, chunk in enumerate(chunks) if chunk.sample is not None]
            if len(sampling) == len(chunks):  # a decode step: every request samples
                return logits[: len(chunks)]
            return logits.index_select(0, host_to_device(sampling, torch.int64, self.device))
        mixed = self.mixed
        if mixed is not None and mixed.fits(sum(lengths), len(chunks)):
            sampling = [i for i, chunk in enumerate(chunks) if chunk.sample is not None]
            logits = mixed.run([chunk.token_ids for chunk in chunks], starts, block_ids, sampling, feedback)
            return logits[: len(sampling)]
        self.eager_steps += 1
        flat_ids = [token for chunk in chunks for token in chunk.token_ids]
        ends = torch.tensor(lengths, dtype=torch.int64).cumsum(0) - 1
        rows = ends[[i for i, chunk in enumerate(chunks) if chunk.sample is not None]].to(self.device)
        meta = build_metadata(self.pool, starts, lengths, block_ids, self.device, self.backend)
        input_ids = torch.tensor(flat_ids, dtype=torch.int64).to(self.device, non_blocking=True)
        if feedback is not None:
            input_ids.index_copy_(0, *feedback)
        while True:
            try:
                hidden = self.decoder(
                    input_ids=input_ids[None],
                    position_ids=meta.positions[None],
                    attention_mask=self._no_mask,
                    use_cache=False,
                    paged_attention=meta,
                ).last_hidden_state[0]
                break
            except RuntimeError as exc:  # a compile failure: the same step again with eager layers
                if not self._compile_failed(exc):
                    raise
        return self.logits(hidden.index_select(0, rows))

    def _feedback(
        self, chunks: Sequence[ChunkInput], lengths: list[int], feedback_ids: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(flat input positions, their ids on the device) for the chunks whose last token is fed back."""
        pairs = []
        end = 0
        for chunk, length in zip(chunks, lengths):
            end += length
            if chunk.feedback_row is not None:
                pairs.append((end - 1, chunk.feedback_row))
        if not pairs:
            return None
        if feedback_ids is None:
            raise RuntimeError("a chunk feeds back a sampled token but no previous step was given")
        index = host_to_device([[p for p, _ in pairs], [r for _, r in pairs]], torch.int64, self.device)
        return index[0], feedback_ids.index_select(0, index[1])

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.head.weight, getattr(self.head, "bias", None)).float()

    def sample(self, logits: torch.Tensor, specs: Sequence[SampleSpec]) -> list[SampledToken]:
        return _unpack(self.sample_tensors(logits, specs), [spec.params for spec in specs])

    def sample_tensors(self, logits: torch.Tensor, specs: Sequence[SampleSpec]) -> Any:
        """The sampler's `SampleResult` (device tensors) for `logits` [S, V], one row per spec."""
        from rlasync.engine.sampler import BatchSampling, sample
        from rlasync.engine.sampler_compiled import sample_compiled
        from rlasync.model.attention import _compile_errors  # what the learner's compiled paths fall back on

        params = [spec.params for spec in specs]
        seeds = [spec.seed for spec in specs]
        slots = [spec.slot for spec in specs]
        if None not in slots:
            batch, steps = self.slots.batch(slots, params, seeds, [s.step for s in specs])
            wants_candidates = self.slots.wants_candidates(slots)
        else:
            batch = BatchSampling.from_params(params, seeds, self.device)
            steps = torch.tensor([spec.step for spec in specs], dtype=torch.int64, device=self.device)
            wants_candidates = any(p.filters and p.return_sampling_mask for p in params)
        seen = None
        if any(spec.seen_ids is not None for spec in specs):
            rows = [row for row, spec in enumerate(specs) for _ in spec.seen_ids or ()]
            ids = [token for spec in specs for token in spec.seen_ids or ()]
            seen = torch.zeros(len(specs), logits.shape[1], dtype=torch.bool, device=self.device)
            seen[torch.tensor(rows, device=self.device), torch.tensor(ids, device=self.device)] = True
        if self.compiled_sampler:
            try:
                return sample_compiled(logits, batch, steps, seen_tokens=seen, return_candidates=wants_candidates)
            except _compile_errors() as exc:  # inductor cannot serve this GPU or build: the eager sampler, same results
                logger.warning(
                    "compiled sampler failed (%s: %s); sampling eagerly from now on", type(exc).__name__, exc
                )
                self.compiled_sampler = False
        return sample(logits, batch, steps, seen_tokens=seen, return_candidates=wants_candidates)

    # ---- teacher-forced scoring ---------------------------------------------------------------------------------

    def score(self, token_ids: Sequence[int], prompt_length: int, top_k: int, temperature: float = 1.0) -> ScoreResult:
        """Top-k and realised-token log-probs of `token_ids[prompt_length:]` under softmax(logits / `temperature`),
        one plain forward."""
        with torch.inference_mode(), _on_device(self.device):
            ids = torch.tensor(list(token_ids), dtype=torch.int64, device=self.device)
            hidden = self.decoder(input_ids=ids[None], use_cache=False).last_hidden_state[0]
            hidden = hidden[prompt_length - 1 : -1]
            targets = ids[prompt_length:]
            k = min(top_k, self.vocab_size)
            topk_ids, topk_logprobs, token_logprobs = [], [], []
            for begin in range(0, hidden.shape[0], SCORE_CHUNK_ROWS):
                logits = self.logits(hidden[begin : begin + SCORE_CHUNK_ROWS])
                logprobs = torch.log_softmax(logits if temperature == 1.0 else logits / temperature, dim=-1)
                token_logprobs.append(logprobs.gather(1, targets[begin : begin + SCORE_CHUNK_ROWS, None])[:, 0])
                if k > 0:
                    values, indices = logprobs.topk(k, dim=-1)
                    topk_ids.extend(indices.tolist())
                    topk_logprobs.extend(values.tolist())
            if k <= 0:
                topk_ids = [[] for _ in range(hidden.shape[0])]
                topk_logprobs = [[] for _ in range(hidden.shape[0])]
            return ScoreResult(topk_ids, topk_logprobs, torch.cat(token_logprobs).tolist())


def _on_device(device: torch.device) -> Any:
    """`torch.cuda.device(device)` on CUDA, else a no-op context."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def pack_result(result: object) -> torch.Tensor:
    """The sampler's batched tensors as one [B, W] float64 tensor (ids are exact in float64), so a step's results
    leave the device in one copy: token id, log-prob, then top-N ids and log-probs, then candidates and their count
    (the parts present, in that order; `unpack_packed` reads them back)."""
    parts = [result.token_ids[:, None], result.logprobs[:, None]]
    for extra in (result.topn_ids, result.topn_logprobs, result.candidate_ids):
        if extra is not None:
            parts.append(extra)
    if result.num_candidates is not None:
        parts.append(result.num_candidates[:, None])
    return torch.cat([part.to(torch.float64) for part in parts], dim=1)


def unpack_packed(packed: torch.Tensor, result: object, params: Sequence[SamplingParams]) -> list[SampledToken]:
    """`pack_result`'s tensor (on the host) -> one `SampledToken` per row; `result` gives the parts' widths.

    Runs for every request at every step, so it reads the packed tensor by columns (one `tolist` per part, ids
    converted to int64 in bulk) and does per row only what needs a Python object of its own."""
    n = result.topn_ids.shape[1] if result.topn_ids is not None else 0
    c = result.candidate_ids.shape[1] if result.candidate_ids is not None else 0
    has_topn = result.topn_ids is not None
    has_candidates = result.candidate_ids is not None and result.num_candidates is not None
    token_ids = packed[:, 0].to(torch.int64).tolist()
    logprobs = packed[:, 1].tolist()
    if has_topn:  # a row per request, kept by it until it finishes (`TopLogprobs.from_rows`): no dict per token
        top_rows = packed[:, 2 : 2 + 2 * n].numpy().copy()  # a copy: the pinned buffer goes back to its allocator
    if has_candidates:
        begin = 2 + 2 * n  # the candidates' first column, their count after them
        candidate_ids = packed[:, begin : begin + c].to(torch.int64).tolist()
        counts = packed[:, begin + c].to(torch.int64).tolist()
    out = []
    append = out.append
    for row, p in enumerate(params):
        top = top_rows[row] if has_topn and p.num_logprobs > 0 else None
        candidates = None
        if has_candidates and p.return_sampling_mask and p.filters:
            candidates = candidate_ids[row][: counts[row]]
        append(SampledToken(token_ids[row], logprobs[row], top, candidates))
    return out


def _unpack(result: object, params: Sequence[SamplingParams]) -> list[SampledToken]:
    """The sampler's batched tensors -> one `SampledToken` per row (Python values), through one device copy."""
    return unpack_packed(pack_result(result).cpu(), result, params)
