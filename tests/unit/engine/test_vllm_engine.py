"""The in-process vLLM adapter without vLLM: the missing-vllm ImportError, vLLM outputs -> TurnRecord/ScoreResult, the
worker extension's weight loading (inline bytes, base64, a gloo weight group) on a fake model runner, VLLMEngine's
pause/resume/load_weights/stats over a fake AsyncLLM, and engine selection (make_engine, ClusterConfig)."""

import asyncio
import inspect
import sys
import threading
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from rlasync.config.grpo import ClusterConfig
from rlasync.engine import EngineError, make_engine
from rlasync.engine.base import SamplingParams
from rlasync.engine.vllm_engine import (
    VLLMEngine,
    import_vllm,
    score_from_prompt_logprobs,
    turn_from_flat_output,
    turn_from_output,
)
from rlasync.engine.vllm_worker import EXTENSION_QUALNAME, WorkerExtension, decode_weights, encode_weights


def run(coro):
    return asyncio.run(coro)


# ---- vllm stays optional ----------------------------------------------------------------------------------------------


@pytest.fixture
def no_vllm(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError


def test_missing_vllm_names_the_extra(no_vllm):
    with pytest.raises(ImportError, match=r"pip install 'rlasync\[vllm\]'") as info:
        import_vllm()
    assert "cluster.engine='torch'" in str(info.value)
    with pytest.raises(ImportError, match=r"rlasync\[vllm\]"):
        VLLMEngine("some/model")
    with pytest.raises(ImportError, match=r"rlasync\[vllm\]"):
        make_engine("vllm", "some/model", dtype="auto")


def test_the_extension_is_importable_by_its_qualified_name():
    module, name = EXTENSION_QUALNAME.rsplit(".", 1)
    assert getattr(__import__(module, fromlist=[name]), name) is WorkerExtension


# ---- vLLM outputs -> records -----------------------------------------------------------------------------------------


def lp(logprob, rank):
    return SimpleNamespace(logprob=logprob, rank=rank)


def test_turn_from_output_keeps_the_sampled_logprob_and_the_top_n_by_rank():
    logprobs = [
        {14: lp(-0.5, 1), 20: lp(-1.4, 2)},  # sampled is the top-1
        {9: lp(-3.2, 7), 4: lp(-0.3, 1), 5: lp(-1.6, 2)},  # sampled outside the top-2
    ]
    turn = turn_from_output([1, 2], [14, 9], logprobs, 2, "length")
    assert turn.output_ids == [14, 9] and turn.output_log_probs == [-0.5, -3.2] and turn.finish_reason == "length"
    assert turn.output_sampler_logprobs == [{14: -0.5, 20: -1.4}, {4: -0.3, 5: -1.6}]
    assert turn.output_sampling_mask is None
    only = turn_from_output([1], [14], [{14: lp(-0.5, 3)}], 0, "stop")
    assert only.output_sampler_logprobs is None and only.output_log_probs == [-0.5]


def test_turn_from_output_refuses_missing_logprobs():
    with pytest.raises(EngineError, match="log-probs for none"):
        turn_from_output([1], [3], None, 0, "length")
    with pytest.raises(EngineError, match="do not include the sampled id 3"):
        turn_from_output([1], [3], [{4: lp(-0.1, 1)}], 0, "length")


def vllm_positions(rng, num_tokens, num_logprobs, vocab=50):
    """Random outputs laid out as vLLM builds them: per position the sampled token (its rank), then the top-N by
    rank; as the dict per position (the sampled entry overwritten when it is in the top-N) and as FlatLogprobs."""
    ids, dicts = [], []
    flat = SimpleNamespace(start_indices=[], end_indices=[], token_ids=[], logprobs=[], ranks=[])
    for _ in range(num_tokens):
        order = rng.permutation(vocab)
        values = np.sort(rng.normal(size=vocab))[::-1] - 3.0
        pick = int(rng.integers(0, vocab))
        entries = [(int(order[pick]), float(values[pick]), pick + 1)]
        entries += [(int(order[r]), float(values[r]), r + 1) for r in range(num_logprobs)]
        ids.append(entries[0][0])
        dicts.append({token: lp(value, rank) for token, value, rank in entries})
        flat.start_indices.append(len(flat.token_ids))
        for token, value, rank in entries:
            flat.token_ids.append(token), flat.logprobs.append(value), flat.ranks.append(rank)
        flat.end_indices.append(len(flat.token_ids))
    return ids, dicts, flat


@pytest.mark.parametrize("num_logprobs", [0, 1, 8])
def test_flat_logprobs_give_the_same_turn_as_the_dicts(num_logprobs):
    rng = np.random.default_rng(num_logprobs)
    ids, dicts, flat = vllm_positions(rng, 40, num_logprobs)
    slow = turn_from_output([1, 2], ids, dicts, num_logprobs, "length")
    fast = turn_from_flat_output([1, 2], ids, flat, num_logprobs, "length")
    assert fast == slow
    assert (fast.output_sampler_logprobs is None) == (num_logprobs == 0)


def test_flat_logprobs_refuse_a_mismatch():
    ids, _, flat = vllm_positions(np.random.default_rng(0), 3, 2)
    with pytest.raises(EngineError, match="sampled id"):
        turn_from_flat_output([1], [ids[0], ids[1], ids[2] + 1000], flat, 2, "length")
    with pytest.raises(EngineError, match="log-probs for 3 positions"):
        turn_from_flat_output([1], ids[:2], flat, 2, "length")


def test_score_from_prompt_logprobs_by_rank():
    ids = [5, 6, 7]
    prompt_logprobs = [None, {6: lp(-2.0, 3), 1: lp(-0.5, 1), 2: lp(-1.0, 2)}, {7: lp(-0.1, 1), 3: lp(-2.5, 2)}]
    result = score_from_prompt_logprobs(ids, 1, 2, prompt_logprobs)
    assert result.token_logprobs == [-2.0, -0.1]
    assert result.topk_ids == [[1, 2], [7, 3]] and result.topk_logprobs == [[-0.5, -1.0], [-0.1, -2.5]]
    assert score_from_prompt_logprobs(ids, 2, 0, prompt_logprobs).topk_ids == [[]]


# ---- the worker extension on a fake model runner ---------------------------------------------------------------------


class FakeModel(torch.nn.Module):
    """vLLM-style `load_weights`: consumes the iterable, copies by name, returns the loaded names."""

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Parameter(torch.zeros(3, 4))
        self.b = torch.nn.Parameter(torch.zeros(5, dtype=torch.bfloat16))
        self.seen = []

    def load_weights(self, weights):
        params, loaded = dict(self.named_parameters()), set()
        for name, tensor in weights:
            self.seen.append((name, tensor.dtype, tuple(tensor.shape)))
            params[name].data.copy_(tensor)
            loaded.add(name)
        return loaded


class FakeWorker(WorkerExtension):
    def __init__(self, rank=0):
        self.model_runner = SimpleNamespace(model=FakeModel())
        self.rank = rank


WEIGHTS = {"a": torch.arange(12.0).reshape(3, 4), "b": torch.linspace(-1, 1, 5).to(torch.bfloat16)}


@pytest.mark.parametrize("text", [False, True], ids=["raw", "base64"])
def test_payloads_round_trip_through_the_extension(text):
    worker = FakeWorker()
    payloads = list(encode_weights(WEIGHTS.items(), chunk_bytes=1 << 20, text=text))
    assert len(payloads) == 1
    result = worker.load_weights_payload(payloads[0])
    model = worker.model_runner.model
    assert result["num_tensors"] == 2 and result["bytes"] == 12 * 4 + 5 * 2 and result["num_loaded"] == 2
    assert torch.equal(model.a, WEIGHTS["a"]) and torch.equal(model.b, WEIGHTS["b"])
    assert model.seen == [("a", torch.float32, (3, 4)), ("b", torch.bfloat16, (5,))]
    assert worker.weight_fingerprint(["b", "missing"]) == {"b": pytest.approx(float(WEIGHTS["b"].double().sum()))}


def test_payload_chunks_bound_the_bytes_and_reject_garbage():
    payloads = list(
        encode_weights([("a", torch.zeros(100)), ("b", torch.zeros(100)), ("c", torch.zeros(1))], chunk_bytes=400)
    )
    assert [[item[0] for item in p["items"]] for p in payloads] == [["a"], ["b"], ["c"]]
    with pytest.raises(ValueError, match="not an rlasync weight payload"):
        list(decode_weights({"items": []}))
    bad = {"format": "rlasync-weights-v1", "items": [["a", "float99", [1], "raw", b"0000"]]}
    with pytest.raises(ValueError, match="unknown dtype"):
        list(decode_weights(bad))


def test_cuda_ipc_needs_a_keepalive():
    if not torch.cuda.is_available():
        pytest.skip("CUDA IPC needs a GPU")
    with pytest.raises(ValueError, match="keepalive"):
        list(encode_weights([("a", torch.zeros(2, device="cuda"))], cuda_ipc=True))


def test_receive_weights_needs_a_group_first():
    with pytest.raises(RuntimeError, match="init_weight_group"):
        FakeWorker().receive_weights([["a", "float32", [3, 4]]])


def test_receive_weights_from_a_real_gloo_group():
    """Learner rank 0 (a thread) broadcasts; the extension joins as rank 1 and loads what arrives."""
    from rlasync.weights.broadcast import WeightGroup, free_port
    from rlasync.weights.plan import ManifestEntry

    port, worker = free_port(), FakeWorker()
    manifest = [ManifestEntry("a", "float32", (3, 4)), ManifestEntry("b", "bfloat16", (5,))]
    errors = []

    def sender():
        try:
            group = WeightGroup.open("127.0.0.1", port, 0, 2, 20.0)
            send = group.send
            if "manifest" in inspect.signature(send).parameters:
                send(iter(WEIGHTS.items()), manifest)
            else:
                send(iter(WEIGHTS.items()))
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread
            errors.append(exc)

    thread = threading.Thread(target=sender, daemon=True)
    thread.start()
    joined = worker.init_weight_group("127.0.0.1", str(port), "1", "2", "20")
    assert joined["rank"] == 1 and joined["world_size"] == 2
    result = worker.receive_weights([[e.name, e.dtype, list(e.shape)] for e in manifest])
    thread.join(30)
    assert not errors, errors
    model = worker.model_runner.model
    assert result["num_tensors"] == 2 and torch.equal(model.a, WEIGHTS["a"]) and torch.equal(model.b, WEIGHTS["b"])
    worker.close_weight_group()
    assert worker._rlasync_group is None


# ---- VLLMEngine over a fake AsyncLLM ---------------------------------------------------------------------------------


class FakeLLM:
    """The AsyncLLM methods VLLMEngine calls besides generate; collective_rpc runs the extension in-process."""

    def __init__(self, worker, args):
        self.worker, self.args, self.calls = worker, args, []
        self.vllm_config = SimpleNamespace(
            model_config=SimpleNamespace(
                max_model_len=args.get("max_model_len", 128), max_logprobs=args["max_logprobs"]
            ),
            cache_config=SimpleNamespace(num_gpu_blocks=10, block_size=16),
        )

    async def pause_generation(self, *, mode, clear_cache):
        self.calls.append(("pause", mode, clear_cache))

    async def resume_generation(self):
        self.calls.append(("resume",))

    async def reset_prefix_cache(self, reset_running_requests=False, reset_connector=False):
        self.calls.append(("reset", reset_running_requests, reset_connector))
        return getattr(self, "reset_result", True)

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        self.calls.append(("rpc", method, timeout))
        return [getattr(self.worker, method)(*args, **(kwargs or {}))]

    def shutdown(self):
        self.calls.append(("shutdown",))


class FakeVLLMEngine(VLLMEngine):
    def _build(self, args):
        self.vllm_version = "0.25.0"
        return FakeLLM(FakeWorker(), args)


def test_engine_args_pause_resume_load_weights_and_stats():
    engine = FakeVLLMEngine(
        "m", dtype=None, max_model_len=96, gpu_memory_utilization=0.3, seed=5, enforce_eager=True, chunk_bytes=16
    )
    llm = engine._llm
    assert llm.args["logprobs_mode"] == "processed_logprobs" and llm.args["worker_extension_cls"] == EXTENSION_QUALNAME
    assert llm.args["dtype"] == "auto" and llm.args["enforce_eager"] is True and llm.args["seed"] == 5
    assert engine.max_model_len == 96 and engine.max_logprobs == 20

    async def go():
        with pytest.raises(RuntimeError, match="paused"):
            await engine.load_weights(WEIGHTS.items())
        await engine.pause()
        result = await engine.load_weights(WEIGHTS.items())
        await engine.resume()
        await engine.close()
        return result

    result = run(go())
    assert result["num_tensors"] == 2 and result["bytes"] == 58
    assert llm.calls[0] == ("pause", "keep", True) and llm.calls[-2:] == [("resume",), ("shutdown",)]
    assert [c[1] for c in llm.calls if c[0] == "rpc"] == ["load_weights_payload"] * 2  # 48 B > 16 B: two chunks
    model = llm.worker.model_runner.model
    assert torch.equal(model.a, WEIGHTS["a"]) and torch.equal(model.b, WEIGHTS["b"])
    engine._gauges.num_running, engine._gauges.kv_cache_usage, engine._gauges.num_preemptions = 3, 0.5, 2
    stats = engine.stats()
    assert (stats.num_running, stats.kv_cache_usage_frac, stats.num_preemptions) == (3, 0.5, 2)
    assert stats.kv_capacity_tokens == 160 and stats.max_model_len == 96


@pytest.fixture
def fake_vllm_params(monkeypatch):
    """A `vllm` module with the two names `_vllm_params` imports: SamplingParams keeps its keyword arguments."""

    class Params:
        def __init__(self, **kwargs):
            self.kwargs = kwargs

    module = SimpleNamespace(SamplingParams=Params)
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.setitem(
        sys.modules, "vllm.sampling_params", SimpleNamespace(RequestOutputKind=SimpleNamespace(FINAL_ONLY="final"))
    )


def test_request_seeds_reach_vllm_only_when_asked(fake_vllm_params):
    """By default vLLM samples from the engine's own stream (seeded at random per engine, so engines differ): a
    request's seed is dropped. With `use_request_seeds` it is passed, and a request without one gets a random one."""
    seeded = SamplingParams(max_tokens=4, temperature=1.0, seed=1234)
    unseeded = SamplingParams(max_tokens=4, temperature=1.0)
    default = FakeVLLMEngine("m")
    assert default.use_request_seeds is False
    assert default._vllm_params(seeded, 4).kwargs["seed"] is None
    assert default._vllm_params(unseeded, 4).kwargs["seed"] is None
    seeds = [FakeVLLMEngine("m")._llm.args["seed"] for _ in range(4)]
    assert len(set(seeds)) == 4  # one random stream per engine
    asked = FakeVLLMEngine("m", use_request_seeds=True)
    assert asked._vllm_params(seeded, 4).kwargs["seed"] == 1234
    drawn = {asked._vllm_params(unseeded, 4).kwargs["seed"] for _ in range(8)}
    assert None not in drawn and len(drawn) == 8


def test_request_params_skip_vllms_deep_copy_where_it_offers_the_field(monkeypatch):
    """Each request's params are built for it alone: where vLLM's SamplingParams has `skip_clone` (0.25 does) it is
    set, so vLLM's input processing copies them shallowly; a vLLM without the field gets neither extra."""

    class Params:
        __struct_fields__ = ("max_tokens", "flat_logprobs", "skip_clone")

        def __init__(self, **kwargs):
            self.kwargs = kwargs

    class OldParams(Params):
        __struct_fields__ = ("max_tokens",)

    kinds = SimpleNamespace(RequestOutputKind=SimpleNamespace(FINAL_ONLY="final"))
    monkeypatch.setitem(sys.modules, "vllm.sampling_params", kinds)
    request = SamplingParams(max_tokens=4, temperature=1.0)
    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(SamplingParams=Params))
    kwargs = FakeVLLMEngine("m")._vllm_params(request, 4).kwargs
    assert kwargs["skip_clone"] is True and kwargs["flat_logprobs"] is True
    monkeypatch.setitem(sys.modules, "vllm", SimpleNamespace(SamplingParams=OldParams))
    kwargs = FakeVLLMEngine("m")._vllm_params(request, 4).kwargs
    assert "skip_clone" not in kwargs and "flat_logprobs" not in kwargs


