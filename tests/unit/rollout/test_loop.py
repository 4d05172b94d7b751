"""AsyncRolloutLoop with fakes in one event loop: leases, groups, versions, retries, failures, stop, metrics."""

import asyncio
import collections
import random

import numpy as np
import pytest

from rlasync.algorithms.grpo.loop import (
    AsyncRolloutLoop,
    PromptLease,
    build_training_sequences,
    retry_backoff_s,
)
from rlasync.config import AsyncGRPOConfig
from rlasync.engine.base import EngineError, EngineStats, RequestRejectedError
from rlasync.records import Rollout, TurnRecord
from rlasync.rewards import RewardFunctionError
from rlasync.rollout.concurrency import ConcurrencyController

EOS = 2
VOCAB = 100
ROLES = ("system", "user", "assistant", "tool")


# ---- fakes ------------------------------------------------------------------------------------------------


class FakeTokenizer:
    """A trivial chat template: BOS, then per message a role id and one id per character."""

    eos_token_id = EOS
    pad_token_id = 0

    def apply_chat_template(self, messages, add_generation_prompt=False, tokenize=True, **kwargs):
        ids = [1]
        for message in messages:
            ids += [3 + ROLES.index(message["role"])] + [10 + ord(c) % 80 for c in message["content"]]
        if add_generation_prompt:
            ids.append(3 + ROLES.index("assistant"))
        return {"input_ids": ids, "attention_mask": [1] * len(ids)}  # transformers 5 returns a BatchEncoding

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(str(i) for i in ids if not (skip_special_tokens and i in (0, 1, EOS)))


class FakeEngine:
    """Deterministic outputs from the request seed; latency = `yields` event-loop turns, or until `gate` opens."""

    def __init__(self, yields=2, kv_capacity_tokens=0, max_model_len=64, kv_usage=0.1, ignore_seed=False):
        self.yields = yields
        self.gate = None
        self.transient_failures = 0
        self.reject = lambda prompt_ids: False
        self.crash = None
        self.on_request = None
        self.ignore_seed = ignore_seed
        self.requests = []
        self.inflight = 0
        self.max_inflight = 0
        self.cancelled = 0
        self._waiters = []
        self.stats_value = EngineStats(
            kv_cache_usage_frac=kv_usage,
            num_running=0,
            num_waiting=0,
            num_preemptions=0,
            kv_capacity_tokens=kv_capacity_tokens,
            max_model_len=max_model_len,
        )

    async def generate(self, prompt_ids, sampling):
        self.requests.append((list(prompt_ids), sampling))
        self.inflight += 1
        self.max_inflight = max(self.max_inflight, self.inflight)
        for count, event in self._waiters:
            if self.inflight >= count:
                event.set()
        try:
            if self.on_request is not None:
                self.on_request(prompt_ids, sampling)
            if self.gate is not None:
                await self.gate.wait()
            for _ in range(self.yields):
                await asyncio.sleep(0)
            if self.crash is not None:
                raise self.crash
            if self.transient_failures > 0:
                self.transient_failures -= 1
                raise EngineError("engine hiccup")
            if self.reject(prompt_ids):
                raise RequestRejectedError("prompt longer than max_model_len")
            return self.turn(prompt_ids, sampling)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.inflight -= 1

    def turn(self, prompt_ids, sampling):
        rng = random.Random(0 if self.ignore_seed else sampling.seed)
        length = rng.randint(1, sampling.max_tokens)
        ids = [rng.randrange(10, VOCAB) for _ in range(length)]
        finish = "length"
        if rng.random() < 0.5:
            ids[-1], finish = EOS, "stop"
        logprobs = [-rng.random() for _ in ids]
        top = None
        if sampling.num_logprobs:
            top = [{token: lp, (token + 1) % VOCAB: lp - 1.0} for token, lp in zip(ids, logprobs)]
        return TurnRecord(list(prompt_ids), ids, logprobs, output_sampler_logprobs=top, finish_reason=finish)

    async def wait_inflight(self, count):
        event = asyncio.Event()
        self._waiters.append((count, event))
        if self.inflight >= count:
            event.set()
        await event.wait()

    def stats(self):
        return self.stats_value


class FakePromptSource:
    def __init__(self, rows, num_epochs=1):
        self.rows = rows
        self.total = len(rows) * num_epochs
        self.leased = []
        self.released = []

    def lease(self):
        group_id = len(self.leased)
        if group_id >= self.total:
            return None
        lease = PromptLease(
            group_id, group_id % len(self.rows), self.rows[group_id % len(self.rows)], group_id // len(self.rows)
        )
        self.leased.append(lease)
        return lease

    def release(self, lease, reason):
        self.released.append((lease.group_id, reason))


