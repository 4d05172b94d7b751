"""The one weight transport: `choose_transport` for every layout (pure: device identities in, plan out), and the
paired senders/receivers with fakes: a fake engine recording pause/load/resume, gloo broadcast between two threads,
ipc on the CPU through shared memory, an engine with its own receiver, and extra learner ranks that only gather."""

import asyncio
import threading
import time

import pytest
import torch

from rlasync.weights import build_manifest, stream_parameters
from rlasync.weights.broadcast import free_port
from rlasync.weights.transport import (
    BroadcastReceiver,
    BroadcastSender,
    EngineNativeReceiver,
    GatherOnlySender,
    IpcReceiver,
    IpcSender,
    TransportPlan,
    choose_transport,
    make_receiver,
    make_sender,
)


def gpu(node="n0", uuid="GPU-a"):
    return {"device": "cuda", "node": node, "gpu": uuid}


CPU = {"device": "cpu", "node": "n0", "gpu": None}
WHERE = dict(host="127.0.0.1", port=1234, timeout_s=30.0, bucket_bytes=1 << 20, staging_bytes=4096)


def kind(sender, receivers, requested="auto"):
    plan, reason = choose_transport(sender, receivers, requested, **WHERE)
    return plan.kind, reason


def test_each_engine_on_its_own_gpu_is_nccl():
    assert kind(gpu(uuid="a"), [gpu(uuid="b"), gpu(uuid="c")]) == ("nccl", None)
    assert kind(gpu(uuid="a"), [gpu(node="n1", uuid="a")]) == ("nccl", None)  # same GPU id, other host
    assert kind(gpu(uuid="a"), [gpu(uuid="b")], "nccl") == ("nccl", None)


def test_one_shared_gpu_is_ipc_and_a_mixed_layout_is_gloo():
    assert kind(gpu(uuid="a"), [gpu(uuid="a")]) == ("ipc", None)  # learner and engine on one GPU
    assert kind(gpu(uuid="a"), [gpu(uuid="a"), gpu(uuid="a")]) == ("ipc", None)
    assert kind(gpu(uuid="a"), [gpu(uuid="a"), gpu(uuid="a")], "ipc") == ("ipc", None)
    plan_kind, reason = kind(gpu(uuid="a"), [gpu(uuid="a"), gpu(uuid="b")])  # one engine shares, one does not
    assert plan_kind == "gloo" and "distinct GPU per rank" in reason and "one GPU for all" in reason
    plan_kind, _ = kind(gpu(uuid="a"), [gpu(uuid="b"), gpu(uuid="b")])  # two engines share one GPU
    assert plan_kind == "gloo"
    assert kind(gpu(uuid="a"), [gpu(uuid="a")], "gloo") == ("gloo", None)  # an explicit request wins


def test_cpu_is_gloo_and_gloo_is_always_honoured():
    assert kind(CPU, [CPU]) == ("gloo", None)
    plan_kind, reason = kind(gpu(), [CPU])
    assert plan_kind == "gloo" and "no GPU" in reason
    assert kind(gpu(uuid="a"), [gpu(uuid="b")], "gloo") == ("gloo", None)
    assert kind(CPU, [CPU], "ipc") == ("ipc", None)  # shared memory


def test_the_plan_carries_the_layout():
    plan, _ = choose_transport(CPU, [CPU, CPU], "auto", **WHERE)
    assert plan == TransportPlan("gloo", "127.0.0.1", 1234, 3, 30.0, 1 << 20, 4096)
    ipc, _ = choose_transport(CPU, [CPU], "ipc", **WHERE)
    assert ipc.staging_bytes == 0 and ipc.world_size == 2  # nothing to stage: the engine maps the buckets


def test_bad_requests_raise_naming_the_setting():
    with pytest.raises(ValueError, match="cluster.weight_sync_backend='nccl'.*share one GPU"):
        kind(gpu(uuid="a"), [gpu(uuid="a")], "nccl")
    with pytest.raises(ValueError, match="cluster.weight_sync_backend='nccl'.*has a GPU"):
        kind(CPU, [CPU], "nccl")
    with pytest.raises(ValueError, match="cluster.weight_sync_backend='mpi'"):
        kind(CPU, [CPU], "mpi")
    with pytest.raises(ValueError, match=r"cluster.weight_sync_backend='ipc'.*engine\(s\) \[1\] are elsewhere"):
        kind(gpu(uuid="a"), [gpu(uuid="a"), gpu(uuid="b")], "ipc")
    with pytest.raises(ValueError, match="cluster.weight_sync_backend='ipc'"):
        kind(gpu(uuid="a"), [gpu(node="n1", uuid="a")], "ipc")


