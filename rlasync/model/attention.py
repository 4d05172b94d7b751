"""Tree attention for Hugging Face causal LMs over one packed row (SPEC §4.2-4.3, DESIGN §3 "Tree packing").

A packed row lays a prefix trie out depth-first, so node k's subtree is the index range [k, subtree_end[k]). One
rule gives the whole mask:

    key k is visible to query q  iff  k <= q < subtree_end[k]

(each token attends exactly its root path, the context it had when its sample was forwarded alone). Sliding-window
layers add `depth[q] - depth[k] < window` on depth positions, which along a root path equals the distance inside
the sample, so windows are exact too.

How it plugs into transformers (no module is patched):
  * `ATTENTION_NAME` ("rlasync_tree") is registered in `AttentionInterface` (the attention function) and in
    `AttentionMaskInterface` (transformers' own `sdpa_mask`, so a plain forward without a tree builds its usual
    causal / padding / sliding masks and runs transformers' SDPA function: the model stays usable as is).
  * A tree forward passes the row's full-attention mask as a 4D `attention_mask` (a bool [1, 1, N, N] tensor on
    the dense backend, a FlexAttention `BlockMask` on the flex backend). transformers returns a 4D mask unchanged,
    so it builds no mask of its own; the attention function ignores it and reads `tree_attention=TreeAttention`,
    a keyword argument the decoder forwards to every attention call, to pick the mask of the layer's window.

Backends (`TreeAttention.backend`):
  dense  a bool [N, N] mask through `scaled_dot_product_attention` (CPU, tests, reference);
  flex   one `BlockMask` per window built once per row directly from subtree_end (O(N) work, no [N, N] tensor),
         shared by all layers, through `torch.compile(flex_attention)` (CUDA).
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F

ATTENTION_NAME = "rlasync_tree"
ALLOWED_LAYER_TYPES = ("full_attention", "sliding_attention")
DEFAULT_BLOCK_SIZE = 128

logger = logging.getLogger(__name__)

Backend = Literal["dense", "flex"]


# ---- architecture checks -----------------------------------------------------------------------------------------


def check_tree_attention_support(model: torch.nn.Module) -> None:
    """Refuse, with a `ValueError`, a model tree attention cannot run exactly (SPEC §4.3, §11).

    Refused: any text-config `layer_types` other than full / sliding attention (recurrent or convolutional layers
    would mix the samples of a packed row) and any parameter named `*.sinks` (attention sinks). A model whose
    attention does not go through transformers' `AttentionInterface` is refused by `enable_tree_attention`.
    """
    check_layer_types(model.config)
    sinks = [name for name, _ in model.named_parameters() if name == "sinks" or name.endswith(".sinks")]
    if sinks:
        raise ValueError(
            f"tree packing does not support attention sinks, but this model has sink parameters ({sinks[0]}"
            f"{', ...' if len(sinks) > 1 else ''})"
        )


def check_layer_types(config: Any) -> None:
    """Refuse (`ValueError`) a config whose text `layer_types` include anything but full / sliding attention."""
    text = _text_config_of(config)
    layer_types = getattr(text, "layer_types", None) or []
    unsupported = sorted({str(kind) for kind in layer_types} - set(ALLOWED_LAYER_TYPES))
    if unsupported:
        raise ValueError(
            f"tree packing supports only {list(ALLOWED_LAYER_TYPES)} layers, but this model "
            f"({getattr(text, 'model_type', '?')}) has layer_types {unsupported}: recurrent or convolutional "
            "layers would mix the samples of a packed row"
        )


def enable_tree_attention(model: torch.nn.Module) -> torch.nn.Module:
    """Check `model` and switch its attention implementation to `ATTENTION_NAME` (in place; returns `model`)."""
    register_tree_attention()
    check_tree_attention_support(model)
    pretrained = _pretrained_root(model)
    if pretrained is None:
        raise ValueError(f"expected a transformers PreTrainedModel, got {type(model).__name__}")
    pretrained.set_attn_implementation(ATTENTION_NAME)
    if not uses_tree_attention(pretrained):
        raise ValueError(
            f"{type(pretrained).__name__} kept attn_implementation={_text_config(pretrained)._attn_implementation!r}: "
            "its attention does not go through transformers' AttentionInterface, so tree attention cannot be used"
        )
    return model


def uses_tree_attention(model: torch.nn.Module) -> bool:
    pretrained = _pretrained_root(model)
    return pretrained is not None and _text_config(pretrained)._attn_implementation == ATTENTION_NAME


def sliding_windows(model: torch.nn.Module) -> tuple[int, ...]:
    """The sliding windows the model's layers may request (built up front so a row's masks are all made once)."""
    text = _text_config(model)
    window = getattr(text, "sliding_window", None)
    layer_types = getattr(text, "layer_types", None)
    if not window or (layer_types and "sliding_attention" not in layer_types):
        return ()
    return (int(window),)


def _text_config(model: torch.nn.Module) -> Any:
    return _text_config_of(model.config)


def _text_config_of(config: Any) -> Any:
    get_text_config = getattr(config, "get_text_config", None)
    return get_text_config() if get_text_config is not None else config


def _pretrained_root(model: torch.nn.Module) -> Any:
    from transformers import PreTrainedModel

    return model if isinstance(model, PreTrainedModel) else None


# ---- the row's masks --------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class TreeAttention:
    """The attention masks of one packed row, built once and shared by every layer.

    `masks` maps a sliding window (None = full attention) to a bool [1, 1, N, N] tensor (dense) or a `BlockMask`
    (flex). `position_ids` ([N] depth) and `subtree_end` ([N]) are kept to build a window nobody announced.
    """

    backend: Backend
    subtree_end: torch.Tensor  # [N] int64
    position_ids: torch.Tensor  # [N] int64
    masks: dict[Any, Any]  # window -> mask; ("dense", window) -> the flex backend's dense fallback
    block_size: int = DEFAULT_BLOCK_SIZE
    compile: bool = True

    @property
    def num_tokens(self) -> int:
        return int(self.subtree_end.shape[0])

    @property
    def full_mask(self) -> Any:
        """The full-attention mask; passed to the model as its 4D `attention_mask` so it builds none itself."""
        return self.masks[None]

    def mask_for(self, sliding_window: int | None) -> Any:
        key = int(sliding_window) if sliding_window else None
        mask = self.masks.get(key)
        if mask is None:  # a window the config did not announce: build it now (eager only)
            mask = _build_mask(self.backend, self.subtree_end, self.position_ids, key, self.block_size)
            self.masks[key] = mask
        return mask


def build_tree_attention(
    subtree_end: torch.Tensor,
    position_ids: torch.Tensor,
    backend: Backend | Literal["auto"] = "auto",
    windows: Iterable[int] = (),
    block_size: int = DEFAULT_BLOCK_SIZE,
    compile: bool = True,
) -> TreeAttention:
    """Build the masks of one row for full attention and each sliding window in `windows`.

    `backend="auto"` picks flex on CUDA and dense elsewhere. `compile=False` runs flex_attention eagerly (only
    meant for checking the flex path on CPU: eager FlexAttention materialises the scores).
    """
    if subtree_end.ndim != 1 or position_ids.shape != subtree_end.shape:
        raise ValueError(
            f"subtree_end and position_ids must both be [N], got {tuple(subtree_end.shape)} and "
            f"{tuple(position_ids.shape)}"
        )
    if backend == "auto":
        backend = "flex" if subtree_end.device.type == "cuda" else "dense"
    if backend not in ("dense", "flex"):
        raise ValueError(f"unknown tree attention backend {backend!r}: use 'auto', 'dense' or 'flex'")
    subtree_end = subtree_end.long()
    position_ids = position_ids.long()
    masks: dict[int | None, Any] = {}
    for window in (None, *sorted({int(w) for w in windows if w})):
        masks[window] = _build_mask(backend, subtree_end, position_ids, window, block_size)
    return TreeAttention(backend, subtree_end, position_ids, masks, block_size, compile)


def _build_mask(
    backend: Backend, subtree_end: torch.Tensor, position_ids: torch.Tensor, window: int | None, block_size: int
) -> Any:
    if backend == "dense":
        return dense_tree_mask(subtree_end, position_ids, window)[None, None]
    return tree_block_mask(subtree_end, position_ids, window, block_size)


def dense_tree_mask(
    subtree_end: torch.Tensor, position_ids: torch.Tensor | None = None, sliding_window: int | None = None
) -> torch.Tensor:
    """[N, N] bool, True where query q (row) may attend key k (column): k <= q < subtree_end[k] (and the window)."""
    n = subtree_end.shape[0]
    index = torch.arange(n, device=subtree_end.device)
    q, k = index[:, None], index[None, :]
    mask = (k <= q) & (q < subtree_end[None, :])
    if sliding_window:
        if position_ids is None:
            raise ValueError("a sliding-window tree mask needs position_ids (the depth of each token)")
        mask &= (position_ids[:, None] - position_ids[None, :]) < sliding_window
    return mask


def tree_mask_mod(
    subtree_end: torch.Tensor, position_ids: torch.Tensor, sliding_window: int | None, padded_length: int
) -> Callable:
    """FlexAttention mask_mod of the tree rule. The captured tensors are padded to `padded_length` (a multiple of
    the block size) so reads at out-of-range indices of the last partial block stay in bounds (padding: invisible)."""
    n = subtree_end.shape[0]
    end = F.pad(subtree_end, (0, padded_length - n), value=0)
    if not sliding_window:

        def mask_mod(b, h, q_idx, kv_idx):
            return (kv_idx <= q_idx) & (q_idx < end[kv_idx])

        return mask_mod

    depth = F.pad(position_ids, (0, padded_length - n), value=0)

    def windowed_mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx < end[kv_idx]) & (depth[q_idx] - depth[kv_idx] < sliding_window)

    return windowed_mask_mod


def tree_block_sparsity(
    subtree_end: torch.Tensor,
    position_ids: torch.Tensor,
    sliding_window: int | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-level ([nb, nb] bool, query block x key block) `(partial, full)` maps of the tree mask, in O(N + nb²).

    Key block j holds keys [jB, (j+1)B). Key k is visible to the contiguous query range [k, subtree_end[k]), so
    block j reaches exactly the query blocks j .. (max_k subtree_end[k] - 1) // B. It is full for query block i
    > j iff every key's subtree covers the whole block: (i+1)B <= min_k subtree_end[k]. A window can only drop
    blocks (depth differences all >= window) or spoil fullness (some difference >= window); both are bounded with
    per-block depth extrema, so the map never drops a visible pair and never calls a masked pair full.
    """
    n = subtree_end.shape[0]
    num_blocks = max(1, math.ceil(n / block_size))
    pad = num_blocks * block_size - n
    device = subtree_end.device
    end_max = F.pad(subtree_end, (0, pad), value=0).view(num_blocks, block_size).amax(1)
    end_min = F.pad(subtree_end, (0, pad), value=n).view(num_blocks, block_size).amin(1)
    blocks = torch.arange(num_blocks, device=device)
    q_block, k_block = blocks[:, None], blocks[None, :]
    last_reached = torch.div(end_max - 1, block_size, rounding_mode="floor")
    nonempty = (k_block <= q_block) & (q_block <= last_reached[None, :])
    full = (k_block < q_block) & ((q_block + 1) * block_size <= end_min[None, :])
    if sliding_window:
        big = torch.iinfo(torch.int64).max // 4
        depth_max = F.pad(position_ids, (0, pad), value=-big).view(num_blocks, block_size).amax(1)
        depth_min = F.pad(position_ids, (0, pad), value=big).view(num_blocks, block_size).amin(1)
        nonempty &= (depth_min[:, None] - depth_max[None, :]) < sliding_window
        full &= (depth_max[:, None] - depth_min[None, :]) < sliding_window
    return nonempty & ~full, full & nonempty


