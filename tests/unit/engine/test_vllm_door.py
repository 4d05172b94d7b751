"""vLLM's sync door without vLLM: a fake worker whose `execute_model` a thread calls as vLLM's EngineCore would. A
load sent through the door lands between two steps (never inside one), is answered once applied, an idle worker
applies it on the nudge (even a nudge that overtook its load), a failed load is answered as failed, and the
engine's `direct_sync` path goes through the door from the sync thread while the front end only gets the nudge and
the prefix cache reset."""

import asyncio
import concurrent.futures
import queue
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from rlasync.engine.vllm_door import DoorClient, SyncDoor, install_door, remove_door
from rlasync.engine.vllm_worker import WorkerExtension, flat_buckets
from tests.unit.engine.test_vllm_engine import WEIGHTS, FakeLLM, FakeModel, FakeVLLMEngine


class SteppingWorker(WorkerExtension):
    """A worker with vLLM's `execute_model` entry point: a step copies the model's weights into its output (so a
    step that saw a load land halfway would show a mix), slowly enough for loads to arrive mid-step."""

    def __init__(self, step_s=0.002):
        self.model_runner = SimpleNamespace(model=FakeModel())
        self.rank, self.step_s = 0, step_s
        self.in_step = False
        self.seen = []

    def execute_model(self, scheduler_output):
        self.in_step = True
        model = self.model_runner.model
        first = model.a.detach().clone()
        time.sleep(self.step_s)
        self.seen.append((scheduler_output, torch.equal(first, model.a)))
        self.in_step = False
        return scheduler_output

    def load_flat_ipc(self, key, buckets, done_event=None):
        assert not self.in_step, "a load ran inside a step"
        return super().load_flat_ipc(key, buckets, done_event)


class StepLoop:
    """vLLM's EngineCore busy loop, reduced: one thread runs the utility calls queued for the worker (between
    steps, or as they come when idle) and, while `running`, calls the worker's `execute_model` (looked up on the
    instance each time, as vLLM's wrapper does)."""

    def __init__(self, worker):
        self.worker, self.running, self.steps = worker, threading.Event(), 0
        self.calls = queue.Queue()
        self.stop = False
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def call(self, method, args):
        future = concurrent.futures.Future()
        self.calls.put((method, args, future))
        return future

    def _loop(self):
        while not self.stop:
            try:
                while True:
                    method, args, future = self.calls.get(timeout=0 if self.running.is_set() else 0.01)
                    try:
                        future.set_result(getattr(self.worker, method)(*args))
                    except Exception as exc:  # noqa: BLE001
                        future.set_exception(exc)
            except queue.Empty:
                pass
            if self.running.is_set():
                self.steps += 1
                self.worker.execute_model(self.steps)


