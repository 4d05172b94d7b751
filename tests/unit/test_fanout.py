"""`actors/fanout.py`: a call to a group of actors written once, with named deadlines. Fake handles and fake
`ray.get` / `ray.wait` (no Ray cluster): the calls made, the order of the results, the deadline passed, and that a
failed call raises the error Ray raises for it (so the caller names the actor exactly as before)."""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest

from actors import fanout
from actors.fanout import Timeouts, call_all, call_all_async, get_all, remote_all

ray = fanout.ray  # its exception types, as the module under test sees them (unit tests import no ray themselves)
REPO = Path(__file__).resolve().parents[2]


class Ref:
    """A fake ObjectRef: a value, or an error raised by `ray.get`; `ready=False` never finishes."""

    def __init__(self, value=None, error: BaseException | None = None, ready: bool = True) -> None:
        self.value, self.error, self.ready = value, error, ready


class Handle:
    """A fake actor handle: `handle.method.remote(*args, **kwargs)` records the call and returns a `Ref`."""

    def __init__(self, name: str, results: dict[str, Ref] | None = None) -> None:
        self.name, self.results, self.calls = name, results or {}, []

    def __getattr__(self, method: str):
        def remote(*args, **kwargs):
            self.calls.append((method, args, kwargs))
            return self.results.get(method, Ref((self.name, method, args)))

        return SimpleNamespace(remote=remote)


@pytest.fixture
def fake_ray(monkeypatch):
    """`ray.get` / `ray.wait` over `Ref`s; records every timeout given."""
    timeouts = []

    def get(refs, timeout=None):
        timeouts.append(timeout)
        items = refs if isinstance(refs, list) else [refs]
        if any(not ref.ready for ref in items):
            raise ray.exceptions.GetTimeoutError(f"not ready within {timeout}")
        for ref in items:
            if ref.error is not None:
                raise ref.error
        values = [ref.value for ref in items]
        return values if isinstance(refs, list) else values[0]

    def wait(refs, num_returns=1, timeout=None):
        ready = [ref for ref in refs if ref.ready][:num_returns]
        return ready, [ref for ref in refs if ref not in ready]

    monkeypatch.setattr(fanout.ray, "get", get)
    monkeypatch.setattr(fanout.ray, "wait", wait)
    return timeouts


def test_remote_all_calls_every_handle_in_order_with_shared_and_per_handle_arguments():
    handles = [Handle("a"), Handle("b")]
    refs = remote_all(handles, "open", "plan", each=[(1, "m"), (2, "m")], flag=True)
    assert [ref.value for ref in refs] == [("a", "open", ("plan", 1, "m")), ("b", "open", ("plan", 2, "m"))]
    assert handles[1].calls == [("open", ("plan", 2, "m"), {"flag": True})]
    assert remote_all([], "stop") == []
    with pytest.raises(ValueError, match=r"remote_all\('open'\): 1 argument tuples for 2 actors"):
        remote_all(handles, "open", each=[(1,)])


def test_call_all_returns_results_in_order_within_the_deadline(fake_ray):
    handles = [Handle("a"), Handle("b"), Handle("c")]
    assert call_all(handles, "stats", timeout=7.0) == [(name, "stats", ()) for name in "abc"]
    assert fake_ray == [7.0]


def test_call_all_raises_the_failed_actors_own_error(fake_ray):
    died = ray.exceptions.RayActorError()
    handles = [Handle("a"), Handle("b", {"setup": Ref(error=died)})]
    with pytest.raises(ray.exceptions.RayActorError) as caught:
        call_all(handles, "setup", None, 60.0, timeout=660.0)
    assert caught.value is died  # the same error object: its actor id still names the dead actor
    assert handles[0].calls == [("setup", (None, 60.0), {})]  # every actor was asked, at once


def test_call_all_async_fails_as_soon_as_one_call_failed(fake_ray):
    """A dead learner rank must not leave the driver waiting for a rank blocked in a collective with it."""
    broken = RuntimeError("rank 1: collective failed")
    handles = [Handle("rank 0", {"train_step": Ref(ready=False)}), Handle("rank 1", {"train_step": Ref(error=broken)})]
    with pytest.raises(RuntimeError, match="rank 1: collective failed"):
        asyncio.run(call_all_async(handles, "train_step", ["ref"], timeout=3900.0))
    assert handles[0].calls == [("train_step", (["ref"],), {})]


def test_call_all_async_returns_every_result(fake_ray):
    handles = [Handle("a"), Handle("b")]
    assert asyncio.run(call_all_async(handles, "save", "dir", None, timeout=900.0)) == [
        ("a", "save", ("dir", None)),
        ("b", "save", ("dir", None)),
    ]


def test_get_all_times_out_on_an_unfinished_call(fake_ray):
    with pytest.raises(ray.exceptions.GetTimeoutError, match="1 of 2 calls unfinished after 5 s"):
        get_all([Ref(1), Ref(ready=False)], 5.0)


def test_timeouts_are_derived_once_from_the_collective_timeout():
    timeouts = Timeouts.from_cluster(SimpleNamespace(collective_timeout_s=60))
    assert timeouts.call == 60.0
    assert (timeouts.build, timeouts.save, timeouts.train_step) == (660.0, 660.0, 3660.0)
    assert (timeouts.open_transport, timeouts.weight_sync, timeouts.settle) == (90.0, 120.0, 90.0)
    assert (timeouts.stop, timeouts.health, timeouts.probe, timeouts.death, timeouts.restart) == (20, 60, 10, 30, 180)
    with pytest.raises(AttributeError):
        timeouts.collective = 1.0  # frozen: one value for the whole run


def _hand_written_fanouts(path: Path) -> list[str]:
    """Comprehensions whose element calls `.remote(...)`: a fan-out written by hand."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
            elements = [node.key, node.value] if isinstance(node, ast.DictComp) else [node.elt]
            for element in elements:
                for call in ast.walk(element):
                    if (
                        isinstance(call, ast.Call)
                        and isinstance(call.func, ast.Attribute)
                        and call.func.attr == "remote"
                    ):
                        found.append(f"{path.relative_to(REPO)}:{node.lineno}: {ast.unparse(node)[:80]}")
    return found


def test_the_driver_writes_no_fanout_by_hand():
    paths = [p for p in sorted((REPO / "actors").glob("*.py")) if p.name != "fanout.py"]
    found = [hit for path in paths for hit in _hand_written_fanouts(path)]
    assert not found, "use actors.fanout.remote_all / call_all / call_all_async:\n" + "\n".join(found)