def tree_block_mask(
    subtree_end: torch.Tensor,
    position_ids: torch.Tensor,
    sliding_window: int | None = None,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> Any:
    """The row's FlexAttention `BlockMask`, built from subtree_end without evaluating the mask on [N, N]."""
    from torch.nn.attention.flex_attention import BlockMask

    n = subtree_end.shape[0]
    partial, full = tree_block_sparsity(subtree_end, position_ids, sliding_window, block_size)
    num_blocks = partial.shape[0]
    kv_num_blocks, kv_indices = _ordered_blocks(partial)
    full_kv_num_blocks, full_kv_indices = _ordered_blocks(full)
    mask_mod = tree_mask_mod(subtree_end, position_ids, sliding_window, num_blocks * block_size)
    return BlockMask.from_kv_blocks(
        kv_num_blocks[None, None],
        kv_indices[None, None],
        full_kv_num_blocks[None, None],
        full_kv_indices[None, None],
        BLOCK_SIZE=block_size,
        mask_mod=mask_mod,
        seq_lengths=(n, n),
    )


def _ordered_blocks(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[nb, nb] bool -> (count per row [nb] int32, the present column indices first [nb, nb] int32)."""
    counts = blocks.sum(-1, dtype=torch.int32)
    order = torch.argsort(blocks.to(torch.int8), dim=-1, descending=True, stable=True)
    return counts, order.to(torch.int32)


# ---- the attention function ---------------------------------------------------------------------------------------


def tree_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    tree_attention: TreeAttention | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: query [B, Hq, N, D], key/value [B, Hkv, N, D] -> ([B, N, Hq, D], None).

    Without `tree_attention` this is a plain forward: transformers' SDPA function with the mask it built (or a
    plain eager softmax when the layer softcaps its scores, which SDPA cannot do).
    """
    if kwargs.get("s_aux") is not None:
        raise ValueError("tree attention does not support attention sinks (s_aux)")
    if tree_attention is None:
        return _plain_attention(module, query, key, value, attention_mask, scaling, dropout, softcap, **kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"tree attention runs on one packed row (batch 1), got batch {query.shape[0]}")
    if query.shape[2] != tree_attention.num_tokens or key.shape[2] != tree_attention.num_tokens:
        raise ValueError(
            f"tree attention masks were built for {tree_attention.num_tokens} tokens but the layer got "
            f"{query.shape[2]} queries and {key.shape[2]} keys (is a KV cache in use? pass use_cache=False)"
        )
    mask = tree_attention.mask_for(sliding_window)
    device_type = query.device.type
    if torch.is_autocast_enabled(device_type):  # as SDPA under autocast: q/k (fp32 after RoPE) and v in one dtype
        dtype = torch.get_autocast_dtype(device_type)
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    elif not query.dtype == key.dtype == value.dtype:  # e.g. a norm upcast q/k: attend in v's (the compute) dtype
        query, key = query.to(value.dtype), key.to(value.dtype)
    if tree_attention.backend == "flex" and not (tree_attention.compile and _FLEX_COMPILE_FAILED):
        if dropout:
            raise ValueError("tree attention on the flex backend does not support attention dropout")
        if torch.compiler.is_compiling():  # traced into an outer graph: that compile reports its own errors
            output = _flex_attention(query, key, value, mask, scaling, softcap, tree_attention.compile)
        else:
            output = _flex_or_dense(query, key, value, mask, scaling, softcap, tree_attention, sliding_window)
    elif tree_attention.backend == "flex":
        output = _masked_attention(query, key, value, _dense_mask(tree_attention, sliding_window), scaling, dropout,
                                   softcap)  # fmt: skip
    else:
        output = _masked_attention(query, key, value, mask, scaling, dropout, softcap)
    return output.transpose(1, 2).contiguous(), None


def _masked_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    scaling: float | None,
    dropout: float,
    softcap: float | None,
) -> torch.Tensor:
    """Attention under a bool mask broadcastable to [B, Hq, Q, K]; SDPA unless the scores are softcapped."""
    groups = query.shape[1] // key.shape[1]
    if softcap is None:
        return F.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling, enable_gqa=groups > 1
        )
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale
    scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = F.dropout(weights, p=dropout, training=dropout > 0)
    return torch.matmul(weights, value)


