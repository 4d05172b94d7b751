"""Forward over packed rows: the decoder with tree attention, then the chunked head (docs/algorithms.md §4.3, §5.1).

    PackedRow (numpy, rlasync.packing) --packed_row_to_tensors--> PackedRowTensors (torch, on the device)
        --packed_token_scores(model, row)--> decoder over the row's N unique tokens (tree attention, position_ids =
        depth) -> hidden states gathered at token_index [M, H] -> chunked head -> TokenScores [M]

The model's own `lm_head` forward is never called (no [N, vocab] logits): the head weight is read from
`get_output_embeddings()`. Under FSDP2 wrap a `TreeScorer` (the decoder layers, then the scorer as the root), so
one root forward all-gathers the embedding, final norm and head weight and the chunked head reads them unsharded.

`sequence_logprobs` is the public comparison helper: per-completion-token log-probs of plain sequences, either
tree-packed in one row or one sequence at a time through the model's ordinary forward (the reference).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any, Literal

import numpy as np
import torch

from rlasync.config.kernels import KernelSettings
from rlasync.model.attention import (
    DEFAULT_BLOCK_SIZE,
    Backend,
    build_tree_attention,
    sliding_windows,
    uses_tree_attention,
)
from rlasync.model.devices import to_device
from rlasync.model.head import LogitTransform, TokenScores, chunked_token_scores
from rlasync.model.segment_attention import SegmentPlan, segment_plan


@dataclass(frozen=True)
class PackedRowTensors:
    """The tensors of one `PackedRow` the forward and the loss read (same names and shapes, torch, one device)."""

    input_ids: torch.Tensor  # [N] int64 unique tokens in DFS order
    position_ids: torch.Tensor  # [N] int64 depth in the trie
    subtree_end: torch.Tensor  # [N] int64 key k is visible to query q iff k <= q < subtree_end[k]
    token_index: torch.Tensor  # [M] int64 packed position whose output predicts the target
    target_ids: torch.Tensor  # [M] int64
    sampler_logprobs: torch.Tensor  # [M] float32
    advantages: torch.Tensor  # [M] float32
    sample_index: torch.Tensor  # [M] int64
    sampler_topk_ids: torch.Tensor | None = None  # [M, K] int64, -1 padded
    sampler_topk_logprobs: torch.Tensor | None = None  # [M, K] float32, -inf padded
    sampling_mask: torch.Tensor | None = None  # [M, C] int64 candidate ids, -1 padded
    has_sampling_mask: torch.Tensor | None = None  # [M] bool
    segments: SegmentPlan | None = None  # the varlen tree attention's plan, made on the host

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_terms(self) -> int:
        return int(self.token_index.shape[0])


def packed_row_to_tensors(row: Any, device: torch.device | str = "cpu", *, segments: bool = False) -> PackedRowTensors:
    """Convert a `rlasync.packing.PackedRow` (or anything with its fields) to `PackedRowTensors` on `device` (to
    a GPU from pinned memory, without waiting for the work queued there); `segments=True` also plans the varlen
    tree attention from the row's host arrays (`segment_plan`)."""
    values: dict[str, Any] = {}
    for field in fields(PackedRowTensors):
        array = getattr(row, field.name, None) if field.name != "segments" else None
        values[field.name] = None if array is None else to_device(torch.as_tensor(np.asarray(array)), device)
    if segments:
        values["segments"] = segment_plan(row.subtree_end, row.position_ids).to(device)
    return PackedRowTensors(**values)


class TreeScorer(torch.nn.Module):
    """A causal LM whose forward scores one packed row: `TreeScorer(model)(row) -> TokenScores`.

    Holds the model (tree attention enabled) as `self.model`. It exists so the whole scoring (decoder and chunked
    head) is one module call: apply FSDP2 to `scorer.model`'s decoder layers and then to the scorer itself.
    `kernels` (the run's `KernelSettings`, default the defaults) choose the tree attention backend, FlexAttention's
    kernel options and the head's compile and keep settings.
    """

    def __init__(self, model: torch.nn.Module, kernels: KernelSettings | None = None) -> None:
        super().__init__()
        if not uses_tree_attention(model):
            raise ValueError(
                "TreeScorer needs a model with tree attention: load it with rlasync.model.load_model or call "
                "rlasync.model.enable_tree_attention(model) first"
            )
        self.model = model
        self.kernels = KernelSettings.of(kernels)

    @property
    def backend(self) -> Backend | Literal["auto"]:
        """The tree attention backend the kernels name ("auto": flex on CUDA, dense elsewhere)."""
        return self.kernels.tree_attention

    def forward(self, row: PackedRowTensors, temperature: float = 1.0, chunk_size: int | None = None) -> TokenScores:
        return _packed_token_scores(
            self.model, row, temperature, chunk_size, self.backend, DEFAULT_BLOCK_SIZE, True, self.kernels
        )


def packed_token_scores(
    model: torch.nn.Module,
    row: PackedRowTensors,
    temperature: float = 1.0,
    chunk_size: int | None = None,
    *,
    backend: Backend | Literal["auto"] = "auto",
    block_size: int = DEFAULT_BLOCK_SIZE,
    compile_flex: bool = True,
    kernels: KernelSettings | None = None,
) -> TokenScores:
    """Per loss term log-prob, entropy and sampler top-K log-probs of one packed row (docs/algorithms.md §5.1, §5.3).

    `model` is a causal LM with tree attention enabled, or a `TreeScorer` (then its own forward runs, which is
    what FSDP2 needs). Terms with a sampling mask are renormalised over their candidate set. `backend`: "auto"
    (`kernels.tree_attention`, then `rlasync.model.tree_mask.resolve_backend`), "dense", "flex" or "varlen";
    `compile_flex=False` runs flex eagerly (CPU checks only). `kernels`: the `KernelSettings` (default: a
    `TreeScorer`'s own, else the defaults).
    """
    if isinstance(model, TreeScorer):
        if (backend, block_size, compile_flex, kernels) == ("auto", DEFAULT_BLOCK_SIZE, True, None):
            return model(row, temperature=temperature, chunk_size=chunk_size)
        kernels = kernels or model.kernels
        model = model.model
    if not uses_tree_attention(model):
        raise ValueError(
            "packed_token_scores needs a model with tree attention: load it with rlasync.model.load_model or call "
            "rlasync.model.enable_tree_attention(model) first"
        )
    kernels = KernelSettings.of(kernels)
    if backend == "auto":
        backend = kernels.tree_attention
    return _packed_token_scores(model, row, temperature, chunk_size, backend, block_size, compile_flex, kernels)


