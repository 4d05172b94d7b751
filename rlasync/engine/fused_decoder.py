"""`FusedDecoder`: the engine's paged steps through a Llama/Qwen2/Qwen3 decoder with its elementwise work fused
(`triton_layers`), the same modules' weights, the same numbers.

    transformers (eager), per layer                      fused, per layer
    input_layernorm (6 kernels)                          add_rms_norm (the previous layer's residual add with it)
    q/k/v_proj                                           q/k/v_proj (the same modules)
    q_norm, k_norm (Qwen3, 6 each), rotary (~10),        rope_rows x 3: norm + rotary of q into [N, Hq, D], of k
      transposes, the pool's two index copies              into the pool's slots, v's copy into the pool
    paged attention                                      paged attention (`paged_attention.attend_cached`)
    o_proj, residual add, post_attention_layernorm       o_proj, add_rms_norm
    gate/up_proj, SiLU, product, down_proj, residual     gate/up_proj, silu_mul, down_proj (its residual add in the
                                                           next layer's add_rms_norm, the last in the final norm's)

It is called as the transformers decoder is (`input_ids`, `position_ids`, `paged_attention`: the engine's
`DecodeGraphs`/`MixedGraphs` capture it like the decoder) and returns an object with `last_hidden_state`; a call
without `paged_attention` (the engine's teacher-forced `score`) goes to the transformers decoder. Nothing is copied:
the projections, norms' weights and embeddings are the model's own modules, so weight syncs (in-place copies) reach
it and the CUDA graphs that captured it.

`fusable(model)` says why a model cannot take it (None: it can); `check_fused(...)` compares each fused layer with
transformers' on a short prefill before the engine uses it (a kernel that compiles but computes wrong on some GPU
turns the fused layers off, logged, rather than reaching a run).
"""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import Any

import torch

from rlasync.engine import triton_layers
from rlasync.engine.paged_attention import PagedAttentionMetadata, attend_cached

logger = logging.getLogger(__name__)

FUSED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
CHECK_TOLERANCE = 0.05  # relative L2 error of a fused layer's output against transformers' same layer (bf16: ~0.005)


def _eps(norm: torch.nn.Module) -> float:
    return float(getattr(norm, "variance_epsilon", getattr(norm, "eps", 1e-6)))


def _head_norm(norm: torch.nn.Module | None) -> dict[str, Any]:
    """`rope_rows`' arguments for a per-head norm (Qwen3's q_norm / k_norm), none without one."""
    return {} if norm is None else {"norm_weight": norm.weight, "eps": _eps(norm)}


def fusable(model: torch.nn.Module) -> str | None:
    """Why `model` cannot run through `FusedDecoder` (None: it can)."""
    if not triton_layers.available():
        return "Triton is not installed"
    config = model.config
    if config.model_type not in FUSED_MODEL_TYPES:
        return f"model_type {config.model_type!r} (fused: {', '.join(FUSED_MODEL_TYPES)})"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r} (fused: silu)"
    if float(getattr(config, "partial_rotary_factor", 1.0) or 1.0) != 1.0:
        return "a partial rotary embedding"
    decoder = model.get_decoder()
    layer = decoder.layers[0]
    head_dim = int(layer.self_attn.head_dim)
    if head_dim & (head_dim - 1):
        return f"head_dim {head_dim} (fused: a power of two)"
    if not all(hasattr(layer.mlp, name) for name in ("gate_proj", "up_proj", "down_proj")):
        return f"{type(layer.mlp).__name__} is not a gate/up/down MLP"
    return None


