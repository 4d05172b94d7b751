"""Activation checkpointing chosen per decoder layer by memory (docs/algorithms.md §5.5).

Checkpointing every layer costs a whole extra forward (about a third more compute); a 0.6B model with 8K-token
rows needs about 10 GB of activations without it, and an H200 has 141 GB. So the learner checkpoints only as many
layers as it must:

    activation_bytes_per_token(config, ...)     -> (full, checkpointed) bytes one eager layer keeps per token
    compiled_activation_bytes_per_token(...)    -> the same for a torch.compile'd layer (what it saves, no margin)
    planner_bytes_per_token(model, mixed, ...)  -> the figures of the layers as the learner runs them (compiled or
                                                   eager; autocast, FSDP2's bf16 policy, or the weights' dtype): the
                                                   one source for the plan and the dry run's estimate
    activation_memory_budget(model, device,...) -> bytes left for activations (device x MEMORY_FRACTION - state)
    plan_checkpointing(num_layers, tokens, ...) -> CheckpointPlan: the fewest layers that fit, spread evenly
    apply_checkpoint_plan(model, plan.layers)   -> per-layer switch (the model's checkpointing already enabled)

`plan_checkpointing` is pure arithmetic (unit-tested in milliseconds). The per-token figures are derived from the
config (hidden, intermediate, heads, dtypes): the eager one calibrated against the tensors autograd saves for Llama
and Qwen3 layers (saved-tensor hooks, fp32, bf16 autocast over fp32 weights and pure bf16) with a 10% margin, the
compiled one counted on a compiled Qwen3 layer (no margin; the dry run's estimate built on it is within 1% of the
H200's measured peaks). The plan's safety margin is MEMORY_FRACTION (15% of the device left uncounted).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers import PretrainedConfig

logger = logging.getLogger(__name__)

# The plan's safety margin: of the device's memory (x gpu_share) the plan lets the learner's counted peak use. The
# counted peak (training state + FSDP2's gathered root and layers + one row's activations + the head's reserve) is an
# honest estimate, 0.3-0.8% under the allocated peaks measured on an H200 (bench/results/fsdp_fake_pg_h200.json).
# The other 15% covers what it does not count: the caching allocator's fragmentation (reserved over allocated, a few
# percent to ~10% in training steps), the CUDA context, cuBLAS/NCCL workspaces and the compiled kernels' scratch
# outside torch's allocator, small buffers (masks, rotary tables, row tensors). Erring high is the safe side: an OOM
# in the middle of a run costs far more than a few recomputed layers (~1/3 of a layer's forward each).
MEMORY_FRACTION = 0.85
ESTIMATE_MARGIN = 1.1  # over the calibrated element counts: the estimate errs high
HEAD_BUFFERS = 4  # [chunk, V] float32 buffers of the chunked LM head alive at once (logits, softmax, grads)
ADAM_STATES = 2  # float32 moments per trainable parameter
FSDP_UNSHARDED_LAYERS = 2  # FSDP2 holds the layer it runs and the one it prefetches unsharded


@dataclass(frozen=True)
class CheckpointPlan:
    """Which decoder layers run under activation checkpointing, and the estimate the choice rests on."""

    num_layers: int
    layers: tuple[int, ...]  # checkpointed layer indices, ascending
    reason: str  # "all" / "count" (the user's choice), "memory", "cpu", "disabled"
    tokens: int = 0  # the row token budget planned for
    estimate_bytes: int = 0  # activations of one row under this plan (reason "memory" only)
    available_bytes: int = 0  # memory left for activations, negative when the training state alone overflows

    @property
    def fits(self) -> bool:
        """Whether the estimate fits (True where nothing was estimated: the user chose the layers)."""
        return self.reason != "memory" or self.estimate_bytes <= self.available_bytes

    def describe(self) -> str:
        text = f"activation checkpointing on {len(self.layers)} of {self.num_layers} decoder layers ({self.reason})"
        if self.reason == "memory":
            text += (
                f": {self.tokens}-token rows need ~{self.estimate_bytes / 2**30:.1f} GiB of activations, "
                f"{self.available_bytes / 2**30:.1f} GiB available"
            )
            if not self.fits:
                text += " (does not fit even with every layer checkpointed: lower token_budget if it runs out)"
        return text


def spread(count: int, num_layers: int) -> tuple[int, ...]:
    """`count` layer indices spread evenly over `num_layers` (the middle of each of `count` equal slices)."""
    count = max(0, min(int(count), num_layers))
    return tuple(sorted({int((j + 0.5) * num_layers / count) for j in range(count)})) if count else ()


def plan_checkpointing(
    num_layers: int,
    tokens: int,
    full_bytes_per_token: float,
    checkpointed_bytes_per_token: float,
    available_bytes: float,
    *,
    layer_fixed_bytes: float = 0.0,
) -> CheckpointPlan:
    """The fewest checkpointed layers whose activations fit `available_bytes`, spread evenly over the depth.

    A layer without checkpointing keeps `full_bytes_per_token * tokens + layer_fixed_bytes` (the fixed part: e.g.
    the bf16 weight copies autocast saves) until backward; a checkpointed one keeps `checkpointed_bytes_per_token *
    tokens` (its input), and while any layer is checkpointed one layer's full activations exist again during its
    recompute. Everything fits -> none; nothing fits -> all (the estimate says so: `CheckpointPlan.fits`).
    """
    if num_layers < 0 or tokens < 0:
        raise ValueError(f"plan_checkpointing: num_layers={num_layers} and tokens={tokens} must be >= 0")
    full = full_bytes_per_token * tokens + layer_fixed_bytes
    saved = checkpointed_bytes_per_token * tokens

    def estimate(k: int) -> float:
        return (num_layers - k) * full + k * saved + (full if k else 0.0)

    if full <= saved:  # checkpointing would not save anything
        count = 0
    elif estimate(0) <= available_bytes:
        count = 0
    else:  # estimate(k) = L*full - k*(full - saved) + full for k >= 1
        count = math.ceil((num_layers * full + full - available_bytes) / (full - saved))
        count = max(1, min(num_layers, count))
    return CheckpointPlan(
        num_layers, spread(count, num_layers), "memory", tokens, int(estimate(count)), int(available_bytes)
    )


def activation_bytes_per_token(
    config: PretrainedConfig, compute_bytes: int, residual_bytes: int | None = None
) -> tuple[float, float]:
    """(full, checkpointed) bytes one decoder layer keeps per token until backward, from the text config.

    `compute_bytes`: the element size matmuls run in (2 under bf16 autocast or a bf16 model, 4 in float32);
    `residual_bytes`: the residual stream's and the norms' (the weights' dtype: 4 under autocast over float32
    weights; default `compute_bytes`). Element counts per token (H hidden, I intermediate, q/kv query and key-value
    widths, D head dim, NH heads): norms, residuals, q/k norm inputs, rotary tables in the residual dtype, 4H + q +
    kv + 2D + NH + 4; projection inputs and outputs, attention output, the MLP's gate/up/act/product in the compute
    dtype, 5H + 3q + 4kv + 4I. A checkpointed layer keeps its input (H, residual dtype).
    """
    hidden, intermediate, heads, head_dim, kv_heads = layer_dims(config)
    q, kv = heads * head_dim, kv_heads * head_dim
    residual_bytes = residual_bytes or compute_bytes
    residual = 4 * hidden + q + kv + 2 * head_dim + heads + 4
    compute = 5 * hidden + 3 * q + 4 * kv + 4 * intermediate
    full = ESTIMATE_MARGIN * (residual * residual_bytes + compute * compute_bytes)
    return full, float(hidden * residual_bytes)


def layer_dims(config: PretrainedConfig) -> tuple[int, int, int, int, int]:
    """(hidden, intermediate, attention heads, head dim, key-value heads) of a decoder layer, from the text config
    (the usual defaults where a config leaves one out)."""
    text = getattr(config, "get_text_config", lambda: config)()
    hidden = int(text.hidden_size)
    intermediate = int(getattr(text, "intermediate_size", None) or 4 * hidden)
    heads = int(text.num_attention_heads)
    head_dim = int(getattr(text, "head_dim", None) or hidden // heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    return hidden, intermediate, heads, head_dim, kv_heads


def compiled_activation_bytes_per_token(
    config: PretrainedConfig, compute_bytes: int, residual_bytes: int | None = None
) -> tuple[float, float]:
    """(full, checkpointed) bytes one torch.compile'd decoder layer keeps per token until backward.

    Inductor's min-cut partitioner recomputes the elementwise ops in backward, so a compiled layer keeps less than an
    eager one (`activation_bytes_per_token`): counted with saved-tensor hooks on a compiled Qwen3 layer (bf16, float32,
    and bf16 autocast over float32 weights; the same graph partition on the CPU as on CUDA), per token: the layer's
    input and the attention residual in the residual dtype (2H); the two norms' outputs, the q/k projections and
    their rotated copies, v, the attention output and the MLP's gate, up and product in the compute dtype (2H + 3q
    + 3kv + 3I); float32 statistics: two norm rstd, the q/k-norm rstd and the attention log-sum-exp (2 + 2NH + KVH).
    No margin: this is what the graph saves (a model without q/k norms saves q + kv fewer elements, so it errs high
    there). A checkpointed layer keeps its input (H, residual dtype).
    """
    hidden, intermediate, heads, head_dim, kv_heads = layer_dims(config)
    q, kv = heads * head_dim, kv_heads * head_dim
    residual_bytes = residual_bytes or compute_bytes
    compute = 2 * hidden + 3 * q + 3 * kv + 3 * intermediate
    full = 2 * hidden * residual_bytes + compute * compute_bytes + 4 * (2 + 2 * heads + kv_heads)
    return float(full), float(hidden * residual_bytes)


def layer_element_bytes(weight_bytes: int, *, mixed: bool, world_size: int = 1) -> tuple[int, int, bool]:
    """(compute, residual, autocast): the element sizes a decoder layer's matmuls and its residual stream run in, and
    whether autocast runs them, as the learner sets its precision up. `mixed`: bf16 compute over float32 weights
    (`bf16=True` on a GPU). With one rank that is autocast: bf16 matmuls, the residual stream and the norms in the
    weights' float32, a bf16 copy of each weight saved for backward. With several, FSDP2's MixedPrecisionPolicy casts
    the parameters and each layer's input to bf16: the whole layer is bf16. Otherwise everything is in the weights'
    dtype."""
    if not mixed:
        return weight_bytes, weight_bytes, False
    if world_size > 1:
        return 2, 2, False
    return 2, weight_bytes, True


def planner_bytes_per_token(
    model: torch.nn.Module, *, mixed: bool = False, world_size: int = 1, compiled: bool = False
) -> tuple[float, float, float]:
    """(full, checkpointed, fixed) bytes per decoder layer as the learner runs it: the one source of these figures
    for the "auto" plan (`plan_for_model`) and the dry run's estimate (`rlasync.learner.dry_run`).

    `compiled` layers: what a compiled layer saves (`compiled_activation_bytes_per_token`, counted, no margin; the
    dry run's estimate built on it lies within 1% of the H200 peaks of bench/results/fsdp_fake_pg_h200.json); eager
    ones: `activation_bytes_per_token` (its ESTIMATE_MARGIN over the counted elements). The element sizes are
    `layer_element_bytes(mixed, world_size)`; the fixed part is autocast's bf16 weight copies (one rank, mixed)."""
    weight_bytes = next(model.parameters()).element_size()
    compute_bytes, residual_bytes, autocast = layer_element_bytes(weight_bytes, mixed=mixed, world_size=world_size)
    per_token = compiled_activation_bytes_per_token if compiled else activation_bytes_per_token
    full, saved = per_token(model.config, compute_bytes, residual_bytes)
    fixed = compute_bytes * decoder_layer_params(decoder_layers(model)[0]) if autocast else 0.0
    return full, saved, float(fixed)


def fsdp_unsharded_bytes(model: torch.nn.Module, *, world_size: int, compute_bytes: int) -> int:
    """What FSDP2 holds gathered on a rank besides its shards (0 with one rank): the root's parameters (embedding, LM
    head, final norm: gathered from its forward to its backward) and FSDP_UNSHARDED_LAYERS decoder layers (the one
    it runs and the one it prefetches), in the compute dtype (bf16 under the MixedPrecisionPolicy)."""
    if world_size <= 1:
        return 0
    layers = decoder_layers(model)
    layer = decoder_layer_params(layers[0])
    root = sum(p.numel() for p in model.parameters()) - len(layers) * layer
    return int((root + FSDP_UNSHARDED_LAYERS * layer) * compute_bytes)


def sharded_state_bytes(
    model: torch.nn.Module,
    *,
    world_size: int = 1,
    optimizer_states: int = ADAM_STATES,
    moment_bytes: int | None = None,
) -> int:
    """Weights, gradients and `optimizer_states` moments per trainable parameter that one rank holds (FSDP2 shards all
    three over `world_size`). The gradients are in the parameters' dtype, and so are torch's AdamW moments
    (`zeros_like(param)`) unless `moment_bytes` says otherwise."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    trainable = [p for p in model.parameters() if p.requires_grad]
    grads = sum(p.numel() * p.element_size() for p in trainable)
    states = sum(p.numel() * (moment_bytes or p.element_size()) * optimizer_states for p in trainable)
    return (weights + grads + states) // max(1, world_size)


def training_state_bytes(
    model: torch.nn.Module,
    *,
    world_size: int = 1,
    optimizer_states: int = ADAM_STATES,
    mixed: bool = False,
    tokens: int = 0,
) -> int:
    """What the "auto" plan reserves before the decoder layers' activations: the sharded training state
    (`sharded_state_bytes`, its moments counted as float32), what FSDP2 holds gathered (`fsdp_unsharded_bytes`, in
    bf16 when `mixed`), a `tokens`-token row's final-norm and LM-head inputs (every token a loss term), and the
    chunked LM head's CPU-sized buffers (on a GPU the head sizes its chunks and kept logits by the memory free then:
    at most 3/8 of it, so it eats into MEMORY_FRACTION's margin by design and never fills it)."""
    state = sharded_state_bytes(model, world_size=world_size, optimizer_states=optimizer_states, moment_bytes=4)
    weight_bytes = next(model.parameters()).element_size()
    compute_bytes, residual_bytes, _ = layer_element_bytes(weight_bytes, mixed=mixed, world_size=world_size)
    state += fsdp_unsharded_bytes(model, world_size=world_size, compute_bytes=compute_bytes)
    hidden = int(getattr(model.config, "get_text_config", lambda: model.config)().hidden_size)
    state += max(0, int(tokens)) * hidden * (residual_bytes + compute_bytes)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head_bytes = 0
    if head is not None and getattr(head, "weight", None) is not None:
        from rlasync.model.head import default_chunk_size

        vocab = int(head.weight.shape[0])
        head_bytes = HEAD_BUFFERS * default_chunk_size(vocab) * vocab * 4
    return state + head_bytes


def activation_memory_budget(
    model: torch.nn.Module,
    device: torch.device,
    *,
    world_size: int = 1,
    mixed: bool = False,
    tokens: int = 0,
    fraction: float = MEMORY_FRACTION,
) -> int:
    """Bytes left for one row's activations on a CUDA `device`: the smaller of total x fraction minus the training
    state, and the memory free now x fraction minus what of the state is not allocated yet (another process on the
    same device, e.g. a colocated engine, counts)."""
    free, total = torch.cuda.mem_get_info(device)
    state = training_state_bytes(model, world_size=world_size, mixed=mixed, tokens=tokens)
    resident = torch.cuda.memory_allocated(device)  # this process' weights, already loaded
    return int(min(total * fraction - state, free * fraction - max(0, state - resident)))


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder's repeated blocks (`model.model.layers` for the Llama/Qwen families)."""
    layers = getattr(model.get_decoder(), "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: cannot find the decoder layers (expected get_decoder().layers)")
    return list(layers)


def decoder_layer_params(layer: torch.nn.Module) -> int:
    return sum(p.numel() for p in layer.parameters())


def plan_for_model(
    model: torch.nn.Module,
    choice: str | int,
    *,
    device: torch.device,
    tokens: int,
    enabled: bool = True,
    mixed: bool = False,
    world_size: int = 1,
    compiled: bool = False,
    gpu_share: float = 1.0,
) -> CheckpointPlan:
    """The plan of `gradient_checkpointing_layers=choice` for `model` on `device` ("auto": by memory on CUDA, every
    layer elsewhere; "all"; an int: that many layers, spread evenly; `enabled=False`: none). `gpu_share` (0, 1]: the
    part of the device the learner was given (`cluster.learner_num_gpus` when it shares the GPU with an engine that
    may allocate after the plan is made): the budget is that part of the device's memory. "auto" weighs the layers as
    they run (`planner_bytes_per_token`): `mixed` (bf16 compute over float32 weights: autocast with one rank, FSDP2's
    MixedPrecisionPolicy with several) and `compiled` decoder layers."""
    layers = decoder_layers(model)
    num_layers = len(layers)
    if not enabled:
        return CheckpointPlan(num_layers, (), "disabled")
    if choice == "all":
        return CheckpointPlan(num_layers, tuple(range(num_layers)), "all")
    if isinstance(choice, int) and not isinstance(choice, bool):
        if not 0 <= choice <= num_layers:
            raise ValueError(
                f"gradient_checkpointing_layers={choice}: the model has {num_layers} decoder layers; use 0..{num_layers}, "
                "'all' or 'auto'"
            )
        return CheckpointPlan(num_layers, spread(choice, num_layers), "count")
    if choice != "auto":
        raise ValueError(f"gradient_checkpointing_layers={choice!r}: use 'auto', 'all' or a number of layers")
    if device.type != "cuda":
        return CheckpointPlan(num_layers, tuple(range(num_layers)), "cpu")
    if tokens <= 0:  # fixed-count rows: their size is not known before the step
        return CheckpointPlan(num_layers, tuple(range(num_layers)), "no token_budget")
    full, saved, fixed = planner_bytes_per_token(model, mixed=mixed, world_size=world_size, compiled=compiled)
    if not 0 < gpu_share <= 1:
        raise ValueError(f"gpu_share={gpu_share}: must be in (0, 1] (the learner's part of its GPU)")
    available = activation_memory_budget(
        model, device, world_size=world_size, mixed=mixed, tokens=tokens, fraction=MEMORY_FRACTION * gpu_share
    )
    plan = plan_checkpointing(num_layers, tokens, full, saved, available, layer_fixed_bytes=fixed)
    return plan


def replan_for_eager_layers(
    model: torch.nn.Module, plan: CheckpointPlan, *, mixed: bool, world_size: int
) -> CheckpointPlan:
    """The "auto" plan again, on the same budget, for layers that now run eager (the learner's fallback when compiling
    them failed: an eager layer keeps about 3x what a compiled one does). Any other plan is returned as it is."""
    if plan.reason != "memory":
        return plan
    full, saved, fixed = planner_bytes_per_token(model, mixed=mixed, world_size=world_size, compiled=False)
    return plan_checkpointing(plan.num_layers, plan.tokens, full, saved, plan.available_bytes, layer_fixed_bytes=fixed)


def apply_checkpoint_plan(model: torch.nn.Module, layers: Sequence[int]) -> None:
    """Checkpoint exactly the decoder layers `layers` (the model's checkpointing must already be enabled: this only
    switches the other layers off; transformers' `GradientCheckpointingLayer` reads the flag on every call)."""
    chosen = set(int(i) for i in layers)
    all_layers = decoder_layers(model)
    bad = sorted(chosen - set(range(len(all_layers))))
    if bad:
        raise ValueError(f"checkpoint layers {bad} out of range: the model has {len(all_layers)} decoder layers")
    for index, layer in enumerate(all_layers):
        if not hasattr(layer, "gradient_checkpointing"):
            raise ValueError(f"decoder layer {type(layer).__name__} has no per-layer gradient_checkpointing switch")
        layer.gradient_checkpointing = index in chosen


def checkpointed_layers(model: torch.nn.Module) -> tuple[int, ...]:
    """Indices of the decoder layers that run under activation checkpointing now."""
    return tuple(i for i, layer in enumerate(decoder_layers(model)) if getattr(layer, "gradient_checkpointing", False))


__all__ = [
    "CheckpointPlan",
    "activation_bytes_per_token",
    "activation_memory_budget",
    "apply_checkpoint_plan",
    "checkpointed_layers",
    "compiled_activation_bytes_per_token",
    "decoder_layers",
    "fsdp_unsharded_bytes",
    "layer_element_bytes",
    "plan_checkpointing",
    "plan_for_model",
    "planner_bytes_per_token",
    "replan_for_eager_layers",
    "sharded_state_bytes",
    "spread",
    "training_state_bytes",
]
