"""VLLMServerEngine against a fake `vllm serve` (aiohttp, in a thread) that speaks vLLM 0.25's wire format: the
startup check (dev-mode /server_info, or the one-token logprobs-mode probe), generate and score parsing, retries of
transient failures only, timeouts, /metrics, pause/resume and the weight-sync endpoints; plus the parsers on the
recorded fixtures in fixtures/vllm/ (read structurally, so real recordings can replace them)."""

import asyncio
import json
import logging
import threading
from pathlib import Path

import pytest
import torch
from aiohttp import web

from rlasync.engine import RequestRejectedError, SamplingParams
from rlasync.engine.vllm_server import (
    VLLMServerEngine,
    VLLMServerError,
    error_message,
    parse_prometheus,
    parse_token_id,
    stats_from_metrics,
    turn_from_completion,
)
from rlasync.engine.vllm_worker import WorkerExtension, encode_weights

FIXTURES = Path(__file__).parent / "fixtures" / "vllm"
MODEL_ID = "fake-model"
VOCAB = 50


def fixture(name):
    path = FIXTURES / name
    return path.read_text() if name.endswith(".txt") else json.loads(path.read_text())


# ---- a fake vLLM 0.25 server -----------------------------------------------------------------------------------------


class FakeModel(torch.nn.Module):
    """Parameters plus a vLLM-style `load_weights(iterable of (name, tensor))` returning the loaded names."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Parameter(torch.zeros(3, 4))
        self.b = torch.nn.Parameter(torch.zeros(5, dtype=torch.bfloat16))

    def load_weights(self, weights):
        params, loaded = dict(self.named_parameters()), set()
        for name, tensor in weights:
            params[name].data.copy_(tensor)
            loaded.add(name)
        return loaded


class FakeWorker(WorkerExtension):
    def __init__(self):
        self.model_runner = type("Runner", (), {})()
        self.model_runner.model = FakeModel()


class FakeVLLM:
    """Generation is deterministic: token k of a request is (last prompt token + 1 + k) % VOCAB; its log-prob is
    -(0.1 + 0.05k) (processed mode; exactly 0 with top_k=1) or -(1.5 + 0.05k) (raw mode). With logprobs=N, even
    positions have the sampled token as the top-1, odd positions have it outside the top-N (N+1 entries, sampled
    first, as vLLM orders them)."""

    def __init__(self, *, dev_mode=True, logprobs_mode="processed_logprobs", max_model_len=64):
        self.dev_mode = dev_mode
        self.logprobs_mode = logprobs_mode
        self.max_model_len = max_model_len
        self.requests = []
        self.fail = []  # HTTP statuses for the next /v1/completions calls
        self.delay_s = 0.0
        self.paused = False
        self.worker = FakeWorker()
        self.fail_rpc = None

    # ---- lifecycle ----
    def __enter__(self):
        ready = threading.Event()

        def serve():
            self.loop = asyncio.new_event_loop()
            asyncio.set_event_loop(self.loop)
            app = web.Application(client_max_size=1 << 28)
            app.router.add_post("/v1/completions", self.completions)
            app.router.add_get("/v1/models", self.models)
            app.router.add_get("/version", self.version)
            app.router.add_get("/metrics", self.metrics)
            if self.dev_mode:
                app.router.add_get("/server_info", self.server_info)
                app.router.add_post("/pause", self.pause)
                app.router.add_post("/resume", self.resume)
                app.router.add_post("/collective_rpc", self.collective_rpc)
                app.router.add_get("/get_world_size", self.world_size)
                for path in (
                    "/init_weight_transfer_engine",
                    "/start_weight_update",
                    "/update_weights",
                    "/finish_weight_update",
                ):
                    app.router.add_post(path, self.transfer)
            self.runner = web.AppRunner(app)
            self.loop.run_until_complete(self.runner.setup())
            site = web.TCPSite(self.runner, "127.0.0.1", 0)
            self.loop.run_until_complete(site.start())
            self.port = self.runner.addresses[0][1]
            ready.set()
            self.loop.run_forever()
            self.loop.run_until_complete(self.runner.cleanup())

        self.thread = threading.Thread(target=serve, daemon=True)
        self.thread.start()
        assert ready.wait(10)
        self.url = f"http://127.0.0.1:{self.port}"
        return self

    def __exit__(self, *exc):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)

    def engine(self, **kwargs):
        options = dict(backoff_base_s=0.01, metrics_interval_s=0, request_timeout_s=5.0, control_timeout_s=5.0)
        return VLLMServerEngine(self.url, MODEL_ID, **{**options, **kwargs})

    def paths(self):
        return [path for _, path, _ in self.requests]

    # ---- handlers ----
    def _record(self, request, body):
        self.requests.append((request.method, request.path_qs, body))

    @staticmethod
    def _error(status, message, kind="BadRequestError"):
        return web.json_response(
            {"error": {"message": message, "type": kind, "param": None, "code": status}}, status=status
        )

    async def completions(self, request):
        body = await request.json()
        self._record(request, body)
        if self.fail:
            status = self.fail.pop(0)
            return self._error(status, f"injected failure {status}", "ServiceUnavailable")
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        if body.get("model") not in (None, MODEL_ID):
            return self._error(404, f"The model `{body.get('model')}` does not exist.", "NotFoundError")
        prompt = body["prompt"]
        n, num_logprobs = body.get("max_tokens", 16), body.get("logprobs")
        if len(prompt) + n > self.max_model_len:  # vLLM 0.25: renderers/params.py _token_len_check
            return self._error(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {n} output tokens and your prompt contains {len(prompt)} input "
                f"tokens, for a total of {len(prompt) + n} tokens. Please reduce the length of "
                "the input prompt or the number of requested output tokens.",
            )
        tokens = [(prompt[-1] + 1 + k) % VOCAB for k in range(n)]
        processed = self.logprobs_mode == "processed_logprobs"
        sampled = [
            0.0 if processed and body.get("top_k") == 1 else -((0.1 if processed else 1.5) + 0.05 * k) for k in range(n)
        ]
        logprobs = None
        if num_logprobs is not None:
            top = []
            for k, (token, lp) in enumerate(zip(tokens, sampled)):
                entry = {f"token_id:{token}": lp}
                others = [(token + 10 + j) % VOCAB for j in range(num_logprobs)]
                if k % 2 == 0:  # sampled is the top-1: N entries
                    entry.update({f"token_id:{o}": lp - 1.0 - j for j, o in enumerate(others[: num_logprobs - 1])})
                else:  # sampled is outside the top-N: N + 1 entries
                    entry.update({f"token_id:{o}": lp + 0.5 - 0.01 * j for j, o in enumerate(others)})
                top.append(entry)
            logprobs = {
                "text_offset": list(range(n)),
                "token_logprobs": sampled,
                "tokens": [f"token_id:{t}" for t in tokens],
                "top_logprobs": top,
            }
        prompt_logprobs = None
        if body.get("prompt_logprobs") is not None:
            k_top = body["prompt_logprobs"]
            prompt_logprobs = [None]
            for i in range(1, len(prompt)):
                realised = prompt[i]
                entry = {
                    str(realised): {
                        "logprob": -0.2 * i,
                        "rank": 1 if i % 2 else k_top + 3,
                        "decoded_token": f"t{realised}",
                    }
                }
                others = [(realised + 7 + j) % VOCAB for j in range(k_top)]
                start = 2 if i % 2 else 1
                for j, other in enumerate(others[: k_top - (1 if i % 2 else 0)]):
                    entry[str(other)] = {"logprob": -0.3 * i - j, "rank": start + j, "decoded_token": f"t{other}"}
                prompt_logprobs.append(entry)
        choice = {
            "index": 0,
            "text": "",
            "logprobs": logprobs,
            "finish_reason": "length",
            "stop_reason": None,
            "token_ids": tokens if body.get("return_token_ids") else None,
            "prompt_logprobs": prompt_logprobs,
            "prompt_token_ids": prompt if body.get("return_token_ids") else None,
            "routed_experts": None,
        }
        return web.json_response(
            {
                "id": "cmpl-fake",
                "object": "text_completion",
                "created": 0,
                "model": MODEL_ID,
                "choices": [choice],
                "usage": {"prompt_tokens": len(prompt), "total_tokens": len(prompt) + n, "completion_tokens": n},
            }
        )

    async def models(self, request):
        self._record(request, None)
        return web.json_response(
            {
                "object": "list",
                "data": [
                    {
                        "id": MODEL_ID,
                        "object": "model",
                        "owned_by": "vllm",
                        "root": "/tmp/fake",
                        "max_model_len": self.max_model_len,
                        "permission": [],
                    }
                ],
            }
        )

    async def version(self, request):
        return web.json_response({"version": "0.25.0"})

    async def world_size(self, request):
        self._record(request, None)
        return web.json_response({"world_size": 1})

    async def metrics(self, request):
        self._record(request, None)
        return web.Response(text=fixture("metrics.txt"), content_type="text/plain")

    async def server_info(self, request):
        self._record(request, None)
        info = fixture("server_info.json")["response"]
        info["vllm_config"]["model_config"]["logprobs_mode"] = self.logprobs_mode
        return web.json_response(info)

    async def pause(self, request):
        self._record(request, None)
        self.paused = True
        return web.json_response({"status": "paused"})

    async def resume(self, request):
        self._record(request, None)
        self.paused = False
        return web.json_response({"status": "resumed"})

    async def collective_rpc(self, request):
        body = await request.json()
        self._record(request, body)
        if self.fail_rpc:
            return web.json_response({"detail": self.fail_rpc}, status=500)
        method = getattr(self.worker, body["method"])
        result = await asyncio.to_thread(method, *body.get("args", []), **body.get("kwargs", {}))
        return web.json_response({"results": [result]})

    async def transfer(self, request):
        body = await request.json() if request.can_read_body else None
        self._record(request, body)
        if request.path == "/update_weights" and self.fail:
            return web.json_response({"detail": "update failed"}, status=self.fail.pop(0))
        return web.json_response({"message": "ok"})


@pytest.fixture
def fake():
    with FakeVLLM() as server:
        yield server


def run(coro):
    return asyncio.run(coro)


# ---- startup check ---------------------------------------------------------------------------------------------------


def test_startup_check_reads_models_version_server_info_and_metrics(fake):
    engine = fake.engine()
    info = engine.info
    assert (info.model_id, info.max_model_len, info.version, info.dev_mode) == (MODEL_ID, 64, "0.25.0", True)
    assert (info.logprobs_mode, info.logprobs_mode_source) == ("processed_logprobs", "server_info")
    assert info.kv_capacity_tokens == stats_from_metrics(fixture("metrics.txt"), 64).kv_capacity_tokens > 0
    assert engine.max_model_len == 64
    config = fixture("server_info.json")["response"]["vllm_config"]
    assert info.worker_extension_cls == (config["parallel_config"].get("worker_extension_cls") or None)
    assert info.weight_transfer_backend == (config.get("weight_transfer_config") or {}).get("backend")
    assert info.max_logprobs == config["model_config"]["max_logprobs"]


def test_without_dev_mode_the_probe_confirms_processed_logprobs_and_warns_about_dev_endpoints(caplog):
    with FakeVLLM(dev_mode=False) as server, caplog.at_level(logging.WARNING):
        engine = server.engine()
        probe = [body for _, path, body in server.requests if path == "/v1/completions"]
    assert (engine.info.logprobs_mode, engine.info.logprobs_mode_source) == ("processed_logprobs", "probe")
    assert probe[0]["top_k"] == 1 and probe[0]["logprobs"] == 0 and probe[0]["prompt"] == [0]
    assert "VLLM_SERVER_DEV_MODE=1" in caplog.text


@pytest.mark.parametrize("dev_mode", [True, False])
def test_a_raw_logprobs_server_is_refused_naming_the_flag(dev_mode, caplog):
    with FakeVLLM(dev_mode=dev_mode, logprobs_mode="raw_logprobs") as server:
        with pytest.raises(ValueError, match="--logprobs-mode processed_logprobs"):
            server.engine()
        with caplog.at_level(logging.WARNING):
            server.engine(strict=False)
    assert "--logprobs-mode processed_logprobs" in caplog.text


def test_startup_waits_for_readiness_then_times_out():
    with FakeVLLM() as server:
        url = server.url
    with pytest.raises(TimeoutError, match="not ready within"):
        VLLMServerEngine(url, startup_timeout_s=0.3, connect_timeout_s=0.1)


# ---- generate / score --------------------------------------------------------------------------------------------


def test_generate_sends_token_ids_and_parses_ids_logprobs_top_n_and_finish_reason(fake):
    engine = fake.engine()
    sampling = SamplingParams(
        max_tokens=4,
        temperature=0.7,
        top_k=5,
        top_p=0.9,
        min_p=0.05,
        seed=7,
        num_logprobs=2,
        stop_token_ids=(3,),
        return_sampling_mask=False,
    )

    async def go():
        try:
            return await engine.generate([11, 12, 13], sampling)
        finally:
            await engine.close()

    turn = run(go())
    body = fake.requests[-1][2]
    assert body["prompt"] == [11, 12, 13] and body["model"] == MODEL_ID and body["seed"] == 7
    assert body["return_tokens_as_token_ids"] is True and body["return_token_ids"] is True
    assert body["skip_special_tokens"] is False and body["logprobs"] == 2 and body["max_tokens"] == 4
    assert (body["temperature"], body["top_k"], body["top_p"], body["min_p"]) == (0.7, 5, 0.9, 0.05)
    assert body["stop_token_ids"] == [3] and body["ignore_eos"] is False
    assert turn.prompt_ids == [11, 12, 13] and turn.output_ids == [14, 15, 16, 17]
    assert turn.output_log_probs == pytest.approx([-0.1, -0.15, -0.2, -0.25])
    assert turn.finish_reason == "length" and turn.output_sampling_mask is None
    top = turn.output_sampler_logprobs
    assert all(len(entry) == 2 for entry in top)
    assert 14 in top[0] and 15 not in top[1]  # odd positions: the sampled token is outside the top-2, dropped
    assert max(top[1].values()) > turn.output_log_probs[1]


def test_generate_without_logprobs_asks_for_the_sampled_one_and_a_fresh_seed(fake):
    engine = fake.engine()
    turn = run(engine.generate([5], SamplingParams(max_tokens=2)))
    body = fake.requests[-1][2]
    assert body["logprobs"] == 0 and isinstance(body["seed"], int) and "min_p" not in body
    assert turn.output_sampler_logprobs is None and len(turn.output_log_probs) == 2


def test_filtering_warns_once_that_sampling_masks_need_a_newer_vllm(fake, caplog):
    engine = fake.engine()

    async def go():
        for _ in range(2):
            await engine.generate([5], SamplingParams(max_tokens=1, top_k=3))

    with caplog.at_level(logging.WARNING):
        run(go())
    assert caplog.text.count("sampling masks") == 1 and "0.28" in caplog.text


def test_score_parses_prompt_logprobs_by_rank_with_the_realised_token(fake):
    engine = fake.engine()
    ids = [3, 9, 20, 21, 22]
    result = run(engine.score(ids, 2, 3))
    body = fake.requests[-1][2]
    assert body["prompt_logprobs"] == 3 and body["max_tokens"] == 1 and body["prompt"] == ids
    assert body["temperature"] == 1.0
    run(engine.score(ids, 2, 3, temperature=0.7))
    assert fake.requests[-1][2]["temperature"] == 0.7  # the teacher's temperature goes to the server
    assert result.token_logprobs == pytest.approx([-0.4, -0.6, -0.8])
    assert [len(row) for row in result.topk_ids] == [3, 3, 3]
    assert result.topk_ids[1][0] == 21  # position 3 (odd): the realised token is the top-1
    assert 20 not in result.topk_ids[0]  # position 2 (even): realised ranked below the top-3
    for row in result.topk_logprobs:
        assert row == sorted(row, reverse=True)


# ---- retries and errors ----------------------------------------------------------------------------------------------


def test_transient_failures_are_retried_then_succeed(fake):
    engine = fake.engine()
    fake.fail = [503, 429]
    turn = run(engine.generate([5], SamplingParams(max_tokens=1)))
    assert len(turn.output_ids) == 1 and engine.num_retries == 2
    assert fake.paths().count("/v1/completions") >= 3
    assert engine.stats().extra["retries"] == 2


def test_client_errors_are_not_retried_and_carry_the_server_message(fake):
    engine = fake.engine(max_model_len=1000)  # the client believes more fits than the server does
    before = fake.paths().count("/v1/completions")
    with pytest.raises(RequestRejectedError, match="maximum context length is 64"):
        run(engine.generate(list(range(1, 40)), SamplingParams(max_tokens=30)))
    assert fake.paths().count("/v1/completions") == before + 1 and engine.num_retries == 0


def test_persistent_5xx_raises_after_the_attempts(fake):
    engine = fake.engine(max_attempts=2)
    fake.fail = [500, 502, 503]
    with pytest.raises(VLLMServerError, match="after 2 attempt") as info:
        run(engine.generate([5], SamplingParams(max_tokens=1)))
    assert info.value.status == 502 and "injected failure 502" in str(info.value)


def test_a_slow_server_is_a_timeout_not_a_hang(fake):
    engine = fake.engine(request_timeout_s=0.2, max_attempts=2)
    fake.delay_s = 1.0
    with pytest.raises(TimeoutError, match="after 2 attempt"):
        run(engine.generate([5], SamplingParams(max_tokens=1)))
    assert engine.num_retries == 1


def test_connection_refused_is_a_connection_error():
    with FakeVLLM() as server:
        engine = server.engine()
    with pytest.raises(ConnectionError):
        run(engine.generate([5], SamplingParams(max_tokens=1)))


# ---- metrics -------------------------------------------------------------------------------------------------------


def test_prometheus_text_and_engine_stats():
    text = fixture("metrics.txt")
    samples = parse_prometheus(text)
    names = {name for name, _, _ in samples}
    assert {"vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:num_preemptions_total"} <= names
    info = [labels for name, labels, _ in samples if name == "vllm:cache_config_info"]
    assert info and "num_gpu_blocks" in info[0] and "block_size" in info[0]

    def total(name):
        return sum(v for n, _, v in samples if n == name)

    stats = stats_from_metrics(text, max_model_len=64)
    assert stats.num_running == int(total("vllm:num_requests_running"))
    assert stats.num_waiting == int(total("vllm:num_requests_waiting"))
    assert stats.num_preemptions == int(total("vllm:num_preemptions_total"))
    assert 0 <= stats.kv_cache_usage_frac <= 1
    assert stats.kv_capacity_tokens == sum(int(i["num_gpu_blocks"]) * int(i["block_size"]) for i in info)


def test_prometheus_parser_handles_escapes_and_skips_junk():
    text = 'a{x="q\\"uote",y="b,c"} 1.5\nbad line\nb 2 1700000000\nc{} NaN\n# comment\n'
    samples = parse_prometheus(text)
    assert samples[0] == ("a", {"x": 'q"uote', "y": "b,c"}, 1.5) and samples[1] == ("b", {}, 2.0)
    assert stats_from_metrics("", 10).kv_capacity_tokens == 0


def test_stats_refresh_from_metrics_and_background_polling(fake):
    engine = fake.engine(metrics_interval_s=0.05)

    async def go():
        stats = await engine.refresh_stats()
        await engine.generate([5], SamplingParams(max_tokens=1))
        await asyncio.sleep(0.2)
        polled = fake.paths().count("/metrics")
        await engine.close()
        return stats, polled

    stats, polled = run(go())
    assert stats == stats_from_metrics(fixture("metrics.txt"), 64) and stats.max_model_len == 64
    assert polled >= 3  # the startup check, refresh_stats, and the poller


# ---- pause / resume / weight sync ------------------------------------------------------------------------------------


def test_pause_keeps_requests_and_resume(fake):
    engine = fake.engine()
    run(engine.pause())
    assert fake.paused and engine.is_paused and fake.requests[-1][1] == "/pause?mode=keep&clear_cache=true"
    run(engine.resume())
    assert not fake.paused and not engine.is_paused


def test_dev_endpoints_missing_is_a_clear_error():
    with FakeVLLM(dev_mode=False) as server:
        engine = server.engine()
        with pytest.raises(RuntimeError, match="VLLM_SERVER_DEV_MODE=1"):
            run(engine.pause())


def test_load_weights_sends_base64_chunks_to_the_worker_extension(fake):
    engine = fake.engine(chunk_bytes=16)
    a, b = torch.arange(12.0).reshape(3, 4), torch.linspace(-1, 1, 5).to(torch.bfloat16)
    with pytest.raises(RuntimeError, match="paused"):
        run(engine.load_weights([("a", a)]))

    async def go():
        await engine.pause()
        result = await engine.load_weights([("a", a), ("b", b)])
        await engine.resume()
        return result

    result = run(go())
    assert result["num_tensors"] == 2 and result["bytes"] == a.numel() * 4 + b.numel() * 2
    assert fake.paths().count("/collective_rpc") == 2  # 48 bytes > chunk_bytes: one tensor per chunk
    model = fake.worker.model_runner.model
    assert torch.equal(model.a, a) and torch.equal(model.b, b)
    fingerprint = run(engine.weight_fingerprint(["a"]))
    assert fingerprint == {"a": pytest.approx(float(a.sum()))}


def test_receive_weights_pauses_receives_through_the_extension_and_resumes(fake):
    engine = fake.engine()

    class FakeGroup:
        def receive(self, entries):
            for entry in entries:
                yield entry.name, torch.full(entry.shape, 2.0, dtype=getattr(torch, entry.dtype))

        def close(self):
            pass

    fake.worker._rlasync_group = FakeGroup()
    result = run(engine.receive_weights([("a", "float32", (3, 4)), ("b", "bfloat16", (5,))]))
    assert result["num_tensors"] == 2 and fake.worker.model_runner.model.a.sum().item() == 24.0
    paths = fake.paths()
    assert paths[-3:] == ["/pause?mode=keep&clear_cache=true", "/collective_rpc", "/resume"] and not engine.is_paused
    rpc = fake.requests[-2][2]
    assert rpc["method"] == "receive_weights" and json.loads(rpc["args"][0])[1] == ["b", "bfloat16", [5]]


def test_join_weight_group_calls_the_extension_with_string_args(fake, monkeypatch):
    engine = fake.engine()
    opened = {}

    class FakeWeightGroup:
        @classmethod
        def open(cls, host, port, rank, world_size, timeout_s, **options):
            opened.update(host=host, port=port, rank=rank, world_size=world_size, timeout_s=timeout_s, **options)
            return cls()

        def close(self):
            pass

    import rlasync.weights.broadcast as broadcast

    monkeypatch.setattr(broadcast, "WeightGroup", FakeWeightGroup)
    run(engine.join_weight_group("10.0.0.1", 29500, 1, 2, 30.0))
    assert opened == {"host": "10.0.0.1", "port": 29500, "rank": 1, "world_size": 2, "timeout_s": 30.0}
    assert all(isinstance(arg, str) for arg in fake.requests[-1][2]["args"])


def test_nccl_weight_transfer_endpoints_in_order_and_finish_on_failure(fake):
    engine = fake.engine()
    world = run(engine.init_weight_transfer("10.0.0.1", 29501))
    assert world == 1 and fake.requests[-1][2]["init_info"] == {
        "master_address": "10.0.0.1",
        "master_port": 29501,
        "rank_offset": 1,
        "world_size": 2,
    }
    manifest = [("a", "float32", (3, 4)), ("b", "bfloat16", (5,))]
    run(engine.update_weights_nccl(manifest))
    paths = fake.paths()[-5:]
    assert paths == [
        "/pause?mode=keep&clear_cache=true",
        "/start_weight_update",
        "/update_weights",
        "/finish_weight_update",
        "/resume",
    ]
    info = fake.requests[-3][2]["update_info"]
    assert info == {
        "names": ["a", "b"],
        "dtype_names": ["float32", "bfloat16"],
        "shapes": [[3, 4], [5]],
        "packed": True,
    }
    fake.fail = [500]
    with pytest.raises(RuntimeError, match="update failed"):
        run(engine.update_weights_nccl(manifest))
    assert fake.paths()[-2:] == ["/finish_weight_update", "/resume"]


# ---- the parsers on the recorded fixtures ----------------------------------------------------------------------------


def test_fixture_completion_with_logprobs():
    record = fixture("completions_logprobs.json")
    request, choice = record["request"], record["response"]["choices"][0]
    n = request["logprobs"]
    turn = turn_from_completion(request["prompt"], choice, n)
    tokens = choice["logprobs"]["tokens"]
    assert turn.output_ids == [int(t.split(":")[1]) for t in tokens]
    if choice.get("token_ids") is not None:
        assert turn.output_ids == choice["token_ids"]
    assert turn.output_log_probs == choice["logprobs"]["token_logprobs"]
    assert turn.finish_reason == choice["finish_reason"] and turn.finish_reason in ("length", "stop")
    for entry, raw in zip(turn.output_sampler_logprobs, choice["logprobs"]["top_logprobs"]):
        values = sorted(raw.values(), reverse=True)
        assert len(entry) == min(n, len(raw)) and sorted(entry.values(), reverse=True) == values[: len(entry)]
    for token, lp, raw in zip(turn.output_ids, turn.output_log_probs, choice["logprobs"]["top_logprobs"]):
        assert raw[f"token_id:{token}"] == lp  # vLLM always reports the sampled token
    assert len(turn.output_ids) <= request["max_tokens"]


def test_fixture_prompt_logprobs():
    from rlasync.engine.vllm_engine import score_from_prompt_logprobs

    record = fixture("completions_prompt_logprobs.json")
    request, choice = record["request"], record["response"]["choices"][0]
    ids, k = request["prompt"], request["prompt_logprobs"]
    raw = choice["prompt_logprobs"]
    assert raw[0] is None and len(raw) == len(ids)
    result = score_from_prompt_logprobs(ids, 1, k, raw)
    for i, position in enumerate(range(1, len(ids))):
        entry = raw[position]
        assert result.token_logprobs[i] == entry[str(ids[position])]["logprob"]
        ranked = sorted(entry.items(), key=lambda item: item[1]["rank"])[:k]
        assert result.topk_ids[i] == [int(token) for token, _ in ranked]


def test_fixture_error_models_and_version():
    error = fixture("error_400.json")
    assert (
        error["status"] == 400 and error_message(json.dumps(error["response"])) == error["response"]["error"]["message"]
    )
    models = fixture("models.json")["response"]
    assert models["data"][0]["id"] and models["data"][0]["max_model_len"] > 0
    assert fixture("version.json")["response"]["version"].startswith("0.")
    info = fixture("server_info.json")["response"]["vllm_config"]["model_config"]
    assert info["logprobs_mode"] == "processed_logprobs"


def test_error_message_shapes_and_token_ids():
    assert error_message('{"detail": "Missing init_info"}') == "Missing init_info"
    assert error_message('{"error": "Failed to pause"}') == "Failed to pause"
    assert error_message("<html>oops</html>") == "<html>oops</html>"
    assert parse_token_id("token_id:151643") == 151643 and parse_token_id(7) == 7
    with pytest.raises(Exception, match="return_tokens_as_token_ids"):
        parse_token_id("hello")


def test_encode_weights_text_payload_is_json():
    payload = next(encode_weights([("a", torch.ones(2))], text=True))
    assert json.loads(json.dumps(payload)) == payload