class ListSink:
    def __init__(self):
        self.results = []

    async def put(self, result):
        self.results.append(result)


class RecordingAdmission:
    def __init__(self):
        self.acquired = []
        self.finished = []  # (num_rollouts, num_tokens, queued), or (num_rollouts, "cancelled")

    async def acquire(self, num_rollouts):
        self.acquired.append(num_rollouts)
        return 0.25

    def finish_group(self, num_rollouts, num_tokens, queued=True):
        self.finished.append((num_rollouts, num_tokens, queued))

    def cancel_group(self, num_rollouts):
        self.finished.append((num_rollouts, "cancelled"))


def parity_reward(completion_ids, **kwargs):
    return [float(ids[0] % 2) for ids in completion_ids]


def rows(n):
    return [{"prompt": [{"role": "user", "content": f"q{i}"}], "answer": str(i)} for i in range(n)]


def config(**overrides):
    fields = {"num_generations": 4, "max_completion_length": 6, "max_concurrent_rollouts": 5, "num_sampler_logprobs": 3}
    return AsyncGRPOConfig(**{**fields, **overrides})


def make_loop(cls=AsyncRolloutLoop, *, num_rows=6, engine=None, reward_funcs=(parity_reward,), args=None, **kwargs):
    kwargs.setdefault("rng", random.Random(0))
    kwargs.setdefault("admission", RecordingAdmission())
    return cls(
        config=args or config(),
        tokenizer=FakeTokenizer(),
        engine=engine or FakeEngine(),
        prompt_source=kwargs.pop("prompt_source", None) or FakePromptSource(rows(num_rows)),
        sink=ListSink(),
        reward_funcs=list(reward_funcs),
        **kwargs,
    )


def scored_group_ids(loop):
    return sorted(result.group_id for result in loop.sink.results)


# ---- the main path ----------------------------------------------------------------------------------------


def test_every_leased_prompt_ends_up_in_exactly_one_scored_group_of_g_rollouts():
    seen_answers = []

    def answer_reward(completion_ids, answer, **kwargs):
        seen_answers.append(list(answer))
        return parity_reward(completion_ids)

    loop = make_loop(reward_funcs=[answer_reward])
    asyncio.run(loop.run())

    leased = [lease.group_id for lease in loop.prompt_source.leased]
    assert scored_group_ids(loop) == leased == list(range(6))
    assert loop.prompt_source.released == []
    assert sorted(seen_answers) == [[str(i)] * 4 for i in range(6)]  # dataset columns repeated G times
    for result in loop.sink.results:
        assert result.scored.rewards.shape == (4,)
        assert len(result.scored.samples) == (0 if result.dropped else 4)
        assert {s.policy_version for s in result.scored.samples} <= {0}
        assert {s.group_id for s in result.scored.samples} <= {result.group_id}
    seeds = [sampling.seed for _, sampling in loop.engines[0].requests]
    assert len(seeds) == 24 and len(set(seeds)) == 24 and all(0 <= s < 2**63 for s in seeds)
    admission = loop.admission
    assert admission.acquired == [4] * 7  # 6 groups + the admission that found no prompt left
    assert admission.finished.count((4, "cancelled")) == 1
    expected = [(4, r.num_rollout_tokens if r.dropped else r.num_tokens, not r.dropped) for r in loop.sink.results]
    assert sorted(f for f in admission.finished if len(f) == 3) == sorted(expected)
    for result in loop.sink.results:
        sequences_tokens = result.num_rollout_tokens
        assert sequences_tokens >= result.num_tokens and (result.dropped or sequences_tokens == result.num_tokens)


def test_dropped_groups_reach_the_sink_without_samples():
    def constant_reward(completions, **kwargs):
        return [1.0] * len(completions)

    loop = make_loop(num_rows=3, reward_funcs=[constant_reward])
    asyncio.run(loop.run())
    assert scored_group_ids(loop) == [0, 1, 2]
    assert all(result.dropped and result.scored.samples == [] for result in loop.sink.results)
    assert loop.counters["groups_dropped"] == 3


def test_a_group_keeps_the_policy_version_of_its_first_dispatch_when_the_version_changes_mid_group():
    loop = make_loop(
        num_rows=3, args=config(max_concurrent_rollouts=1), reward_funcs=[lambda completions, **k: [0, 1, 2, 3]]
    )
    engine = loop.engines[0]
    engine.on_request = lambda prompt_ids, sampling: loop.update_policy_version(loop.policy_version + 1)
    asyncio.run(loop.run())
    assert loop.policy_version == 12
    for result in loop.sink.results:
        assert result.policy_version == 4 * result.group_id  # one bump per earlier request
        assert [s.policy_version for s in result.scored.samples] == [4 * result.group_id] * 4