@pytest.fixture
def fake_vllm_loggers(monkeypatch):
    """vLLM 0.25's logger classes as stand-ins; building the real Prometheus logger registers its metrics (here: an
    error), and `manager` follows 0.25's StatLoggerManager: it adds a Prometheus logger unless one was given."""

    class StatLoggerBase:
        def log(self):
            pass

    class AggregateStatLoggerBase(StatLoggerBase):
        pass

    class PrometheusStatLogger(AggregateStatLoggerBase):
        built = 0

        def __init__(self, vllm_config, engine_indexes=None):
            PrometheusStatLogger.built += 1  # vLLM's registers ~100 metrics here

    loggers = SimpleNamespace(
        StatLoggerBase=StatLoggerBase,
        AggregateStatLoggerBase=AggregateStatLoggerBase,
        PrometheusStatLogger=PrometheusStatLogger,
    )
    for name in ("vllm", "vllm.v1", "vllm.v1.metrics"):
        monkeypatch.setitem(sys.modules, name, SimpleNamespace())
    sys.modules["vllm.v1.metrics"].loggers = loggers
    monkeypatch.setitem(sys.modules, "vllm.v1.metrics.loggers", loggers)

    def manager(factories):
        built = [
            f(vllm_config=None, engine_indexes=[0]) if issubclass(f, AggregateStatLoggerBase) else f(None, 0)
            for f in factories
        ]
        if not any(isinstance(b, PrometheusStatLogger) for b in built):
            built.append(PrometheusStatLogger(None, [0]))
        return built

    return SimpleNamespace(classes=loggers, manager=manager)


