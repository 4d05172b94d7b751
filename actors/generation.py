"""GenerationActor: hosts one engine (`cluster.engine`: the built-in TorchEngine on CPU or the one GPU Ray gives it,
vLLM's AsyncLLM on that GPU, or a client of `vllm serve`) and receives weight broadcasts.

A weight sync is one call, `sync_weights`, made while learner rank 0 sends: the broadcast is received while the
engine still generates (up to `staging_bytes` of it is held in its receive buffers), the engine pauses (its step in
flight finishes) meanwhile, then the weights are copied in, the rest is received, and it resumes. Over NCCL the
buckets land in GPU buffers on the engine's device; over gloo they arrive on the CPU and are copied in. vLLM engines
receive in their own workers (and pause themselves).
"""

from __future__ import annotations

import socket
import time
from typing import Any

import ray


@ray.remote
class GenerationActor:
    def __init__(self, *, model: str, dtype: str | None = None, num_threads: int | None = 1,
                 engine_kwargs: dict[str, Any] | None = None, engine: str = "torch",
                 vllm_server_url: str | None = None) -> None:  # fmt: skip
        import torch

        from rlasync.engine.factory import make_engine

        if num_threads and not torch.cuda.is_available():
            torch.set_num_threads(num_threads)
        from rlasync.metrics.loop_lag import LoopLagMonitor

        self.engine = make_engine(engine, model, base_url=vllm_server_url, dtype=dtype, **(engine_kwargs or {}))
        self.group: Any = None
        self.loop_lag = LoopLagMonitor()  # how late this actor's event loop runs (a late loop delays every call)

    async def generate(self, prompt_ids: list[int], sampling: Any) -> Any:
        self.loop_lag.start()
        return await self.engine.generate(prompt_ids, sampling)

    def stats(self) -> Any:
        return self.engine.stats()

    def max_model_len(self) -> int:
        return self.engine.max_model_len

    async def pause(self) -> None:
        await self.engine.pause()

    async def resume(self) -> None:
        await self.engine.resume()

    def _device(self) -> Any:
        import torch

        device = getattr(self.engine, "device", None)
        if device is not None:
            return torch.device(device)
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")

    def device_info(self) -> dict[str, Any]:
        from rlasync.weights.broadcast import device_identity

        return device_identity(self._device(), ray.util.get_node_ip_address() or socket.gethostname(), ray.get_gpu_ids())

    async def join_weight_group(self, host: str, port: int, rank: int, world_size: int, timeout_s: float,
                                backend: str = "gloo", bucket_bytes: int | None = None) -> None:  # fmt: skip
        from rlasync.weights.broadcast import DEFAULT_BUCKET_BYTES, WeightGroup

        if backend == "ipc":  # no group: `sync_weights` maps the learner's shared buckets
            self.group = "ipc"
            return
        if hasattr(self.engine, "receive_weights"):  # vLLM: its worker joins the group and receives in place
            await self.engine.join_weight_group(host, port, rank, world_size, timeout_s, backend, bucket_bytes)
            self.group = "engine"
            return
        device = self._device() if backend == "nccl" else "cpu"
        self.group = WeightGroup.open(
            host, port, rank, world_size, timeout_s, backend=backend, device=device,
            bucket_bytes=bucket_bytes or DEFAULT_BUCKET_BYTES,
        )  # fmt: skip

    async def sync_weights(self, manifest: list[Any], staging_bytes: int = 0,
                           handles: list[Any] | None = None) -> dict[str, float]:  # fmt: skip
        """Receive one broadcast (or, over "ipc", map the learner's shared `handles`) and load it, pausing only for
        the copy: returns the phases' seconds (`pause_s` until the engine stopped, `load_s` from then until loaded,
        `resume_s`, `total_s`), `started_at` (wall clock) and `loop_lag_max_s` (this actor's worst event-loop lag since
        the previous sync)."""
        from rlasync.weights.apply import load_while_pausing

        started_at = time.time()  # wall clock: the driver measures how long this call waited to start
        if self.group is None:
            raise RuntimeError("sync_weights before join_weight_group")
        if self.group == "ipc":
            from rlasync.weights.ipc import open_shared

            if handles is None:
                raise RuntimeError("sync_weights over ipc needs the learner's handles")
            phases = await load_while_pausing(self.engine, open_shared(handles), 0)
        elif self.group == "engine":  # vLLM: its workers receive in place
            from rlasync.engine.vllm_worker import paused_for_update

            start = time.perf_counter()
            async with paused_for_update(self.engine):
                paused = time.perf_counter()
                await self.engine.receive_weights(manifest)
                loaded = time.perf_counter()
            end = time.perf_counter()
            phases = {"pause_s": paused - start, "load_s": loaded - paused, "resume_s": end - loaded,
                      "total_s": end - start}  # fmt: skip
        else:
            phases = await load_while_pausing(self.engine, self.group.receive(manifest), staging_bytes)
        return {**phases, "started_at": started_at, "loop_lag_max_s": self.loop_lag.take_max()}

    async def close(self) -> None:
        await self.engine.close()

