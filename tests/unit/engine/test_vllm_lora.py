"""Runtime LoRA adapters on the vLLM engines without vLLM: an adapter sync becomes a peft folder `rlasync-v{k}`
loaded with `add_lora` (in-process, over a fake AsyncLLM) or POST /v1/load_lora_adapter (a fake `vllm serve`);
requests use the newest adapter; at most `max_loras` stay loaded, older ones are removed (and their folders)."""

import asyncio
import json
import os
import sys
import threading
import types
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("peft")
from aiohttp import web  # noqa: E402

from rlasync.engine.vllm_engine import VLLMEngine  # noqa: E402
from rlasync.engine.vllm_engine_lora import RuntimeAdapters  # noqa: E402
from rlasync.engine.vllm_server import VLLMServerEngine  # noqa: E402


def adapter_sync(scale=1.0):
    """Two LoRA modules' (A, s*B) in stream order, as the learner sends them."""
    out = []
    for module in ("model.layers.0.self_attn.q_proj", "model.layers.0.mlp.down_proj"):
        out += [(f"{module}.lora_A.weight", torch.full((4, 8), scale)), (f"{module}.lora_B.weight", torch.ones(8, 4))]
    return out


@pytest.fixture
def fake_vllm(monkeypatch):
    """Just enough of the `vllm` package for the request path: TokensPrompt, LoRARequest, the engine exceptions."""
    modules = {
        name: types.ModuleType(name)
        for name in ("vllm", "vllm.lora", "vllm.lora.request", "vllm.v1", "vllm.v1.engine", "vllm.v1.engine.exceptions")
    }
    modules["vllm"].TokensPrompt = lambda prompt_token_ids: {"prompt_token_ids": prompt_token_ids}
    modules["vllm.lora.request"].LoRARequest = lambda **kw: SimpleNamespace(**kw)
    for name in ("EngineDeadError", "EngineGenerateError"):
        setattr(modules["vllm.v1.engine.exceptions"], name, type(name, (Exception,), {}))
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)


class FakeLLM:
    def __init__(self, args):
        self.args, self.loras, self.calls, self.requests = args, {}, [], []
        self.vllm_config = SimpleNamespace(
            model_config=SimpleNamespace(max_model_len=64, max_logprobs=20),
            cache_config=SimpleNamespace(num_gpu_blocks=10, block_size=16),
        )

    async def add_lora(self, request):
        with open(f"{request.lora_path}/adapter_config.json") as f:
            assert json.load(f)["r"] == 4
        self.loras[request.lora_int_id] = request
        self.calls.append(("add", request.lora_name))
        return True

    async def remove_lora(self, lora_id):
        self.calls.append(("remove", self.loras.pop(lora_id).lora_name))
        return True

    async def pause_generation(self, *, mode, clear_cache):
        pass

    async def resume_generation(self):
        pass

    async def generate(self, prompt, params, request_id, lora_request=None):
        self.requests.append(lora_request.lora_name if lora_request is not None else None)
        yield SimpleNamespace(finished=True, outputs=[SimpleNamespace(finish_reason="stop")])

    def shutdown(self):
        pass


class FakeLoraEngine(VLLMEngine):
    def _build(self, args):
        self.vllm_version = "0.25.0"
        return FakeLLM(args)


def test_in_process_vllm_loads_versioned_adapters_serves_the_newest_and_retires_old_ones(fake_vllm, tmp_path):
    with pytest.raises(ValueError, match="enable_lora=True"):
        FakeLoraEngine("m", lora_dir=str(tmp_path))
    engine = FakeLoraEngine("m", lora_dir=str(tmp_path), enable_lora=True, max_loras=2, max_lora_rank=8)
    llm = engine._llm
    assert llm.args["enable_lora"] is True and llm.args["max_loras"] == 2 and "lora_dir" not in llm.args

    async def go():
        await engine._run([1, 2], None)  # before any sync: the base model
        for k in range(3):
            await engine.pause()
            result = await engine.load_weights(adapter_sync(scale=k + 1.0))
            await engine.resume()
            assert result["adapter"] == f"rlasync-v{k + 1}"
            await engine._run([1, 2], None)

    asyncio.run(go())
    assert llm.requests == [None, "rlasync-v1", "rlasync-v2", "rlasync-v3"]
    assert llm.calls == [("add", "rlasync-v1"), ("add", "rlasync-v2"), ("add", "rlasync-v3"), ("remove", "rlasync-v1")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rlasync-v2", "rlasync-v3"]  # the retired folder is gone
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "rlasync-v3" / "adapter_model.safetensors"))
    assert torch.equal(saved["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"], torch.full((4, 8), 3.0))


def test_an_adapter_sync_to_an_engine_without_lora_is_an_error(fake_vllm):
    engine = FakeLoraEngine("m")

    async def go():
        await engine.pause()
        await engine.load_weights(adapter_sync())

    with pytest.raises(RuntimeError, match="without lora_dir"):
        asyncio.run(go())