def test_our_stat_logger_takes_prometheus_place_unless_asked_to_keep_it(fake_vllm_loggers):
    from rlasync.engine.vllm_engine import _Gauges, _stat_logger_factory

    prometheus = fake_vllm_loggers.classes.PrometheusStatLogger
    gauges = _Gauges()
    built = fake_vllm_loggers.manager([_stat_logger_factory(gauges)])
    assert len(built) == 1 and isinstance(built[0], prometheus) and prometheus.built == 0  # no metrics registered
    stats = SimpleNamespace(num_running_reqs=7, num_waiting_reqs=3, kv_cache_usage=0.25)
    built[0].record(stats, SimpleNamespace(num_preempted_reqs=2, num_generation_tokens=40), engine_idx=0)
    built[0].record(None, SimpleNamespace(num_preempted_reqs=1, num_generation_tokens=8))
    built[0].log_engine_initialized(), built[0].record_sleep_state(1, 0), built[0].log()
    assert (gauges.num_running, gauges.num_waiting, gauges.kv_cache_usage) == (7, 3, 0.25)
    assert (gauges.num_preemptions, gauges.num_generated_tokens) == (3, 48)

    kept = _Gauges()
    built = fake_vllm_loggers.manager([_stat_logger_factory(kept, prometheus=True)])
    assert len(built) == 2 and prometheus.built == 1 and not isinstance(built[0], prometheus)
    built[0].record(stats, None)
    assert kept.num_running == 7
    assert FakeVLLMEngine("m").prometheus_metrics is False
    assert FakeVLLMEngine("m", prometheus_metrics=True).prometheus_metrics is True


