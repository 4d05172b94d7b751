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
    step_shape(...), synthetic_samples(...)              GRPO samples that fill a step's rows at the token budget

The estimate (bytes of one rank; P parameters, w the weights' element size, N the FSDP world size):

    (P*w weights + P_trainable*w gradients + P_trainable*4*2 AdamW moments) / N      training_state_bytes
    + 4 chunked-LM-head buffers of [min(chunk, token_budget), vocab] float32         (rlasync.model.checkpointing)
    + activations of one token_budget row: the layers the learner's checkpoint plan keeps whole at the full
      per-token estimate, the checkpointed ones at their input, one recomputed layer   plan_checkpointing
    + with N > 1: two decoder layers unsharded in the compute dtype (FSDP2's all-gather and its prefetch)

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
FSDP_UNSHARDED_LAYERS = 2  # FSDP2 holds the layer it runs and the one it prefetches unsharded


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
    """The analytic memory of one learner rank (bytes) and its parts."""

    state_bytes: int  # weights + gradients + optimizer moments (sharded) + the LM head's buffers
    activation_bytes: int  # one row at the token budget under the checkpoint plan
    unsharded_bytes: int  # FSDP2's unsharded layers (0 with one rank)
    checkpointed_layers: int
    num_layers: int

    @property
    def total_bytes(self) -> int:
        return self.state_bytes + self.activation_bytes + self.unsharded_bytes

    def describe(self) -> str:
        return (
            f"{self.total_bytes / GIB:.2f} GiB = {self.state_bytes / GIB:.2f} weights/grads/AdamW/head "
            f"+ {self.activation_bytes / GIB:.2f} activations ({self.checkpointed_layers} of {self.num_layers} layers "
            f"checkpointed) + {self.unsharded_bytes / GIB:.2f} FSDP unsharded layers"
        )


def estimate_rank_memory(
    model: torch.nn.Module,
    settings: LearnerSettings,
    world_size: int,
    *,
    gpu_bytes: float | None,
) -> RankEstimate:
    """The formula of the module docstring for `model` (built on the meta device in the learner's dtype): the
    checkpoint plan is the one the learner would make on a GPU of `gpu_bytes` (its `gpu_share` of it), or every
    layer with checkpointing on and no GPU."""
    from rlasync.model.checkpointing import (
        HEAD_BUFFERS,
        MEMORY_FRACTION,
        activation_bytes_per_token,
        decoder_layer_params,
        decoder_layers,
        plan_checkpointing,
        spread,
        training_state_bytes,
    )
    from rlasync.model.head import default_chunk_size
    from rlasync.model.row_shapes import padded_length

    layers = decoder_layers(model)
    num_layers = len(layers)
    weight_bytes = next(model.parameters()).element_size()
    mixed = gpu_bytes is not None and settings.bf16 and weight_bytes == 4
    compute_bytes = 2 if mixed else weight_bytes
    tokens = padded_length(settings.token_budget, settings.row_bucket) if settings.token_budget > 0 else 0
    if tokens <= 0:  # fixed-count rows: size them as per_device_train_batch_size samples of the model's context
        tokens = settings.per_device_train_batch_size * int(getattr(model.config, "max_position_embeddings", 2048))
    vocab = int(model.get_output_embeddings().weight.shape[0])
    head_full = HEAD_BUFFERS * default_chunk_size(vocab) * vocab * 4  # what training_state_bytes counts
    head_row = HEAD_BUFFERS * min(default_chunk_size(vocab), tokens) * vocab * 4  # a row has `tokens` terms at most
    state = training_state_bytes(model, world_size=world_size) - head_full + head_row
    full, saved = activation_bytes_per_token(model.config, compute_bytes, weight_bytes)
    fixed = compute_bytes * decoder_layer_params(layers[0]) if mixed and world_size == 1 else 0.0
    choice = settings.gradient_checkpointing_layers
    if not settings.gradient_checkpointing:
        count = 0
    elif choice == "all" or (choice == "auto" and gpu_bytes is None):
        count = num_layers
    elif isinstance(choice, int):
        count = len(spread(choice, num_layers))
    else:  # "auto" on a GPU: the fewest layers whose activations fit the learner's part of it
        available = gpu_bytes * MEMORY_FRACTION * settings.gpu_share - state
        count = len(plan_checkpointing(num_layers, tokens, full, saved, available, layer_fixed_bytes=fixed).layers)
    whole = (full * tokens + fixed) * (num_layers - count) + saved * tokens * count + (full * tokens if count else 0)
    unsharded = FSDP_UNSHARDED_LAYERS * compute_bytes * decoder_layer_params(layers[0]) if world_size > 1 else 0
    return RankEstimate(int(state), int(whole), int(unsharded), count, num_layers)


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
    "measure_in_subprocess",
    "measure_rank",
    "meta_model",
    "step_shape",
    "synthetic_samples",
]


if __name__ == "__main__":
    raise SystemExit(main())