def test_training_sequences_hold_the_prompt_and_the_output_with_sampler_data():
    loop = make_loop(num_rows=2, reward_funcs=[lambda completions, **k: [0, 1, 2, 3]])
    asyncio.run(loop.run())
    engine = loop.engines[0]
    prompt_ids = FakeTokenizer().apply_chat_template(rows(1)[0]["prompt"], add_generation_prompt=True)["input_ids"]
    sample = next(r for r in loop.sink.results if r.group_id == 0).scored.samples[0]
    request_prompt, sampling = engine.requests[0]
    assert request_prompt == prompt_ids
    turn = engine.turn(prompt_ids, sampling)
    assert sample.input_ids.tolist() == prompt_ids + turn.output_ids
    assert sample.completion_mask.tolist() == [0] * len(prompt_ids) + [1] * len(turn.output_ids)
    np.testing.assert_allclose(sample.sampler_logprobs[len(prompt_ids) :], turn.output_log_probs, rtol=1e-6)
    assert sample.sampler_topk_ids.shape == (len(sample), 3)
    assert sample.sampler_topk_ids[len(prompt_ids)].tolist()[:2] == [
        turn.output_ids[0],
        (turn.output_ids[0] + 1) % VOCAB,
    ]
    assert sample.sampler_topk_ids[len(prompt_ids), 2] == -1
    assert sample.prompt == rows(1)[0]["prompt"]
    assert sample.completion == [{"role": "assistant", "content": FakeTokenizer().decode(turn.output_ids, True)}]


# ---- retries and failures ---------------------------------------------------------------------------------


def test_transient_engine_errors_are_retried_with_backoff_and_counted():
    delays = []

    async def fake_sleep(seconds):
        delays.append(seconds)

    engine = FakeEngine()
    engine.transient_failures = 3
    loop = make_loop(num_rows=2, engine=engine, sleep=fake_sleep, args=config(max_concurrent_rollouts=1))
    asyncio.run(loop.run())
    assert delays == [1.0, 2.0, 4.0]
    assert loop.counters["generation_retries"] == 3
    assert loop.metrics.reduce()["rollout/vllm_retry_count"] == 3.0
    assert scored_group_ids(loop) == [0, 1]
    retried = [sampling.seed for _, sampling in engine.requests[:4]]
    assert len(set(retried)) == 1  # a retry resends the same request, seed included


def test_retry_backoff_schedule():
    assert [retry_backoff_s(a) for a in range(7)] == [1, 2, 4, 8, 16, 16, 16]


def test_generation_stops_the_loop_after_the_last_attempt_and_check_health_raises():
    async def no_sleep(seconds):
        pass

    engine = FakeEngine()
    engine.transient_failures = 10**9
    loop = make_loop(num_rows=2, engine=engine, sleep=no_sleep)
    loop.max_generation_attempts = 3
    with pytest.raises(EngineError):
        asyncio.run(loop.run())
    with pytest.raises(RuntimeError, match="rollout loop failed") as info:
        loop.check_health()
    assert isinstance(info.value.__cause__, EngineError)
    assert loop.sink.results == []
    assert {reason for _, reason in loop.prompt_source.released} == {"cancelled"}
    assert len(loop.admission.acquired) == len(loop.admission.finished)


def test_a_rejected_request_fails_its_group_and_the_lease_is_released_not_lost():
    engine = FakeEngine()
    rejected_prompt = FakeTokenizer().apply_chat_template(rows(2)[1]["prompt"], add_generation_prompt=True)["input_ids"]
    engine.reject = lambda prompt_ids: prompt_ids == rejected_prompt
    loop = make_loop(num_rows=4, engine=engine)
    asyncio.run(loop.run())
    assert loop.prompt_source.released == [(1, "failed")]
    assert scored_group_ids(loop) == [0, 2, 3]
    assert loop.counters["groups_failed"] == 1
    assert loop.metrics.reduce()["rollout/failed_group_count"] == 1.0
    assert len(loop.admission.acquired) == len(loop.admission.finished)
    loop.check_health()  # a failed group is reported, not fatal


@pytest.mark.parametrize(
    ("where", "error_type"),
    [("engine", KeyError), ("reward", RewardFunctionError), ("generate_one", TypeError)],
)
def test_check_health_raises_after_a_task_crashes(where, error_type):
    engine = FakeEngine()
    reward_funcs = [parity_reward]
    cls = AsyncRolloutLoop
    if where == "engine":
        engine.crash = KeyError("bug in the engine")
    elif where == "reward":

        def broken_reward(completions, **kwargs):
            raise ZeroDivisionError("bug in the reward")

        reward_funcs = [broken_reward]
    else:

        class NotARollout(AsyncRolloutLoop):
            async def generate_one(self, prompt, tools, group_id):
                return "text"

        cls = NotARollout
    loop = make_loop(cls, engine=engine, reward_funcs=reward_funcs)
    with pytest.raises(error_type):
        asyncio.run(loop.run())
    with pytest.raises(RuntimeError) as info:
        loop.check_health()
    assert isinstance(info.value.__cause__, error_type)
    assert not loop.is_running
    held = {lease.group_id for lease in loop.prompt_source.leased} - set(scored_group_ids(loop))
    assert {gid for gid, _ in loop.prompt_source.released} == held  # nothing leased is lost


