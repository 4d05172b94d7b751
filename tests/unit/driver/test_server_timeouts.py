"""`vllm serve` client engines (a `vllm_server` policy engine, a teacher reached by URL) take the config's timeouts:
a teacher URL where no server runs fails after `vllm_server_timeout`, not after the client's own default."""

from rlasync.config import AsyncDistillationConfig, AsyncGRPOConfig
from rlasync.driver import server_engine_kwargs


def test_grpo_vllm_server_timeout_bounds_readiness_requests_and_weight_calls():
    config = AsyncGRPOConfig(output_dir="/tmp/x", vllm_server_timeout=42.0)
    assert server_engine_kwargs(config, None) == {
        "startup_timeout_s": 42.0,
        "request_timeout_s": 42.0,
        "weight_sync_timeout_s": 42.0,
    }


def test_distillation_takes_its_request_and_weight_sync_timeouts():
    config = AsyncDistillationConfig(
        output_dir="/tmp/x", vllm_server_timeout=30.0, request_timeout=7.0, weight_sync_timeout=99.0
    )
    assert server_engine_kwargs(config, None) == {
        "startup_timeout_s": 30.0,
        "request_timeout_s": 7.0,
        "weight_sync_timeout_s": 99.0,
    }


def test_explicit_engine_kwargs_win():
    config = AsyncGRPOConfig(output_dir="/tmp/x", vllm_server_timeout=42.0)
    kwargs = server_engine_kwargs(config, {"startup_timeout_s": 5.0, "max_connections": 8})
    assert kwargs["startup_timeout_s"] == 5.0 and kwargs["max_connections"] == 8 and kwargs["request_timeout_s"] == 42.0