@pytest.mark.parametrize("sync_without_pause", [False, True])  # a broadcast pauses vLLM either way
def test_receive_weights_pauses_unless_paused_and_weight_transfer_needs_the_backend(sync_without_pause):
    engine = FakeVLLMEngine("m", sync_without_pause=sync_without_pause)

    class FakeGroup:
        def receive(self, entries):
            for entry in entries:
                yield entry.name, torch.ones(entry.shape, dtype=getattr(torch, entry.dtype))

        def close(self):
            pass

    engine._llm.worker._rlasync_group = FakeGroup()
    result = run(engine.receive_weights([("a", "float32", (3, 4))]))
    calls = [c[0] if c[0] != "rpc" else c[1] for c in engine._llm.calls]
    assert calls == ["pause", "receive_weights", "resume"] and result["num_tensors"] == 1
    assert not engine.is_paused
    with pytest.raises(RuntimeError, match="weight_transfer_backend='nccl'"):
        run(engine.update_weights_nccl([("a", "float32", (3, 4))]))


def test_a_stalled_rpc_is_a_timeout():
    engine = FakeVLLMEngine("m", rpc_timeout_s=0.1)

    async def stall(*args, **kwargs):
        await asyncio.sleep(5)

    engine._llm.collective_rpc = stall
    with pytest.raises(TimeoutError, match="load_weights_payload did not finish"):
        run(engine._rpc("load_weights_payload", {}))


