"""The vLLM worker side of a weight sync: a worker extension class, and the payload format it reads.

vLLM (0.25) mixes a class named by `worker_extension_cls` into every GPU worker (`Worker.__bases__ += (cls,)`),
so its methods run inside the worker process, next to the model, and are reached through
`AsyncLLM.collective_rpc(method, timeout, args, kwargs)` (in-process engine, `rlasync.engine.vllm_engine`) or
`POST /collective_rpc {"method", "args", "kwargs", "timeout"}` (a `vllm serve` started with
`VLLM_SERVER_DEV_MODE=1 --worker-extension-cls rlasync.engine.vllm_worker.WorkerExtension`). A name clash with a
`Worker` attribute is a hard error in vLLM, so every method here has a name vLLM's Worker does not use
(0.25's Worker already has `update_weights`, `reload_weights`, `start_weight_update`, ...).

    load_weights_payload(payload)                 tensors sent inline (CPU bytes) or as CUDA IPC handles (same GPU)
    load_flat_ipc(key, buckets)                   an IPC sync: learner rank 0's persistent buckets, mapped once,
                                                  the recorded copies replayed as one batched copy
    open_sync_door() / apply_sync_door() / close_sync_door()
                                                  `load_flat_ipc` through a socket of the worker's own, applied at
                                                  its next step (`rlasync.engine.vllm_door`)
    init_weight_group(host, port, rank, world_size, timeout_s)
                                                  join rlasync's weight-sync group (`rlasync.weights.broadcast`)
    receive_weights(manifest)                     receive one broadcast per manifest entry from learner rank 0
    close_weight_group()
    weight_fingerprint(names)                     float64 sums of named parameters (tests, device checks)

Every load ends in the model's own `model.load_weights(iterable of (HF name, tensor))`, which maps HF names onto
vLLM's fused parameters (q/k/v -> qkv_proj, gate/up -> gate_up_proj) and copies in place, so CUDA graphs and
compiled code stay valid. That is complete for dense unquantized models (on CUDA, 0.25's unquantized linear layers do
no post-load processing); quantized checkpoints need vLLM's layerwise reload (`initialize_layerwise_reload` /
`finalize_layerwise_reload`, what its NCCL weight-transfer engine runs), which this extension does not do. This module imports neither vllm nor ray (torch only when a method runs), so it is
importable, and its logic testable, without vLLM: the tests mix it into a fake worker with a fake model runner.

Payload format (a plain dict, so msgpack (collective_rpc) and JSON (HTTP) both carry it):
    {"format": "rlasync-weights-v1", "items": [[name, dtype, shape, kind, data], ...]}
    kind "raw": data is the tensor's bytes (C order);  kind "b64": the same bytes, base64 (for JSON);
    kind "ipc": data is pickled `torch.multiprocessing.reductions.reduce_tensor` arguments plus the GPU's UUID;
    only the in-process engine sends it (the pickle never crosses a network), and the receiving worker must sit
    on the same physical GPU.
"""

from __future__ import annotations

import base64
import json
import logging
import pickle
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

PAYLOAD_FORMAT = "rlasync-weights-v1"
DEFAULT_CHUNK_BYTES = 256 << 20
EXTENSION_QUALNAME = "rlasync.engine.vllm_worker.WorkerExtension"

logger = logging.getLogger(__name__)


# ---- payloads (sender side: the engine adapters) -------------------------------------------------------------------


def nccl_update_info(manifest: Iterable[Any], packed: bool = True) -> dict[str, Any]:
    """vLLM's `update_weights` request body for a manifest (names, dtype names, shapes, packed)."""
    rows = manifest_rows(manifest)
    return {
        "names": [r[0] for r in rows],
        "dtype_names": [r[1] for r in rows],
        "shapes": [r[2] for r in rows],
        "packed": bool(packed),
    }


