"""`Learner`: one training rank in the core (no Ray). It loads the model, applies the precision and, with several
ranks, FSDP2, builds the optimizer and scheduler (resumed from a checkpoint when given), and trains one step at a
time through its objective (`rlasync.learner.objectives`):

    this rank's samples + its StepShare (the driver split the step: rlasync.learner.sharing)
        -> objective.plan (its rows, as the share lays them out) -> objective.rows -> objective.step
        -> reduce over ranks -> metric items (rank 0 reports; the planner's and the step's own metrics included)

Given the whole step instead (no share), the rank splits it itself and keeps its own part.

Precision (TRL's bf16=True on a GPU with float32 trainer weights): bf16 forward/backward over float32 master
weights (a pure-bf16 model would round away Adam steps of lr ~1e-6); the engines get bf16 weights (`wire_dtype`).

The cross-rank reductions are injected (`reducer`: `rlasync.learner.parallel.GroupReducer` over the initialised
training group, or `LocalReducer` for one rank), so the Learner never creates a process group itself.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from rlasync.learner.checkpoint import load_optimizer_state, save_checkpoint
from rlasync.learner.lora import adapter_base, trainable_parameters, wrap_with_lora
from rlasync.learner.metrics import reduce_across_ranks
from rlasync.learner.objectives import MetricItems, StepParts, make_objective
from rlasync.learner.settings import LearnerSettings
from rlasync.learner.sharing import StepShare
from rlasync.learner.step import build_optimizer

logger = logging.getLogger(__name__)


class Reducer(Protocol):
    """Cross-rank reductions of one rank: `all_reduce(sums, maxes)` (SUM, MAX) and `sum(tensor)`."""

    def all_reduce(self, sums: torch.Tensor, maxes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def sum(self, tensor: torch.Tensor) -> torch.Tensor: ...


class LocalReducer:
    """The reductions of a world of one rank (nothing to combine)."""

    def all_reduce(self, sums: torch.Tensor, maxes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return sums, maxes

    def sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor


class Learner:
    """One rank's model, optimizer and step (`train_step(samples) -> metric items`)."""

    def __init__(
        self,
        model_path: str,
        settings: LearnerSettings,
        *,
        rank: int = 0,
        world_size: int = 1,
        device: torch.device | str = "cpu",
        reducer: Reducer | None = None,
        resume_dir: str | None = None,
    ) -> None:
        from rlasync.model import load_model, prepare_for_training
        from rlasync.model.checkpointing import plan_for_model
        from rlasync.model.loading import model_init_options
        from rlasync.model.row_shapes import padded_length

        if world_size > 1 and reducer is None:
            raise ValueError(f"a Learner of {world_size} ranks needs a reducer over the training group (GroupReducer)")
        self.device = torch.device(device)
        on_gpu = self.device.type == "cuda"
        settings = settings.resolved(cuda=on_gpu)  # torch_compile None ("auto"): compiled layers on CUDA only
        self.settings, self.rank, self.world_size = settings, rank, world_size
        self.compile_cache: str | None = None  # inductor's cache folder, where anything compiles: the layers, and
        if settings.torch_compile or on_gpu:  # on CUDA always the LM head's passes and FlexAttention's kernels
            from rlasync.model.compilation import use_compile_cache

            self.compile_cache = str(use_compile_cache())  # kept across runs, shared by the node's ranks
        self.reducer: Reducer = reducer or LocalReducer()
        torch.manual_seed(settings.seed)
        dtype, init_kwargs = model_init_options(settings.model_init_kwargs, settings.dtype, settings.trust_remote_code)  # type: ignore[arg-type]
        self.peft_model: Any = None  # with settings.peft_config: the PeftModel; self.model is the HF model inside it
        path = resume_dir or model_path
        self.model = load_model(
            adapter_base(path) if settings.peft_config else path, dtype=dtype, device=self.device, **init_kwargs
        )
        self.mixed = on_gpu and settings.bf16 and dtype == "float32"
        self.checkpoint_plan = plan_for_model(
            self.model,
            settings.gradient_checkpointing_layers,
            device=self.device,
            tokens=padded_length(settings.token_budget, settings.row_bucket) if settings.token_budget > 0 else 0,
            enabled=settings.gradient_checkpointing,
            mixed=self.mixed,  # one rank: autocast; several: FSDP2's MixedPrecisionPolicy (all bf16)
            world_size=world_size,
            compiled=bool(settings.torch_compile),  # compiled layers save less than eager ones
            gpu_share=settings.gpu_share,
        )
        if rank == 0:
            logger.info("%s", self.checkpoint_plan.describe())
        prepare_for_training(
            self.model,
            gradient_checkpointing=settings.gradient_checkpointing,
            use_reentrant=settings.use_reentrant,
            checkpoint_layers=self.checkpoint_plan.layers,
            compile="layers" if settings.torch_compile else False,
            compile_backend=settings.torch_compile_backend,
            compile_mode=settings.torch_compile_mode,
        )
        if settings.peft_config is not None:
            self.peft_model = wrap_with_lora(self.model, settings.peft_config, adapter_dir=path)
            self.model = self.peft_model.base_model.model  # LoRA layers in place: tree attention and FSDP2 unchanged
        if on_gpu and settings.fp16:
            logger.warning("fp16=True: fp16 mixed precision is not implemented; training in %s (use bf16=True)", dtype)
        self.wire_dtype = torch.bfloat16 if self.mixed else None  # what floating point weights travel to engines as
        self.objective = make_objective(settings, rank, world_size)
        self.scorer = self._wrap(self.objective.scorer_cls)
        self.optimizer, self.scheduler = build_optimizer(self.scorer, settings.optimizer)
        if resume_dir is not None:
            load_optimizer_state(resume_dir, self.scorer, self.optimizer, self.scheduler, world_size=world_size)
        pad_id = getattr(self.model.config, "pad_token_id", None)
        self.pad_id = 0 if pad_id is None else int(pad_id)  # distillation rows are collated with it
        self.objective.build(
            StepParts(
                scorer=self.scorer,
                optimizer=self.optimizer,
                scheduler=self.scheduler,
                rank=rank,
                world_size=world_size,
                device=self.device,
                clip_grad_norm=self._clip,
                autocast_dtype=torch.bfloat16 if self.mixed and world_size == 1 else None,
                sum_across_ranks=self.reducer.sum if world_size > 1 else None,
                all_reduce=self.reducer.all_reduce if world_size > 1 else None,
            )
        )

    def _wrap(self, scorer_cls: Any) -> torch.nn.Module:
        """FSDP2 over the training group when there is one; the scorer root either way, so optimizer and
        checkpoint keys are the same for any number of ranks."""
        if self.world_size == 1:
            return scorer_cls(self.model, self.settings.kernels)
        from torch.distributed.fsdp import MixedPrecisionPolicy

        from rlasync.learner.parallel import shard_for_training

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if self.mixed else None
        return shard_for_training(self.model, mp_policy=policy, scorer_cls=scorer_cls, kernels=self.settings.kernels)

    def info(self) -> dict[str, Any]:
        """What the set-up reports (the driver logs it)."""
        from rlasync.model.loading import compiled_layer_count

        return {
            "num_parameters": sum(p.numel() for p in self.model.parameters()),
            "trainable_parameters": trainable_parameters(self.model),
            "lora_sync": self.settings.lora_sync if self.peft_model is not None else None,
            "device": str(self.device),
            "sharded": self.world_size > 1,
            "mixed_precision": "bf16 compute, float32 master weights" if self.mixed else None,
            "checkpointed_layers": f"{len(self.checkpoint_plan.layers)}/{self.checkpoint_plan.num_layers}",
            "compiled_layers": compiled_layer_count(self.model),
            "compile_cache": self.compile_cache,
            "row_bucket": self.settings.row_bucket,
            "kernels": self.kernels(),
            "share_prefixes": bool(self.objective.share_prefixes),  # how the driver plans the step's rows
        }

    def kernels(self) -> dict[str, Any]:
        """The kernel settings this rank's scorer runs with (`LearnerSettings.kernels`, handed to the model code),
        and the tree attention backend they resolve to on this rank's device."""
        from rlasync.model.tree_mask import resolve_backend

        kernels = self.scorer.kernels
        return {**kernels.describe(), "resolved_tree_attention": resolve_backend(kernels.tree_attention, self.device)}

    def _clip(self, max_norm: float) -> torch.Tensor:
        params = [p for p in self.scorer.parameters() if p.requires_grad]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        full_tensor = getattr(norm, "full_tensor", None)  # FSDP2: a DTensor (the all-reduce happens here)
        return full_tensor() if full_tensor is not None else norm

    # ---- training ----------------------------------------------------------------------------------------------

    def train_step(self, samples: Sequence[Any], fetch_s: float = 0.0, share: StepShare | None = None) -> MetricItems:
        """One optimizer step (a collective): `samples` are this rank's samples and `share` their layout (the
        driver's `split_step`), or `samples` is the whole step (share None: every rank plans it and keeps its part)
        -> plan -> rows -> step -> reduce -> metrics. Rank 0 returns the items; others []."""
        from rlasync.learner.sharing import split_step
        from rlasync.model.compilation import compile_seconds

        started, compiled_before = time.perf_counter(), compile_seconds()
        received = list(samples)
        if share is None:
            share = split_step(self.objective, received)[self.rank]
            samples = [received[i] for i in share.indices]
        elif share.rank != self.rank or share.world_size != self.world_size:
            raise ValueError(
                f"learner rank {self.rank} of {self.world_size} was sent the share of rank {share.rank} of "
                f"{share.world_size}"
            )
        elif len(samples) != share.num_samples:
            raise ValueError(f"learner rank {self.rank}: {len(samples)} samples for a share of {share.num_samples}")
        self.objective.layout = share.layout
        try:
            rows = self.objective.rows(self.objective.plan(samples), self.device, self.pad_id)
        finally:
            self.objective.layout = None
        packed_at = time.perf_counter()
        metrics = self._step(rows)
        compile_s = compile_seconds() - compiled_before  # torch's own compile timers, over this step only
        metrics["perf/compile_s"] = compile_s if compile_s > 0 else float("nan")  # NaN: not logged (every rank: a key)
        metrics["perf/fetch_samples_s"] = fetch_s  # the step's samples out of the object store
        metrics["perf/pack_s"] = packed_at - started  # planning and packing the micro-batches
        metrics["perf/learner_step_s"] = time.perf_counter() - started  # this rank's wall time: packing, step, host
        metrics["batch/forwarded_tokens_per_step"] = float(rows.forwarded_tokens)
        metrics["batch/trained_tokens_per_step"] = float(rows.trained_tokens)
        metrics["batch/samples_per_rank_max"] = float(len(received))  # what this rank was sent (max over ranks)
        metrics["batch/sample_tokens_per_rank_max"] = float(sum(len(sample) for sample in received))
        reduced = reduce_across_ranks(metrics, self.reducer.all_reduce)
        items = share.planner_items + list(reduced.items()) + share.step_items
        fwd_bwd = float(reduced.get("perf/fwd_bwd_s", 0.0))  # type: ignore[arg-type]
        if fwd_bwd > 0:
            items.append(("perf/forwarded_tok_s_fwd_bwd", (float(reduced["batch/forwarded_tokens_per_step"]), fwd_bwd)))  # type: ignore[arg-type]
        return items if self.rank == 0 else []

    def _step(self, rows: Any) -> dict[str, Any]:
        """The objective's step; when a compiled decoder layer fails to compile, the layers go back to eager (one
        warning) and the step runs again from zeroed gradients (no optimizer step had happened)."""
        from rlasync.model.attention import _compile_errors
        from rlasync.model.checkpointing import apply_checkpoint_plan, replan_for_eager_layers
        from rlasync.model.loading import uncompile_decoder_layers

        try:
            return self._step_or_replan_after_oom(rows)
        except _compile_errors() as exc:
            if not self.settings.torch_compile or not uncompile_decoder_layers(self.model):
                raise
            lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
            first_line = " ".join(lines[:2])[:300]  # e.g. "backend='inductor' raised: RuntimeError: ..."
            logger.warning(
                "torch_compile: compiling the decoder layers failed (%s: %s); training with eager layers from now on",
                type(exc).__name__,
                first_line,
            )
            # an eager layer keeps about 3x what a compiled one does: "auto" plans again for eager layers
            plan = replan_for_eager_layers(
                self.model, self.checkpoint_plan, mixed=self.mixed, world_size=self.world_size
            )
            if plan != self.checkpoint_plan:
                self.checkpoint_plan = plan
                apply_checkpoint_plan(self.model, plan.layers)
                if self.rank == 0:
                    logger.warning("eager layers: %s", plan.describe())
            self.optimizer.zero_grad(set_to_none=True)
            return self._step_or_replan_after_oom(rows)

    def _step_or_replan_after_oom(self, rows: Any) -> dict[str, Any]:
        """The objective's step; when the "auto" plan's step runs out of device memory before the optimizer stepped,
        on one rank, every layer is checkpointed from then on (one warning) and the step runs again from zeroed
        gradients. With several ranks the other ranks are inside FSDP2's collectives, so the error stands (lower
        `token_budget` or set `gradient_checkpointing_layers`), as it does for a plan the user chose."""
        stepping = [False]
        hook = self.optimizer.register_step_pre_hook(lambda *_: stepping.__setitem__(0, True))
        try:
            return self.objective.step(rows)
        except torch.OutOfMemoryError as exc:
            plan = self.checkpoint_plan
            all_layers = len(plan.layers) == plan.num_layers
            if stepping[0] or self.world_size > 1 or plan.reason != "memory" or all_layers:
                raise
            first_line = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
        finally:
            hook.remove()
        # out of the except block: the failed step's frames (and the activations they hold) are released
        self._checkpoint_every_layer(first_line)
        return self.objective.step(rows)

    def _checkpoint_every_layer(self, reason: str) -> None:
        from rlasync.model.checkpointing import CheckpointPlan, apply_checkpoint_plan

        before = self.checkpoint_plan
        self.checkpoint_plan = CheckpointPlan(before.num_layers, tuple(range(before.num_layers)), "out of memory")
        apply_checkpoint_plan(self.model, self.checkpoint_plan.layers)
        self.optimizer.zero_grad(set_to_none=True)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        logger.warning(
            "out of device memory with %d of %d decoder layers checkpointed (%s); checkpointing every layer from now "
            "on and running the step again (set gradient_checkpointing_layers='all' or lower token_budget to start so)",
            len(before.layers),
            before.num_layers,
            reason,
        )

    # ---- weights and checkpoints -------------------------------------------------------------------------------

    def weight_manifest(self) -> list[Any]:
        """What a weight sync sends (engine names, wire dtypes, global shapes), in stream order."""
        from rlasync.weights import build_manifest
        from rlasync.weights.adapter import adapter_manifest, merged_manifest

        if self.peft_model is not None:
            lora_manifest = adapter_manifest if self.settings.lora_sync == "adapter" else merged_manifest
            return lora_manifest(self.model, dtype=self.wire_dtype)
        return build_manifest(self.model, dtype=self.wire_dtype)

    def weight_stream(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The full parameters (with LoRA: the adapter or the merged weights) one at a time in manifest order (lazy: under FSDP2 iterating it is a collective)."""
        from rlasync.weights import stream_parameters
        from rlasync.weights.adapter import adapter_stream, merged_stream

        if self.peft_model is not None:  # LoRA: the adapter (A, s*B per module), or the merged full weights
            lora_stream = adapter_stream if self.settings.lora_sync == "adapter" else merged_stream
            return lora_stream(self.model, dtype=self.wire_dtype)
        return stream_parameters(self.model, dtype=self.wire_dtype)

    def checksum(self) -> float:
        """Σ |w| over the full parameters (a collective under FSDP2: call it on every rank)."""
        total = 0.0
        for param in self.model.parameters():
            data = param.detach()
            full_tensor = getattr(data, "full_tensor", None)
            total += float((full_tensor() if full_tensor is not None else data).double().abs().sum())
        return total

    def save(self, directory: str | Path, tokenizer: Any = None) -> None:
        """Every rank (a collective under FSDP2); rank 0 writes the checkpoint (`rlasync.learner.checkpoint`)."""
        save_checkpoint(
            directory,
            self.scorer,
            self.model,
            self.optimizer,
            self.scheduler,
            rank=self.rank,
            tokenizer=tokenizer,
            peft_model=self.peft_model,
        )


__all__ = ["Learner", "LocalReducer", "Reducer"]