def _flex_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    block_mask: Any,
    scaling: float | None,
    softcap: float | None,
    compile: bool,
) -> torch.Tensor:
    from torch.nn.attention.flex_attention import flex_attention

    score_mod = None
    if softcap is not None:

        def score_mod(score, b, h, q_idx, kv_idx):
            return softcap * torch.tanh(score / softcap)

    # inside an outer torch.compile the call is traced into that graph; eagerly it needs its own compiled kernel
    attention = _compiled_flex_attention() if compile and not torch.compiler.is_compiling() else flex_attention
    return attention(
        query,
        key,
        value,
        score_mod=score_mod,
        block_mask=block_mask,
        scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1],
    )


def _flex_or_dense(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: Any,
    scaling: float | None,
    softcap: float | None,
    tree_attention: TreeAttention,
    sliding_window: int | None,
) -> torch.Tensor:
    """Compiled FlexAttention; if it fails to compile (Inductor finds no kernel for this shape, dtype or device),
    the dense fallback, for this call and every later one in this process (logged once)."""
    try:
        return _flex_attention(query, key, value, mask, scaling, softcap, tree_attention.compile)
    except _compile_errors() as exc:  # Inductor found no kernel for this shape/dtype/device: go dense
        if not tree_attention.compile:
            raise
        _flex_compile_failed(exc)
        return _masked_attention(query, key, value, _dense_mask(tree_attention, sliding_window), scaling, 0.0, softcap)