class FusedDecoder:
    def __init__(self, decoder: torch.nn.Module) -> None:
        self.decoder = decoder
        config = decoder.config
        self.layers = list(decoder.layers[: config.num_hidden_layers])
        attn = self.layers[0].self_attn
        self.head_dim = int(attn.head_dim)
        self.num_heads = int(config.num_attention_heads)
        self.num_kv_heads = int(config.num_key_value_heads)

    def __call__(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        paged_attention: PagedAttentionMetadata | None = None,
        **kwargs: Any,
    ) -> Any:
        if paged_attention is None:
            return self.decoder(input_ids=input_ids, position_ids=position_ids, **kwargs)
        return SimpleNamespace(last_hidden_state=self.forward(input_ids, position_ids, paged_attention)[None])

    def forward(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor, meta: PagedAttentionMetadata
    ) -> torch.Tensor:
        """input_ids, position_ids [1, N] -> the final norm's output [N, hidden]."""
        decoder = self.decoder
        hidden = decoder.embed_tokens(input_ids)
        cos, sin = decoder.rotary_emb(hidden, position_ids)
        cos, sin = cos[0], sin[0]
        x, residual = hidden[0], None
        for layer in self.layers:
            x, residual = self._layer(layer, x, residual, cos, sin, meta)
        norm = decoder.norm
        return triton_layers.add_rms_norm(x, residual, norm.weight, _eps(norm))[0]

    def _layer(
        self,
        layer: torch.nn.Module,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: PagedAttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One decoder layer: x is the previous layer's MLP output (its residual not yet added) or, with `residual`
        None, the embeddings; returns this layer's MLP output and its residual stream after attention."""
        norm = layer.input_layernorm
        if residual is None:
            residual, normed = x, triton_layers.rms_norm(x, norm.weight, _eps(norm))
        else:
            normed, residual = triton_layers.add_rms_norm(x, residual, norm.weight, _eps(norm))
        attn = layer.self_attn
        index = attn.layer_idx
        d = self.head_dim
        q = triton_layers.rope_rows(
            attn.q_proj(normed), self.num_heads, d, cos=cos, sin=sin, **_head_norm(getattr(attn, "q_norm", None))
        )
        triton_layers.rope_rows(
            attn.k_proj(normed), self.num_kv_heads, d, cos=cos, sin=sin, **_head_norm(getattr(attn, "k_norm", None)),
            out=meta.pool.keys(index), slots=meta.slot_mapping,
        )  # fmt: skip
        triton_layers.rope_rows(
            attn.v_proj(normed), self.num_kv_heads, d, out=meta.pool.values(index), slots=meta.slot_mapping
        )
        out = attend_cached(q, index, meta, attn.scaling, getattr(attn, "sliding_window", None))
        out = attn.o_proj(out.reshape(out.shape[0], -1))
        norm = layer.post_attention_layernorm
        normed, residual = triton_layers.add_rms_norm(out, residual, norm.weight, _eps(norm))
        mlp = layer.mlp
        return mlp.down_proj(triton_layers.silu_mul(mlp.gate_proj(normed), mlp.up_proj(normed))), residual


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """||got - expected|| / ||expected|| (L2 over every element; an all-zero `expected` counts as tiny, not zero)."""
    return float((got - expected).norm() / expected.norm().clamp_min(1e-12))


def check_fused(
    fused: FusedDecoder, meta: PagedAttentionMetadata, input_ids: torch.Tensor, no_mask: torch.Tensor
) -> float:
    """The largest relative L2 error, over the decoder's layers, of one fused layer against transformers' same layer
    fed the same input: transformers' decoder runs the step (`meta`, `input_ids` [1, N]; `no_mask` the engine's empty
    4D mask) with each layer's input and output recorded, then each fused layer runs on its recorded input. Both
    write the step's keys and values to the pool.

    Layer by layer, not the last hidden states: in bfloat16 a deep model's two forwards drift apart through the
    layers by rounding alone (SmolLM2-135M's 30 layers: 0.06 on an H100, both as far from a float32 forward), while a
    wrong kernel shows in every layer it runs in."""
    positions = meta.positions[None]
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []

    def record(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        hidden = args[0] if args else kwargs["hidden_states"]
        seen.append((hidden, output[0] if isinstance(output, tuple) else output))

    hooks = [layer.register_forward_hook(record, with_kwargs=True) for layer in fused.layers]
    try:
        with torch.inference_mode():
            fused.decoder(
                input_ids=input_ids, position_ids=positions, attention_mask=no_mask, use_cache=False,
                paged_attention=meta,
            )  # fmt: skip
    finally:
        for hook in hooks:
            hook.remove()
    if len(seen) != len(fused.layers):
        raise RuntimeError(f"recorded {len(seen)} of the decoder's {len(fused.layers)} layers")
    with torch.inference_mode():
        cos, sin = fused.decoder.rotary_emb(seen[0][0], positions)
        worst = 0.0
        for layer, (hidden, expected) in zip(fused.layers, seen):
            out, residual = fused._layer(layer, hidden.reshape(-1, hidden.shape[-1]), None, cos[0], sin[0], meta)
            got = out.float() + residual.float()
            want = expected.reshape(got.shape).float()
            worst = max(worst, relative_error(got, want))
    return worst