def _packed_token_scores(
    model: torch.nn.Module,
    row: PackedRowTensors,
    temperature: float,
    chunk_size: int | None,
    backend: Backend | Literal["auto"],
    block_size: int,
    compile_flex: bool,
    kernels: KernelSettings,
) -> TokenScores:
    tree = build_tree_attention(
        row.subtree_end,
        row.position_ids,
        backend,
        sliding_windows(model),
        block_size,
        compile_flex,
        row.segments,
        kernel_options=kernels.flex_kernel_options,
    )
    outputs = model.get_decoder()(
        input_ids=row.input_ids[None],
        position_ids=row.position_ids[None],
        attention_mask=tree.full_mask,  # 4D: transformers builds no mask of its own
        use_cache=False,
        tree_attention=tree,
    )
    hidden = outputs.last_hidden_state[0].index_select(0, row.token_index)
    head = model.get_output_embeddings()
    return chunked_token_scores(
        hidden,
        head.weight,
        row.target_ids,
        bias=getattr(head, "bias", None),
        temperature=temperature,
        transform=LogitTransform.from_config(model.config),
        extra_ids=row.sampler_topk_ids,
        candidate_ids=row.sampling_mask,
        has_candidates=row.has_sampling_mask,
        chunk_size=chunk_size,
        keep_as=kernels.head_keep,
        compile_kernels=None if kernels.head_compile else False,
        dynamic=kernels.head_dynamic,
    )


def sequence_logprobs(
    model: torch.nn.Module,
    sequences: Sequence[Sequence[int] | np.ndarray | torch.Tensor],
    prompt_lengths: Sequence[int],
    packing: Literal["tree", "none"] = "tree",
    temperature: float = 1.0,
    *,
    chunk_size: int | None = None,
    backend: Backend | Literal["auto"] = "auto",
) -> list[torch.Tensor]:
    """Each sequence's log-probs of its tokens at positions >= prompt_length ([L_i - P_i] float32, with grad).

    packing="tree": all sequences in one tree-packed row (rlasync.packing builds the trie), scored by
    `packed_token_scores` (the model needs tree attention). packing="none": one sequence at a time through the
    model's ordinary forward and full logits, `log_softmax(logits / temperature)` (the reference).
    """
    if isinstance(model, TreeScorer):
        model = model.model
    ids = [np.asarray(torch.as_tensor(seq).cpu(), dtype=np.int64).reshape(-1) for seq in sequences]
    lengths = [int(p) for p in prompt_lengths]
    if len(ids) != len(lengths):
        raise ValueError(f"got {len(ids)} sequences but {len(lengths)} prompt lengths")
    for i, (seq, prompt_length) in enumerate(zip(ids, lengths)):
        if not 1 <= prompt_length <= len(seq):
            raise ValueError(
                f"sequence {i}: prompt_length must be in [1, {len(seq)}] (the first token has no prediction), "
                f"got {prompt_length}"
            )
    if packing == "none":
        return [_plain_logprobs(model, seq, p, temperature) for seq, p in zip(ids, lengths)]
    if packing != "tree":
        raise ValueError(f"packing must be 'tree' or 'none', got {packing!r}")
    return _tree_logprobs(model, ids, lengths, temperature, chunk_size, backend)


def _model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def _plain_logprobs(model: torch.nn.Module, ids: np.ndarray, prompt_length: int, temperature: float) -> torch.Tensor:
    device = _model_device(model)
    input_ids = torch.as_tensor(ids, device=device)
    if prompt_length == len(ids):
        return torch.zeros(0, dtype=torch.float32, device=device)
    logits = model(input_ids=input_ids[None], use_cache=False).logits[0, prompt_length - 1 : -1]
    logprobs = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logprobs.gather(1, input_ids[prompt_length:, None]).squeeze(1)


def _tree_logprobs(
    model: torch.nn.Module,
    ids: list[np.ndarray],
    prompt_lengths: list[int],
    temperature: float,
    chunk_size: int | None,
    backend: Backend | Literal["auto"],
) -> list[torch.Tensor]:
    from rlasync.packing import TreeRow, pack
    from rlasync.records import RolloutSample

    row = TreeRow()
    for seq, prompt_length in zip(ids, prompt_lengths):
        completion_mask = (np.arange(len(seq)) >= prompt_length).astype(np.int8)
        row.add(
            RolloutSample(
                input_ids=seq,
                completion_mask=completion_mask,
                sampler_logprobs=np.zeros(len(seq), dtype=np.float32),
                advantage=0.0,
                group_id=0,
            )
        )
    tensors = packed_row_to_tensors(pack(row), _model_device(model))
    scores = packed_token_scores(model, tensors, temperature, chunk_size, backend=backend)
    # loss terms come in sample order, then position order: one per completion token
    return list(torch.split(scores.logprobs, [len(seq) - p for seq, p in zip(ids, prompt_lengths)]))