# ---- selection by config ---------------------------------------------------------------------------------------------


def test_make_engine_validates_the_kind_and_the_url():
    with pytest.raises(ValueError, match="cluster.engine='tpu'"):
        make_engine("tpu", "m")
    with pytest.raises(ValueError, match="cluster.vllm_server_url"):
        make_engine("vllm_server", "m")
    with pytest.raises(ValueError, match="cluster.vllm_server_url is set"):
        make_engine("torch", "m", base_url="http://x:1")


def test_the_built_in_engines_own_kwargs_are_refused_for_another_engine():
    """`BUILTIN_ENGINE_KWARGS` are TorchEngine arguments VLLMEngine does not name (they would reach vLLM's engine
    args and fail on the GPU, minutes in); a run that switches `cluster.engine` with them is refused at load."""
    import inspect

    from rlasync.config.base import BUILTIN_ENGINE_KWARGS
    from rlasync.engine.torch_engine import TorchEngine

    torch_params = set(inspect.signature(TorchEngine.__init__).parameters)
    vllm_params = set(inspect.signature(VLLMEngine.__init__).parameters)
    assert BUILTIN_ENGINE_KWARGS <= torch_params and not BUILTIN_ENGINE_KWARGS & vllm_params
    with pytest.raises(ValueError, match="cluster.engine_kwargs has kv_cache_tokens, launch_on_loop: the built-in"):
        ClusterConfig(engine="vllm", engine_kwargs={"kv_cache_tokens": 8, "launch_on_loop": True, "max_num_seqs": 4})
    assert ClusterConfig(engine="torch", engine_kwargs={"kv_cache_tokens": 8}).engine_kwargs == {"kv_cache_tokens": 8}
    assert ClusterConfig(engine="vllm", engine_kwargs='{"gpu_memory_utilization": 0.2}').engine == "vllm"


