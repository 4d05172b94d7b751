"""`VLLMWeightLoading`: the weight-loading half of `VLLMEngine` (in-process vLLM `AsyncLLM`).

Three ways in, all through the worker extension of `rlasync.engine.vllm_worker` or vLLM's own weight transfer:
`load_weights` (tensors inline, CUDA tensors as CUDA IPC handles), `join_weight_group` + `receive_weights` (the
weight-sync group of `rlasync.weights.broadcast`) and vLLM's NCCL path (`init_weight_transfer` +
`update_weights_nccl`). Separate from the adapter's generation code because it is the part the weight transport
drives, and it only needs the engine's `collective_rpc` and pause/resume.

A mixin: the host class (`VLLMEngine`) provides `_llm` (the AsyncLLM), `_rpc(method, *args, timeout_s=None)`,
`pause()` / `resume()` / `is_paused`, and the attributes annotated below.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

from rlasync.engine.vllm_door import DoorClient
from rlasync.engine.vllm_worker import encode_weights, flat_buckets, manifest_rows, nccl_update_info
from rlasync.weights.adapter import peek_adapter
from rlasync.weights.apply import paused_for_update

logger = logging.getLogger(__name__)


async def bounded(awaitable: Any, timeout_s: float, what: str) -> Any:
    """Await `awaitable` for at most `timeout_s` (vLLM's own timeouts are not enforced in-process)."""
    try:
        return await asyncio.wait_for(awaitable, timeout_s)
    except TimeoutError as exc:
        raise TimeoutError(f"vLLM {what} did not finish within {timeout_s:.0f} s") from exc


def multimodal_cache(llm: Any) -> Any:
    """The multimodal processor cache on this side of vLLM (None for a text model): what a pause also clears."""
    return getattr(getattr(llm, "renderer", None), "mm_processor_cache", None)


def _said(outcome: Any) -> str:
    return f"failed ({type(outcome).__name__}: {outcome})" if isinstance(outcome, BaseException) else "was refused"


def _adapter_entries(handles: Sequence[Any]) -> bool:
    """Whether persistent buckets hold a LoRA adapter (a runtime adapter for vLLM, not weights to copy in)."""
    return any(str(entry[0]).endswith(".lora_A.weight") for entries, _ in handles for entry in entries[:1])


class VLLMWeightLoading:
    """Weight loading and weight sync of an in-process vLLM engine (mixed into `VLLMEngine`)."""

    _llm: Any
    _paused: bool
    _held: bool  # vLLM's scheduler paused (False while only `_paused`: `sync_without_pause`)
    clear_cache_on_pause: bool
    _hold: Callable[[], Awaitable[None]]  # pause vLLM's scheduler itself
    chunk_bytes: int
    rpc_timeout_s: float
    control_timeout_s: float
    weight_transfer_backend: str | None
    _rpc: Callable[..., Awaitable[list[Any]]]  # the host's collective_rpc: _rpc(method, *args, timeout_s=None)
    direct_sync: bool
    _door: DoorClient | None  # the worker's sync door, once open (`direct_sync`)
    _door_loop: asyncio.AbstractEventLoop | None  # the engine's loop (vLLM's front end): nudges and fallbacks go there
    door_counts: dict[str, int]  # loads the door applied at a step / on a nudge, resets vLLM refused

    # ---- the sync door (`direct_sync`): an IPC sync that does not cross the front end ----------------------------

    @property
    def loads_between_steps(self) -> bool:
        """An IPC sync goes through the worker's sync door without a pause (`load_between_steps`); true once the
        door is open (`open_loads_between_steps`)."""
        return self._door is not None

    @property
    def copy_event_handles(self) -> bool:
        """`load_between_steps` takes the ticket's copy event as its raw IPC handle (the worker records it): this
        process opens no CUDA event (nor a CUDA context) of its own."""
        return True

    async def open_loads_between_steps(self) -> None:
        """Open the worker's sync door (`direct_sync` only; once), on the engine's loop. A door that does not open,
        or an engine of several workers (tensor parallel: each would apply a load at its own next step), keeps the
        front end's path, with a warning."""
        if not self.direct_sync or self._door is not None:
            return
        self._door_loop = asyncio.get_running_loop()
        try:
            paths = await self._rpc("open_sync_door", timeout_s=self.control_timeout_s)
        except Exception as exc:  # noqa: BLE001 - an untried vLLM build: the front end's path still works
            logger.warning(
                "vLLM's sync door did not open (%s: %s); weight syncs go through the front end", type(exc).__name__, exc
            )
            return
        if len(paths) != 1:
            logger.warning(
                "vLLM engine of %d workers: direct_sync needs one (no common step boundary); weight syncs "
                "go through the front end",
                len(paths),
            )
            await self._rpc("close_sync_door", timeout_s=self.control_timeout_s)
            return
        self._door = DoorClient(str(paths[0]), self.rpc_timeout_s)

    def load_between_steps(self, load: Any, done_event: bytes | None = None) -> dict[str, float]:
        """One IPC sync through the sync door (`rlasync.engine.vllm_door`), blocking the calling thread (the
        generation actor's sync thread, not the front end's loop): the worker applies it at the start of its next
        step, or at once on the nudge sent through the front end for an idle engine; then, with
        `clear_cache_on_pause`, the running requests are preempted and the prefix cache dropped (sent after, not
        awaited: a step or two may sample from the new weights over the old KV, their log-probs being what was
        sampled). `done_event`: the ticket's copy event as a raw IPC handle, recorded by the worker. Returns
        `wait_s` (until the worker began the load: the step boundary) and `load_s` (the worker's load). A load the
        door cannot take (an adapter, one-off buckets, a multimodal model) or a door that failed goes through the
        front end: pause, `load_weights`, resume, on the engine's loop."""
        started = time.perf_counter()
        handles, key = getattr(load, "handles", None), getattr(load, "key", "")
        door = self._door
        if (
            door is None
            or not handles
            or not key
            or _adapter_entries(handles)
            or getattr(self, "_flat_failed", None)
            or multimodal_cache(self._llm) is not None
        ):
            return self._through_front_end(load, started)
        try:
            seq = door.send_load(key, flat_buckets(handles), done_event)
            self._on_engine_loop(self._rpc("apply_sync_door", seq, timeout_s=self.control_timeout_s), "nudge")
            answer = door.wait(seq)
        except TimeoutError:  # the client closed its connection: a late answer cannot pass for the next load's
            raise
        except OSError as exc:  # ConnectionError included
            logger.warning("vLLM's sync door failed (%s); weight syncs go through the front end from now on", exc)
            self._door = None
            return self._through_front_end(load, started)
        if not answer["ok"]:
            self._flat_failed = answer["error"]
            logger.warning(
                "vLLM weight sync from persistent buckets failed (%s); syncing tensor by tensor from now on",
                self._flat_failed,
            )
            return self._through_front_end(load, started)
        self.door_counts[answer["applied_by"]] = self.door_counts.get(answer["applied_by"], 0) + 1
        if self.clear_cache_on_pause:
            self._on_engine_loop(self._reset_after_load(), "prefix cache reset")
        total = time.perf_counter() - started
        load_s = min(float(answer["result"].get("seconds", 0.0)), total)
        return {"wait_s": total - load_s, "load_s": load_s, "door_wait_s": float(answer["waited_s"])}

    def _through_front_end(self, load: Any, started: float) -> dict[str, float]:
        loop = self._door_loop
        if loop is None:
            raise RuntimeError("VLLMEngine.load_between_steps before open_loads_between_steps")
        future = asyncio.run_coroutine_threadsafe(self._paused_load(load), loop)
        future.result(timeout=self.rpc_timeout_s + 2 * self.control_timeout_s)
        return {"wait_s": 0.0, "load_s": time.perf_counter() - started}

    async def _paused_load(self, load: Any) -> None:
        async with paused_for_update(self):
            await self.load_weights(load)

    async def _reset_after_load(self) -> None:
        reset = await bounded(self._llm.reset_prefix_cache(True, True), self.control_timeout_s, "reset_prefix_cache")
        if reset is not True:
            self.door_counts["resets_refused"] = self.door_counts.get("resets_refused", 0) + 1
            logger.warning(
                "vLLM refused the prefix cache reset after a weight sync: running requests keep the old weights' KV"
            )

    def _on_engine_loop(self, coro: Any, what: str) -> None:
        """Run `coro` on the engine's loop without waiting for it; a failure is logged."""
        future = asyncio.run_coroutine_threadsafe(coro, self._door_loop)  # type: ignore[arg-type]

        def done(f: Any) -> None:
            if not f.cancelled() and f.exception() is not None:
                logger.warning("vLLM sync door: the %s failed: %s", what, f.exception())

        future.add_done_callback(done)

    def close_door(self) -> None:
        if self._door is not None:
            self._door.close()
            self._door = None

    async def load_weights(self, named_tensors: Iterable[tuple[str, Any]]) -> dict[str, Any]:
        """Load `(HF name, tensor)` pairs in place through the workers' `model.load_weights`; only while paused.

        CUDA tensors travel as CUDA IPC handles (no copy; the worker must be on the same GPU), others inline in
        chunks of ~`chunk_bytes`. Returns `{"num_tensors", "bytes", "seconds"}`. A LoRA adapter sync (A / s*B
        pairs) becomes a runtime adapter instead (`load_adapter`)."""
        if not self._paused:
            raise RuntimeError("VLLMEngine.load_weights needs a paused engine: await engine.pause() first")
        handles = getattr(named_tensors, "handles", None)
        flat = handles and getattr(named_tensors, "key", "") and not _adapter_entries(handles)
        if flat and not getattr(self, "_flat_failed", None):
            try:
                return await self.load_flat(named_tensors.key, handles)  # type: ignore[attr-defined]
            except Exception as exc:  # noqa: BLE001 - a worker that cannot map or replay: the per-tensor path
                self._flat_failed = f"{type(exc).__name__}: {exc}"
                logger.warning(
                    "vLLM weight sync from persistent buckets failed (%s); syncing tensor by tensor from now on",
                    self._flat_failed,
                )
        await self._ensure_held()  # several calls follow: no vLLM step may run between them
        named_tensors, is_adapter = peek_adapter(named_tensors)
        if is_adapter:
            return await self.load_adapter(named_tensors)
        import torch

        started = time.perf_counter()
        total = {"num_tensors": 0, "bytes": 0}
        keepalive: list[Any] = []
        try:
            for payload in encode_weights(
                named_tensors, chunk_bytes=self.chunk_bytes, cuda_ipc=True, keepalive=keepalive
            ):
                if keepalive:
                    torch.cuda.synchronize()  # the sender's writes land before the worker reads the handles
                results = await self._rpc("load_weights_payload", payload)
                total["num_tensors"] += int(results[0]["num_tensors"])  # every worker loads the same tensors
                total["bytes"] += int(results[0]["bytes"])
                if keepalive:
                    keepalive.clear()
                    torch.cuda.ipc_collect()  # release the copies the worker has let go of
        finally:
            keepalive.clear()
        total["seconds"] = time.perf_counter() - started
        return total

    async def load_flat(self, key: str, handles: Sequence[Any]) -> dict[str, Any]:
        """An IPC sync from learner rank 0's persistent buckets: one `collective_rpc` carrying their handles (the
        same every sync: each worker maps them once and replays its recorded copies, `WorkerExtension.load_flat_ipc`);
        nothing per tensor here, nothing blocking this event loop (the learner synchronized before handing out
        the handles)."""
        started = time.perf_counter()
        if self.clear_cache_on_pause and multimodal_cache(self._llm) is not None:
            await self._ensure_held()  # multimodal caches: vLLM's own pause clears them
        if self._held or not self.clear_cache_on_pause:
            results = await self._rpc("load_flat_ipc", key, flat_buckets(handles))
        else:  # vLLM still stepping (`sync_without_pause`): the load, then the running requests preempted
            results = await self._load_between_steps(key, handles)
        worker = results[0]
        # `engine_s`: the slowest worker's own time (mapping, copies, the wait for them); the rest of `seconds` is
        # vLLM's collective_rpc round trip (this process -> EngineCore -> its workers and back)
        return {
            **worker,
            "engine_s": max(float(r.get("seconds", 0.0)) for r in results),
            "seconds": time.perf_counter() - started,
        }

    async def _load_between_steps(self, key: str, handles: Sequence[Any]) -> list[Any]:
        """The load and the preemption of the running requests (`reset_prefix_cache(reset_running_requests=True)`)
        sent back to back: vLLM's EngineCore takes utility calls in the order sent and runs them between its steps,
        so the load lands whole between two steps, and the reset (usually before the next step) marks the running
        requests' KV and any output frame still in flight stale, as the pause's cache clearing does."""
        import asyncio

        load = asyncio.ensure_future(self._rpc("load_flat_ipc", key, flat_buckets(handles)))
        reset = asyncio.ensure_future(
            bounded(self._llm.reset_prefix_cache(True, True), self.control_timeout_s, "reset_prefix_cache")
        )
        results, reset_ok = await asyncio.gather(load, reset, return_exceptions=True)
        if isinstance(results, BaseException):
            raise results
        if reset_ok is not True:  # failed, or vLLM said no: its own pause clears the cache and preempts instead
            logger.warning(
                "vLLM's prefix cache reset after a weight sync %s: pausing vLLM to clear it", _said(reset_ok)
            )
            await self._ensure_held()
        return results

    async def _ensure_held(self) -> None:
        """Pause vLLM's scheduler if this engine is paused only in its own state (`sync_without_pause`)."""
        if self._paused and not self._held:
            await self._hold()

    async def load_adapter(self, named_tensors: Iterable[tuple[str, Any]]) -> dict[str, Any]:
        """One LoRA sync: write the adapter, `add_lora` it as `rlasync-v{k}` (new requests use it), `remove_lora`
        the oldest beyond `max_loras` (`rlasync.engine.vllm_engine_lora.RuntimeAdapters`)."""
        from rlasync.engine.vllm_engine_lora import lora_request

        adapters = getattr(self, "_adapters", None)
        if adapters is None:
            raise RuntimeError(
                "a LoRA adapter sync reached a VLLMEngine started without lora_dir / enable_lora: "
                "start it with rlasync.weights.adapter.lora_engine_kwargs(...)"
            )

        async def load(adapter: Any) -> None:
            if not await bounded(self._llm.add_lora(lora_request(adapter)), self.rpc_timeout_s, "add_lora"):
                raise RuntimeError(f"vLLM refused LoRA adapter {adapter[0]} at {adapter[2]}")

        async def unload(adapter: Any) -> None:
            await bounded(self._llm.remove_lora(adapter[1]), self.rpc_timeout_s, "remove_lora")

        return await adapters.publish(named_tensors, load=load, unload=unload)

    async def join_weight_group(
        self,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        timeout_s: float,
        backend: str = "gloo",
        bucket_bytes: int | None = None,
    ) -> None:
        """The workers join rlasync's weight-sync group (`rlasync.weights.broadcast`, learner rank 0 sends) as ranks
        `rank, rank + 1, ...` (one per worker), over `backend` ("gloo": through the CPU; "nccl": into the workers'
        GPUs, the sender on another GPU). Returns when every rank has joined."""
        await self._rpc(
            "init_weight_group",
            host,
            int(port),
            int(rank),
            int(world_size),
            float(timeout_s),
            backend,
            bucket_bytes,
            timeout_s=float(timeout_s) + 30.0,
        )

    async def receive_weights(self, manifest: Iterable[Any]) -> dict[str, Any]:
        """Receive one broadcast per manifest entry in the workers and load it (pausing first unless already
        paused, and resuming then). A stalled sender fails the group's wait with `TimeoutError`."""
        rows = manifest_rows(manifest)
        async with paused_for_update(self):
            await self._ensure_held()
            results = await self._rpc("receive_weights", rows)
        return results[0] if results else {}

    async def init_weight_transfer(
        self, master_address: str, master_port: int, rank_offset: int, world_size: int
    ) -> None:
        """vLLM's own NCCL path: the workers join a NCCL group with the learner (rank 0), as ranks from `rank_offset`.
        The learner calls `NCCLWeightTransferEngine.trainer_init({...})` at the same time. Needs
        `weight_transfer_backend="nccl"`."""
        self._need_backend("nccl")
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        info = {
            "master_address": master_address,
            "master_port": int(master_port),
            "rank_offset": int(rank_offset),
            "world_size": int(world_size),
        }
        await bounded(
            self._llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=info)),
            self.rpc_timeout_s,
            "init_weight_transfer_engine",
        )

    async def update_weights_nccl(self, manifest: Iterable[Any], packed: bool = True) -> float:
        """Receive a NCCL broadcast of the manifest's tensors from the learner (vLLM's `update_weights`), pausing
        and resuming around it unless already paused; the learner sends with
        `NCCLWeightTransferEngine.trainer_send_weights(iterator, {"group": ..., "packed": packed})`. Returns seconds."""
        self._need_backend("nccl")
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        info = nccl_update_info(manifest, packed)
        started = time.perf_counter()
        async with paused_for_update(self):
            await self._ensure_held()
            await bounded(self._llm.start_weight_update(), self.control_timeout_s, "start_weight_update")
            try:
                await bounded(
                    self._llm.update_weights(WeightTransferUpdateRequest(update_info=info)),
                    self.rpc_timeout_s,
                    "update_weights",
                )
            finally:
                await bounded(self._llm.finish_weight_update(), self.control_timeout_s, "finish_weight_update")
        return time.perf_counter() - started

    async def weight_fingerprint(self, names: Sequence[str] | None = None) -> dict[str, float]:
        results = await self._rpc("weight_fingerprint", list(names) if names is not None else None)
        return results[0] if results else {}

    def _need_backend(self, backend: str) -> None:
        if self.weight_transfer_backend != backend:
            raise RuntimeError(
                f"vLLM's weight transfer needs VLLMEngine(weight_transfer_backend={backend!r}) "
                f"(this engine has {self.weight_transfer_backend!r})"
            )
