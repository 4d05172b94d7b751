"""One learner rank's memory, measured or estimated, for `rlasync train CONFIG --dry-run` (and the GPU tests).

    measure_rank(model, settings, world_size, samples)   one rank of an N-rank learner through full training steps
                                                         under torch's fake process group (N > 1: the "fake"
                                                         backend of `torch.testing._internal.distributed.fake_pg`,
                                                         as torchtitan's `comm.mode=fake_backend` dry run): the
                                                         FSDP2 sharding, the mixed precision, the compiled layers,
                                                         the LM head, the optimizer and the weight-sync gather run
                                                         as on a real rank; only the collectives are no-ops
    measure_in_subprocess(...)                           the same in a fresh process (a process joins one process
                                                         group; the peak is this rank's alone), its result parsed
    estimate_rank_memory(model, settings, world_size,..)  without a GPU: the analytic estimate (formula below)
    lm_head_bytes(...), terms_per_row(...)               its LM head term; the loss terms of a packed row
    step_shape(...), synthetic_samples(...)              GRPO samples that fill a step's rows at the token budget

The estimate (bytes of one rank at its peak, the backward of the LM head, when every layer's activations and the
head's buffers are alive; P parameters in w-byte elements, N the FSDP world size, T the row's tokens (token_budget
padded to row_bucket), M its loss terms, c the compute element size: 2 under bf16 mixed precision, else w):

    (P*w weights + P*w gradients + 2*P*w AdamW moments) / N                        sharded_state_bytes
    + one row's activations under the learner's checkpoint plan (k of L layers):   (rlasync.model.checkpointing)
      (L - k) * (full*T + fixed) + k * input*T + (full*T + fixed if k)             the plan: plan_for_model's
      full: what a compiled layer saves (compiled_activation_bytes_per_token;      planner_bytes_per_token:
      Qwen3-0.6B in bf16: 45 KB per token) or the eager estimate (activation_       the learner's own figures
      bytes_per_token); fixed: autocast's bf16 weight copies (one rank only)
      + T*H final-norm input + M*H head input
    + the chunked LM head at its backward: on a GPU the kept [M, V] logits and     lm_head_bytes
      one chunk's grad-logits in c bytes (chunked and kept by the free memory, as
      the head does), on the CPU its float32 chunk buffers; + the [V, H] weight grad
    + with N > 1: the FSDP2 root (embedding, head, final norm: gathered from its   (P - L*layer) * c
      forward to its backward) and two decoder layers unsharded, in c bytes        + 2*layer * c

FSDP2's MixedPrecisionPolicy casts the parameters and each layer's input to bf16, so under it the whole layer,
residual stream included, is bf16; with one rank, autocast keeps a float32 residual stream and saves a bf16 copy of
each layer's weights. The "auto" checkpoint plan is the learner's own (`plan_for_model`), made from the same
figures (`planner_bytes_per_token`, the one function both use) against device x gpu_share x MEMORY_FRACTION minus
the reserved state (`training_state_bytes`: the sharded state, FSDP2's gathered root and layers, the head's
CPU-sized buffers): the fewest checkpointed layers whose activations fit. Against tests/gpu/
test_fsdp_fake_pg_gpu.py (Qwen3-0.6B shape, bf16 over float32 weights, compiled layers, 8192-token rows of 5120
terms; an H200): 17.66 / 15.44 / 14.33 GiB at 2 / 4 / 8 ranks, measured 17.71 / 15.56 / 14.38
(bench/results/fsdp_fake_pg_h200.json): 0.3-0.8% low, the small buffers (masks, row tensors, rotary tables) not
counted (tests/unit/learner/test_dry_run_rank.py holds it within 5%).

Run as a script (what `measure_in_subprocess` starts): `python -m rlasync.learner.dry_run ARGS.pkl` prints
`RESULT {json}`.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from rlasync.records import RolloutSample

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from rlasync.learner.settings import LearnerSettings

logger = logging.getLogger(__name__)

GIB = 2**30
RESULT_PREFIX = "RESULT "
MAX_PROMPT = 256  # the synthetic prompts' length at most (step_shape)


class NoReduce:
    """The reducer of a fake-process-group rank: the fake all-reduce would return zeros, so this rank keeps its own
    values (the step's metrics and the loss normaliser's token count)."""

    def all_reduce(self, sums: Any, maxes: Any) -> tuple[Any, Any]:
        return sums, maxes

    def sum(self, tensor: Any) -> Any:
        return tensor


def synthetic_samples(
    vocab_size: int,
    *,
    groups: int,
    group_size: int,
    prompt_len: int,
    completion_len: int,
    top_k: int = 0,
    seed: int = 0,
) -> list[RolloutSample]:
    """`groups` GRPO groups of `group_size` samples (a shared random prompt of `prompt_len` tokens, completions of
    `completion_len`), sampler log-probs -11 (with `top_k` > 0 also the sampler's top-k ids and log-probs, as
    `num_sampler_logprobs` makes the engine return) and standard-normal advantages: a rank's rows, random."""
    for name, value in (("groups", groups), ("group_size", group_size), ("prompt_len", prompt_len)):
        if value < 1:
            raise ValueError(f"synthetic_samples: {name}={value} must be >= 1")
    if completion_len < 1 or vocab_size < 16:
        raise ValueError(f"synthetic_samples: completion_len={completion_len} >= 1 and vocab_size={vocab_size} >= 16")
    rng = np.random.default_rng(seed)
    mask = np.r_[np.zeros(prompt_len, np.int8), np.ones(completion_len, np.int8)]
    samples = []
    for group in range(groups):
        prompt = rng.integers(5, vocab_size - 5, prompt_len)
        for _ in range(group_size):
            ids = np.r_[prompt, rng.integers(5, vocab_size - 5, completion_len)]
            logprobs = np.full(len(ids), -11.0, np.float32)
            topk = {}
            if top_k > 0:
                topk_ids = rng.integers(5, vocab_size - 5, (len(ids), top_k))
                topk = {"sampler_topk_ids": topk_ids, "sampler_topk_logprobs": np.full(topk_ids.shape, -11.0)}
            samples.append(RolloutSample(ids, mask, logprobs, float(rng.normal()), group, **topk))
    return samples


