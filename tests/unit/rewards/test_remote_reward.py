"""RemoteReward against a local aiohttp server (127.0.0.1, a free port) that answers as scripted: the two protocols,
batching, session reuse, pickling, and slow / failing / malformed answers that are retried, counted and never taken
for a reward."""

import asyncio
import contextlib
import json
import math
import pickle

import pytest
from aiohttp import web

from rlasync.rewards import (
    RemoteReward,
    RemoteRewardError,
    RewardFunctionError,
    call_reward_funcs,
    last_number_reward,
)
from rlasync.rewards.remote import RemoteRewardHTTPError, RemoteRewardResponseError

PROMPTS = [[{"role": "user", "content": "add"}]] * 3
COMPLETIONS = [[{"role": "assistant", "content": str(i)}] for i in range(3)]  # completion i is worth float(i)
FAST = {"backoff_s": 0.01, "max_backoff_s": 0.02, "timeout_s": 2.0}


class Server:
    """Answers POSTs; each request takes the next scripted action (then "ok"), and is recorded with its body and
    the client's port (the same port = the same kept-alive connection)."""

    def __init__(self, actions=()):
        self.actions = list(actions)
        self.requests = []
        self.client_ports = []

    async def handle(self, request):
        body = await request.json()
        self.requests.append(body)
        self.client_ports.append(request.transport.get_extra_info("peername")[1])
        action = self.actions.pop(0) if self.actions else "ok"
        if action == "slow":
            await asyncio.sleep(3.0)
        elif action in ("500", "503", "400"):
            return web.Response(status=int(action), text=f"injected {action}")
        elif action == "429":
            return web.Response(status=429, text="slow down", headers={"Retry-After": "0"})
        elif action == "reset":
            request.transport.abort()
            return web.Response(text="never sent")
        elif action == "not_json":
            return web.Response(text="<html>bad gateway</html>")
        rewards = self.rewards(request.path, body)
        malformed = {
            "wrong_length": lambda: {"rewards": rewards[:-1]},
            "strings": lambda: {"rewards": [str(value) for value in rewards]},
            "bools": lambda: {"rewards": [True] * len(rewards)},
            "missing_key": lambda: {"scores": rewards},
            "not_a_list": lambda: {"rewards": 1.0},
        }
        return web.json_response(malformed[action]() if action in malformed else self.answer(request.path, rewards))

    @staticmethod
    def rewards(path, body):
        if "messages" in body:
            return [float(body["messages"][-1]["content"])]
        if "input" in body:
            return [float(text.rsplit(" ", 1)[-1]) for text in body["input"]]
        return [float(completion[-1]["content"]) for completion in body["completions"]]

    @staticmethod
    def answer(path, rewards):
        if path.endswith("/classify"):
            data = [
                {"index": i, "label": "x", "probs": [value, -value], "num_classes": 2}
                for i, value in enumerate(rewards)
            ]
            return {"object": "list", "data": data[::-1]}  # out of order: the client sorts by index
        if path.endswith("/pooling"):
            return {
                "object": "list",
                "data": [{"index": i, "object": "pooling", "data": [value]} for i, value in enumerate(rewards)],
            }
        return {"rewards": rewards}


@contextlib.asynccontextmanager
async def serving(server):
    app = web.Application()
    app.router.add_post("/{tail:.*}", server.handle)
    runner = web.AppRunner(app, shutdown_timeout=0.5)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


def run(server, make_reward, scenario):
    """Start `server`, build the reward against its base URL, run `scenario(reward)` and close the session."""

    async def main():
        async with serving(server) as base:
            reward = make_reward(base)
            try:
                return await scenario(reward)
            finally:
                await reward.aclose()

    return asyncio.run(main())


def call(reward, prompts=PROMPTS, completions=COMPLETIONS, **columns):
    return reward(prompts=prompts, completions=completions, completion_ids=[[1]] * len(completions), **columns)


# ---- success paths -------------------------------------------------------------------------------------------


def test_json_protocol_sends_the_group_and_dataset_columns_and_reads_rewards():
    server = Server()
    rewards = run(server, lambda base: RemoteReward(base + "/score", **FAST), lambda r: call(r, answer=["0", "1", "2"]))
    assert rewards == [0.0, 1.0, 2.0]
    (body,) = server.requests
    assert body == {"prompts": PROMPTS, "completions": COMPLETIONS, "answer": ["0", "1", "2"]}


