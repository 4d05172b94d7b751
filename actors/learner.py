"""LearnerActor: one training rank, on the GPU Ray gives it (`cluster.learner_num_gpus > 0`) or on the CPU.

Ranks form the training group: NCCL on GPUs, gloo on CPU. With more than one rank the model is sharded with FSDP2
(`rlasync.learner.shard_for_training`: gradients are reduce-scattered and averaged in backward, clipping works on
the DTensor shards); one rank trains a plain model. Each rank fetches the step's samples (ObjectRefs from the queue),
runs the same deterministic planner (`TokenBudgetBatcher` over all ranks, or `FixedCountBatcher` when
`token_budget <= 0`) and trains its own row of every micro-batch; the loss is normalised by the loss terms of all
ranks. The step's metrics are reduced over ranks (`rlasync.learner.reduce_across_ranks`, one all-reduce pair with
the cluster's timeout) and returned by rank 0.

Collectives the driver must call on every rank at once: `setup`, `train_step`, `send_weights` (each parameter is
gathered with `full_tensor()`; only rank 0, which holds the weight-sync group, broadcasts) and `save` (a full
state dict is gathered; rank 0 writes it).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import ray

logger = logging.getLogger(__name__)

MODEL_PREFIX = "model."  # the TreeScorer's attribute holding the HF model: stripped from state-dict keys


@ray.remote
class LearnerActor:
    def __init__(self, *, rank: int, world_size: int, model: str, args: Any, token_budget: int,
                 num_threads: int | None = 1, mode: str = "grpo", max_steps: int | None = None,
                 teacher_ids: list[str] | None = None) -> None:  # fmt: skip
        import torch

        if num_threads and not torch.cuda.is_available():
            torch.set_num_threads(num_threads)
        if mode not in ("grpo", "distill"):
            raise ValueError(f"LearnerActor mode={mode!r}: use 'grpo' or 'distill'")
        self.rank, self.world_size = rank, world_size
        self.mode = mode  # "distill": DistillScorer + DistillLearnerStep on plain padding-free rows (SPEC §9.3, §9.5)
        self.max_steps = max_steps  # the scheduler's horizon when the driver resolved it (distillation, max_steps=-1)
        self.teacher_ids = list(teacher_ids or ["default"])  # distillation: stable order = teacher_id_idx
        self.model_path, self.args, self.token_budget = model, args, token_budget
        self.weight_group: Any = None
        self.shared: Any = None  # over "ipc": the buckets rank 0 shares until the engines copied them
        self.manifest_entries: list[Any] = []
        self.trained_groups: set[int] = set()
        self.device = self._pick_device()
        self.wire_dtype: Any = None  # what floating point weights travel to the engines as (None: as trained)

    @staticmethod
    def _pick_device() -> Any:
        """`cuda:0` when Ray assigned this actor a GPU (it sets CUDA_VISIBLE_DEVICES to it), else the CPU."""
        import torch

        if ray.get_gpu_ids() and torch.cuda.is_available():
            return torch.device("cuda", 0)
        return torch.device("cpu")

    def address(self) -> tuple[str, int]:
        from rlasync.weights.broadcast import free_port

        return ray.util.get_node_ip_address() or socket.gethostname(), free_port()

    def device_info(self) -> dict[str, Any]:
        from rlasync.weights.broadcast import device_identity

        return device_identity(self.device, ray.util.get_node_ip_address() or socket.gethostname(), ray.get_gpu_ids())

    def setup(self, master: tuple[str, int] | None, timeout_s: float, resume_dir: str | None = None) -> dict:
        import torch
        import torch.distributed as dist

        from rlasync.learner import LearnerStep, OptimizerSettings, build_optimizer, shard_for_training
        from rlasync.losses import LossConfig
        from rlasync.model import TreeScorer, load_model, prepare_for_training
        from rlasync.model.loading import model_init_options

        args = self.args
        self.timeout = timedelta(seconds=timeout_s)
        on_gpu = self.device.type == "cuda"
        if on_gpu:
            torch.cuda.set_device(self.device)
        if self.world_size > 1:
            host, port = master
            dist.init_process_group(
                "nccl" if on_gpu else "gloo", init_method=f"tcp://{host}:{port}", rank=self.rank,
                world_size=self.world_size, timeout=self.timeout, **({"device_id": self.device} if on_gpu else {}),
            )  # fmt: skip
        torch.manual_seed(args.seed)
        dtype, init_kwargs = model_init_options(args.model_init_kwargs, args.dtype, args.trust_remote_code)
        self.model = load_model(resume_dir or self.model_path, dtype=dtype, device=self.device, **init_kwargs)
        prepare_for_training(self.model, gradient_checkpointing=args.gradient_checkpointing)
        # TRL's bf16=True on a GPU: bf16 forward/backward over float32 master weights (a pure-bf16 model would round
        # away Adam steps of lr ~1e-6); the engines get bf16 weights
        mixed = on_gpu and bool(getattr(args, "bf16", False)) and dtype == "float32"
        if on_gpu and getattr(args, "fp16", False):
            logger.warning("fp16=True: fp16 mixed precision is not implemented; training in %s (use bf16=True)", dtype)
        self.wire_dtype = torch.bfloat16 if mixed else None
        # FSDP2 over the training group when there is one; the TreeScorer root either way, so optimizer and
        # checkpoint keys are the same for any number of ranks
        scorer_cls = TreeScorer
        if self.mode == "distill":
            from rlasync.learner.distill import DistillScorer

            scorer_cls = DistillScorer
        if self.world_size > 1:
            from torch.distributed.fsdp import MixedPrecisionPolicy

            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed else None
            self.scorer = shard_for_training(self.model, mp_policy=policy, scorer_cls=scorer_cls)
        else:
            self.scorer = scorer_cls(self.model)
        settings = OptimizerSettings.from_args(args)
        if self.max_steps is not None:
            settings = dataclasses.replace(settings, max_steps=self.max_steps)
        self.optimizer, self.scheduler = build_optimizer(self.scorer, settings)
        if resume_dir is not None:
            self._load_optimizer(Path(resume_dir))
        if self.mode == "distill":
            self._setup_distill(mixed)
        else:
            self.step_core = LearnerStep(
                self.scorer, self.optimizer, self.scheduler, LossConfig.from_args(args), temperature=args.temperature,
                max_grad_norm=args.max_grad_norm, num_ranks=self.world_size, device=self.device,
                clip_grad_norm=self._clip, autocast_dtype=torch.bfloat16 if mixed and self.world_size == 1 else None,
            )  # fmt: skip
        return {
            "num_parameters": sum(p.numel() for p in self.model.parameters()),
            "device": str(self.device),
            "sharded": self.world_size > 1,
            "mixed_precision": "bf16 compute, float32 master weights" if mixed else None,
        }

    def _setup_distill(self, mixed: bool) -> None:
        import torch

        from rlasync.learner.distill import DistillLearnerStep
        from rlasync.losses.distill import DistillLossConfig

        args = self.args
        self.step_core = DistillLearnerStep(
            self.scorer, self.optimizer, self.scheduler, DistillLossConfig.from_args(args),
            max_grad_norm=args.max_grad_norm, num_ranks=self.world_size, device=self.device,
            teacher_ids=self.teacher_ids, clip_grad_norm=self._clip,
            autocast_dtype=torch.bfloat16 if mixed and self.world_size == 1 else None,
            reduce_stats=self._sum_stats if self.world_size > 1 else None,
        )  # fmt: skip

    def _sum_stats(self, stats: Any) -> Any:
        """SUM all-reduce of the distillation statistics tensor over the training group, with the timeout."""
        import torch.distributed as dist

        from rlasync.weights.broadcast import wait_work

        tensor = stats.to(self.device)
        work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, async_op=True)
        wait_work(work, self.timeout.total_seconds(), f"learner rank {self.rank}: distillation stats all-reduce",
                  poll=self.device.type == "cuda")  # fmt: skip
        return tensor.cpu()

    def _clip(self, max_norm: float) -> Any:
        import torch

        params = [p for p in self.scorer.parameters() if p.requires_grad]
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        full_tensor = getattr(norm, "full_tensor", None)  # FSDP2: a DTensor (the all-reduce happens here)
        return full_tensor() if full_tensor is not None else norm

    def _all_reduce(self, sums: Any, maxes: Any) -> tuple[Any, Any]:
        """SUM and MAX all-reduces of the metric vectors over the training group, each with the timeout."""
        import torch.distributed as dist

        from rlasync.weights.broadcast import wait_work

        on_gpu = self.device.type == "cuda"
        out = []
        for tensor, op, name in ((sums, dist.ReduceOp.SUM, "sum"), (maxes, dist.ReduceOp.MAX, "max")):
            tensor = tensor.to(self.device)
            work = dist.all_reduce(tensor, op=op, async_op=True)
            wait_work(work, self.timeout.total_seconds(), f"learner rank {self.rank}: metric all-reduce ({name})",
                      poll=on_gpu)  # fmt: skip
            out.append(tensor.cpu())
        return out[0], out[1]

    def _plan(self, samples: list[Any]) -> list[Any]:
        from rlasync.packing import FixedCountBatcher, TokenBudgetBatcher

        if self.token_budget > 0:
            batcher: Any = TokenBudgetBatcher(self.world_size, self.token_budget)
        else:
            batcher = FixedCountBatcher(self.world_size, self.args.per_device_train_batch_size)
        batches = batcher.plan(samples)
        if not batches:
            raise ValueError(f"the step's {len(samples)} samples cannot fill one row per rank ({self.world_size})")
        return batches

    def train_step(self, refs: list[Any]) -> list[tuple[str, Any]]:
        from rlasync.learner import reduce_across_ranks
        from rlasync.learner.metrics import local_all_reduce

        started = time.perf_counter()
        samples = ray.get(refs, timeout=self.timeout.total_seconds())
        fetched = time.perf_counter()
        if self.mode == "distill":
            return self._train_step_distill(samples, started, fetched)
        batches = self._plan(samples)
        rows, terms, items = [], [], []
        forwarded = trained = 0
        for batch in batches:
            packed = batch.pack()
            mine = packed[self.rank]
            rows.append(mine)
            terms.append(float(sum(len(row.target_ids) for row in packed)))  # the normaliser: all ranks' terms
            forwarded += len(mine.input_ids)
            trained += len(mine.target_ids)
            if self.rank == 0:
                items += list(batch.metrics().items())  # planner metrics already cover every rank's rows
        packed_at = time.perf_counter()
        metrics = self.step_core.step(rows, terms, rate_pairs=True)
        metrics["perf/fetch_samples_s"] = fetched - started  # the step's samples out of the object store
        metrics["perf/pack_s"] = packed_at - fetched  # planning and tree-packing the micro-batches
        metrics["batch/forwarded_tokens_per_step"] = float(forwarded)
        metrics["batch/trained_tokens_per_step"] = float(trained)
        reduced = reduce_across_ranks(metrics, self._all_reduce if self.world_size > 1 else local_all_reduce)
        new_groups = {s.group_id for s in samples} - self.trained_groups
        self.trained_groups |= new_groups
        items += list(reduced.items())
        items += [
            ("batch/samples_per_step", float(len(samples))),
            ("batch/groups_per_step", float(len(new_groups))),
        ]
        fwd_bwd = float(reduced.get("perf/fwd_bwd_s", 0.0))
        if fwd_bwd > 0:
            items.append(("perf/forwarded_tok_s_fwd_bwd", (float(reduced["batch/forwarded_tokens_per_step"]), fwd_bwd)))
        return items if self.rank == 0 else []

    def _plan_distill(self, samples: list[Any]) -> list[Any]:
        from rlasync.distill import FixedCountBatcher, TokenBudgetBatcher

        if self.token_budget > 0:
            batcher: Any = TokenBudgetBatcher(self.world_size, self.token_budget)
        else:
            batcher = FixedCountBatcher(self.world_size, self.args.per_device_train_batch_size * self.world_size)
        batches = batcher.plan(samples)
        if not batches:
            raise ValueError(
                f"the step's {len(samples)} distillation samples cannot fill one row per rank ({self.world_size}) "
                f"within token_budget={self.token_budget}: raise token_budget or lower max_completion_length"
            )
        return batches

    def _train_step_distill(self, samples: list[Any], started: float, fetched: float) -> list[tuple[str, Any]]:
        """Plain padding-free rows (Σ L² balanced, SPEC §9.5), one per rank and micro-batch, then one step."""
        from rlasync.learner import reduce_across_ranks
        from rlasync.learner.distill import distill_row_tensors
        from rlasync.learner.metrics import local_all_reduce

        pad_id = getattr(self.model.config, "pad_token_id", None)
        pad_id = 0 if pad_id is None else int(pad_id)
        teacher_ids = self.teacher_ids if len(self.teacher_ids) > 1 else None
        rows, items = [], []
        forwarded = trained = 0
        for batch in self._plan_distill(samples):
            row = distill_row_tensors(batch.collate(pad_id, teacher_ids), self.rank, self.device)
            rows.append(row)
            forwarded += row.num_tokens
            trained += row.num_trained_tokens
            if self.rank == 0:
                items += list(batch.metrics().items())  # planner metrics already cover every rank's rows
        packed_at = time.perf_counter()
        metrics = self.step_core.step(rows, rate_pairs=True)
        metrics["perf/fetch_samples_s"] = fetched - started
        metrics["perf/pack_s"] = packed_at - fetched
        metrics["batch/forwarded_tokens_per_step"] = float(forwarded)
        metrics["batch/trained_tokens_per_step"] = float(trained)
        reduced = reduce_across_ranks(metrics, self._all_reduce if self.world_size > 1 else local_all_reduce)
        new_prompts = {s.prompt_id for s in samples} - self.trained_groups
        self.trained_groups |= new_prompts
        items += list(reduced.items())
        items += [("batch/samples_per_step", float(len(samples))), ("batch/prompts_per_step", float(len(new_prompts)))]
        fwd_bwd = float(reduced.get("perf/fwd_bwd_s", 0.0))
        if fwd_bwd > 0:
            items.append(("perf/forwarded_tok_s_fwd_bwd", (float(reduced["batch/forwarded_tokens_per_step"]), fwd_bwd)))
        return items if self.rank == 0 else []

    # ---- weights -----------------------------------------------------------------------------------------------

    def manifest(self) -> list[Any]:
        from rlasync.weights import build_manifest

        return build_manifest(self.model, dtype=self.wire_dtype)

    def join_weight_group(self, host: str, port: int, world_size: int, timeout_s: float, backend: str = "gloo",
                          bucket_bytes: int | None = None) -> str:  # fmt: skip
        """Rank 0 only: join the weight-sync group as its sender (NCCL from this GPU, or gloo through the CPU)."""
        from rlasync.weights import build_manifest
        from rlasync.weights.broadcast import DEFAULT_BUCKET_BYTES, WeightGroup

        self.manifest_entries = build_manifest(self.model, dtype=self.wire_dtype)
        self.bucket_bytes = bucket_bytes or DEFAULT_BUCKET_BYTES
        if backend == "ipc":  # no group: `share_weights` hands out handles to buckets on this device
            return backend
        device = self.device if backend == "nccl" else "cpu"
        self.weight_group = WeightGroup.open(
            host, port, 0, world_size, timeout_s, backend=backend, device=device, bucket_bytes=self.bucket_bytes
        )
        return backend

    def send_weights(self) -> float:
        """Every rank: gather each parameter (a collective under FSDP2); rank 0 broadcasts them. Returns seconds."""
        import torch

        from rlasync.weights import stream_parameters

        start = time.perf_counter()
        stream = stream_parameters(self.model, dtype=self.wire_dtype)
        if self.rank == 0:
            if self.weight_group is None:
                raise RuntimeError("send_weights before join_weight_group")
            self.weight_group.send(stream, self.manifest_entries)
        else:
            for _ in stream:  # take part in the gathers; rank 0 sends
                pass
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - start

    def share_weights(self) -> list[Any] | None:
        """Every rank (gathers are collectives under FSDP2); rank 0 packs the weights into buckets on its device and
        returns their handles (`rlasync.weights.ipc`), kept alive until `release_weights`."""
        from rlasync.weights import stream_parameters
        from rlasync.weights.ipc import SharedWeights

        stream = stream_parameters(self.model, dtype=self.wire_dtype)
        if self.rank != 0:
            for _ in stream:
                pass
            return None
        self.shared = SharedWeights.pack(stream, self.manifest_entries, self.device, self.bucket_bytes)
        return self.shared.handles()

    def release_weights(self) -> None:
        shared = getattr(self, "shared", None)
        if shared is not None:
            shared.release()
            self.shared = None

    def checksum(self) -> float:
        """Σ |w| over the full parameters (a collective under FSDP2: call it on every rank)."""
        total = 0.0
        for param in self.model.parameters():
            data = param.detach()
            full_tensor = getattr(data, "full_tensor", None)
            total += float((full_tensor() if full_tensor is not None else data).double().abs().sum())
        return total

    # ---- checkpoints -------------------------------------------------------------------------------------------

    def save(self, directory: str, tokenizer: Any = None) -> None:
        """Every rank: gather the full model and optimizer state (collectives under FSDP2); rank 0 writes the HF
        model (+ tokenizer), `optimizer.pt` (keyed by parameter name) and `scheduler.pt`."""
        import torch
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_state = get_model_state_dict(self.scorer, options=options)
        optimizer_state = get_optimizer_state_dict(self.scorer, self.optimizer, options=options)
        if self.rank != 0:
            return
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        model_state = {key.removeprefix(MODEL_PREFIX): value for key, value in model_state.items()}
        self.model.save_pretrained(path, state_dict=model_state)
        if tokenizer is not None:
            if isinstance(tokenizer, str):
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(tokenizer)
            tokenizer.save_pretrained(path)
        torch.save(optimizer_state, path / "optimizer.pt")
        torch.save(self.scheduler.state_dict(), path / "scheduler.pt")

    def _load_optimizer(self, path: Path) -> None:
        """Every rank reads the full optimizer state and keeps its shard (FSDP2) or all of it."""
        import torch
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        if not (path / "optimizer.pt").is_file():
            return
        state = torch.load(path / "optimizer.pt", weights_only=False, map_location="cpu")
        if any(isinstance(key, int) for key in state.get("state", {})):  # an older checkpoint: keyed by position
            if self.world_size > 1:
                raise ValueError(
                    f"{path}/optimizer.pt is keyed by parameter position (saved by an older version with one rank): "
                    "resume it with cluster.num_learners=1 once, then save again"
                )
            self.optimizer.load_state_dict(state)
        else:
            set_optimizer_state_dict(
                self.scorer, self.optimizer, state, options=StateDictOptions(full_state_dict=True)
            )
        if (path / "scheduler.pt").is_file():
            self.scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=False))

    def close(self) -> None:
        import torch.distributed as dist

        if self.weight_group is not None:
            self.weight_group.close()
        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.pop("MASTER_ADDR", None)