# ---- filtering, concurrency, engines ----------------------------------------------------------------------


def test_filter_prompt_rejections_are_released_counted_and_skipped():
    class OddRowsOnly(AsyncRolloutLoop):
        def filter_prompt(self, row_index, row, epoch):
            return row_index % 2 == 1

    loop = make_loop(OddRowsOnly, num_rows=6)
    asyncio.run(loop.run())
    assert scored_group_ids(loop) == [1, 3, 5]
    assert loop.prompt_source.released == [(0, "filtered"), (2, "filtered"), (4, "filtered")]
    assert loop.counters["prompts_filtered"] == 3
    assert loop.metrics.reduce()["rollout/filtered_prompt_count"] == 3.0
    assert all(len(request[0]) for request in loop.engines[0].requests)
    assert len(loop.engines[0].requests) == 12


@pytest.mark.parametrize(("max_concurrent", "kv_slots", "expected"), [(2, 0, 2), (8, 3, 3), (3, 100, 3)])
def test_rollouts_in_flight_never_exceed_the_concurrency_limit(max_concurrent, kv_slots, expected):
    engine = FakeEngine(yields=5, kv_capacity_tokens=kv_slots * 64, max_model_len=64, kv_usage=0.7)
    loop = make_loop(num_rows=6, engine=engine, args=config(max_concurrent_rollouts=max_concurrent))
    asyncio.run(loop.run())
    assert engine.max_inflight == expected  # reached, never exceeded
    assert scored_group_ids(loop) == list(range(6))
    assert loop.metrics.reduce()["rollout/concurrency_cap"] == min(max_concurrent, kv_slots or max_concurrent)


def test_a_lowered_cap_holds_back_new_rollouts():
    engine = FakeEngine()
    controller = ConcurrencyController(max_concurrent_rollouts=8)
    controller._cap = 1  # as after repeated cuts
    loop = make_loop(num_rows=2, engine=engine, controller=controller, args=config(max_concurrent_rollouts=8))
    asyncio.run(loop.run())
    assert engine.max_inflight == 1


def test_a_groups_requests_go_to_one_engine_and_the_next_group_to_the_least_loaded():
    engines = [FakeEngine(), FakeEngine()]

    async def scenario():
        gate = asyncio.Event()
        for engine in engines:
            engine.gate = gate
        loop = make_loop(num_rows=2, engine=engines, args=config(max_concurrent_rollouts=8))
        task = asyncio.create_task(loop.run())
        await engines[0].wait_inflight(4)
        await engines[1].wait_inflight(4)
        assert (engines[0].inflight, engines[1].inflight) == (4, 4)
        gate.set()
        await task
        return loop

    loop = asyncio.run(scenario())
    assert scored_group_ids(loop) == [0, 1]
    prompts = [{tuple(ids) for ids, _ in engine.requests} for engine in engines]
    assert [len(engine.requests) for engine in engines] == [4, 4]
    assert len(prompts[0]) == len(prompts[1]) == 1 and prompts[0] != prompts[1]  # one group (one prompt) an engine


# ---- hooks ------------------------------------------------------------------------------------------------


class TwoTurnLoop(AsyncRolloutLoop):
    """A subclass in the style TRL's docs show: its own rollout and advantages."""

    async def generate_one(self, prompt, tools, group_id):
        first_ids = self.render(prompt)
        first = await self.generate_one_turn(first_ids)
        messages = prompt + [self.parse_response(first.output_ids, first_ids), {"role": "user", "content": "more"}]
        second_ids = self.render(messages)
        second = await self.generate_one_turn(second_ids)
        completion = [{"role": "assistant", "content": "custom"}]
        return Rollout(completion, first.output_ids + second.output_ids, [first, second])

    def compute_advantages(self, group):
        return np.array([10.0, 20.0, 30.0, 40.0])


def test_a_subclass_overriding_generate_one_and_compute_advantages_is_used():
    loop = make_loop(TwoTurnLoop, num_rows=2, reward_funcs=[lambda completions, **k: [0, 1, 2, 3]])
    asyncio.run(loop.run())
    assert len(loop.engines[0].requests) == 16
    for result in loop.sink.results:
        assert result.scored.advantages.tolist() == [10.0, 20.0, 30.0, 40.0]
        advantages = sorted({s.advantage for s in result.scored.samples})
        assert advantages == [10.0, 20.0, 30.0, 40.0]
        assert all(s.completion == [{"role": "assistant", "content": "custom"}] for s in result.scored.samples)
    reduced = loop.metrics.reduce()
    assert reduced["rollout/turns_mean"] == 2.0 and reduced["rollout/turns_max"] == 2.0


