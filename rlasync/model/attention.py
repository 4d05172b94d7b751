"""Tree attention for Hugging Face causal LMs over one packed row (docs/algorithms.md §4.2-4.3, docs/design.md §3 "Tree packing"): the
attention function, its registration with transformers and the architecture checks.

The masks themselves (the rule `k <= q < subtree_end[k]`, `TreeAttention`, the dense and FlexAttention block masks)
are built in `rlasync.model.tree_mask` and `rlasync.model.block_mask`; their names are re-exported here.

Gated DeltaNet hybrids (`linear_attention` layers, docs/algorithms.md §4.3): `enable_tree_attention` wraps each
`*.linear_attn` module's forward (on the instance; state dict and class unchanged) so that a tree forward runs it
once per sample of a padding-free row (`sample_bounds`); rows that share a prefix are refused.

How it plugs into transformers (no module class is patched):
  * `ATTENTION_NAME` ("rlasync_tree") is registered in `AttentionInterface` (the attention function) and in
    `AttentionMaskInterface` (transformers' own `sdpa_mask`, so a plain forward without a tree builds its usual
    causal / padding / sliding masks and runs transformers' SDPA function: the model stays usable as is).
  * A tree forward passes the row's full-attention mask as a 4D `attention_mask` (a bool [1, 1, N, N] tensor on
    the dense backend, a FlexAttention `BlockMask` on the flex backend). transformers returns a 4D mask unchanged,
    so it builds no mask of its own; the attention function ignores it and reads `tree_attention=TreeAttention`,
    a keyword argument the decoder forwards to every attention call, to pick the mask of the layer's window.

Backends (`TreeAttention.backend`): dense (a bool mask through SDPA), flex (`torch.compile(flex_attention)` over a
`BlockMask`, CUDA; a compile failure falls back to the dense masks for the rest of the process) or varlen
(FlashAttention varlen over root-path segments, `rlasync.model.segment_attention`; softcapped scores go dense).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from rlasync.model.block_mask import (  # noqa: F401 - re-exported: these lived here first
    DEFAULT_BLOCK_SIZE,
    tree_block_mask,
    tree_block_sparsity,
    tree_mask_mod,
)
from rlasync.model.segment_attention import segment_attention
from rlasync.model.tree_mask import (  # noqa: F401 - re-exported: these lived here first
    Backend,
    TreeAttention,
    build_tree_attention,
    dense_tree_mask,
)

if TYPE_CHECKING:
    from transformers import PretrainedConfig

ATTENTION_NAME = "rlasync_tree"
ALLOWED_LAYER_TYPES = ("full_attention", "sliding_attention")
LINEAR_LAYER_TYPES = ("linear_attention",)  # gated DeltaNet: run one sample at a time (padding-free rows)
_BOUNDS_KEY = ("rlasync", "sample_bounds")  # TreeAttention.masks entry caching a row's sample bounds

logger = logging.getLogger(__name__)


# ---- architecture checks -----------------------------------------------------------------------------------------


def check_tree_attention_support(model: torch.nn.Module) -> None:
    """Refuse, with a `ValueError`, a model tree attention cannot run exactly (docs/algorithms.md §4.3, §11).

    Refused: any text-config `layer_types` other than full / sliding / linear attention (recurrent or convolutional
    layers would mix the samples of a packed row), linear-attention layers that are not gated DeltaNet modules
    under `linear_attn` (the layers `enable_tree_attention` runs one sample at a time), and any parameter named
    `*.sinks` (attention sinks). A model whose attention does not go through transformers' `AttentionInterface`
    is refused by `enable_tree_attention`.
    """
    check_layer_types(model.config)
    linear_attention_modules(model)  # raises for linear-attention layers it cannot run per sample
    sinks = [name for name, _ in model.named_parameters() if name == "sinks" or name.endswith(".sinks")]
    if sinks:
        raise ValueError(
            f"tree packing does not support attention sinks, but this model has sink parameters ({sinks[0]}"
            f"{', ...' if len(sinks) > 1 else ''})"
        )


def check_layer_types(config: PretrainedConfig) -> None:
    """Refuse (`ValueError`) a config whose text `layer_types` include anything but full / sliding / linear
    attention."""
    text = _text_config_of(config)
    layer_types = getattr(text, "layer_types", None) or []
    unsupported = sorted({str(kind) for kind in layer_types} - set(ALLOWED_LAYER_TYPES) - set(LINEAR_LAYER_TYPES))
    if unsupported:
        raise ValueError(
            f"tree packing supports only {list(ALLOWED_LAYER_TYPES + LINEAR_LAYER_TYPES)} layers (linear attention: "
            f"gated DeltaNet hybrids, trained padding-free), but this model ({getattr(text, 'model_type', '?')}) "
            f"has layer_types {unsupported}: recurrent or convolutional layers would mix the samples of a packed row"
        )


def has_linear_attention(model_or_config: torch.nn.Module | PretrainedConfig) -> bool:
    """Whether the model (or config) has linear-attention layers: it must then be trained padding-free (each sample
    its own chain, `TreeRow(share_prefixes=False)`), docs/algorithms.md §4.3."""
    config = getattr(model_or_config, "config", model_or_config)
    layer_types = getattr(_text_config_of(config), "layer_types", None) or []
    return any(str(kind) in LINEAR_LAYER_TYPES for kind in layer_types)


def linear_attention_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The gated DeltaNet token mixers (`*.linear_attn`) of a hybrid model; `ValueError` if the config announces
    linear-attention layers this function cannot find as such modules."""
    if not has_linear_attention(model):
        return []
    layer_types = [str(kind) for kind in getattr(_text_config(model), "layer_types", None) or []]
    expected = sum(kind in LINEAR_LAYER_TYPES for kind in layer_types)
    found = [module for name, module in model.named_modules() if name.endswith(".linear_attn")]
    unknown = sorted({type(m).__name__ for m in found if "GatedDeltaNet" not in type(m).__name__})
    if len(found) != expected or unknown:
        raise ValueError(
            f"this model announces {expected} linear_attention layers but has {len(found)} gated DeltaNet "
            f"`linear_attn` modules{f' (unknown kinds {unknown})' if unknown else ''}: only gated DeltaNet hybrids "
            "(Qwen3-Next, Qwen3.5) are supported, trained padding-free"
        )
    return found


