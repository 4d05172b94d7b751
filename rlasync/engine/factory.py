"""`make_engine(kind, model, **kwargs)`: the one place that turns `cluster.engine` (an
`rlasync.config.vocab.EngineKind`; its traits say how the kinds differ) into an engine.

    torch        TorchEngine(model, **kwargs)                      the built-in engine (default; CPU or GPU)
    vllm         VLLMEngine(model, **kwargs)                       vLLM's AsyncLLM in this process (needs vllm)
    vllm_server  VLLMServerEngine(base_url, model, **kwargs)       a client of `vllm serve` at `base_url`

Each engine module is imported only when chosen, so choosing "torch" never imports vllm, and nothing is imported
when this module is.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rlasync.config.vocab import EngineKind, parse_engine


def _torch(model: Any, base_url: str | None, kwargs: dict[str, Any]) -> Any:
    from rlasync.engine.torch_engine import TorchEngine

    return TorchEngine(model, **kwargs)


def _vllm(model: Any, base_url: str | None, kwargs: dict[str, Any]) -> Any:
    from rlasync.engine.vllm_engine import VLLMEngine

    if kwargs.get("dtype") == "auto":
        kwargs["dtype"] = None
    return VLLMEngine(model, **kwargs)


def _vllm_server(model: Any, base_url: str | None, kwargs: dict[str, Any]) -> Any:
    from rlasync.engine.vllm_server import VLLMServerEngine

    return VLLMServerEngine(base_url, model if isinstance(model, str) else None, **kwargs)


BUILDERS: dict[EngineKind, Callable[[Any, str | None, dict[str, Any]], Any]] = {
    EngineKind.TORCH: _torch,
    EngineKind.VLLM: _vllm,
    EngineKind.VLLM_SERVER: _vllm_server,
}


def make_engine(kind: str, model: Any, *, base_url: str | None = None, **kwargs: Any) -> Any:
    """Build the engine of `kind` for `model` (a path, hub id, or, for "torch", a built model).

    `base_url` (the `vllm serve` address, `cluster.vllm_server_url`) is required by a kind whose traits say
    `needs_url` and refused by the others; a `dtype` of None or "auto" means the checkpoint's. Other keyword
    arguments go to the engine (`cluster.engine_kwargs`)."""
    engine = parse_engine(kind)
    if engine.traits.needs_url and not base_url:
        raise ValueError(f"cluster.engine={engine.value!r} needs cluster.vllm_server_url (e.g. http://host:8000)")
    if not engine.traits.needs_url and base_url is not None:
        raise ValueError(
            f"cluster.vllm_server_url is set but cluster.engine={engine.value!r}: use an engine that takes a URL "
            f"({', '.join(repr(k.value) for k in EngineKind if k.traits.needs_url)})"
        )
    return BUILDERS[engine](model, base_url, kwargs)