def test_setup_and_close_run_on_the_loops_event_loop():
    calls = []

    class WithResources(AsyncRolloutLoop):
        async def setup(self):
            calls.append(("setup", asyncio.get_running_loop()))

        async def close(self):
            calls.append(("close", asyncio.get_running_loop()))

    loop = make_loop(WithResources, num_rows=1)
    asyncio.run(loop.run())
    assert [name for name, _ in calls] == ["setup", "close"]
    assert calls[0][1] is calls[1][1]


def test_construction_errors_name_the_fix():
    with pytest.raises(ValueError, match="No reward source"):
        make_loop(reward_funcs=[])
    with pytest.raises(ValueError, match="two tools are named 'len'"):
        make_loop(tools=[len, type("Other", (), {"__name__": "len", "__call__": lambda self: 0})()])


def test_a_string_prompt_stops_the_loop_with_the_conversion_hint():
    source = FakePromptSource([{"prompt": "What is 1 + 1?"}])
    loop = make_loop(prompt_source=source)
    with pytest.raises(ValueError, match="conversational"):
        asyncio.run(loop.run())
    assert source.released == [(0, "cancelled")]


# ---- stop and heartbeat -----------------------------------------------------------------------------------


def test_stop_cancels_in_flight_rollouts_and_releases_their_leases():
    engine = FakeEngine()
    engine.gate = asyncio.Event()  # never opened

    async def scenario():
        loop = make_loop(engine=engine, args=config(num_generations=2, max_concurrent_rollouts=4))
        task = asyncio.create_task(loop.run())
        await engine.wait_inflight(4)
        assert loop.is_running and loop.num_inflight == 4
        await loop.stop()
        assert task.done() and task.exception() is None
        return loop

    loop = asyncio.run(scenario())
    assert engine.cancelled == 4 and engine.inflight == 0
    assert sorted(loop.prompt_source.released) == [(0, "cancelled"), (1, "cancelled")]
    assert loop.sink.results == []
    assert len(loop.admission.acquired) == len(loop.admission.finished)
    assert not loop.is_running
    loop.check_health()


def test_check_health_reports_a_stale_heartbeat_while_running():
    now = [1000.0]
    engine = FakeEngine()
    engine.gate = asyncio.Event()

    async def scenario():
        loop = make_loop(engine=engine, wall_clock=lambda: now[0])
        task = asyncio.create_task(loop.run())
        await engine.wait_inflight(1)
        loop.check_health(stale_after_s=300)
        now[0] += 301
        with pytest.raises(RuntimeError, match="hung"):
            loop.check_health(stale_after_s=300)
        await loop.stop()
        await task

    asyncio.run(scenario())


# ---- metrics ----------------------------------------------------------------------------------------------


def test_metrics_follow_the_spec_names_and_shapes():
    pushed = []
    loop = make_loop(num_rows=3, metrics_callback=pushed.extend)
    asyncio.run(loop.run())
    keys = {key for key, _ in pushed}
    expected = {
        "rollout/concurrency",
        "rollout/generated_tokens_per_s",
        "rollout/duration_s",
        "rollout/score_s",
        "rollout/backpressure_s",
        "rollout/samples_per_rollout",
        "completions/mean_length",
        "completions/max_length",
        "completions/min_length",
        "completions/clipped_ratio",
        "completions/duplicate_frac",
        "rollout/concurrency_cap",
        "rollout/vllm_kv_cache_usage_frac",
        "frac_zero_std_groups",
    }
    assert expected <= keys
    rates = {"rollout/generated_tokens_per_s", "completions/mean_length", "completions/clipped_ratio"}
    assert all(isinstance(value, tuple) for key, value in pushed if key in rates)
    lengths = [value for key, value in pushed if key == "completions/max_length"]
    assert len(lengths) == 12 and 1 <= min(lengths) and max(lengths) <= 6
    generated = sum(value[0] for key, value in pushed if key == "rollout/generated_tokens_per_s")
    assert generated == sum(lengths)
    assert [value for key, value in pushed if key == "rollout/backpressure_s"] == [0.25] * 3  # one per group


def test_clipped_ratio_counts_rollouts_not_ending_on_eos():
    loop = make_loop(num_rows=3)
    asyncio.run(loop.run())
    engine = loop.engines[0]
    stopped = [engine.turn(p, s).finish_reason == "stop" for p, s in engine.requests]
    assert loop.metrics.reduce()["completions/clipped_ratio"] == pytest.approx(1 - sum(stopped) / len(stopped))