def sample_bounds(tree: TreeAttention) -> list[tuple[int, int]]:
    """`[(start, end)]` of each sample of a padding-free row (every sample its own chain, nothing shared); a row
    whose samples share a prefix is refused (`ValueError`): a linear-attention layer cannot share one."""
    cached = tree.masks.get(_BOUNDS_KEY)
    if cached is not None:
        return cached
    depth = tree.position_ids.detach().cpu()
    subtree_end = tree.subtree_end.detach().cpu()
    n = int(depth.shape[0])
    starts = torch.nonzero(depth == 0).flatten().tolist() if n else []
    ends = [*starts[1:], n]
    lengths = torch.tensor([e - s for s, e in zip(starts, ends)], dtype=torch.int64)
    chains = bool(starts) and starts[0] == 0
    if chains:
        expected_depth = torch.arange(n) - torch.repeat_interleave(torch.tensor(starts), lengths)
        expected_end = torch.repeat_interleave(torch.tensor(ends), lengths)
        chains = bool((depth == expected_depth).all() and (subtree_end == expected_end).all())
    if n and not chains:
        raise ValueError(
            "this row shares prefixes between samples, but the model has linear-attention (gated DeltaNet) layers, "
            "which cannot share a prefix: pack it padding-free (TreeRow(share_prefixes=False); the GRPO learner "
            "does so for such models)"
        )
    bounds = list(zip(starts, ends))
    tree.masks[_BOUNDS_KEY] = bounds
    return bounds