def test_json_protocol_options_columns_ids_extra_body_and_null_rewards():
    server = Server()

    async def scenario(reward):
        return await call(reward, answer=["a"] * 3, unused=[object()] * 3)

    make = lambda base: RemoteReward(  # noqa: E731
        base + "/score", columns=["answer"], send_completion_ids=True, extra_body={"task": "sums"}, **FAST
    )
    assert run(server, make, scenario) == [0.0, 1.0, 2.0]
    assert server.requests[0]["completion_ids"] == [[1]] * 3 and server.requests[0]["task"] == "sums"
    assert "unused" not in server.requests[0]

    class NullServer(Server):
        def answer(self, path, rewards):
            return {"rewards": [None, 1, 2.5]}

    assert run(NullServer(), lambda base: RemoteReward(base, **FAST), call) == [None, 1.0, 2.5]


def test_an_unserialisable_column_is_named_before_any_request():
    server = Server()
    with pytest.raises(TypeError, match="not JSON-serialisable.*columns="):
        run(server, lambda base: RemoteReward(base, **FAST), lambda r: call(r, blob=[object()] * 3))
    assert server.requests == []


def test_batches_split_the_group_and_keep_the_order():
    server = Server()
    completions = [[{"role": "assistant", "content": str(i)}] for i in range(5)]
    rewards = run(
        server,
        lambda base: RemoteReward(base + "/score", batch_size=2, **FAST),
        lambda r: call(r, prompts=PROMPTS[:1] * 5, completions=completions),
    )
    assert rewards == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert sorted(len(body["completions"]) for body in server.requests) == [1, 2, 2]


def test_vllm_classify_sends_one_chat_per_completion_and_reads_the_label():
    server = Server()
    make = lambda base: RemoteReward(base + "/classify", model="org/rm", label_index=1, **FAST)  # noqa: E731
    rewards = run(server, make, call)
    assert rewards == [-0.0, -1.0, -2.0]  # probs[1] = -value
    assert len(server.requests) == 3
    first = min(server.requests, key=lambda body: body["messages"][-1]["content"])
    assert first == {"model": "org/rm", "use_activation": False, "messages": PROMPTS[0] + COMPLETIONS[0]}


def test_vllm_pooling_with_render_batches_texts():
    server = Server()

    def render(prompt, completion):
        return f"{prompt[-1]['content']} {completion[-1]['content']}"

    make = lambda base: RemoteReward(base + "/pooling", render=render, batch_size=2, use_activation=None, **FAST)  # noqa: E731
    assert run(server, make, call) == [0.0, 1.0, 2.0]
    assert sorted(body["input"] for body in server.requests) == [["add 0", "add 1"], ["add 2"]]
    assert all("use_activation" not in body for body in server.requests)


def test_at_most_max_connections_in_flight_and_waiting_for_one_is_not_a_timeout():
    class Pacing(Server):
        in_flight = peak = 0

        async def handle(self, request):
            Pacing.in_flight += 1
            Pacing.peak = max(Pacing.peak, Pacing.in_flight)
            await asyncio.sleep(0.15)
            try:
                return await super().handle(request)
            finally:
                Pacing.in_flight -= 1

    completions = [[{"role": "assistant", "content": str(i)}] for i in range(8)]

    async def scenario(reward):  # 8 requests of 0.15 s through 2 connections: the last starts after 0.45 s
        return await call(reward, prompts=PROMPTS[:1] * 8, completions=completions), reward.stats.as_dict()

    make = lambda base: RemoteReward(base, batch_size=1, max_connections=2, **{**FAST, "timeout_s": 0.4})  # noqa: E731
    rewards, stats = run(Pacing(), make, scenario)
    assert rewards == [float(i) for i in range(8)]
    assert Pacing.peak == 2 and stats["timeouts"] == 0 and stats["attempts"] == 8


def test_used_through_the_calling_convention_under_its_name():
    async def scenario(reward):
        return await call_reward_funcs(
            [reward], prompts=PROMPTS, completions=COMPLETIONS, completion_ids=[[1]] * 3, reward_kwargs={}
        )

    table = run(Server(), lambda base: RemoteReward(base, name="judge", **FAST), scenario)
    assert table.names == ("judge",) and table.column("judge").tolist() == [0.0, 1.0, 2.0]


# ---- failures: retried, counted, never a reward --------------------------------------------------------------


def test_server_errors_resets_and_429_are_retried_and_counted():
    server = Server(["500", "429", "reset", "503"])

    async def scenario(reward):
        return await call(reward), reward.stats.as_dict()

    rewards, stats = run(server, lambda base: RemoteReward(base, max_retries=4, **FAST), scenario)
    assert rewards == [0.0, 1.0, 2.0]
    assert stats["attempts"] == 5 and stats["retries"] == 4 and stats["failures"] == 0
    assert stats["http_errors"] == 3 and stats["connection_errors"] == 1 and stats["completions"] == 3


