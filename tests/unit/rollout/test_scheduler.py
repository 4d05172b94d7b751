"""TaskScheduler with fakes only (a prompt source, an admission, a sink and a trivial policy): N tasks per lease,
group failures, cancellation, the concurrency cap and a bounded stop. Milliseconds: no engine, no tokenizer."""

import asyncio

import pytest

from rlasync.records import GroupOutcome, PromptLease
from rlasync.rollout.protocols import Collected
from rlasync.rollout.scheduler import TaskScheduler


class Rejected(Exception):
    """The trivial policy's group failure."""


class Source:
    def __init__(self, num_prompts):
        self.num_prompts = num_prompts
        self.leased = []
        self.released = []

    def lease(self):
        if len(self.leased) >= self.num_prompts:
            return None
        lease = PromptLease(len(self.leased), len(self.leased), {"n": len(self.leased)})
        self.leased.append(lease)
        return lease

    async def release(self, lease, reason):
        self.released.append((lease.group_id, reason))


class Admission:
    def __init__(self):
        self.acquired = self.finished = self.cancelled = 0

    async def acquire(self, num_rollouts):
        self.acquired += 1
        return 0.0

    def finish_group(self, num_rollouts, num_tokens, queued=True):
        self.finished += 1

    def cancel_group(self, num_rollouts):
        self.cancelled += 1


class Sink:
    def __init__(self):
        self.items = []

    async def put(self, item):
        self.items.append(item)


class Policy:
    """Each task returns `(group_id, index)` after `yields` event-loop turns (or waits on `gate`); `fail(group_id,
    index)` picks the tasks that raise `Rejected` (a group failure) and `crash` the ones that raise KeyError."""

    hand_over_holds_slots = False
    failure_metric = "test/failed"

    def __init__(self, yields=1):
        self.yields = yields
        self.gate = None
        self.fail = lambda group_id, index: False
        self.crash = lambda group_id, index: False
        self.inflight = self.max_inflight = 0
        self.cancelled = 0
        self.metrics = []
        self.versions = []

    async def setup(self):
        pass

    async def close(self):
        pass

    def after_close(self):
        pass

    async def admit(self, lease, waited_s):
        return None if lease.row.get("skip") else lease

    async def run_task(self, lease, index, policy_version):
        self.inflight += 1
        self.max_inflight = max(self.max_inflight, self.inflight)
        self.versions.append((lease.group_id, policy_version))
        try:
            if self.gate is not None:
                await self.gate.wait()
            for _ in range(self.yields):
                await asyncio.sleep(0)
            if self.fail(lease.group_id, index):
                raise Rejected(f"task {index} of group {lease.group_id}")
            if self.crash(lease.group_id, index):
                raise KeyError("a bug")
            return (lease.group_id, index)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.inflight -= 1

    def record(self, lease, index, result):
        pass

    async def collect(self, lease, results, policy_version):
        return Collected(results, True, len(results))

    def handed_over(self, lease, collected, put_s, num_inflight):
        pass

    def is_group_failure(self, error):
        return isinstance(error, Rejected)

    def emit(self, items):
        self.metrics += items


def scheduler(policy=None, num_prompts=3, group_size=4, max_concurrent=8, **kwargs):
    return TaskScheduler(
        policy or Policy(),
        prompt_source=Source(num_prompts),
        sink=Sink(),
        group_size=group_size,
        max_concurrent=max_concurrent,
        admission=kwargs.pop("admission", None) or Admission(),
        **kwargs,
    )


def run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, timeout=5))


@pytest.mark.parametrize("group_size", [1, 4])
def test_each_lease_runs_n_tasks_and_hands_over_their_results_once(group_size):
    s = scheduler(group_size=group_size)
    run(s.run())
    assert sorted(tuple(item) for item in s.sink.items) == [tuple((g, i) for i in range(group_size)) for g in range(3)]
    assert s.prompt_source.released == []
    assert (s.admission.acquired, s.admission.finished, s.admission.cancelled) == (4, 3, 1)  # + the empty lease
    assert s.counters["tasks_completed"] == 3 * group_size and not s.is_running


def test_a_failed_task_fails_its_group_cancels_its_siblings_and_releases_the_lease_as_failed():
    policy = Policy(yields=3)
    policy.fail = lambda group_id, index: group_id == 1 and index == 0
    s = scheduler(policy)
    run(s.run())
    assert [item[0][0] for item in s.sink.items] == [0, 2]
    assert s.prompt_source.released == [(1, GroupOutcome.FAILED)]
    assert s.prompt_source.released[0][1] == "failed"  # the enum is a str
    assert s.counters["groups_failed"] == 1 and ("test/failed", 1.0) in policy.metrics
    assert s.admission.acquired == s.admission.finished + s.admission.cancelled
    s.check_health()  # a failed group is reported, not fatal