def _per_sample_forward(forward: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`forward` of a linear-attention module, run once per sample of a padding-free row when a tree forward
    passes `tree_attention` (without it: the module's own forward, unchanged)."""

    @functools.wraps(forward)
    def run(*args: Any, tree_attention: TreeAttention | None = None, **kwargs: Any) -> torch.Tensor:
        if tree_attention is None:
            return forward(*args, **kwargs)
        hidden = kwargs.pop("hidden_states") if "hidden_states" in kwargs else args[0]
        if hidden.shape[0] != 1 or hidden.shape[1] != tree_attention.num_tokens:
            raise ValueError(f"linear attention on a packed row expects [1, {tree_attention.num_tokens}, H]")
        if kwargs.get("cache") is not None:
            raise ValueError("a packed tree forward runs without a cache (pass use_cache=False)")
        parts = [forward(hidden_states=hidden[:, s:e]) for s, e in sample_bounds(tree_attention)]
        return torch.cat(parts, dim=1)

    run.__rlasync_per_sample__ = True  # type: ignore[attr-defined]
    return run


def enable_tree_attention(model: torch.nn.Module) -> torch.nn.Module:
    """Check `model` and switch its attention implementation to `ATTENTION_NAME` (in place; returns `model`)."""
    register_tree_attention()
    check_tree_attention_support(model)
    pretrained = _pretrained_root(model)
    if pretrained is None:
        raise ValueError(f"expected a transformers PreTrainedModel, got {type(model).__name__}")
    pretrained.set_attn_implementation(ATTENTION_NAME)
    for module in linear_attention_modules(pretrained):  # the instance's forward; the class is left alone
        if not getattr(module.forward, "__rlasync_per_sample__", False):
            module.forward = _per_sample_forward(module.forward)
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


def _text_config_of(config: PretrainedConfig) -> PretrainedConfig:
    get_text_config = getattr(config, "get_text_config", None)
    return get_text_config() if get_text_config is not None else config


def _pretrained_root(model: torch.nn.Module) -> Any:
    from transformers import PreTrainedModel

    return model if isinstance(model, PreTrainedModel) else None


# ---- the row's masks --------------------------------------------------------------------------------------------

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
    device_type = query.device.type
    if torch.is_autocast_enabled(device_type):  # as SDPA under autocast: q/k (fp32 after RoPE) and v in one dtype
        dtype = torch.get_autocast_dtype(device_type)
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    elif not query.dtype == key.dtype == value.dtype:  # e.g. a norm upcast q/k: attend in v's (the compute) dtype
        query, key = query.to(value.dtype), key.to(value.dtype)
    if tree_attention.backend == "varlen" and softcap is None:
        if dropout:
            raise ValueError("tree attention on the varlen backend does not support attention dropout")
        return segment_attention(query, key, value, tree_attention.segments, scaling, sliding_window), None
    mask = tree_attention.mask_for(sliding_window) if tree_attention.backend != "varlen" else None
    if tree_attention.backend == "flex" and not (tree_attention.compile and _FLEX_COMPILE_FAILED):
        if dropout:
            raise ValueError("tree attention on the flex backend does not support attention dropout")
        if torch.compiler.is_compiling():  # traced into an outer graph: that compile reports its own errors
            output = _flex_attention(
                query, key, value, mask, scaling, softcap, tree_attention.compile, tree_attention.kernel_options
            )
        else:
            output = _flex_or_dense(query, key, value, mask, scaling, softcap, tree_attention, sliding_window)
    elif tree_attention.backend != "dense":  # flex that failed to compile; varlen with softcapped scores
        output = _masked_attention(
            query, key, value, tree_attention.dense_mask_for(sliding_window), scaling, dropout, softcap
        )
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
    kernel_options: dict[str, Any] | None = None,
) -> torch.Tensor:
    """FlexAttention over `block_mask`; `kernel_options` (`KernelSettings.flex_kernel_options`, a constant of the
    row's `TreeAttention`) passed through when set."""
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
        **({"kernel_options": kernel_options} if kernel_options else {}),
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
        return _flex_attention(
            query, key, value, mask, scaling, softcap, tree_attention.compile, tree_attention.kernel_options
        )
    except _compile_errors() as exc:  # Inductor found no kernel for this shape/dtype/device: go dense
        if not tree_attention.compile:
            raise
        _flex_compile_failed(exc)
        dense = tree_attention.dense_mask_for(sliding_window)
        return _masked_attention(query, key, value, dense, scaling, 0.0, softcap)


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
            type(exc).__name__,
            first_line,
        )


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
    """Register `ATTENTION_NAME` with transformers (idempotent; done on import of this module)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, tree_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])


register_tree_attention()