def step_shape(token_budget: int, group_size: int, max_completion_length: int) -> tuple[int, int]:
    """(prompt_len, completion_len) of synthetic groups that fill rows of `token_budget` tokens with as many
    completion tokens as `max_completion_length` allows: the worst case of a step (every row full, the LM head's
    terms nearly all of it). A short prompt (token_budget / 32, at most MAX_PROMPT tokens), then k = ceil(budget /
    (prompt + group_size x max_completion_length)) groups per row with completions of (budget / k - prompt) /
    group_size tokens (a tree-packed group takes prompt + group_size x completion tokens of its row)."""
    if token_budget < 4 or group_size < 1 or max_completion_length < 1:
        raise ValueError(
            f"token_budget={token_budget}, group_size={group_size}, max_completion_length={max_completion_length}: "
            "the dry run needs rows of at least 4 tokens, groups of at least 1 and completions of at least 1 token"
        )
    prompt = max(1, min(MAX_PROMPT, token_budget // 32))
    per_row = -(-token_budget // (prompt + group_size * max_completion_length))
    completion = max(1, min(max_completion_length, (token_budget // per_row - prompt) // group_size))
    return prompt, completion


def measure_rank(
    model: str,
    settings: LearnerSettings,
    world_size: int,
    samples: list[RolloutSample],
    *,
    steps: int = 2,
    device: str = "cuda",
) -> dict[str, Any]:
    """Rank 0 of a `world_size`-rank learner through `steps` training steps on `samples` (this rank's share) and
    the weight-sync gather; N > 1 joins a fake process group first (once per process). Returns the losses, the
    optimizer's step counts, the gathered and sharded sizes and `peak_gib` (the device's peak allocated memory
    since the learner was built; on the CPU, 0)."""
    import torch.distributed as dist

    from rlasync.learner.learner import Learner
    from rlasync.weights.plan import stream_parameters

    if world_size > 1 and not dist.is_initialized():
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    on_gpu = torch.device(device).type == "cuda"
    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    learner = Learner(
        model, settings, rank=0, world_size=world_size, device=device, reducer=NoReduce() if world_size > 1 else None
    )
    losses = [float(dict(learner.train_step(samples))["loss"]) for _ in range(steps)]
    # the fake reduce-scatter leaves each gradient shard as allocated, so the update is not checked here (the gloo
    # tests on the CPU check values); what is checked is that the optimizer stepped every trainable shard
    stepped = [int(learner.optimizer.state[p]["step"]) for p in learner.scorer.parameters() if p.requires_grad]
    gathered = sum(tensor.numel() for _, tensor in stream_parameters(learner.model, device, dtype=learner.wire_dtype))
    params = list(learner.model.parameters())
    local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in params)  # this rank's shards
    info = learner.info()
    return {
        "world_size": world_size,
        "losses": losses,
        "optimizer_steps": sorted(set(stepped)),
        "trainable": len(stepped),
        "gathered": gathered,
        "full_numel": sum(p.numel() for p in params),  # DTensors: the logical (whole) sizes
        "local_numel": local,
        "peak_gib": torch.cuda.max_memory_allocated() / GIB if on_gpu else 0.0,
        "reserved_gib": torch.cuda.max_memory_reserved() / GIB if on_gpu else 0.0,
        "compiled_layers": info.get("compiled_layers"),
        "mixed_precision": info.get("mixed_precision"),
        "checkpointed_layers": len(learner.checkpoint_plan.layers),
    }


def measure_in_subprocess(
    model: str,
    settings: LearnerSettings,
    world_size: int,
    samples: list[RolloutSample],
    *,
    steps: int = 2,
    device: str = "cuda",
    timeout_s: float = 900.0,
) -> dict[str, Any]:
    """`measure_rank` in a fresh Python process (its own process group and CUDA context); a failure is a
    RuntimeError with the end of the child's output."""
    repo = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (repo, os.environ.get("PYTHONPATH")) if p)}
    with tempfile.TemporaryDirectory(prefix="rlasync-dry-run-") as folder:
        args = Path(folder) / "args.pkl"
        with args.open("wb") as f:
            payload = {"model": model, "settings": settings, "world_size": world_size, "samples": samples}
            pickle.dump({**payload, "steps": steps, "device": device}, f)
        done = subprocess.run(
            [sys.executable, "-m", "rlasync.learner.dry_run", str(args)],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            env=env,
        )
    lines = [line for line in done.stdout.splitlines() if line.startswith(RESULT_PREFIX)]
    if done.returncode != 0 or not lines:
        raise RuntimeError(
            f"the dry run's learner rank (world size {world_size}) failed (exit {done.returncode}):\n"
            + done.stdout[-2000:]
            + done.stderr[-4000:]
        )
    return json.loads(lines[-1][len(RESULT_PREFIX) :])


@dataclass(frozen=True)
class RankEstimate:
    """The analytic memory of one learner rank (bytes) at its peak, the backward of the LM head, and its parts."""

    state_bytes: int  # weights + gradients + optimizer moments, sharded over the ranks
    activation_bytes: int  # one row at the token budget under the checkpoint plan
    head_bytes: int  # the chunked LM head at its backward: kept logits, a chunk's grad-logits, the weight's grad
    unsharded_bytes: int  # FSDP2's unsharded root (embedding, head, final norm) and layers (0 with one rank)
    checkpointed_layers: int
    num_layers: int
    compiled: bool = False  # compiled decoder layers (their saved activations), else eager ones

    @property
    def total_bytes(self) -> int:
        return self.state_bytes + self.activation_bytes + self.head_bytes + self.unsharded_bytes

    def describe(self) -> str:
        layers = "compiled" if self.compiled else "eager"
        return (
            f"{self.total_bytes / GIB:.2f} GiB = {self.state_bytes / GIB:.2f} weights/grads/AdamW "
            f"+ {self.activation_bytes / GIB:.2f} activations ({self.checkpointed_layers} of {self.num_layers} "
            f"{layers} layers checkpointed) + {self.head_bytes / GIB:.2f} LM head "
            f"+ {self.unsharded_bytes / GIB:.2f} FSDP unsharded"
        )


def lm_head_bytes(
    terms: int,
    vocab: int,
    hidden: int,
    *,
    matmul_bytes: int,
    weight_bytes: int,
    free_bytes: float | None,
    compiled: bool = True,
) -> int:
    """What the chunked LM head (`rlasync.model.head.chunked_token_scores`) holds at its backward for a row of `terms`
    loss terms, with its own defaults. On a GPU with `free_bytes` free: chunks of `free_bytes / 8` of working memory,
    the raw [chunk, V] logits of the first chunks kept within `free_bytes / 4` (a whole row, on a large GPU), then
    one chunk's grad-logits (and its recomputed logits when it was not kept), plus the fused passes' float32
    temporaries when they are not compiled. On the CPU (`free_bytes` None): nothing kept, HEAD_BUFFERS [chunk, V]
    float32 buffers of `default_chunk_size` terms. Then the head weight's gradient ([V, H] in the weight's dtype
    with one chunk, a float32 accumulator with several) and, when the matmuls run in another dtype (autocast), the
    weight's copy in it."""
    from rlasync.model.checkpointing import HEAD_BUFFERS
    from rlasync.model.head import plan_chunk_size

    terms = max(1, int(terms))
    cpu = torch.device("cpu")
    if free_bytes is None:
        chunk = plan_chunk_size(terms, vocab, cpu)
        kept_terms, working = 0, HEAD_BUFFERS * chunk * vocab * 4
    else:
        free = max(1, int(free_bytes))
        chunk = plan_chunk_size(terms, vocab, cpu, chunk_bytes=max(1, free // 8))
        chunks = -(-terms // chunk)
        kept = min(chunks, (free // 4) // (chunk * vocab * matmul_bytes))
        kept_terms = min(terms, kept * chunk)
        working = chunk * vocab * matmul_bytes * (1 if kept >= chunks else 2)
        if not compiled:
            working += 2 * chunk * vocab * 4
    single = terms <= chunk
    grad_weight = vocab * hidden * (weight_bytes if single else 4)
    cast = vocab * hidden * matmul_bytes if matmul_bytes != weight_bytes else 0
    return int(kept_terms * vocab * matmul_bytes + working + grad_weight + cast)


def estimate_rank_memory(
    model: torch.nn.Module,
    settings: LearnerSettings,
    world_size: int,
    *,
    gpu_bytes: float | None,
    terms_per_row: int | None = None,
) -> RankEstimate:
    """The formula of the module docstring for `model` (built on the meta device in the learner's dtype) on a GPU
    of `gpu_bytes` (its `gpu_share` of it; None: the learner runs on the CPU). `terms_per_row`: the loss terms of a
    row (default: every token of the row, the worst case). The checkpoint plan is the one the learner makes: "auto"
    on a GPU weighs the per-layer figures counted here (`planner_bytes_per_token`), the layers as they run."""
    from rlasync.model.checkpointing import (
        MEMORY_FRACTION,
        decoder_layers,
        fsdp_unsharded_bytes,
        layer_element_bytes,
        plan_checkpointing,
        planner_bytes_per_token,
        sharded_state_bytes,
        spread,
        training_state_bytes,
    )
    from rlasync.model.row_shapes import padded_length

    on_gpu = gpu_bytes is not None
    num_layers = len(decoder_layers(model))
    weight_bytes = next(model.parameters()).element_size()
    mixed = on_gpu and settings.bf16 and weight_bytes == 4  # as the Learner: bf16 compute over float32 weights
    # one rank: autocast (float32 residual stream); several: FSDP2's policy casts each layer's inputs to bf16 too
    compute_bytes, residual_bytes, _ = layer_element_bytes(weight_bytes, mixed=mixed, world_size=world_size)
    resolved = settings.resolved(cuda=on_gpu)  # as the learner: torch_compile None compiles on CUDA only
    compiled = bool(resolved.torch_compile)
    tokens = padded_length(settings.token_budget, resolved.row_bucket) if settings.token_budget > 0 else 0
    if tokens <= 0:  # fixed-count rows: size them as per_device_train_batch_size samples of the model's context
        tokens = settings.per_device_train_batch_size * int(getattr(model.config, "max_position_embeddings", 2048))
    terms = min(tokens, terms_per_row) if terms_per_row else tokens
    vocab, hidden = model.get_output_embeddings().weight.shape
    state = sharded_state_bytes(model, world_size=world_size)
    # the learner's own figures (one function for both): its plan weighs exactly what is counted here
    full, saved, fixed = planner_bytes_per_token(model, mixed=mixed, world_size=world_size, compiled=compiled)
    choice = settings.gradient_checkpointing_layers
    if not settings.gradient_checkpointing:
        count = 0
    elif isinstance(choice, int) and not isinstance(choice, bool):
        count = len(spread(choice, num_layers))
    elif choice == "all" or not on_gpu or settings.token_budget <= 0:
        count = num_layers  # the learner's "auto" without a GPU or without a token budget
    else:  # "auto" on a GPU: the learner's plan (plan_for_model), its budget on a device with nothing else on it
        reserved = training_state_bytes(model, world_size=world_size, mixed=mixed, tokens=tokens)
        available = gpu_bytes * MEMORY_FRACTION * settings.gpu_share - reserved
        plan = plan_checkpointing(num_layers, tokens, full, saved, available, layer_fixed_bytes=fixed)
        count = len(plan.layers)
    whole = full * tokens + fixed
    activations = (num_layers - count) * whole + count * saved * tokens + (whole if count else 0)
    activations += tokens * hidden * residual_bytes + terms * hidden * compute_bytes  # final norm input, head input
    # the root's parameters stay gathered from forward to backward; a layer and its prefetch (0 with one rank)
    unsharded = fsdp_unsharded_bytes(model, world_size=world_size, compute_bytes=compute_bytes)
    head_weight_bytes = compute_bytes if world_size > 1 else weight_bytes  # FSDP2 gathers it in the compute dtype
    free = gpu_bytes * settings.gpu_share - (state + activations + unsharded) if on_gpu else None
    head = lm_head_bytes(
        terms,
        int(vocab),
        int(hidden),
        matmul_bytes=compute_bytes,
        weight_bytes=head_weight_bytes,
        free_bytes=free,
        compiled=on_gpu and settings.kernels.head_compile,
    )
    return RankEstimate(int(state), int(activations), head, int(unsharded), count, num_layers, compiled)


def terms_per_row(token_budget: int, group_size: int, prompt_len: int, completion_len: int) -> int:
    """The loss terms of a row of `token_budget` tokens packed with whole groups of `group_size` completions of
    `completion_len` tokens after a shared prompt of `prompt_len` (one term per completion token)."""
    groups = max(1, token_budget // (prompt_len + group_size * completion_len))
    return min(token_budget, groups * group_size * completion_len)


def meta_model(model_config: PretrainedConfig, dtype: str) -> torch.nn.Module:
    """The causal LM of `model_config` on the meta device (no memory, no weights), in the learner's `dtype`."""
    from transformers import AutoModelForCausalLM

    from rlasync.model.loading import model_init_options

    chosen, _ = model_init_options(None, dtype)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(model_config, dtype=getattr(torch, chosen))


def main(argv: list[str] | None = None) -> int:
    """`python -m rlasync.learner.dry_run ARGS.pkl`: `measure_rank` of the pickled arguments; prints `RESULT {json}`."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m rlasync.learner.dry_run ARGS.pkl", file=sys.stderr)
        return 2
    with open(argv[0], "rb") as f:
        args = pickle.load(f)
    result = measure_rank(
        args["model"],
        args["settings"],
        args["world_size"],
        args["samples"],
        steps=args["steps"],
        device=args["device"],
    )
    print(RESULT_PREFIX + json.dumps(result), flush=True)
    return 0


__all__ = [
    "NoReduce",
    "RankEstimate",
    "estimate_rank_memory",
    "lm_head_bytes",
    "measure_in_subprocess",
    "measure_rank",
    "meta_model",
    "step_shape",
    "synthetic_samples",
    "terms_per_row",
]


if __name__ == "__main__":
    raise SystemExit(main())