def test_a_slow_answer_times_out_and_is_retried():
    server = Server(["slow"])

    async def scenario(reward):
        return await call(reward), reward.stats.timeouts

    rewards, timeouts = run(server, lambda base: RemoteReward(base, **{**FAST, "timeout_s": 0.3}), scenario)
    assert rewards == [0.0, 1.0, 2.0] and timeouts == 1


@pytest.mark.parametrize("kind", ["wrong_length", "strings", "bools", "missing_key", "not_a_list", "not_json"])
def test_malformed_answers_are_retried_then_raise_the_named_error(kind):
    server = Server([kind] * 3)

    async def scenario(reward):
        with pytest.raises(RemoteRewardError) as info:
            await call(reward)
        return info.value, reward.stats.as_dict()

    error, stats = run(server, lambda base: RemoteReward(base + "/score", max_retries=2, **FAST), scenario)
    assert isinstance(error, RewardFunctionError) and isinstance(error.cause, RemoteRewardResponseError)
    assert error.attempts == 3 and error.url.endswith("/score")
    assert "/score" in str(error) and "3 attempt(s)" in str(error) and "malformed response" in str(error)
    assert stats["malformed"] == 3 and stats["failures"] == 1 and stats["completions"] == 0


def test_one_malformed_answer_is_retried_into_a_good_one():
    server = Server(["strings"])
    assert run(server, lambda base: RemoteReward(base, **FAST), call) == [0.0, 1.0, 2.0]
    assert len(server.requests) == 2


@pytest.mark.parametrize("kind", ["token_vectors", "no_label", "nan"])
def test_malformed_vllm_answers_are_not_rewards(kind):
    class BadVLLM(Server):
        def answer(self, path, rewards):
            vector = {"token_vectors": [[1.0], [2.0]], "no_label": [], "nan": [math.nan]}[kind]
            return {"data": [{"index": i, "data": vector} for i in range(len(rewards))]}

    async def scenario(reward):
        with pytest.raises(RemoteRewardError) as info:
            await call(reward)
        return info.value

    error = run(BadVLLM(), lambda base: RemoteReward(base + "/pooling", max_retries=0, **FAST), scenario)
    assert isinstance(error.cause, RemoteRewardResponseError) and error.attempts == 1


def test_a_client_error_status_is_not_retried():
    server = Server(["400"])

    async def scenario(reward):
        with pytest.raises(RemoteRewardError, match="not retried.*HTTP 400: injected 400") as info:
            await call(reward)
        return info.value

    error = run(server, lambda base: RemoteReward(base, **FAST), scenario)
    assert error.attempts == 1 and isinstance(error.cause, RemoteRewardHTTPError) and len(server.requests) == 1


def test_no_server_raises_the_named_error_after_the_retries():
    async def main():
        async with serving(Server()) as base:
            pass  # the port is free again: nothing listens
        reward = RemoteReward(base, max_retries=2, **FAST)
        with pytest.raises(RemoteRewardError, match="failed after 3 attempt") as info:
            await call(reward)
        await reward.aclose()
        return info.value, reward.stats.connection_errors

    error, connection_errors = asyncio.run(main())
    assert error.url.startswith("http://127.0.0.1:") and connection_errors == 3


def test_the_calling_convention_fails_the_group_instead_of_scoring_it():
    async def scenario(reward):
        return await call_reward_funcs(
            [reward], prompts=PROMPTS, completions=COMPLETIONS, completion_ids=[[1]] * 3, reward_kwargs={}
        )

    with pytest.raises(RewardFunctionError, match="remote_reward") as info:
        run(Server(["500"] * 2), lambda base: RemoteReward(base, max_retries=1, **FAST), scenario)
    assert isinstance(info.value.__cause__, RemoteRewardError)


# ---- session and pickling ------------------------------------------------------------------------------------


def test_one_session_per_loop_reused_across_calls():
    server = Server()

    async def scenario(reward):
        await call(reward)
        session = reward._session
        await call(reward)
        return session is reward._session

    assert run(server, lambda base: RemoteReward(base, **FAST), scenario)
    assert len(server.requests) == 2 and server.client_ports[0] == server.client_ports[1]  # kept alive


@pytest.mark.filterwarnings("ignore::ResourceWarning")  # the first loop's session is left behind, unclosed
def test_a_new_event_loop_gets_a_new_session():
    reward = RemoteReward("http://127.0.0.1:1/", **FAST)
    sessions = []

    async def once():
        async with serving(Server()) as base:
            reward.url = base
            assert await call(reward) == [0.0, 1.0, 2.0]
            sessions.append(reward._session)

    asyncio.run(once())  # no aclose(): the session outlives its loop
    asyncio.run(once())
    asyncio.run(reward.aclose())
    assert sessions[0] is not sessions[1] and reward.stats.failures == 0