_FLEX_COMPILE_FAILED: list[str] = []  # the first compile error, once compiled FlexAttention failed in this process


def _compile_errors() -> tuple[type[BaseException], ...]:
    """The exceptions of a failed torch.compile (Dynamo's, and Inductor's where this torch has it)."""
    import torch._dynamo.exc

    errors: list[type[BaseException]] = [torch._dynamo.exc.TorchDynamoException]
    inductor = getattr(getattr(torch, "_inductor", None), "exc", None)
    if inductor is not None and hasattr(inductor, "InductorError"):
        errors.append(inductor.InductorError)
    return tuple(errors)


def _flex_compile_failed(exc: BaseException) -> None:
    """Remember (and log once) that compiled FlexAttention failed: tree attention goes dense from now on."""
    if not _FLEX_COMPILE_FAILED:
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[-1][:300]
        _FLEX_COMPILE_FAILED.append(first_line)
        logger.warning(
            "compiled FlexAttention failed (%s: %s); tree attention uses dense masks with SDPA from now on "
            "(memory grows with the square of the row length: lower token_budget if it runs out)",
            type(exc).__name__, first_line,
        )  # fmt: skip


def _dense_mask(tree_attention: TreeAttention, sliding_window: int | None) -> torch.Tensor:
    """The row's dense [1, 1, N, N] mask for `sliding_window`, built once per row (the flex backend's fallback)."""
    key = ("dense", int(sliding_window) if sliding_window else None)
    mask = tree_attention.masks.get(key)
    if mask is None:
        mask = _build_mask("dense", tree_attention.subtree_end, tree_attention.position_ids, key[1], 0)
        tree_attention.masks[key] = mask
    return mask


@functools.cache
def _compiled_flex_attention() -> Callable:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


def _plain_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None,
    dropout: float,
    softcap: float | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if softcap is None:
        sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
        return sdpa(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    q_len, kv_len = query.shape[2], key.shape[2]
    if attention_mask is None:  # transformers skipped a pure causal mask: bottom-right aligned lower triangle
        index_q = torch.arange(q_len, device=query.device)[:, None] + (kv_len - q_len)
        attention_mask = index_q >= torch.arange(kv_len, device=query.device)[None, :]
    elif attention_mask.dtype != torch.bool:
        attention_mask = attention_mask == 0
    output = _masked_attention(query, key, value, attention_mask[..., :kv_len], scaling, dropout, softcap)
    return output.transpose(1, 2).contiguous(), None


@functools.cache
def register_tree_attention() -> None:
    """Register `ATTENTION_NAME` with transformers (idempotent; done on import of `rlasync.model`)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, tree_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