def test_cluster_config_engine_fields():
    assert ClusterConfig().engine == "torch" and ClusterConfig(engine="vllm").engine == "vllm"
    config = ClusterConfig(engine="vllm_server", vllm_server_url="http://10.0.0.5:8000")
    assert config.vllm_server_url == "http://10.0.0.5:8000"
    with pytest.raises(ValueError, match="cluster.engine='sglang'"):
        ClusterConfig(engine="sglang")
    with pytest.raises(ValueError, match="cluster.vllm_server_url is required"):
        ClusterConfig(engine="vllm_server")
    with pytest.raises(ValueError, match="must start with http"):
        ClusterConfig(engine="vllm_server", vllm_server_url="10.0.0.5:8000")
    with pytest.raises(ValueError, match="set cluster.engine='vllm_server'"):
        ClusterConfig(vllm_server_url="http://10.0.0.5:8000")


class FakeEngineCore:
    """The AsyncLLM's EngineCore client: the scheduler pause `pause_generation` awaits before its 20 ms sleep."""

    def __init__(self, calls):
        self.calls = calls

    async def pause_scheduler_async(self, mode, clear_cache):
        self.calls.append(("pause_scheduler", mode, clear_cache))


class FakeRenderer:
    def __init__(self, calls, multimodal):
        self.calls, self.mm_processor_cache = calls, object() if multimodal else None

    async def clear_mm_cache_async(self):
        self.calls.append(("clear_mm_cache",))