def test_pickles_without_its_session_and_counters():
    server = Server()

    async def scenario(reward):
        await call(reward)
        copy = pickle.loads(pickle.dumps(reward))
        assert copy._session is None and copy.stats.attempts == 0 and reward.stats.attempts == 1
        assert (copy.url, copy.__name__, copy.batch_size) == (reward.url, "rm", 8)
        rewards = await call(copy)
        await copy.aclose()
        return rewards

    assert run(server, lambda base: RemoteReward(base, name="rm", batch_size=8, **FAST), scenario) == [0.0, 1.0, 2.0]


# ---- configuration -------------------------------------------------------------------------------------------


def test_protocol_inferred_from_the_url_and_bad_options_named():
    assert RemoteReward("http://h:8000/classify").protocol == "vllm-classify"
    assert RemoteReward("http://h:8000/pooling/").protocol == "vllm-pooling"
    assert RemoteReward("http://h:9000/score").protocol == "json"
    assert RemoteReward("http://h/x", name="judge").__name__ == "judge"
    with pytest.raises(ValueError, match="url="):
        RemoteReward("h:8000/classify")
    with pytest.raises(ValueError, match="protocol="):
        RemoteReward("http://h/x", protocol="grpc")
    with pytest.raises(ValueError, match="batch_size="):
        RemoteReward("http://h/x", batch_size=0)
    with pytest.raises(ValueError, match="render="):
        RemoteReward("http://h/score", render=str)
    with pytest.raises(ValueError, match="columns="):
        RemoteReward("http://h/score", columns="answer")


def test_json_bodies_carry_no_nan():
    with pytest.raises(TypeError, match="not JSON-serialisable"):
        RemoteReward("http://h/score")._encode({"x": math.nan})
    assert json.loads(RemoteReward("http://h/score")._encode({"x": 1.5})) == {"x": 1.5}


# ---- reward-model ids --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("reward_funcs", ["org/reward-model", ["org/reward-model"], [last_number_reward, "org/rm"]])
def test_the_trainer_refuses_a_reward_model_id_that_is_not_local_before_ray_starts(reward_funcs):
    from rlasync.config import AsyncGRPOConfig
    from rlasync.trainers import AsyncGRPOTrainer

    datasets = pytest.importorskip("datasets")
    dataset = datasets.Dataset.from_dict({"prompt": [[{"role": "user", "content": "1 + 1?"}]], "answer": ["2"]})
    args = AsyncGRPOConfig(output_dir="unused", max_steps=1)
    with pytest.raises(ValueError, match="rlasync does not download models at run time") as info:
        AsyncGRPOTrainer(model="some/model", reward_funcs=reward_funcs, args=args, train_dataset=dataset)
    message = str(info.value)
    assert "reward_funcs='org/" in message and "RemoteReward(url)" in message and "'O' is not" not in message


def test_the_trainer_takes_a_remote_reward():
    from rlasync.config import AsyncGRPOConfig
    from rlasync.trainers import AsyncGRPOTrainer

    datasets = pytest.importorskip("datasets")
    dataset = datasets.Dataset.from_dict({"prompt": [[{"role": "user", "content": "1 + 1?"}]], "answer": ["2"]})
    reward = RemoteReward("http://127.0.0.1:9/score", name="judge")
    trainer = AsyncGRPOTrainer(
        model="some/model",
        reward_funcs=reward,
        args=AsyncGRPOConfig(output_dir="unused", max_steps=1),
        train_dataset=dataset,
    )
    assert trainer.reward_funcs == [reward]


def test_backoff_doubles_with_jitter_is_capped_and_honours_retry_after():
    reward = RemoteReward("http://h/score", backoff_s=1.0, max_backoff_s=5.0)
    for attempt, base in [(1, 1.0), (2, 2.0), (3, 4.0), (4, 5.0), (9, 5.0)]:
        delays = [reward._backoff(attempt, RuntimeError()) for _ in range(50)]
        assert all(0.5 * base <= delay <= base for delay in delays), (attempt, delays)
        assert len(set(delays)) > 1  # jittered
    assert reward._backoff(1, RemoteRewardHTTPError(429, "", retry_after_s=3.0)) == 3.0
    assert reward._backoff(1, RemoteRewardHTTPError(429, "", retry_after_s=60.0)) == 5.0  # capped