def test_duplicate_frac_flags_deterministic_sampling():
    loop = make_loop(num_rows=2, engine=FakeEngine(ignore_seed=True))
    asyncio.run(loop.run())
    assert loop.metrics.reduce()["completions/duplicate_frac"] == pytest.approx(3 / 4)


# ---- sequences from turns ---------------------------------------------------------------------------------


def test_sequences_from_turn_records_have_masks_and_padded_top_k():
    turn = TurnRecord(
        prompt_ids=[1, 2, 3],
        output_ids=[10, 11, 12],
        output_log_probs=[-0.1, -0.2, -0.3],
        output_mask=[1, 0, 1],
        output_sampling_mask=[[10, 20], [11], [12, 30, 31]],
        output_sampler_logprobs=[{10: -0.1, 20: -2.0, 21: -3.0, 22: -4.0}, {11: -0.2}, {30: -1.5, 12: -0.3}],
    )
    (sequence,) = build_training_sequences([turn], "r0", num_sampler_logprobs=3)
    assert sequence.rollout_id == "r0"
    assert sequence.input_ids.tolist() == [1, 2, 3, 10, 11, 12]
    assert sequence.completion_mask.tolist() == [0, 0, 0, 1, 0, 1]
    np.testing.assert_allclose(sequence.sampler_logprobs, [0, 0, 0, -0.1, 0, -0.3], rtol=1e-6)
    assert sequence.sampler_topk_ids.tolist() == [
        [-1, -1, -1],
        [-1, -1, -1],
        [-1, -1, -1],
        [10, 20, 21],  # the best 3 of 4, by log-prob
        [-1, -1, -1],  # not trained
        [12, 30, -1],  # fewer than K: padded
    ]
    assert sequence.sampler_topk_logprobs[5].tolist() == pytest.approx([-0.3, -1.5, -np.inf])
    assert np.isneginf(sequence.sampler_topk_logprobs[:3]).all()
    assert sequence.sampling_mask.tolist() == [
        [-1, -1, -1],
        [-1, -1, -1],
        [-1, -1, -1],
        [10, 20, -1],
        [-1, -1, -1],
        [12, 30, 31],
    ]


def test_sequences_from_top_logprob_arrays_equal_those_from_the_same_dicts():
    """The built-in engine's `TopLogprobs` (ranked arrays) and the same entries as dicts (vLLM's form) give the same
    training arrays: ties broken by id, -inf pads dropped, masked positions left out, several turns, K below N."""
    from rlasync.records import TopLogprobs

    rng = np.random.default_rng(0)
    turns_arrays, turns_dicts = [], []
    prompt = [1, 2]
    for turn_index, (count, n) in enumerate([(5, 4), (3, 6), (4, 4)]):
        ids = np.stack([rng.choice(50, size=n, replace=False) for _ in range(count)])
        logprobs = np.round(rng.normal(-2, 1, size=(count, n)))  # whole numbers: ties between ids
        logprobs[0, -2:] = -np.inf  # fewer than N candidates
        logprobs = -np.sort(-logprobs, axis=1)  # ranked (ties in either order)
        ids[logprobs == -np.inf] = -1
        top = TopLogprobs(ids, logprobs)
        output = [int(i) for i in ids[:, 0]]
        kwargs = dict(
            prompt_ids=list(prompt),
            output_ids=output,
            output_log_probs=[float(x) for x in logprobs[:, 0]],
            output_mask=[1 if (j + turn_index) % 3 else 0 for j in range(count)],
        )
        turns_arrays.append(TurnRecord(**kwargs, output_sampler_logprobs=top))
        turns_dicts.append(TurnRecord(**kwargs, output_sampler_logprobs=[top[j] for j in range(count)]))
        assert top == [top[j] for j in range(count)] and len(top) == count
        prompt = prompt + output + [7]
    for k in (3, 4, 6):
        (a,) = build_training_sequences(turns_arrays, "r", num_sampler_logprobs=k)
        (b,) = build_training_sequences(turns_dicts, "r", num_sampler_logprobs=k)
        assert a.sampler_topk_ids.tolist() == b.sampler_topk_ids.tolist()
        np.testing.assert_array_equal(a.sampler_topk_logprobs, b.sampler_topk_logprobs)
        assert a.input_ids.tolist() == b.input_ids.tolist()


def test_sequences_without_sampler_extras_leave_them_out():
    turn = TurnRecord([1, 2], [10, 11], [-0.5, -0.6])
    (sequence,) = build_training_sequences([turn], "r", num_sampler_logprobs=8)
    assert sequence.sampler_topk_ids is None and sequence.sampling_mask is None
    assert build_training_sequences([TurnRecord([1], [10], [-0.1], output_mask=[0])], "r") == []
    with pytest.raises(ValueError, match="output_log_probs"):
        build_training_sequences([TurnRecord([1], [10, 11])], "r")


