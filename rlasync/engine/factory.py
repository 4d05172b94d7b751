"""`make_engine(kind, model, **kwargs)`: the one place that turns `cluster.engine` into an engine.

    "torch"        TorchEngine(model, **kwargs)                      the built-in engine (default; CPU or GPU)
    "vllm"         VLLMEngine(model, **kwargs)                       vLLM's AsyncLLM in this process (needs vllm)
    "vllm_server"  VLLMServerEngine(base_url, model, **kwargs)       a client of `vllm serve` at `base_url`

Each engine module is imported only when chosen, so choosing "torch" never imports vllm, and nothing is imported
when this module is.
"""

from __future__ import annotations

from typing import Any

ENGINE_KINDS = ("torch", "vllm", "vllm_server")


def make_engine(kind: str, model: Any, *, base_url: str | None = None, **kwargs: Any) -> Any:
    """Build the engine of `kind` for `model` (a path, hub id, or, for "torch", a built model).

    `base_url` (the `vllm serve` address, `cluster.vllm_server_url`) is required by "vllm_server" and refused by the
    others; a `dtype` of None or "auto" means the checkpoint's. Other keyword arguments go to the engine
    (`cluster.engine_kwargs`)."""
    if kind not in ENGINE_KINDS:
        raise ValueError(f"cluster.engine={kind!r}: must be one of {', '.join(ENGINE_KINDS)}")
    if kind != "vllm_server" and base_url is not None:
        raise ValueError(f"cluster.vllm_server_url is set but cluster.engine={kind!r}: use engine 'vllm_server'")
    if kind == "torch":
        from rlasync.engine.torch_engine import TorchEngine

        return TorchEngine(model, **kwargs)
    if kind == "vllm":
        from rlasync.engine.vllm_engine import VLLMEngine

        if kwargs.get("dtype") == "auto":
            kwargs["dtype"] = None
        return VLLMEngine(model, **kwargs)
    from rlasync.engine.vllm_server import VLLMServerEngine

    if not base_url:
        raise ValueError("cluster.engine='vllm_server' needs cluster.vllm_server_url (e.g. http://host:8000)")
    return VLLMServerEngine(base_url, model if isinstance(model, str) else None, **kwargs)