def manifest_rows(manifest: Iterable[Any]) -> list[list[Any]]:
    """`[[name, dtype, shape], ...]` from `ManifestEntry` objects, dicts, `(name, dtype, shape)` sequences, or a JSON
    string of any of those (HTTP transports pass strings)."""
    if isinstance(manifest, str):
        manifest = json.loads(manifest)
    rows = []
    for entry in manifest:
        if isinstance(entry, dict):
            name, dtype, shape = entry["name"], entry["dtype"], entry["shape"]
        elif hasattr(entry, "name") and hasattr(entry, "shape"):
            name, dtype, shape = entry.name, entry.dtype, entry.shape
        else:
            name, dtype, shape = entry
        rows.append([str(name), str(dtype).removeprefix("torch."), [int(d) for d in shape]])
    return rows


def encode_weights(
    named_tensors: Iterable[tuple[str, Any]],
    *,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    text: bool = False,
    cuda_ipc: bool = False,
    keepalive: list[Any] | None = None,
) -> Iterator[dict[str, Any]]:
    """Yield payloads of at most ~`chunk_bytes` of tensor data each (a larger tensor goes alone).

    text=True base64-encodes the bytes (JSON transports). cuda_ipc=True sends CUDA tensors as IPC handles instead
    of bytes: each is copied (the sender may reuse its buffer once the iterator advances) and the copy appended to
    `keepalive`, which the caller must hold until the receiver has loaded the payload (handles keep no memory alive).
    """
    import torch

    items: list[list[Any]] = []
    size = 0
    for name, value in named_tensors:
        tensor = torch.as_tensor(value).detach()
        dtype = str(tensor.dtype).removeprefix("torch.")
        shape = [int(d) for d in tensor.shape]
        if cuda_ipc and tensor.is_cuda:
            from torch.multiprocessing.reductions import reduce_tensor

            if keepalive is None:
                raise ValueError("encode_weights(cuda_ipc=True) needs a keepalive list")
            # a copy: the sender may reuse its buffer (a broadcast bucket) as soon as the generator advances
            tensor = tensor.clone(memory_format=torch.contiguous_format)
            keepalive.append(tensor)
            uuid = str(torch.cuda.get_device_properties(tensor.device).uuid)
            _, args = reduce_tensor(tensor)
            items.append([name, dtype, shape, "ipc", pickle.dumps((uuid, args))])
            nbytes = tensor.numel() * tensor.element_size()
        else:
            flat = tensor.to("cpu").contiguous().reshape(-1)
            data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
            nbytes = len(data)
            items.append(
                [name, dtype, shape, "b64", base64.b64encode(data).decode("ascii")]
                if text
                else [name, dtype, shape, "raw", data]
            )
        size += nbytes
        if size >= chunk_bytes:
            yield {"format": PAYLOAD_FORMAT, "items": items}
            items, size = [], 0
    if items:
        yield {"format": PAYLOAD_FORMAT, "items": items}


def decode_weights(payload: dict[str, Any], device: Any = None) -> Iterator[tuple[str, Any]]:
    """The receiver's view of a payload: `(name, tensor on device)` pairs, lazily (one tensor built at a time)."""
    import torch

    if isinstance(payload, str):
        payload = json.loads(payload)
    if not isinstance(payload, dict) or payload.get("format") != PAYLOAD_FORMAT:
        raise ValueError(f"not an rlasync weight payload (expected a dict with format={PAYLOAD_FORMAT!r})")
    for name, dtype_name, shape, kind, data in payload["items"]:
        dtype = getattr(torch, str(dtype_name), None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"weight {name}: unknown dtype {dtype_name!r}")
        if kind == "ipc":
            yield name, _rebuild_ipc(name, data, device)
            continue
        if kind == "b64":
            data = base64.b64decode(data)
        elif kind != "raw":
            raise ValueError(f"weight {name}: unknown payload kind {kind!r}")
        buffer = bytearray(data)  # writable, owned by the tensor
        if buffer:
            tensor = torch.frombuffer(buffer, dtype=torch.uint8).view(dtype).reshape(tuple(shape))
        else:
            tensor = torch.empty(tuple(shape), dtype=dtype)
        yield name, tensor.to(device) if device is not None else tensor