# ---- senders and receivers ----------------------------------------------------------------------------------


def tiny_model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


class FakeEngine:
    """Records pause/load/resume and loads named tensors into a model of the learner's shape."""

    def __init__(self, seed=1):
        self.model = tiny_model(seed)
        self.events = []

    async def pause(self):
        self.events.append("pause")

    async def resume(self):
        self.events.append("resume")

    async def load_weights(self, named_tensors):
        assert self.events[-1] == "pause"
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, tensor in named_tensors:
                params[name].copy_(tensor)
        self.events.append("load")


class SelfReceiving(FakeEngine):
    """An engine whose workers join the group and receive in place (as vLLM's)."""

    def __init__(self):
        super().__init__()
        self.joined = None
        self.received = None

    async def join_weight_group(self, host, port, rank, world_size, timeout_s, backend="gloo", bucket_bytes=None):
        self.joined = (host, port, rank, world_size, backend, bucket_bytes)

    async def receive_weights(self, manifest):
        self.received = list(manifest)
        self.events.append("receive")

    @property
    def is_paused(self):
        return bool(self.events) and self.events[-1] in ("pause", "receive")


def same_weights(a, b):
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


def sync_once(sender, receiver, engine, learner):
    """One sync as the Cluster runs it: prepare -> (send || load_into) -> finish."""
    ticket = sender.prepare(stream_parameters(learner))
    errors = []

    def send():
        try:
            sender.send(stream_parameters(learner))
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    phases = asyncio.run(receiver.load_into(engine, ticket))
    thread.join(30)
    sender.finish()
    if errors:
        raise errors[0]
    return phases


def check_phases(phases, extra=frozenset()):
    assert set(phases) == {"pause_s", "load_s", "resume_s", "total_s", *extra}
    assert all(value >= 0 for value in phases.values())


@pytest.mark.parametrize("staging_bytes", [0, 1 << 20])
def test_gloo_broadcast_between_two_threads_loads_the_learners_weights(staging_bytes):
    learner, engine = tiny_model(0), FakeEngine()
    manifest = build_manifest(learner)
    plan = TransportPlan("gloo", "127.0.0.1", free_port(), 2, 20.0, bucket_bytes=256, staging_bytes=staging_bytes)
    opened = {}
    thread = threading.Thread(target=lambda: opened.setdefault("sender", make_sender(plan, "cpu", manifest=manifest)))
    thread.start()
    receiver = asyncio.run(make_receiver(plan, 1, manifest, engine, "cpu"))
    thread.join(30)
    sender = opened["sender"]
    assert isinstance(sender, BroadcastSender) and isinstance(receiver, BroadcastReceiver)
    try:
        assert sender.prepare(stream_parameters(learner)) is None  # a broadcast hands out no ticket
        for _ in range(2):  # the group serves every sync of the run
            check_phases(sync_once(sender, receiver, engine, learner))
            assert same_weights(learner, engine.model)
            with torch.no_grad():
                next(learner.parameters()).add_(1.0)
        assert engine.events == ["pause", "load", "resume"] * 2
    finally:
        sender.close()
        receiver.close()


