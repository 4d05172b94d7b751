"""RemoteReward in a real run (Ray local cluster, tiny random Llama): the reward actor pickles it, opens its own
session and scores every group through a local JSON reward server; a server that keeps failing stops `train()`
with the named error instead of training on made-up rewards."""

import asyncio
import json
import threading

import pytest
from aiohttp import web

from tests.integration.tiny_runs import tiny_grpo_config

pytestmark = pytest.mark.integration


class ThreadedServer:
    """A plain-JSON-protocol reward server on 127.0.0.1 in a background thread (its own event loop)."""

    def __init__(self, status=200):
        self.status = status
        self.bodies = []
        self.loop = asyncio.new_event_loop()
        started = threading.Event()
        self.thread = threading.Thread(target=self._serve, args=(started,), daemon=True)
        self.thread.start()
        assert started.wait(30), "the reward server did not start"

    def _serve(self, started):
        asyncio.set_event_loop(self.loop)
        app = web.Application()
        app.router.add_post("/score", self.handle)
        self.runner = web.AppRunner(app)
        self.loop.run_until_complete(self.runner.setup())
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        self.loop.run_until_complete(site.start())
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}/score"
        started.set()
        self.loop.run_forever()

    async def handle(self, request):
        body = await request.json()
        self.bodies.append(body)
        if self.status != 200:
            return web.Response(status=self.status, text="injected failure")
        rewards = []
        for completion in body["completions"]:
            words = completion[-1]["content"].split()
            rewards.append(sum(w.isdigit() for w in words) / max(len(words), 1))
        return web.json_response({"rewards": rewards})

    def stop(self):
        asyncio.run_coroutine_threadsafe(self.runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)


@pytest.fixture
def server(request):
    server = ThreadedServer(getattr(request, "param", 200))
    yield server
    server.stop()


def make_config(tmp_path):
    config = tiny_grpo_config(tmp_path, max_steps=2)
    config.cluster.num_reward_actors = 1  # the RewardActor pool holds the RemoteReward
    return config


def test_a_run_scores_every_group_through_the_server(ray_cluster, tiny_model_dir, tmp_path, server):
    from rlasync import AsyncGRPOTrainer
    from rlasync.data import arithmetic_dataset
    from rlasync.rewards import RemoteReward

    reward = RemoteReward(server.url, name="judge", batch_size=2)
    trainer = AsyncGRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=reward,
        args=make_config(tmp_path),
        train_dataset=arithmetic_dataset(64, seed=0),
    )
    assert trainer.train()["global_step"] == 2
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    scored = [record["rewards/judge/mean"] for record in records if "rewards/judge/mean" in record]
    assert scored and all(0.0 <= value <= 1.0 for value in scored), records  # a window logs the groups it scored
    assert server.bodies and all(len(body["completions"]) == 2 for body in server.bodies)  # groups of 4, batches of 2
    assert all(len(body["prompts"]) == 2 and "answer" in body for body in server.bodies)


@pytest.mark.parametrize("server", [503], indirect=True)
def test_a_failing_server_stops_the_run_with_the_named_error(ray_cluster, tiny_model_dir, tmp_path, server):
    from rlasync import AsyncGRPOTrainer
    from rlasync.data import arithmetic_dataset
    from rlasync.rewards import RemoteReward

    reward = RemoteReward(server.url, name="judge", max_retries=2, backoff_s=0.01)
    trainer = AsyncGRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=reward,
        args=make_config(tmp_path),
        train_dataset=arithmetic_dataset(64, seed=0),
    )
    with pytest.raises(RuntimeError, match="failed") as info:
        trainer.train()
    message = str(info.value)
    assert "RemoteRewardError" in message or "remote reward 'judge'" in message, message
    assert server.url in message and "3 attempt(s)" in message and "HTTP 503" in message
    assert not (tmp_path / "checkpoint-1").exists()
