"""LearnerActor: one training rank, on the GPU Ray gives it (`cluster.learner_num_gpus > 0`) or on the CPU; a thin
shell over `rlasync.learner.Learner` (model, precision, FSDP2, optimizer, objective, checkpoints) and a sender of
the weight transport (`rlasync.weights.transport`).

Ranks form the training group: NCCL on GPUs, gloo on CPU (`rlasync.learner.parallel.init_training_group`). With
more than one rank the model is sharded with FSDP2; the step's metrics are reduced over ranks (one all-reduce pair
with the cluster's timeout) and returned by rank 0.

Collectives the driver must call on every rank at once: `setup`, `train_step`, the weight methods
(`prepare_weights`, `send_weights`, `finish_weights`: each parameter is gathered with `full_tensor()`; only rank
0, which holds the sender, sends), `checksum` and `save` (a full state dict is gathered; rank 0 writes it).
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

import ray

from actors.group_payload import fetch
from rlasync.metrics.gc_pauses import CollectionHold


@ray.remote
class LearnerActor:
    def __init__(self, rank: int, world_size: int, model: str, settings: Any, num_threads: int | None = 1) -> None:
        """`settings`: the run's `rlasync.learner.LearnerSettings` (`LearnerSettings.from_config`)."""
        import torch

        if num_threads and not torch.cuda.is_available():
            torch.set_num_threads(num_threads)
        self.rank, self.world_size = rank, world_size
        self.model_path, self.settings = model, settings
        self.learner: Any = None
        self.sender: Any = None
        self.timeout_s = 300.0
        self.device = self._pick_device()
        self.gc_pauses: Any = None  # this process's garbage collections, timed (`setup`)
        self.gc_hold = CollectionHold()  # none starts during a weight sync: prepare_weights until finish_weights

    @staticmethod
    def _pick_device() -> Any:
        """`cuda:0` when Ray assigned this actor a GPU (it sets CUDA_VISIBLE_DEVICES to it), else the CPU."""
        import torch

        if ray.get_gpu_ids() and torch.cuda.is_available():
            return torch.device("cuda", 0)
        return torch.device("cpu")

    @staticmethod
    def _node() -> str:
        return ray.util.get_node_ip_address() or socket.gethostname()

    def address(self) -> tuple[str, int]:
        """(host, a free port) of this rank: rank 0's is the training group's and the weight group's rendezvous."""
        from rlasync.weights.transport import free_port

        return self._node(), free_port()

    def setup(self, master: tuple[str, int] | None, timeout_s: float, resume_dir: str | None = None) -> dict:
        """Join the training group (several ranks), load the model (from `resume_dir` when resuming, with the
        optimizer state) and build the step. Every rank at once."""
        import torch

        from rlasync.learner import Learner
        from rlasync.learner.parallel import GroupReducer, init_training_group

        self.timeout_s = timeout_s
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        init_training_group(self.rank, self.world_size, master, timeout_s, self.device)
        reducer = GroupReducer(self.rank, self.device, timeout_s) if self.world_size > 1 else None
        self.learner = Learner(
            self.model_path,
            self.settings,
            rank=self.rank,
            world_size=self.world_size,
            device=self.device,
            reducer=reducer,
            resume_dir=resume_dir,
        )
        from rlasync.metrics.gc_pauses import REFREEZE_OVER_S, GcPauseMonitor, freeze_heap

        freeze_heap()  # the model's and the step's start-up heap is never walked again by a full collection
        if self.gc_pauses is not None:
            self.gc_pauses.close()
        self.gc_pauses = GcPauseMonitor(refreeze_over_s=REFREEZE_OVER_S)  # nor what the first compile builds
        return self.learner.info()

    def train_step(self, refs: list[Any], share: Any = None) -> list[tuple[str, Any]]:
        """Fetch this rank's samples (what the queue's entries hold: `GroupPart`s or ObjectRefs, those of its rows,
        laid out by `share`, a `rlasync.learner.sharing.StepShare`; without a share the whole step's) and train one
        step; rank 0 returns the metric items, the other ranks []."""
        started = time.perf_counter()
        self.gc_hold.release_if_stale()  # a sync that failed before its finish_weights
        samples = fetch(refs, timeout_s=self.timeout_s)
        items = self.learner.train_step(samples, fetch_s=time.perf_counter() - started, share=share)
        collections = self.gc_pauses.take()  # the longest collection since the previous step (this rank's)
        if items:
            items += [("perf/learner_gc_max_s", collections["gc_max_s"])]
            items += [("perf/learner_gc_refreezes", collections["gc_refreezes"])]
        return items

    # ---- weights -----------------------------------------------------------------------------------------------

    def weight_endpoint(self) -> dict[str, Any]:
        """This rank's device identity (what `choose_transport` compares)."""
        from rlasync.weights.transport import device_identity

        return device_identity(self.device, self._node(), ray.get_gpu_ids())

    def weight_manifest(self) -> list[Any]:
        return self.learner.weight_manifest()

    def open_weight_transport(self, plan: Any) -> None:
        """Every rank: its sender for `plan` (rank 0 joins the broadcast group here, with every engine at once)."""
        from rlasync.weights.transport import make_sender

        if self.sender is not None:
            self.sender.close()
        self.sender = make_sender(plan, self.device, manifest=self.learner.weight_manifest(), rank=self.rank)

    def _sender(self) -> Any:
        if self.sender is None:
            raise RuntimeError("weight sync before open_weight_transport")
        return self.sender

    def prepare_weights(self) -> Any:
        """Every rank: the sync's ticket (IPC: rank 0 packs the weights and returns their handles; None else)."""
        self.gc_hold.hold()
        return self._sender().prepare(self.learner.weight_stream())

    def send_weights(self) -> float:
        """Every rank: gather each parameter (a collective under FSDP2); rank 0 sends (a broadcast; nothing over
        IPC). Returns seconds."""
        import torch

        start = time.perf_counter()
        self._sender().send(self.learner.weight_stream())
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter() - start

    def finish_weights(self) -> None:
        """Every rank, once every engine has loaded: release what the sync held (IPC: the shared buckets)."""
        self.gc_hold.release()
        self._sender().finish()

    def checksum(self) -> float:
        """Σ |w| over the full parameters (a collective under FSDP2: call it on every rank)."""
        return self.learner.checksum()

    # ---- checkpoints -------------------------------------------------------------------------------------------

    def save(self, directory: str, tokenizer: Any = None) -> None:
        """Every rank: gather the full model and optimizer state; rank 0 writes the HF model (+ tokenizer),
        `optimizer.pt` (keyed by parameter name) and `scheduler.pt`."""
        self.learner.save(directory, tokenizer)

    def close(self) -> None:
        from rlasync.learner.parallel import close_training_group

        if self.sender is not None:
            self.sender.close()
            self.sender = None
        close_training_group()
        os.environ.pop("MASTER_ADDR", None)