def _rebuild_ipc(name: str, data: bytes, device: Any) -> Any:
    uuid, args = pickle.loads(data)
    return _rebuild_cuda(name, uuid, args, device)


def _rebuild_cuda(name: str, uuid: str, args: tuple | list, device: Any) -> Any:
    import torch
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    index = torch.device(device).index if device is not None and torch.device(device).type == "cuda" else None
    index = torch.cuda.current_device() if index is None else index
    here = str(torch.cuda.get_device_properties(index).uuid)
    if here != uuid:
        raise ValueError(
            f"weight {name}: sent as a CUDA IPC handle from GPU {uuid}, but this worker is on GPU {here}; CUDA IPC "
            "works on the same GPU only: send CPU tensors instead"
        )
    args = list(args)
    args[6] = index  # the storage device, as this process numbers it
    return rebuild_cuda_tensor(*args)


# ---- the worker extension (receiver side) --------------------------------------------------------------------------


class WorkerExtension:
    """Mixed into vLLM's GPU `Worker` (`worker_extension_cls=EXTENSION_QUALNAME`); defines no `__init__`.

    Uses only `self.model_runner` (its `.model`, or `get_model()`) and, when present, `self.device` and `self.rank`
    of the worker it is mixed into. State lives in attributes prefixed `_rlasync_`.
    """

    # ---- helpers ----

    def _rlasync_model(self) -> Any:
        runner = self.model_runner  # type: ignore[attr-defined]
        model = getattr(runner, "model", None)
        return model if model is not None else runner.get_model()

    def _rlasync_device(self) -> Any:
        device = getattr(self, "device", None)
        if device is not None:
            return device
        for param in self._rlasync_model().parameters():
            return param.device
        return "cpu"

    def _rlasync_load(self, named_tensors: Iterable[tuple[str, Any]]) -> dict[str, Any]:
        import torch

        counted = _Counted(named_tensors)
        started = time.perf_counter()
        with torch.no_grad():
            loaded = self._rlasync_model().load_weights(counted)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        return {
            "num_tensors": counted.count,
            "bytes": counted.bytes,
            "num_loaded": len(loaded) if loaded is not None and hasattr(loaded, "__len__") else None,
            "seconds": time.perf_counter() - started,
        }

    # ---- collective_rpc methods ----

    def load_weights_payload(self, payload: dict[str, Any] | str) -> dict[str, Any]:
        """Load one payload of `encode_weights` (a dict, or its JSON) through the model's `load_weights` (in place)."""
        return self._rlasync_load(decode_weights(payload, self._rlasync_device()))

    def load_flat_ipc(self, key: str, buckets: Sequence[Any], done_event: bytes | None = None) -> dict[str, Any]:
        """One sync from learner rank 0's persistent buckets (`rlasync.weights.ipc.SharedWeights`; `buckets` as
        `flat_buckets` encodes them): mapped once per `key` (the same handles every sync), the first load through
        the model's `load_weights` with its copies recorded, later ones one batched copy of the recorded shards
        into the fused parameters (`rlasync.engine.weights.CopyPlan`; the loader again if it is not replayable).
        `done_event`: the IPC handle of learner rank 0's event for this engine (`IpcTicket.done_events`), recorded
        behind the copies instead of waiting for them (the sender waits for it before refilling its buckets)."""
        import torch

        from rlasync.engine.weights import PlannedLoader

        started = time.perf_counter()
        cached = getattr(self, "_rlasync_flat", None)
        if cached is None or cached.key != key:
            cached = self._rlasync_flat = _Mapped(key, self._rlasync_open(buckets), PlannedLoader())
        mapped = time.perf_counter()
        with torch.no_grad():
            how = cached.loader.load(self._rlasync_model(), cached, lambda pairs: self._rlasync_load(pairs))
        queued = time.perf_counter()
        recorded = done_event is not None and self._rlasync_record(done_event)
        if torch.cuda.is_available() and not recorded:
            torch.cuda.synchronize()  # the sender refills its buckets once this returns
        ended = time.perf_counter()
        # the phases inside the worker: mapping the buckets (first sync only), queueing the copies (host), waiting
        # for them on the GPU (a GPU shared with a learner's kernels waits for its time slices)
        return {
            "how": how,
            "not_replayed": cached.loader.reason(key),
            "num_tensors": len(cached.pairs),
            "seconds": ended - started,
            "map_s": mapped - started,
            "queue_s": queued - mapped,
            "gpu_wait_s": ended - queued,
            "bytes": sum(t.numel() * t.element_size() for _, t in cached.pairs),
            "recorded": bool(recorded),
        }

    def _rlasync_record(self, handle: bytes) -> bool:
        """Record the sender's interprocess event on this worker's stream, behind the queued copies; False (the
        caller waits for the copies) off CUDA or where it cannot be opened."""
        import torch

        from rlasync.weights.ipc import open_event

        if not torch.cuda.is_available():
            return False
        device = torch.device(self._rlasync_device())
        index = device.index if device.type == "cuda" and device.index is not None else torch.cuda.current_device()
        try:
            open_event(bytes(handle), index).record(torch.cuda.current_stream(index))
        except RuntimeError as exc:
            if not getattr(self, "_rlasync_event_warned", False):
                self._rlasync_event_warned = True
                logger.warning("vLLM worker: the weight sync's copy event failed (%s); waiting for the copies", exc)
            return False
        return True

    def _rlasync_open(self, buckets: Sequence[Any]) -> list[tuple[str, Any]]:
        from pathlib import Path

        import torch

        from rlasync.weights.ipc import _map_file

        pairs = []
        for entries, handle in buckets:
            if handle[0] == "file":
                flat = _map_file(Path(handle[1]), int(handle[2]), create=False)
            else:
                flat = _rebuild_cuda("flat bucket", handle[2], pickle.loads(handle[1]), self._rlasync_device())
            for name, dtype, shape, offset, num_bytes in entries:
                pairs.append((name, flat[offset : offset + num_bytes].view(getattr(torch, dtype)).view(tuple(shape))))
        return pairs

    def open_sync_door(self) -> str:
        """Open this worker's sync door (`rlasync.engine.vllm_door`; once) and return its socket's path: loads sent
        through it are applied at the start of the worker's next step, or by `apply_sync_door`."""
        from rlasync.engine.vllm_door import install_door

        door = getattr(self, "_rlasync_door", None)
        if door is None:
            door = self._rlasync_door = install_door(
                self, lambda request: self.load_flat_ipc(request["key"], request["buckets"], request.get("event"))
            )
        return door.path

    def apply_sync_door(self, seq: Any = 0, timeout_s: Any = 5.0) -> int:
        """Apply the loads pending at the sync door now (the client's nudge through the front end, for an engine
        with no step to run), once load `seq` has arrived (the nudge may overtake it); how many."""
        door = getattr(self, "_rlasync_door", None)
        if door is None:
            return 0
        door.wait_received(int(seq), float(timeout_s))
        return door.apply_pending("nudge")

    def close_sync_door(self) -> None:
        from rlasync.engine.vllm_door import remove_door

        door = getattr(self, "_rlasync_door", None)
        if door is not None:
            remove_door(self, door)
        self._rlasync_door = None

    def init_weight_group(
        self,
        host: str,
        port: Any,
        rank: Any,
        world_size: Any,
        timeout_s: Any = 300.0,
        backend: str = "gloo",
        bucket_bytes: Any = None,
    ) -> dict:
        """Join rlasync's weight-sync group as rank `rank + self.rank` (one rank per worker of this engine: with
        tensor parallelism the sender's group counts every worker). Returns when every rank has joined.

        `backend` "nccl" receives straight into this worker's GPU (the sender must be on another GPU); `backend` and
        `bucket_bytes` must match the sender's, and are passed to `WeightGroup.open` only when not the defaults."""
        from rlasync.weights.broadcast import WeightGroup

        self.close_weight_group()
        my_rank = int(rank) + int(getattr(self, "rank", 0) or 0)
        options: dict[str, Any] = {}
        if backend != "gloo":
            options.update(backend=backend, device=self._rlasync_device())
        if bucket_bytes not in (None, "", "None"):
            options["bucket_bytes"] = int(bucket_bytes)
        started = time.perf_counter()
        self._rlasync_group = WeightGroup.open(
            str(host), int(port), my_rank, int(world_size), float(timeout_s), **options
        )
        return {"rank": my_rank, "world_size": int(world_size), "seconds": time.perf_counter() - started}

    def receive_weights(self, manifest: Sequence[Any] | str) -> dict[str, Any]:
        """Receive every manifest entry (`[name, dtype, shape]`, in the sender's order) by broadcast from rank 0 of
        the weight-sync group, and load them as they arrive. A stalled sender is a `TimeoutError` (the group's
        timeout), never a hang."""
        group = getattr(self, "_rlasync_group", None)
        if group is None:
            raise RuntimeError("receive_weights before init_weight_group: join the weight-sync group first")
        from rlasync.weights.plan import ManifestEntry

        device = self._rlasync_device()
        entries = [ManifestEntry(name=n, dtype=d, shape=tuple(s)) for n, d, s in manifest_rows(manifest)]
        return self._rlasync_load((name, tensor.to(device)) for name, tensor in group.receive(entries))

    def close_weight_group(self) -> None:
        group = getattr(self, "_rlasync_group", None)
        if group is not None:
            group.close()
        self._rlasync_group = None

    def weight_fingerprint(self, names: Sequence[str] | None = None) -> dict[str, float]:
        """`{name: float64 sum}` of the model's parameters (all, or those named): cheap evidence of a load."""
        params = dict(self._rlasync_model().named_parameters())
        chosen = list(params) if names is None else [n for n in names if n in params]
        return {name: float(params[name].detach().double().sum().item()) for name in chosen}


