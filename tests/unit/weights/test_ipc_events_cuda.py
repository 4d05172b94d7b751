"""The IPC sync's copy events across processes (CUDA; run through the device tool): an engine process records its
event of the ticket (`IpcTicket.done_event`) behind the work it queued and returns at once; learner rank 0's next
`CopyEvents.wait` puts its stream behind that work, so the buckets are refilled only after the engine has read them.
An engine that never recorded holds nothing up."""

import subprocess
import sys
import time

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# the engine: opens its event from the ticket, queues ~1 s of GPU work (its steps and copies), records the event
# behind it and says so at once; then lives on until told (its context holds the recorded work)
ENGINE = """
import sys, torch
from rlasync.weights.ipc import IpcTicket
handles = tuple(bytes.fromhex(h) for h in sys.argv[1:])
event = IpcTicket("key", [], 0.0, handles).done_event(1, torch.device("cuda", 0))
sys.stdin.readline()
torch.cuda._sleep(2_000_000_000)
event.record(torch.cuda.current_stream())
print("recorded", flush=True)
sys.stdin.readline()
"""


def _timed(copies=None):
    start = time.perf_counter()
    if copies is not None:
        copies.wait()
    torch.ones(1, device="cuda").add_(1.0)  # the refill of the buckets
    torch.cuda.synchronize()
    return time.perf_counter() - start


def test_the_next_pack_waits_on_the_gpu_for_an_engines_recorded_copies():
    from rlasync.weights.ipc import CopyEvents

    copies = CopyEvents(2, torch.device("cuda", 0))  # engine 2 never records
    assert len(copies.handles) == 2 and all(isinstance(h, bytes) for h in copies.handles)
    assert _timed(copies) < 0.5  # nothing recorded yet: nothing to wait for
    args = [sys.executable, "-c", ENGINE, *(h.hex() for h in copies.handles)]
    engine = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        engine.stdin.write("go\n")
        engine.stdin.flush()
        assert engine.stdout.readline().strip() == "recorded"
        control = _timed()  # this process's own stream has nothing queued
        waited = _timed(copies)  # behind the engine's ~1 s of queued work
        again = _timed(copies)  # that work is done: the next wait is free
        assert control < 0.3 and waited > 0.4 and again < 0.3, (control, waited, again)
    finally:
        engine.communicate("done\n", timeout=60)


def test_a_plan_without_copy_events_gives_tickets_without_them():
    """cluster.weight_sync_copy_events=false: each engine waits for its copies inside the sync (no events to record)."""
    from torch import nn

    from rlasync.weights import build_manifest, stream_parameters
    from rlasync.weights.transport import choose_transport, make_sender

    model = nn.Linear(8, 8).cuda()
    where = {"device": "cuda", "node": "n0", "gpu": "uuid-0"}
    for flag, engines in ((True, 2), (False, 0)):
        plan, _ = choose_transport(where, [where, where], "ipc", host="h", port=1, timeout_s=1.0, copy_events=flag)
        sender = make_sender(plan, "cuda", manifest=build_manifest(model))
        try:
            assert len(sender.prepare(stream_parameters(model)).done_events) == engines
        finally:
            sender.close()