@pytest.fixture
def shared():
    from rlasync.weights.ipc import SharedWeights
    from rlasync.weights.plan import ManifestEntry

    manifest = [ManifestEntry(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in WEIGHTS.items()]
    weights = SharedWeights.pack(WEIGHTS.items(), manifest, "cpu")
    weights.manifest = manifest
    yield weights
    weights.release()


def versions(n):
    return [{"a": WEIGHTS["a"] * (i + 2), "b": WEIGHTS["b"] * (-1) ** i} for i in range(n)]


def test_messages_round_trip_and_a_closed_peer_reads_as_none():
    import socket

    from rlasync.engine.vllm_door import recv_message, send_message

    left, right = socket.socketpair()
    sender = threading.Thread(target=send_message, args=(left, {"seq": 3, "blob": b"x" * 3_000_000}))
    sender.start()  # larger than the socket's buffer: received in pieces
    assert recv_message(right) == {"seq": 3, "blob": b"x" * 3_000_000}
    sender.join()
    left.close()
    assert recv_message(right) is None
    right.close()


def test_loads_through_the_door_land_between_steps_and_are_answered(shared):
    worker = SteppingWorker()
    path = worker.open_sync_door()
    assert worker.open_sync_door() == path  # once
    loop = StepLoop(worker)
    loop.running.set()
    client = DoorClient(path, timeout_s=10)
    model = worker.model_runner.model
    applied = []
    try:
        for weights in versions(5):
            shared.fill(weights.items(), shared.manifest)
            seq = client.send_load(shared.key, flat_buckets(shared.handles()))
            answer = client.wait(seq)
            applied.append(answer["applied_by"])
            assert answer["ok"] and answer["seq"] == seq and answer["applied_by"] == "step"
            assert answer["result"]["how"] in ("recorded", "replayed") and answer["waited_s"] >= 0
            assert torch.equal(model.a, weights["a"]) and torch.equal(model.b, weights["b"])
    finally:
        loop.stop = True
        loop.thread.join()
    assert all(unchanged for _, unchanged in worker.seen)  # no step saw weights change under it
    assert applied == ["step"] * 5  # every load at a step, none on a nudge
    worker.close_sync_door()
    assert "execute_model" not in worker.__dict__ and worker.apply_sync_door(1) == 0
    client.close()


def test_an_idle_worker_applies_a_load_on_the_nudge_even_one_that_overtook_it(shared):
    worker = SteppingWorker()
    client = DoorClient(worker.open_sync_door(), timeout_s=10)
    model = worker.model_runner.model
    (weights,) = versions(1)
    shared.fill(weights.items(), shared.manifest)
    nudged = []
    nudge = threading.Thread(target=lambda: nudged.append(worker.apply_sync_door(1, 10.0)))
    nudge.start()  # before the load is even sent: it waits for load 1 to arrive
    time.sleep(0.05)
    seq = client.send_load(shared.key, flat_buckets(shared.handles()))
    answer = client.wait(seq)
    nudge.join()
    assert seq == 1 and nudged == [1] and answer["ok"] and answer["applied_by"] == "nudge"
    assert torch.equal(model.a, weights["a"])
    assert worker.apply_sync_door(1, 0.0) == 0  # nothing pending: a late nudge finds nothing
    worker.close_sync_door()
    client.close()


def test_a_failed_load_is_answered_as_failed_and_the_door_keeps_serving():
    calls = []

    def apply(request):
        calls.append(request["seq"])
        if request["seq"] == 1:
            raise RuntimeError("cannot map")
        return {"seconds": 0.0}

    door = SyncDoor(apply)
    client = DoorClient(door.path, timeout_s=10)
    first = client.send_load("k", [])
    assert door.wait_received(first, 5.0) and door.apply_pending("nudge") == 1
    answer = client.wait(first)
    assert not answer["ok"] and "RuntimeError: cannot map" in answer["error"]
    second = client.send_load("k", [])
    assert door.wait_received(second, 5.0) and door.apply_pending("step") == 1
    assert client.wait(second)["ok"] and calls == [1, 2]
    door.close()
    client.close()


def test_a_worker_that_never_applies_is_a_timeout_not_a_hang():
    door = SyncDoor(lambda request: {})
    client = DoorClient(door.path, timeout_s=0.2)
    seq = client.send_load("k", [])
    with pytest.raises(TimeoutError, match="did not apply"):
        client.wait(seq)
    door.close()


def test_the_step_wrapper_is_on_the_instance_and_comes_off():
    worker = SteppingWorker()
    door = install_door(worker, lambda request: {})
    assert worker.execute_model(7) == 7 and worker.seen[-1][0] == 7
    remove_door(worker, door)
    assert worker.execute_model.__func__ is SteppingWorker.execute_model


# ---- the engine's side: VLLMEngine(direct_sync=True) ------------------------------------------------------------------


class DoorLLM(FakeLLM):
    """A fake AsyncLLM whose collective_rpc runs on the fake EngineCore's thread (`StepLoop`), between steps."""

    steps = None

    async def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
        if self.steps is None:
            return await super().collective_rpc(method, timeout, args, kwargs)
        self.calls.append(("rpc", method, timeout))
        return [await asyncio.wrap_future(self.steps.call(method, args))]


class DoorEngine(FakeVLLMEngine):
    def _build(self, args):
        self.vllm_version = "0.25.0"
        return DoorLLM(SteppingWorker(), args)


def engine_loop():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    return loop, thread


def on(loop, coro):
    return asyncio.run_coroutine_threadsafe(coro, loop).result(10)


@pytest.mark.parametrize("stepping", [True, False], ids=["stepping", "idle"])
def test_direct_sync_goes_through_the_door_and_the_front_end_gets_only_the_nudge_and_the_reset(shared, stepping):
    from rlasync.weights.ipc import MappedWeights

    engine = DoorEngine("m", direct_sync=True)
    llm, worker = engine._llm, engine._llm.worker
    assert engine.sync_without_pause and not engine.loads_between_steps  # until the door opens
    loop, thread = engine_loop()
    steps = llm.steps = StepLoop(worker)
    try:
        on(loop, engine.open_loads_between_steps())
        assert engine.loads_between_steps and engine.copy_event_handles
        if stepping:
            steps.running.set()
        for weights in versions(3):
            shared.fill(weights.items(), shared.manifest)
            result = engine.load_between_steps(MappedWeights(shared.key, shared.handles()))  # the sync thread
            assert result["wait_s"] >= 0 and result["load_s"] >= 0
            assert torch.equal(worker.model_runner.model.a, weights["a"])
        deadline = time.time() + 5
        while len([c for c in llm.calls if c[0] == "reset"]) < 3 and time.time() < deadline:
            time.sleep(0.01)
    finally:
        steps.stop = True
        steps.thread.join()
    names = [c[1] if c[0] == "rpc" else c[0] for c in llm.calls]
    assert names.count("open_sync_door") == 1 and names.count("apply_sync_door") == 3
    assert names.count("reset") == 3 and "load_flat_ipc" not in names and "pause" not in names
    assert ("reset", True, True) in llm.calls
    assert sum(engine.door_counts.get(k, 0) for k in ("step", "nudge")) == 3
    if not stepping:
        assert engine.door_counts == {"nudge": 3} and engine.stats().extra["sync_door_nudge"] == 3.0
    on(loop, engine.close())
    loop.call_soon_threadsafe(loop.stop)
    thread.join()
    assert engine._door is None


def test_direct_sync_sends_what_the_door_cannot_take_through_the_front_end(shared):
    """One-off buckets (no key) and a door that broke: pause, load_weights, resume on the engine's loop; the
    weights still arrive."""
    from rlasync.weights.ipc import MappedWeights

    engine = DoorEngine("m", direct_sync=True)
    llm, model = engine._llm, engine._llm.worker.model_runner.model
    loop, thread = engine_loop()
    on(loop, engine.open_loads_between_steps())
    (weights,) = versions(1)
    shared.fill(weights.items(), shared.manifest)
    engine.load_between_steps(MappedWeights("", shared.handles()))
    assert torch.equal(model.a, weights["a"]) and "apply_sync_door" not in [c[1] for c in llm.calls if c[0] == "rpc"]
    assert [c[0] for c in llm.calls if c[0] in ("pause", "resume")] == ["pause", "resume"]  # per tensor: held

    engine._door.close()
    engine._door.path = "/nonexistent/door.sock"  # the worker's door is gone
    shared.fill(WEIGHTS.items(), shared.manifest)
    engine.load_between_steps(MappedWeights(shared.key, shared.handles()))
    assert engine._door is None and torch.equal(model.a, WEIGHTS["a"])
    assert not engine.loads_between_steps
    on(loop, engine.close())
    loop.call_soon_threadsafe(loop.stop)
    thread.join()


def test_direct_sync_keeps_the_front_end_for_several_workers():
    engine = DoorEngine("m", direct_sync=True)
    worker = engine._llm.worker

    async def two_workers(method, timeout=None, args=(), kwargs=None):
        engine._llm.calls.append(("rpc", method, timeout))
        return [getattr(worker, method)(*args)] * 2

    engine._llm.collective_rpc = two_workers

    async def go():
        await engine.open_loads_between_steps()

    asyncio.run(go())
    assert not engine.loads_between_steps
    assert [c[1] for c in engine._llm.calls] == ["open_sync_door", "close_sync_door"]
    assert "execute_model" not in worker.__dict__
    assert not DoorEngine("m").loads_between_steps


def test_the_ipc_receiver_hands_vllm_the_raw_event_handle_and_opens_the_door():
    from rlasync.weights.transport import IpcReceiver

    ticket = SimpleNamespace(done_events=(b"e1", b"e2"), done_event=lambda rank, device: pytest.fail("opened"))
    receiver = IpcReceiver([], between_steps=True, rank=2, device="cuda")
    assert receiver._done_event(SimpleNamespace(copy_event_handles=True), ticket) == b"e2"
    assert IpcReceiver([], rank=3, device="cuda")._done_event(SimpleNamespace(copy_event_handles=True), ticket) is None
    cpu = IpcReceiver([], rank=1, device="cpu")
    assert cpu._done_event(SimpleNamespace(copy_event_handles=True), ticket) is None


def test_an_ipc_transport_to_a_direct_sync_engine_loads_through_the_door_without_a_pause():
    """The generation actor's path: `make_receiver` (on the engine's loop) opens the door, so the IPC receiver
    loads between steps (no early pause); a sync from learner rank 0's persistent buckets, run inline on the sync
    thread, reaches the worker through the door (an idle worker: on the nudge), twice with the same buckets."""
    from rlasync.weights import build_manifest, stream_parameters
    from rlasync.weights.transport import IpcReceiver, choose_transport, make_receiver, make_sender

    learner = FakeModel()
    manifest = build_manifest(learner)
    cpu = {"device": "cpu", "node": "n0", "gpu": None}
    plan, _ = choose_transport(cpu, [cpu], "ipc", host="127.0.0.1", port=1234, timeout_s=30.0, bucket_bytes=1 << 20)
    sender = make_sender(plan, "cpu", manifest=manifest)
    engine = DoorEngine("m", direct_sync=True)
    llm, worker = engine._llm, engine._llm.worker
    loop, thread = engine_loop()
    try:
        receiver = on(loop, make_receiver(plan, 1, manifest, engine, "cpu"))
        assert isinstance(receiver, IpcReceiver) and receiver.between_steps and not receiver.pauses_early
        for scale in (2.0, -3.0):
            with torch.no_grad():
                learner.a.copy_(WEIGHTS["a"] * scale)
                learner.b.copy_(WEIGHTS["b"] * scale)
            ticket = sender.prepare(stream_parameters(learner))
            phases = asyncio.run(receiver.load_into(engine, ticket, inline=True))  # this thread: the sync thread
            assert torch.equal(worker.model_runner.model.a, learner.a) and torch.equal(
                worker.model_runner.model.b, learner.b
            )
            assert phases["resume_s"] == 0.0 and phases["total_s"] >= phases["load_s"] >= 0
            sender.finish()
    finally:
        sender.close()
        on(loop, engine.close())
        loop.call_soon_threadsafe(loop.stop)
        thread.join()
    names = [c[1] if c[0] == "rpc" else c[0] for c in llm.calls]
    assert "pause" not in names and "load_flat_ipc" not in names and names.count("apply_sync_door") == 2
    assert engine.door_counts.get("nudge") == 2