def flat_buckets(handles: Sequence[Any]) -> list[list[Any]]:
    """`SharedWeights.handles()` as `load_flat_ipc` takes them through `collective_rpc` (plain lists and bytes):
    per bucket its entries and `["file", path, size]` or `["cuda", pickled reduce_tensor args, GPU UUID]`."""
    out = []
    for entries, handle in handles:
        rows = [[n, d, list(s), int(o), int(b)] for n, d, s, o, b in entries]
        if handle[0] == "file":
            out.append([rows, ["file", str(handle[1]), int(handle[2])]])
        else:
            out.append([rows, ["cuda", pickle.dumps(handle[1][1]), str(handle[2])]])
    return out


class _Mapped:
    """A worker's mapped persistent buckets: `(name, view)` pairs with the `key` a `PlannedLoader` caches by."""

    def __init__(self, key: str, pairs: list[tuple[str, Any]], loader: Any) -> None:
        self.key, self.pairs, self.loader = key, pairs, loader

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        return iter(self.pairs)


class _Counted:
    """Wraps a `(name, tensor)` iterable and counts what passed through (the model's loader consumes it)."""

    def __init__(self, named_tensors: Iterable[tuple[str, Any]]) -> None:
        self._items = iter(named_tensors)
        self.count = 0
        self.bytes = 0

    def __iter__(self) -> _Counted:
        return self

    def __next__(self) -> tuple[str, Any]:
        name, tensor = next(self._items)
        self.count += 1
        self.bytes += int(tensor.numel() * tensor.element_size())
        return name, tensor