@pytest.mark.parametrize("multimodal", [False, True])
def test_pause_asks_the_engine_core_without_pause_generations_sleep(multimodal, monkeypatch):
    """With an EngineCore client that pauses the scheduler, `pause` awaits that alone (0.25's `pause_generation`
    would sleep 20 ms after it); a multimodal model's input cache is cleared first, as `pause_generation` does."""
    engine = FakeVLLMEngine("m", dtype=None, max_model_len=96, gpu_memory_utilization=0.3)
    llm = engine._llm
    llm.engine_core, llm.renderer = FakeEngineCore(llm.calls), FakeRenderer(llm.calls, multimodal)

    async def slept(delay, *args):  # any sleep inside pause would be vLLM's settle time
        raise AssertionError(f"pause slept {delay} s")

    monkeypatch.setattr(asyncio, "sleep", slept)
    run(engine.pause())
    assert engine.is_paused
    expected = [("clear_mm_cache",)] if multimodal else []
    assert llm.calls == [*expected, ("pause_scheduler", "keep", True)]  # not pause_generation
    engine.clear_cache_on_pause = False
    llm.calls.clear()
    run(engine.pause())
    assert llm.calls == [("pause_scheduler", "keep", False)]


def test_pause_via_pause_generation_takes_vllms_own_path():
    """`pause(via_pause_generation=True)` (bench/vllm_weight_sync.py's A/B) calls vLLM's `pause_generation`, not the
    scheduler pause, and leaves the engine paused."""
    engine = FakeVLLMEngine("m", dtype=None, max_model_len=96, gpu_memory_utilization=0.3)
    llm = engine._llm
    llm.engine_core = FakeEngineCore(llm.calls)
    run(engine.pause(via_pause_generation=True))
    assert engine.is_paused
    assert llm.calls == [("pause", "keep", True)]  # pause_generation, not the scheduler pause