def test_a_turn_that_extends_the_held_tokens_continues_the_sequence_and_any_other_forks():
    first = TurnRecord([1, 2, 3], [10, 11], [-0.1, -0.2])
    clean = TurnRecord([1, 2, 3, 10, 11, 20, 21], [30, 31], [-0.3, -0.4])
    (sequence,) = build_training_sequences([first, clean], "r")
    assert sequence.input_ids.tolist() == [1, 2, 3, 10, 11, 20, 21, 30, 31]
    assert sequence.completion_mask.tolist() == [0, 0, 0, 1, 1, 0, 0, 1, 1]
    drifted = TurnRecord([1, 2, 3, 99, 88], [30], [-0.5])
    forked = build_training_sequences([first, drifted], "r")
    assert [s.input_ids.tolist() for s in forked] == [[1, 2, 3, 10, 11], [1, 2, 3, 99, 88, 30]]
    assert forked[1].completion_mask.tolist() == [0, 0, 0, 0, 0, 1]


# ---- admission --------------------------------------------------------------------------------------------


def test_the_token_allowance_plugs_in_as_admission_and_balances():
    from rlasync.pipeline import TokenAllowance

    allowance = TokenAllowance(max_staleness=1, tokens_per_step=10**6)
    started_while_busy = []
    original = allowance.start_group

    def start_group(num_rollouts):
        started_while_busy.append(allowance.inflight_groups)
        original(num_rollouts)

    allowance.start_group = start_group
    loop = make_loop(num_rows=5, admission=allowance, reward_funcs=[lambda completions, **k: [0, 1, 2, 3]])
    asyncio.run(loop.run())
    assert scored_group_ids(loop) == list(range(5))
    assert started_while_busy[0] == 0  # cold start: the first group alone
    assert allowance.inflight_groups == 0 and allowance.inflight_rollouts == 0
    assert allowance.queued_tokens == sum(result.num_tokens for result in loop.sink.results)
    assert allowance.completed_groups == 5


def test_a_closed_allowance_holds_new_groups_back_until_tokens_are_consumed():
    from rlasync.pipeline import TokenAllowance

    allowance = TokenAllowance(max_staleness=1, tokens_per_step=1)  # the first group fills it

    async def scenario():
        loop = make_loop(num_rows=3, admission=allowance, reward_funcs=[lambda completions, **k: [0, 1, 2, 3]])
        task = asyncio.create_task(loop.run())
        for _ in range(1000):  # event-loop turns, not time
            await asyncio.sleep(0)
        assert len(loop.sink.results) == 1
        assert len(loop.prompt_source.leased) == 1  # held: queued tokens >= allowance
        allowance.set_tokens_per_step(10**6)
        await task
        return loop

    loop = asyncio.run(scenario())
    assert scored_group_ids(loop) == [0, 1, 2]


def test_a_prompt_source_that_gates_reports_its_wait_as_backpressure():
    class GatingSource(FakePromptSource):
        def lease(self):
            lease = super().lease()
            return None if lease is None else lease._replace(waited_s=1.5)

    loop = make_loop(num_rows=2, prompt_source=GatingSource(rows(2)))
    asyncio.run(loop.run())
    assert loop.metrics.reduce()["rollout/backpressure_s"] == 1.75  # the admission's 0.25 plus the source's 1.5


def test_a_remote_reward_scorer_gives_the_same_groups_as_scoring_in_the_loop():
    """With `reward_scorer` (a RewardActor pool in the trainer) the reward functions run there; advantages,
    drops, samples and metrics come out exactly as when the loop calls them itself."""
    from rlasync.rewards import call_reward_funcs

    calls = []

    async def remote(*, prompts, completions, completion_ids, reward_kwargs):
        calls.append(len(completions))
        return await call_reward_funcs(
            [parity_reward],
            prompts=prompts,
            completions=completions,
            completion_ids=completion_ids,
            reward_kwargs=reward_kwargs,
        )

    local, remote_loop = make_loop(), make_loop(reward_scorer=remote)
    asyncio.run(local.run())
    asyncio.run(remote_loop.run())
    assert calls == [4] * 6
    for a, b in zip(local.sink.results, remote_loop.sink.results):
        assert a.group_id == b.group_id and a.dropped == b.dropped
        np.testing.assert_array_equal(a.scored.rewards, b.scored.rewards)
        np.testing.assert_array_equal(a.scored.advantages, b.scored.advantages)
        assert [s.metrics for s in a.scored.samples] == [s.metrics for s in b.scored.samples]
    assert local.metrics.reduce().keys() == remote_loop.metrics.reduce().keys()


