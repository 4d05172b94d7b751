"""Runtime LoRA adapters for the vLLM engines (in-process `VLLMEngine` and the `vllm serve` client): an adapter sync
(LoRA A / s*B pairs from the learner, `rlasync.weights.adapter`) is written as a peft directory and loaded by vLLM
as a new adapter; requests use the newest; at most `max_loras` stay loaded (the oldest is retired: removed).

A request holds its adapter from submission to its end (`using`): vLLM may load an adapter again from its folder
while one of its requests waits or is preempted, so an adapter beyond `max_loras` is retired (unloaded, folder
deleted) only once its last request has finished. (A request naming a deleted folder kills vLLM's engine core:
measured on one H200 before this rule.)

    adapters = RuntimeAdapters(lora_dir, max_loras, base_model)
    name = await adapters.publish(stream, load=..., unload=...)    # writes lora_dir/rlasync-v{k}, loads, retires
    adapters.current                                               # (name, int id, path) of the newest, or None

In-process (vLLM 0.25 `AsyncLLM`): `load` is `add_lora(LoRARequest(name, id, path))`, `unload` is `remove_lora(id)`,
and each request passes `lora_request=`; the engine must be started with `enable_lora=True`, `max_loras`,
`max_lora_rank` (`rlasync.weights.adapter.lora_engine_kwargs`). Against `vllm serve` (started with `--enable-lora
--max-loras N --max-lora-rank R` and `VLLM_ALLOW_RUNTIME_LORA_UPDATING=1`): POST /v1/load_lora_adapter
{lora_name, lora_path} and /v1/unload_lora_adapter {lora_name}; requests name the adapter as their `model`. The
folder must be one the server can read (a shared `cluster.lora_dir`). No vllm import here.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from rlasync.weights.adapter import ADAPTER_NAME_PREFIX, adapter_pairs, write_adapter

Adapter = tuple[str, int, str]  # (lora_name, lora_int_id, lora_path)


class RuntimeAdapters:
    """The adapters one vLLM engine has loaded, oldest first; `publish` adds the next version and retires the
    oldest beyond `max_loras` (its folder is deleted after vLLM let it go)."""

    def __init__(self, lora_dir: str | Path, max_loras: int = 2, base_model: str | None = None) -> None:
        if max_loras < 1:
            raise ValueError(f"max_loras={max_loras}: must be >= 1")
        self.lora_dir, self.max_loras, self.base_model = Path(lora_dir), int(max_loras), base_model
        self.live: list[Adapter] = []
        self.version = 0
        self._users: dict[str, int] = {}  # adapter name -> requests in flight on it
        self._retiring: dict[str, Adapter] = {}  # beyond max_loras, retired once its last request ends
        self._unload: Callable[[Adapter], Awaitable[Any]] | None = None
        self._retirements: set[asyncio.Task[None]] = set()

    @property
    def current(self) -> Adapter | None:
        return self.live[-1] if self.live else None

    async def publish(
        self,
        named_tensors: Iterable[tuple[str, Any]],
        *,
        load: Callable[[Adapter], Awaitable[Any]],
        unload: Callable[[Adapter], Awaitable[Any]],
    ) -> dict[str, Any]:
        """Write the adapter of one sync, load it (`load(adapter)`), then retire the oldest ones beyond
        `max_loras` (`unload(adapter)`); returns {"adapter", "write_s", "load_s", "retired"}."""
        started = time.perf_counter()
        self.version += 1
        name = f"{ADAPTER_NAME_PREFIX}{self.version}"
        path = await asyncio.to_thread(
            write_adapter, self.lora_dir / name, adapter_pairs(named_tensors), self.base_model
        )
        written = time.perf_counter()
        adapter = (name, self.version, str(path))
        await load(adapter)
        self.live.append(adapter)
        self._unload = unload
        retired = []
        while len(self.live) > self.max_loras:
            old = self.live.pop(0)
            if self._users.get(old[0], 0):
                self._retiring[old[0]] = old  # `using` retires it when its last request ends
                continue
            await self._retire(old)
            retired.append(old[0])
        return {
            "adapter": name,
            "write_s": written - started,
            "load_s": time.perf_counter() - written,
            "retired": retired,
        }

    @contextlib.contextmanager
    def using(self) -> Iterator[Adapter | None]:
        """The newest adapter (None before the first sync), held for one request: `with adapters.using() as a:`."""
        adapter = self.current
        if adapter is None:
            yield None
            return
        name = adapter[0]
        self._users[name] = self._users.get(name, 0) + 1
        try:
            yield adapter
        finally:
            self._users[name] -= 1
            if not self._users[name]:
                del self._users[name]
                retiring = self._retiring.pop(name, None)
                if retiring is not None:
                    task = asyncio.ensure_future(self._retire(retiring))
                    self._retirements.add(task)
                    task.add_done_callback(self._retirements.discard)

    @property
    def retiring(self) -> list[str]:
        """Adapters beyond `max_loras` still used by requests in flight."""
        return list(self._retiring)

    async def _retire(self, adapter: Adapter) -> None:
        if self._unload is not None:
            await self._unload(adapter)
        shutil.rmtree(adapter[2], ignore_errors=True)


def lora_request(adapter: Adapter | None) -> Any:
    """vLLM's `LoRARequest` for `adapter` (None: the base model)."""
    if adapter is None:
        return None
    from vllm.lora.request import LoRARequest

    name, int_id, path = adapter
    return LoRARequest(lora_name=name, lora_int_id=int_id, lora_path=path)


__all__ = ["Adapter", "RuntimeAdapters", "lora_request"]