def test_ipc_on_the_cpu_reuses_persistent_buckets_mapped_once_until_close():
    from pathlib import Path

    learner, engine = tiny_model(0), FakeEngine()
    manifest = build_manifest(learner)
    plan, _ = choose_transport(CPU, [CPU], "ipc", **{**WHERE, "bucket_bytes": 256})
    sender = make_sender(plan, "cpu", manifest=manifest)
    receiver = asyncio.run(make_receiver(plan, 1, manifest, SelfReceiving(), "cpu"))  # ipc wins over in-place
    assert isinstance(sender, IpcSender) and isinstance(receiver, IpcReceiver)
    ticket = sender.prepare(stream_parameters(learner))
    files = [Path(handle[1]) for _, handle in ticket.handles]
    assert len(files) > 1 and all(path.exists() for path in files) and ticket.pack_s >= 0
    sender.send(stream_parameters(learner))  # nothing left to send: the engines copy from the buckets
    phases = asyncio.run(receiver.load_into(engine, ticket))
    check_phases(phases, extra={"stage_s", "pack_s"})
    assert same_weights(learner, engine.model) and engine.events == ["pause", "load", "resume"]
    sender.finish()
    assert all(path.exists() for path in files)  # persistent: the next sync refills them
    mapped = receiver.mapped
    with torch.no_grad():  # a new policy version: same buckets, same handles, new contents
        for param in learner.parameters():
            param.mul_(-2.0)
    second = sender.prepare(stream_parameters(learner))
    assert second.key == ticket.key and second.handles == ticket.handles
    asyncio.run(receiver.load_into(engine, second))
    assert receiver.mapped is mapped  # mapped once
    assert same_weights(learner, engine.model)
    sender.close()
    assert not any(path.exists() for path in files)
    with pytest.raises(RuntimeError, match="handles"):
        asyncio.run(receiver.load_into(engine, None))


class BetweenSteps(FakeEngine):
    """An engine that loads between its steps (as the built-in one): never paused for a sync."""

    loads_between_steps = True

    def load_between_steps(self, named_tensors):
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, tensor in named_tensors:
                params[name].copy_(tensor)
        self.events.append(("between", threading.current_thread() is threading.main_thread()))
        time.sleep(0.003)  # the reported parts lie within the call, as a real engine's do
        return {"wait_s": 0.001, "load_s": 0.002}


def test_ipc_into_an_engine_that_loads_between_steps_never_pauses_it():
    learner, engine = tiny_model(0), BetweenSteps()
    manifest = build_manifest(learner)
    plan, _ = choose_transport(CPU, [CPU], "ipc", **{**WHERE, "bucket_bytes": 256})
    sender = make_sender(plan, "cpu", manifest=manifest)
    receiver = asyncio.run(make_receiver(plan, 1, manifest, engine, "cpu"))
    assert isinstance(receiver, IpcReceiver) and not receiver.pauses_early  # the actor's begin_sync starts no pause
    try:
        for _ in range(2):
            phases = sync_once(sender, receiver, engine, learner)
            check_phases(phases, extra={"stage_s", "pack_s", "lock_wait_s"})
            assert phases["lock_wait_s"] == 0.001 and phases["load_s"] == 0.002 and phases["resume_s"] == 0.0
            # the phases sum to the call: pause_s is everything before the copies (thread hand-over, lock wait)
            assert phases["pause_s"] + phases["load_s"] == pytest.approx(phases["total_s"], abs=1e-9)
            assert same_weights(learner, engine.model)
            with torch.no_grad():
                next(learner.parameters()).add_(1.0)
        assert engine.events == [("between", False)] * 2  # loaded off the event loop's thread, no pause or resume
        # inline (the generation actor's sync call, on a loop of its own): the calling thread loads, no hand-over
        with torch.no_grad():
            next(learner.parameters()).add_(1.0)
        ticket = sender.prepare(stream_parameters(learner))
        phases = asyncio.run(receiver.load_into(engine, ticket, inline=True))
        assert engine.events[-1] == ("between", True) and same_weights(learner, engine.model)
        assert phases["pause_s"] + phases["load_s"] == pytest.approx(phases["total_s"], abs=1e-9)
        # a pause begun before the ticket (an engine of another kind would have started one) is honoured
        pausing = asyncio.run(_paused_load(receiver, engine, sender.prepare(stream_parameters(learner))))
        assert pausing[-3:] == ["pause", "load", "resume"]
    finally:
        sender.close()
        receiver.close()


async def _paused_load(receiver, engine, ticket):
    from rlasync.weights.apply import begin_pause

    await receiver.load_into(engine, ticket, pausing=begin_pause(engine))
    return engine.events


def test_ipc_into_an_engine_without_loads_between_steps_pauses_early():
    learner, switched_off = tiny_model(0), BetweenSteps()
    switched_off.loads_between_steps = False  # TorchEngine(loads_between_steps=False): the A/B's other side
    plan, _ = choose_transport(CPU, [CPU], "ipc", **{**WHERE, "bucket_bytes": 256})
    for engine in (FakeEngine(), switched_off):
        receiver = asyncio.run(make_receiver(plan, 1, build_manifest(learner), engine, "cpu"))
        assert receiver.pauses_early and not receiver.between_steps
        sender = make_sender(plan, "cpu", manifest=build_manifest(learner))
        try:
            sync_once(sender, receiver, engine, learner)
        finally:
            sender.close()
        assert engine.events == ["pause", "load", "resume"] and same_weights(learner, engine.model)


