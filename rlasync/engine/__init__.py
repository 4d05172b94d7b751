"""Generation engines behind one interface (`rlasync.engine.base.Engine`).

The built-in `TorchEngine` (continuous batching, paged KV cache, processed log-probs) is the default; a vLLM
adapter is the only module that will import vllm, and only when selected. Importing this package loads no torch:
`TorchEngine` is resolved on first access.
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
    from rlasync.engine.torch_engine import TorchEngine

__all__ = [
    "Engine",
    "EngineError",
    "EngineStats",
    "RequestRejectedError",
    "SamplingParams",
    "ScoreResult",
    "TorchEngine",
]


def __getattr__(name: str) -> Any:
    if name == "TorchEngine":
        from rlasync.engine.torch_engine import TorchEngine

        return TorchEngine
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