class FakeLoraServer:
    """`vllm serve --enable-lora` with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1: the LoRA endpoints and pause/resume."""

    def __init__(self):
        self.requests, self.loaded = [], []

    async def load(self, request):
        body = await request.json()
        assert os.path.isfile(f"{body['lora_path']}/adapter_model.safetensors")  # a path the server can read
        self.requests.append(("load", body["lora_name"]))
        self.loaded.append(body["lora_name"])
        return web.Response(text=f"Success: LoRA adapter '{body['lora_name']}' added successfully.")

    async def unload(self, request):
        body = await request.json()
        self.requests.append(("unload", body["lora_name"]))
        self.loaded.remove(body["lora_name"])
        return web.Response(text="Success")

    async def control(self, request):
        return web.json_response({})

    def __enter__(self):
        ready = threading.Event()

        def serve():
            self.loop = asyncio.new_event_loop()
            app = web.Application()
            app.router.add_post("/v1/load_lora_adapter", self.load)
            app.router.add_post("/v1/unload_lora_adapter", self.unload)
            app.router.add_post("/pause", self.control)
            app.router.add_post("/resume", self.control)
            self.runner = web.AppRunner(app)
            self.loop.run_until_complete(self.runner.setup())
            site = web.TCPSite(self.runner, "127.0.0.1", 0)
            self.loop.run_until_complete(site.start())
            self.port = self.runner.addresses[0][1]
            ready.set()
            self.loop.run_forever()

        self.thread = threading.Thread(target=serve, daemon=True)
        self.thread.start()
        assert ready.wait(10)
        return self

    def __exit__(self, *exc):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)


def test_vllm_server_loads_adapters_over_http_and_requests_name_the_newest(tmp_path):
    with FakeLoraServer() as server:
        engine = VLLMServerEngine(
            f"http://127.0.0.1:{server.port}",
            "base-model",
            check=False,
            lora_dir=str(tmp_path),
            max_loras=2,
            backoff_base_s=0.01,
            metrics_interval_s=0,
        )
        served = [engine._served_model()]

        async def go():
            for _ in range(3):
                await engine.pause()
                await engine.load_weights(adapter_sync())
                await engine.resume()
                served.append(engine._served_model())
            await engine.close()

        asyncio.run(go())
    assert served == ["base-model", "rlasync-v1", "rlasync-v2", "rlasync-v3"]
    assert server.requests == [
        ("load", "rlasync-v1"),
        ("load", "rlasync-v2"),
        ("load", "rlasync-v3"),
        ("unload", "rlasync-v1"),
    ]
    assert server.loaded == ["rlasync-v2", "rlasync-v3"]


def test_runtime_adapters_refuse_a_stream_that_is_not_an_adapter(tmp_path):
    adapters = RuntimeAdapters(tmp_path, max_loras=1)

    async def noop(adapter):
        pass

    with pytest.raises(ValueError, match="not a LoRA A/B weight"):
        asyncio.run(adapters.publish([("model.embed_tokens.weight", torch.ones(2))], load=noop, unload=noop))


def test_an_adapter_in_use_is_retired_only_after_its_last_request_ends(tmp_path):
    """vLLM may reload an adapter from its folder while one of its requests waits or is preempted: an adapter beyond
    max_loras keeps its folder (and stays loaded) until no request holds it, then is removed and deleted."""
    calls = []

    async def load(adapter):
        calls.append(("load", adapter[0]))

    async def unload(adapter):
        calls.append(("unload", adapter[0]))

    async def scenario():
        adapters = RuntimeAdapters(tmp_path, max_loras=1)
        await adapters.publish(adapter_sync(), load=load, unload=unload)  # v1
        with adapters.using() as held:  # a request on v1, still running across two more syncs
            assert held[0] == "rlasync-v1"
            await adapters.publish(adapter_sync(2.0), load=load, unload=unload)  # v2: v1 is beyond max_loras
            assert adapters.retiring == ["rlasync-v1"] and (tmp_path / "rlasync-v1").is_dir()
            with adapters.using() as newer:
                assert newer[0] == "rlasync-v2"  # new requests take the newest
            await adapters.publish(adapter_sync(3.0), load=load, unload=unload)  # v3: v2 unused, retired at once
            assert ("unload", "rlasync-v2") in calls and not (tmp_path / "rlasync-v2").exists()
            assert ("unload", "rlasync-v1") not in calls
        await asyncio.sleep(0)  # the retirement runs once the request let go
        await asyncio.sleep(0)
        assert ("unload", "rlasync-v1") in calls and not (tmp_path / "rlasync-v1").exists()
        assert adapters.retiring == [] and [a[0] for a in adapters.live] == ["rlasync-v3"]
        assert (tmp_path / "rlasync-v3").is_dir()

    asyncio.run(scenario())