def length_reward(completion_ids, **kwargs):
    return [float(len(ids)) if ids[0] % 3 else None for ids in completion_ids]


def test_reward_weights_reach_the_loop_and_a_remote_scorer_weighs_the_same():
    """`reward_weights` of the config weigh the reward functions' columns, in the loop and through a
    `reward_scorer` alike: each group's rewards are the weighted nansum of its table (TRL's formula)."""
    from rlasync.rewards import call_reward_funcs

    funcs = [parity_reward, length_reward]

    async def remote(*, prompts, completions, completion_ids, reward_kwargs):
        return await call_reward_funcs(
            funcs, prompts=prompts, completions=completions, completion_ids=completion_ids, reward_kwargs=reward_kwargs
        )

    weights = [3.0, -0.5]
    local = make_loop(reward_funcs=funcs, args=config(reward_weights=weights))
    remote_loop = make_loop(reward_funcs=funcs, args=config(reward_weights=weights), reward_scorer=remote)
    asyncio.run(local.run())
    asyncio.run(remote_loop.run())
    assert len(local.sink.results) == len(remote_loop.sink.results) == 6
    for a, b in zip(local.sink.results, remote_loop.sink.results):
        values = a.scored.reward_table.values
        weighted = values * np.array(weights)[:, None]
        expected = np.where(np.isnan(values).all(axis=0), np.nan, np.nansum(weighted, axis=0))
        np.testing.assert_allclose(a.scored.rewards, expected)
        np.testing.assert_array_equal(a.scored.rewards, b.scored.rewards)
        np.testing.assert_array_equal(a.scored.advantages, b.scored.advantages)
    with pytest.raises(ValueError, match=r"reward_weights has 1 weight\(s\) \[2.0\] for 2 reward function"):
        make_loop(reward_funcs=funcs, args=config(reward_weights=[2.0]))


# ---- the config -------------------------------------------------------------------------------------------


def test_hooks_read_the_users_config_subclass_and_args_is_its_old_name():
    import dataclasses

    @dataclasses.dataclass
    class MyConfig(AsyncGRPOConfig):
        keep_row: int = 1

    class KeepOneRow(AsyncRolloutLoop):
        def filter_prompt(self, row_index, row, epoch):
            return row_index == self.config.keep_row and self.args is self.config

    loop = make_loop(KeepOneRow, num_rows=3, args=MyConfig(**{**vars(config()), "keep_row": 2}))
    asyncio.run(loop.run())
    assert scored_group_ids(loop) == [2]
    old_name = AsyncRolloutLoop(
        args=config(),
        tokenizer=FakeTokenizer(),
        engine=FakeEngine(),
        prompt_source=FakePromptSource(rows(1)),
        sink=ListSink(),
        reward_funcs=[parity_reward],
    )
    assert old_name.config is old_name.args and old_name.settings.group_size == 4
    with pytest.raises(TypeError, match="config="):
        AsyncRolloutLoop(tokenizer=FakeTokenizer(), engine=FakeEngine(), prompt_source=None, sink=None)


def test_a_class_level_attempts_override_reaches_the_engine_pool():
    class FewAttempts(AsyncRolloutLoop):
        max_generation_attempts = 2

    assert make_loop(FewAttempts).engine_pool.max_attempts == 2
    assert make_loop().max_generation_attempts == 30


def test_a_groups_prompt_is_rendered_once_and_every_rollout_gets_the_same_ids():
    calls = []

    class CountingTokenizer(FakeTokenizer):
        def apply_chat_template(self, messages, **kwargs):
            calls.append(messages[-1]["content"])
            return super().apply_chat_template(messages, **kwargs)

    loop = AsyncRolloutLoop(
        config=config(),
        tokenizer=CountingTokenizer(),
        engine=FakeEngine(),
        prompt_source=FakePromptSource(rows(3)),
        sink=ListSink(),
        reward_funcs=[parity_reward],
        rng=random.Random(0),
        admission=RecordingAdmission(),
    )
    asyncio.run(loop.run())
    assert sorted(calls) == ["q0", "q1", "q2"]  # one rendering per group, not one per rollout
    prompts = collections.defaultdict(set)
    for prompt_ids, _ in loop.engines[0].requests:
        prompts[len(prompt_ids)].add(tuple(prompt_ids))
    expected = {
        tuple(FakeTokenizer().apply_chat_template(r["prompt"], add_generation_prompt=True)["input_ids"])
        for r in rows(3)
    }
    assert set().union(*prompts.values()) == expected
    ids = loop.render([{"role": "user", "content": "q0"}])
    ids.append(999)  # a caller mutating its ids does not change the cached rendering
    assert 999 not in loop.render([{"role": "user", "content": "q0"}])