def test_an_ipc_sync_is_one_rpc_the_worker_maps_once_and_replays():
    """Persistent buckets (`MappedWeights`): one `load_flat_ipc` rpc per sync carrying the handles; the worker maps
    them once, records its model's `load_weights` copies at the first sync and replays them after (same weights)."""
    from rlasync.weights.ipc import MappedWeights, SharedWeights
    from rlasync.weights.plan import ManifestEntry

    manifest = [ManifestEntry(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in WEIGHTS.items()]
    shared = SharedWeights.pack(WEIGHTS.items(), manifest, "cpu")
    engine = FakeVLLMEngine("m", dtype=None, max_model_len=96, gpu_memory_utilization=0.3)
    llm, model = engine._llm, engine._llm.worker.model_runner.model
    versions = [WEIGHTS, {"a": -WEIGHTS["a"], "b": WEIGHTS["b"] * 2}, {"a": WEIGHTS["a"] + 1, "b": -WEIGHTS["b"]}]

    async def go():
        results = []
        for weights in versions:
            shared.fill(weights.items(), manifest)
            await engine.pause()
            results.append(await engine.load_weights(MappedWeights(shared.key, shared.handles())))
            await engine.resume()
            assert torch.equal(model.a, weights["a"]) and torch.equal(model.b, weights["b"])
        return results

    results = run(go())
    assert [r["how"] for r in results] == ["recorded", "replayed", "replayed"]
    assert all(r["not_replayed"] is None for r in results)
    for r in results:  # the worker's own time, split, within the call's round trip
        assert 0 <= r["map_s"] + r["queue_s"] + r["gpu_wait_s"] <= r["engine_s"] + 1e-6
        assert r["engine_s"] <= r["seconds"]
    assert [c[1] for c in llm.calls if c[0] == "rpc"] == ["load_flat_ipc"] * 3
    assert len(model.seen) == 2  # the model's own loader ran once (the recorded sync)
    worker_pairs = llm.worker._rlasync_flat.pairs
    run(engine.pause())
    run(engine.load_weights(MappedWeights(shared.key, shared.handles())))
    assert llm.worker._rlasync_flat.pairs is worker_pairs  # mapped once
    shared.release()


def test_sync_without_pause_swaps_ipc_weights_between_steps_and_pauses_for_anything_else(caplog):
    """`sync_without_pause`: pause/resume touch only the engine's own state; an IPC sync from persistent buckets is
    the load then the running requests' preemption, sent back to back (nothing else); a per-tensor load or a
    broadcast still pauses vLLM first and resumes it after. Without the cache clearing, the load alone."""
    from rlasync.weights.ipc import MappedWeights, SharedWeights
    from rlasync.weights.plan import ManifestEntry

    manifest = [ManifestEntry(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in WEIGHTS.items()]
    shared = SharedWeights.pack(WEIGHTS.items(), manifest, "cpu")
    engine = FakeVLLMEngine("m", sync_without_pause=True)
    llm, model = engine._llm, engine._llm.worker.model_runner.model
    names = lambda: [c[1] if c[0] == "rpc" else c[0] for c in llm.calls]  # noqa: E731

    async def ipc_sync(weights):
        shared.fill(weights.items(), manifest)
        await engine.pause()
        assert engine.is_paused and llm.calls[-1:] != [("pause", "keep", True)]
        result = await engine.load_weights(MappedWeights(shared.key, shared.handles()))
        await engine.resume()
        return result

    flipped = {"a": -WEIGHTS["a"], "b": WEIGHTS["b"] * 3}
    run(ipc_sync(flipped))
    assert names() == ["load_flat_ipc", "reset"] and llm.calls[-1] == ("reset", True, True)
    assert torch.equal(model.a, flipped["a"]) and torch.equal(model.b, flipped["b"]) and not engine.is_paused

    llm.calls.clear()
    run(engine.pause())
    run(engine.load_weights(WEIGHTS.items()))  # per tensor: several calls, so vLLM pauses
    run(engine.resume())
    assert names()[0] == "pause" and names()[-1] == "resume" and "load_weights_payload" in names()
    assert torch.equal(model.a, WEIGHTS["a"])

    llm.calls.clear()
    llm.reset_result = False  # vLLM refused the reset: its own pause clears the cache and preempts instead
    with caplog.at_level("WARNING", logger="rlasync.engine.vllm_engine_weights"):
        run(ipc_sync(WEIGHTS))
    assert "was refused: pausing vLLM" in caplog.text
    assert names() == ["load_flat_ipc", "reset", "pause", "resume"] and torch.equal(model.a, WEIGHTS["a"])

    keep = FakeVLLMEngine("m", sync_without_pause=True, clear_cache_on_pause=False)
    keep._llm.worker = llm.worker
    run(keep.pause()), run(keep.load_weights(MappedWeights(shared.key, shared.handles()))), run(keep.resume())
    assert [c[1] if c[0] == "rpc" else c[0] for c in keep._llm.calls] == ["load_flat_ipc"]
    assert FakeVLLMEngine("m").sync_without_pause is False
    shared.release()


def test_a_failed_flat_sync_falls_back_to_the_per_tensor_path_for_good(monkeypatch, caplog):
    """A worker that cannot map or replay the persistent buckets (an untried vLLM build): one warning, then the
    per-tensor path for this sync and the later ones; the weights still arrive."""
    from rlasync.weights.ipc import MappedWeights, SharedWeights
    from rlasync.weights.plan import ManifestEntry

    manifest = [ManifestEntry(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in WEIGHTS.items()]
    shared = SharedWeights.pack(WEIGHTS.items(), manifest, "cpu")
    engine = FakeVLLMEngine("m", dtype=None, max_model_len=96, gpu_memory_utilization=0.3)
    llm, model = engine._llm, engine._llm.worker.model_runner.model

    def broken(self, key, buckets):
        raise RuntimeError("cannot map")

    monkeypatch.setattr(type(llm.worker), "load_flat_ipc", broken)

    async def go(weights):
        shared.fill(weights.items(), manifest)
        await engine.pause()
        await engine.load_weights(MappedWeights(shared.key, shared.handles()))
        await engine.resume()
        assert torch.equal(model.a, weights["a"]) and torch.equal(model.b, weights["b"])

    with caplog.at_level("WARNING"):
        run(go(WEIGHTS))
        run(go({"a": -WEIGHTS["a"], "b": WEIGHTS["b"] * 2}))
    assert caplog.text.count("persistent buckets failed") == 1
    assert [c[1] for c in llm.calls if c[0] == "rpc"].count("load_flat_ipc") == 1
    shared.release()
