"""Generation engines behind one interface (`rlasync.engine.base.Engine`).

The built-in `TorchEngine` (continuous batching, paged KV cache, processed log-probs) is the default; a vLLM
adapter is the only module that will import vllm, and only when selected.
"""

from rlasync.engine.base import (
    Engine,
    EngineError,
    EngineStats,
    RequestRejectedError,
    SamplingParams,
    ScoreResult,
)

__all__ = ["Engine", "EngineError", "EngineStats", "RequestRejectedError", "SamplingParams", "ScoreResult"]
