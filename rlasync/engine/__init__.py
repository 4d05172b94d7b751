"""Generation engines behind one interface (`rlasync.engine.base.Engine`).

The built-in `TorchEngine` (continuous batching, paged KV cache, processed log-probs) is the default; `VLLMEngine`
(in-process vLLM `AsyncLLM`) and `VLLMServerEngine` (a client of `vllm serve`) are the vLLM adapters, and
`make_engine(kind, model, ...)` picks one by `cluster.engine`. Only `rlasync.engine.vllm_engine` (and its weight
loading, `vllm_engine_weights`) imports vllm, and only when a `VLLMEngine` is built or used. Importing this package
loads no torch: the engines are resolved on first access.

vLLM modules: vllm_engine (the AsyncLLM adapter) + vllm_engine_weights (its weight loading) + vllm_outputs (vLLM
outputs -> records, shared); vllm_server (the HTTP engine) + vllm_server_wire (bodies, parsers) + vllm_server_http
(client, retries) + vllm_server_check (startup check); vllm_worker (the worker extension inside vLLM).
"""

from typing import TYPE_CHECKING, Any

from rlasync.engine.base import (
    Engine,
    EngineError,
    EngineStats,
    RequestRejectedError,
    SamplingParams,
    ScoreResult,
)

if TYPE_CHECKING:
    from rlasync.engine.factory import make_engine
    from rlasync.engine.torch_engine import TorchEngine
    from rlasync.engine.vllm_engine import VLLMEngine
    from rlasync.engine.vllm_server import VLLMServerEngine

__all__ = [
    "Engine",
    "EngineError",
    "EngineStats",
    "RequestRejectedError",
    "SamplingParams",
    "ScoreResult",
    "TorchEngine",
    "VLLMEngine",
    "VLLMServerEngine",
    "make_engine",
]

_LAZY = {
    "TorchEngine": "rlasync.engine.torch_engine",
    "VLLMEngine": "rlasync.engine.vllm_engine",
    "VLLMServerEngine": "rlasync.engine.vllm_server",
    "make_engine": "rlasync.engine.factory",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is not None:
        import importlib

        return getattr(importlib.import_module(module), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
