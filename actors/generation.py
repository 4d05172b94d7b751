"""GenerationActor: hosts one engine (`cluster.engine`: the built-in TorchEngine on CPU or the one GPU Ray gives it,
vLLM's AsyncLLM on that GPU, or a client of `vllm serve`) and receives weight syncs.

The transport is chosen once by the driver (`rlasync.weights.transport.TransportPlan`); `open_weight_transport` makes
this engine's receiver for it. A weight sync is one call, `sync_weights(ticket)`, made while learner rank 0 sends: a
broadcast is received while the engine still generates (up to `staging_bytes` held), the engine pauses meanwhile, the
weights are copied in and it resumes; over IPC the ticket holds handles to learner rank 0's buckets (the built-in
engine loads them between steps, unpaused). vLLM engines receive in their own workers.

Restarts (docs/design.md §4): Ray restarts a GenerationActor that died (`max_restarts`). The new incarnation holds the
initial weights, so `generate` waits at a first-sync gate (at most `SYNC_GATE_S`, then a retryable `EngineError`)
until the driver has re-opened the weight transport for it and sent it the current policy. The driver learns of the
death from its `watch()` call failing; `weights_version()` is None until the first sync.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import sys
import time
from typing import Any

import ray

from actors.engine_channel import ChannelHost
from rlasync.engine.base import EngineError

logger = logging.getLogger(__name__)

SYNC_GATE_S = 30.0  # a generate call waits this long for this incarnation's first weight sync, then fails retryably


@ray.remote(concurrency_groups={"weights": 1})  # sync_weights' own loop: not behind the busy engine loop's callbacks
class GenerationActor:
    def __init__(
        self,
        *,
        model: str,
        dtype: str | None = None,
        num_threads: int | None = 1,
        engine_kwargs: dict[str, Any] | None = None,
        engine: str = "torch",
        vllm_server_url: str | None = None,
        serve_initial_weights: bool = False,
        warm_sampling: list[Any] | None = None,
        loop_stall_s: float | None = None,
        switch_interval_s: float | None = None,
    ) -> None:
        """`serve_initial_weights`: serve the weights loaded here at once (outside a training run; a run's engines
        wait for their first sync). `warm_sampling`: the run's `SamplingParams`, built for here (`warm_up`: the sampler,
        a dummy run on CUDA), not in the first steps. `switch_interval_s`: `cluster.gil_switch_interval_s`."""
        import torch

        from rlasync.engine.factory import make_engine

        if num_threads and not torch.cuda.is_available():
            torch.set_num_threads(num_threads)
        if switch_interval_s:
            sys.setswitchinterval(switch_interval_s)
        from rlasync.metrics.gc_pauses import REFREEZE_OVER_S, CollectionHold, GcPauseMonitor, freeze_heap
        from rlasync.metrics.loop_lag import LoopLagMonitor
        from rlasync.metrics.process_cpu import ProcessCpu

        self.engine = make_engine(engine, model, base_url=vllm_server_url, dtype=dtype, **(engine_kwargs or {}))
        warm_up = getattr(self.engine, "warm_up", None)
        if warm_sampling and warm_up is not None and (seconds := warm_up(warm_sampling)):
            logger.info("generation engine: warmed up for the run's sampling (sampler, dummy steps) in %.1f s", seconds)
        freeze_heap()  # the start-up heap is never walked again; a slow later collection freezes what it walked
        self.gc_pauses = GcPauseMonitor(refreeze_over_s=REFREEZE_OVER_S)
        self.gc_hold = CollectionHold()  # no collection in a sync: from begin_sync (or sync_weights) to its end
        self.receiver: Any = None  # the weight transport's receiver (`open_weight_transport`)
        self.pausing: Any = None  # a pause begun before the sync's ticket arrived (`begin_sync`)
        self.main_loop: Any = None  # the engine's loop (`open_weight_transport`): a paused load runs there
        self.loop_lag = LoopLagMonitor(interval_s=0.05, stall_s=loop_stall_s)  # how late its loop runs; few wakes
        self.cpu = ProcessCpu()  # how busy this process is between syncs (near 1.0: bound by its GIL)
        self.version: int | None = None  # the policy version last loaded; None: this incarnation's initial weights
        self.channels = ChannelHost(self)  # the rollout actors' channels: requests in, one result stream each
        self.synced = asyncio.Event()
        if serve_initial_weights:
            self.synced.set()

    async def generate(self, prompt_ids: list[int], sampling: Any) -> Any:
        self.loop_lag.start()
        if not self.synced.is_set():  # a restarted engine: not before it holds the current policy
            try:
                await asyncio.wait_for(self.synced.wait(), SYNC_GATE_S)
            except TimeoutError:
                why = f"not synced with the current policy after {SYNC_GATE_S:.0f} s (restarted, waiting for a sync)"
                raise EngineError(f"generation engine {why}: retry") from None
        return await self.engine.generate(prompt_ids, sampling)

    async def submit(self, channel_id: str, requests: list[tuple[int, list[int], Any]]) -> None:
        """Start a channel's requests, each through `generate` (its first-sync gate): `actors.engine_channel`."""
        self.loop_lag.start()
        await self.channels.submit(channel_id, requests)

    async def results(self, channel_id: str) -> Any:
        """A channel's one stream (a Ray streaming generator): lists of `(request_id, ok, TurnRecord or exception)`."""
        async for ready in self.channels.results(channel_id):
            yield ready

    async def watch(self) -> None:
        """Never returns: the driver keeps one in flight; its failure says this actor died (a frozen one's pends)."""
        await asyncio.Event().wait()

    def weights_version(self) -> int | None:
        """The policy version this incarnation last loaded (None: none yet, e.g. restarted by Ray)."""
        return self.version

    def stats(self) -> Any:
        return self.engine.stats()

    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def _device(self) -> Any:
        import torch

        return torch.device(getattr(self.engine, "device", None) or ("cuda" if torch.cuda.is_available() else "cpu"))

    def weight_endpoint(self) -> dict[str, Any]:
        """This engine's device identity (what `choose_transport` compares)."""
        from rlasync.weights.transport import device_identity

        return device_identity(
            self._device(), ray.util.get_node_ip_address() or socket.gethostname(), ray.get_gpu_ids()
        )

    async def open_weight_transport(self, plan: Any, rank: int, manifest: list[Any]) -> None:
        """This engine's receiver for `plan` as rank `rank` of the weight-sync group (joined here, with learner
        rank 0 and every other engine at once)."""
        from rlasync.weights.transport import make_receiver

        if self.receiver is not None:
            self.receiver.close()
        self.main_loop = asyncio.get_running_loop()
        self.receiver = await make_receiver(plan, rank, manifest, self.engine, self._device())

    async def begin_sync(self) -> None:
        """The driver's call at the start of a sync, before learner rank 0's ticket exists: a receiver that
        `pauses_early` (IPC: nothing to stage before the ticket) starts pausing now, so the step in flight drains
        while the learner packs. Undone by `cancel_sync` or, should no sync follow, after `SYNC_GATE_S`."""
        from rlasync.weights.apply import begin_pause

        if getattr(self.receiver, "pauses_early", False) and self.pausing is None:
            self.gc_hold.hold()
            self.pausing = begin_pause(self.engine)
            asyncio.get_running_loop().call_later(SYNC_GATE_S, lambda p=self.pausing: self._abandon(p))

    def _abandon(self, pausing: Any) -> None:
        if self.pausing is pausing:  # no sync_weights took it over
            asyncio.ensure_future(self.cancel_sync())

    async def cancel_sync(self) -> None:
        """A sync begun (`begin_sync`) that will not come (its prepare failed): resume the engine."""
        pausing, self.pausing = self.pausing, None
        if pausing is not None:
            await asyncio.gather(pausing, return_exceptions=True)
            await self.engine.resume()
        self.gc_hold.release()

    @ray.method(concurrency_group="weights")
    async def sync_weights(self, ticket: Any = None, version: int | None = None) -> dict[str, float]:
        """Receive one sync (`ticket`: learner rank 0's `prepare_weights`) of policy `version` and load it (then the
        first-sync gate opens): the phases' seconds (`pause_s`, `load_s`, `resume_s`, `total_s`), `started_at` (wall
        clock), since the previous sync this actor's worst loop lag (`loop_lag_max_s`), CPU seconds a second
        (`cpu_frac`), longest collection (`gc_max_s`; none in a sync, `gc_hold`), and `gc_refreezes`. In its own loop:
        a load between steps blocks it (no thread hand-over); a paused one runs on the engine's loop."""
        started_at = time.time()  # wall clock: the driver measures how long this call waited to start
        if self.receiver is None:  # a restarted incarnation: the driver recognises this error by its type
            from rlasync.weights.transport import WeightTransportNotOpen

            raise WeightTransportNotOpen("sync_weights before open_weight_transport")
        inline = bool(getattr(self.receiver, "between_steps", False))
        load, loop = self._load(ticket, version, started_at, inline), self.main_loop
        if loop is None or inline:
            return await load
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(load, loop))

    async def _load(self, ticket: Any, version: int | None, started_at: float, inline: bool) -> dict[str, float]:
        pausing, self.pausing = self.pausing, None
        extra = {"pausing": pausing} if pausing is not None else {"inline": True} if inline else {}
        self.gc_hold.hold()
        try:
            phases = await self.receiver.load_into(self.engine, ticket, **extra)
        finally:  # a hold begun by begin_sync ends here too
            self.gc_hold.release()
        self.version = version
        (self.main_loop or asyncio.get_running_loop()).call_soon_threadsafe(self.synced.set)  # the engine loop's
        collections = {**self.gc_pauses.take(), "cpu_frac": self.cpu.take()}
        self.loop_lag.log_stalls(logger, "generation actor")  # cluster.generation_stall_s: where its loop was
        return {**phases, "started_at": started_at, "loop_lag_max_s": self.loop_lag.take_max(), **collections}

    async def close(self) -> None:
        self.loop_lag.stop()
        if self.receiver is not None:
            self.receiver.close()
        await self.engine.close()