def test_any_other_error_stops_the_scheduler_and_releases_what_was_leased():
    policy = Policy()
    policy.crash = lambda group_id, index: group_id == 1
    s = scheduler(policy)
    with pytest.raises(KeyError):
        run(s.run())
    with pytest.raises(RuntimeError, match="failed: KeyError") as info:
        s.check_health()
    assert isinstance(info.value.__cause__, KeyError)
    handed = {item[0][0] for item in s.sink.items}
    assert {gid for gid, _ in s.prompt_source.released} == {lease.group_id for lease in s.prompt_source.leased} - handed
    assert {reason for _, reason in s.prompt_source.released} <= {GroupOutcome.CANCELLED}


def test_filtered_leases_are_released_as_filtered_and_counted():
    s = scheduler()
    s.prompt_source.lease = lambda: _lease_with(s.prompt_source, skip=len(s.prompt_source.leased) == 1)
    run(s.run())
    assert s.prompt_source.released == [(1, GroupOutcome.FILTERED)]
    assert s.counters["prompts_filtered"] == 1 and len(s.sink.items) == 2


def _lease_with(source, **row):
    lease = Source.lease(source)
    return None if lease is None else lease._replace(row=row)


@pytest.mark.parametrize(("max_concurrent", "group_size"), [(1, 4), (3, 4), (5, 2)])
def test_tasks_in_flight_never_exceed_the_cap(max_concurrent, group_size):
    policy = Policy()

    async def scenario():
        policy.gate = asyncio.Event()
        s = scheduler(policy, num_prompts=5, group_size=group_size, max_concurrent=max_concurrent)
        task = asyncio.create_task(s.run())
        for _ in range(200):  # event-loop turns: every slot fills, no more
            await asyncio.sleep(0)
        assert policy.inflight == max_concurrent == s.num_inflight
        policy.gate.set()
        await task
        return s

    s = run(scenario())
    assert policy.max_inflight == max_concurrent
    assert len(s.sink.items) == 5


def test_hand_overs_hold_slots_when_the_policy_says_so():
    class BlockingSink(Sink):
        async def put(self, item):
            await asyncio.Event().wait()  # the queue is full for good

    async def scenario(holds):
        policy = Policy()
        policy.hand_over_holds_slots = holds
        s = scheduler(policy, num_prompts=6, group_size=1, max_concurrent=2)
        s.sink = BlockingSink()
        task = asyncio.create_task(s.run())
        for _ in range(100):
            await asyncio.sleep(0)
        started = len(policy.versions)
        await s.stop()
        await task
        return started

    assert run(scenario(True)) == 2  # two samples wait in put: nothing more is generated
    assert run(scenario(False)) == 6  # put backlog does not hold generation back (up to max_pending_groups)


def test_a_group_keeps_the_policy_version_of_its_first_dispatch():
    policy = Policy()
    s = scheduler(policy, num_prompts=2, group_size=3, max_concurrent=1)
    original = policy.run_task

    async def bump_then_run(lease, index, version):
        s.policy_version += 1
        return await original(lease, index, version)

    policy.run_task = bump_then_run
    run(s.run())
    assert policy.versions == [(0, 0)] * 3 + [(1, 3)] * 3


def test_stop_cancels_everything_releases_the_leases_and_returns_promptly():
    policy = Policy()
    policy.gate = asyncio.Event()  # never opens

    async def scenario():
        s = scheduler(policy, num_prompts=10, group_size=2, max_concurrent=4)
        task = asyncio.create_task(s.run())
        while policy.inflight < 4:
            await asyncio.sleep(0)
        assert s.is_running and s.num_inflight == 4
        await asyncio.wait_for(s.stop(), timeout=1)
        assert task.done() and task.exception() is None
        return s

    s = run(scenario())
    assert policy.cancelled == 4 and policy.inflight == 0
    assert sorted(s.prompt_source.released) == [(0, GroupOutcome.CANCELLED), (1, GroupOutcome.CANCELLED)]
    assert s.sink.items == [] and not s.is_running
    assert s.admission.acquired == s.admission.finished + s.admission.cancelled
    s.check_health()


def test_a_stale_heartbeat_is_reported_while_running():
    now = [100.0]
    policy = Policy()
    policy.gate = asyncio.Event()

    async def scenario():
        s = scheduler(policy, heartbeat_timeout_s=30, wall_clock=lambda: now[0])
        task = asyncio.create_task(s.run())
        while policy.inflight < 1:
            await asyncio.sleep(0)
        s.check_health()
        now[0] += 31
        with pytest.raises(RuntimeError, match="hung"):
            s.check_health()
        await s.stop()
        await task

    run(scenario())


def test_run_twice_at_once_is_refused():
    policy = Policy()
    policy.gate = asyncio.Event()

    async def scenario():
        s = scheduler(policy)
        task = asyncio.create_task(s.run())
        await asyncio.sleep(0)
        with pytest.raises(RuntimeError, match="already running"):
            await s.run()
        await s.stop()
        await task

    run(scenario())