def test_an_engine_with_its_own_receiver_joins_and_receives_in_place():
    learner, engine = tiny_model(0), SelfReceiving()
    manifest = build_manifest(learner)
    plan = TransportPlan("nccl", "10.0.0.1", 29500, 3, 30.0, bucket_bytes=1 << 20)
    receiver = asyncio.run(make_receiver(plan, 2, manifest, engine, "cpu"))
    assert isinstance(receiver, EngineNativeReceiver)
    assert engine.joined == ("10.0.0.1", 29500, 2, 3, "nccl", 1 << 20)
    phases = asyncio.run(receiver.load_into(engine, None))
    check_phases(phases)
    assert engine.received == manifest and engine.events == ["pause", "receive", "resume"]


class CountingStream:
    """A weight stream that counts how often it was iterated (a gather under FSDP2)."""

    def __init__(self, model):
        self.model, self.iterated = model, 0

    def __call__(self):
        yield from stream_parameters(self.model)
        self.iterated += 1


@pytest.mark.parametrize(("plan_kind", "phase"), [("gloo", "send"), ("nccl", "send"), ("ipc", "prepare")])
def test_other_learner_ranks_gather_in_the_phase_rank_0_consumes_the_stream(plan_kind, phase):
    plan = TransportPlan(plan_kind, "127.0.0.1", 1, 2, 5.0)
    stream = CountingStream(tiny_model(0))
    sender = make_sender(plan, "cpu", manifest=build_manifest(stream.model), rank=1)
    assert isinstance(sender, GatherOnlySender)
    assert sender.prepare(stream()) is None
    assert stream.iterated == (1 if phase == "prepare" else 0)
    sender.send(stream())
    sender.finish()
    assert stream.iterated == 1


def test_a_between_steps_load_records_the_tickets_event_of_its_own_rank(monkeypatch):
    """On CUDA the ticket carries one interprocess event per engine (rank r at r - 1): the engine records its own
    behind its copies instead of waiting for them (opened once per handle). The CUDA half: test_ipc_events_cuda.py."""
    from rlasync.weights import ipc
    from rlasync.weights.ipc import IpcTicket

    opened = []
    monkeypatch.setattr(ipc, "open_event", lambda handle, index: opened.append((handle, index)) or f"event {handle}")

    class Recording(BetweenSteps):
        def load_between_steps(self, named_tensors, done_event=None):
            self.events.append(("event", done_event))
            return super().load_between_steps(named_tensors)

    learner, engine = tiny_model(0), Recording()
    manifest = build_manifest(learner)
    plan, _ = choose_transport(CPU, [CPU], "ipc", **{**WHERE, "bucket_bytes": 256})
    sender = make_sender(plan, "cpu", manifest=manifest)
    try:
        cpu_ticket = sender.prepare(stream_parameters(learner))
        assert cpu_ticket.done_events == ()  # on the CPU the copies are done when the load returns
        ticket = IpcTicket(cpu_ticket.key, cpu_ticket.handles, 0.0, (b"first", b"second", b"third"))
        receiver = IpcReceiver(manifest, between_steps=True, rank=2, device=torch.device("cuda", 1))
        asyncio.run(receiver.load_into(engine, ticket, inline=True))
        assert engine.events[0] == ("event", "event b'second'") and opened == [(b"second", 1)]
        assert same_weights(learner, engine.model)
        off_cuda = IpcReceiver(manifest, between_steps=True, rank=2, device="cpu")
        asyncio.run(off_cuda.load_into(engine, ticket, inline=True))
        assert engine.events[-2] == ("event", None)  # not on CUDA: nothing to record
        assert ticket.done_event(4, torch.device("cuda", 0)) is None  # no event for a rank the ticket lacks

        def unopenable(handle, index):
            raise RuntimeError("CUDA error: invalid resource handle")

        monkeypatch.setattr(ipc, "open_event", unopenable)
        assert ticket.done_event(1, torch.device("cuda", 0)) is None  # the engine waits for its copies instead
    finally:
        sender.close()
