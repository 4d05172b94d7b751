"""LearnerActor: one training rank. Ranks form a gloo group (CPU); rank 0 also sends weight broadcasts.

Each rank fetches the step's samples (ObjectRefs from the queue), runs the same deterministic planner
(`TokenBudgetBatcher` over all ranks, or `FixedCountBatcher` when `token_budget <= 0`) and trains its own row of
every micro-batch; the loss is normalised by the loss terms of all ranks, and gradients are averaged across ranks
before clipping (every collective has the cluster's timeout). Rank 0 returns the step's metrics.
"""

from __future__ import annotations

import os
import socket
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import ray


@ray.remote
class LearnerActor:
    def __init__(self, *, rank: int, world_size: int, model: str, args: Any, token_budget: int,
                 num_threads: int | None = 1) -> None:
        import torch

        if num_threads and not torch.cuda.is_available():
            torch.set_num_threads(num_threads)
        self.rank, self.world_size = rank, world_size
        self.model_path, self.args, self.token_budget = model, args, token_budget
        self.weight_group: Any = None
        self.trained_groups: set[int] = set()

    def address(self) -> tuple[str, int]:
        from rlasync.weights.broadcast import free_port

        return ray.util.get_node_ip_address() or socket.gethostname(), free_port()

    def setup(self, master: tuple[str, int] | None, timeout_s: float, resume_dir: str | None = None) -> dict:
        import torch
        import torch.distributed as dist

        from rlasync.learner import LearnerStep, OptimizerSettings, build_optimizer
        from rlasync.losses import LossConfig
        from rlasync.model import load_model, prepare_for_training

        args = self.args
        self.timeout = timedelta(seconds=timeout_s)
        if self.world_size > 1:
            host, port = master
            dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=self.rank,
                                    world_size=self.world_size, timeout=self.timeout)
        torch.manual_seed(args.seed)
        self.model = load_model(resume_dir or self.model_path, dtype=args.dtype if args.dtype != "auto" else "float32")
        prepare_for_training(self.model, gradient_checkpointing=args.gradient_checkpointing)
        self.optimizer, self.scheduler = build_optimizer(self.model, OptimizerSettings.from_args(args))
        if resume_dir is not None and (Path(resume_dir) / "optimizer.pt").is_file():
            self.optimizer.load_state_dict(torch.load(Path(resume_dir) / "optimizer.pt", weights_only=False))
            self.scheduler.load_state_dict(torch.load(Path(resume_dir) / "scheduler.pt", weights_only=False))
        self.step_core = LearnerStep(
            self.model, self.optimizer, self.scheduler, LossConfig.from_args(args), temperature=args.temperature,
            max_grad_norm=args.max_grad_norm, num_ranks=self.world_size, clip_grad_norm=self._clip,
        )
        return {"num_parameters": sum(p.numel() for p in self.model.parameters())}

    def _clip(self, max_norm: float) -> Any:
        import torch
        import torch.distributed as dist

        params = [p for p in self.model.parameters() if p.requires_grad]
        if self.world_size > 1:
            for param in params:
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                work = dist.all_reduce(param.grad, op=dist.ReduceOp.SUM, async_op=True)
                if not work.wait(self.timeout):
                    raise TimeoutError(f"learner rank {self.rank}: gradient all-reduce stalled for {self.timeout}")
                param.grad /= self.world_size
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

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
        samples = ray.get(refs, timeout=self.timeout.total_seconds())
        batches = self._plan(samples)
        rows, terms, items = [], [], []
        forwarded = trained = 0
        for batch in batches:
            packed = batch.pack()
            rows.append(packed[self.rank])
            terms.append(float(sum(len(row.target_ids) for row in packed)))
            forwarded += sum(len(row.input_ids) for row in packed)
            trained += int(terms[-1])
            if self.rank == 0:
                items += list(batch.metrics().items())
        metrics = self.step_core.step(rows, terms)
        new_groups = {s.group_id for s in samples} - self.trained_groups
        self.trained_groups |= new_groups
        items += list(metrics.items())
        items += [
            ("batch/forwarded_tokens_per_step", float(forwarded)),
            ("batch/trained_tokens_per_step", float(trained)),
            ("batch/samples_per_step", float(len(samples))),
            ("batch/groups_per_step", float(len(new_groups))),
        ]
        fwd_bwd = float(metrics.get("perf/fwd_bwd_s", 0.0))
        if fwd_bwd > 0:
            items.append(("perf/forwarded_tok_s_fwd_bwd", (float(forwarded), fwd_bwd)))
        return items if self.rank == 0 else []

    # ---- weights -----------------------------------------------------------------------------------------------

    def manifest(self) -> list[Any]:
        from rlasync.weights import build_manifest

        return build_manifest(self.model)

    def join_weight_group(self, host: str, port: int, world_size: int, timeout_s: float) -> None:
        from rlasync.weights.broadcast import WeightGroup

        self.weight_group = WeightGroup.open(host, port, 0, world_size, timeout_s)

    def send_weights(self) -> float:
        from rlasync.weights import stream_parameters

        start = time.perf_counter()
        self.weight_group.send(stream_parameters(self.model))
        return time.perf_counter() - start

    def checksum(self) -> float:
        return float(sum(p.detach().double().abs().sum() for p in self.model.parameters()))

    # ---- checkpoints -------------------------------------------------------------------------------------------

    def save(self, directory: str, tokenizer: Any = None) -> None:
        import torch

        if self.rank != 0:
            return
        path = Path(directory)
        path.mkdir(parents=True, exist_ok=True)
        self.model.save_pretrained(path)
        if tokenizer is not None:
            if isinstance(tokenizer, str):
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(tokenizer)
            tokenizer.save_pretrained(path)
        torch.save(self.optimizer.state_dict(), path / "optimizer.pt")
        torch.save(self.scheduler.state_dict(), path / "scheduler.pt")

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        os.environ.pop("MASTER_ADDR", None)
