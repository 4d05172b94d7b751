"""The error that stops a run when a learner rank's call fails on a closed connection (`actors.cluster_faults.blame`):
Ray's node and actor tables, stubbed, decide between "died (its node ... was lost)", "died (on node ...)" and
"stopped answering"."""

import pytest

ray = pytest.importorskip("ray")
ray_exceptions = pytest.importorskip("ray.exceptions")
ray_state = pytest.importorskip("ray._private.state")

from actors.cluster_faults import blame  # noqa: E402


def _stub_gcs(monkeypatch, node_dead_after: int | None, actor_dead_after: int | None = None):
    """Ray's actor and node tables as seen by `node_of`: the node (the actor) is declared dead at the
    `node_dead_after`-th (`actor_dead_after`-th) look, None: never."""
    looks = {"n": 0}

    def actors(actor_id):
        looks["n"] += 1
        dead = actor_dead_after is not None and looks["n"] >= actor_dead_after
        return {"Address": {"NodeID": "ab12", "IPAddress": "10.0.0.7"}, "State": "DEAD" if dead else "ALIVE"}

    def nodes():
        return [{"NodeID": "ab12", "Alive": node_dead_after is None or looks["n"] < node_dead_after}]

    monkeypatch.setattr(ray_state, "actors", actors)
    monkeypatch.setattr(ray, "nodes", nodes)
    monkeypatch.setattr("actors.cluster_faults.time.sleep", lambda s: None)
    return looks


def test_a_rank_that_stopped_answering_is_named_dead_once_its_node_is_declared_lost(tmp_path, monkeypatch):
    """A crashed node first shows as a closed connection (ActorUnavailableError); Ray's health checks declare the
    node dead a few seconds later. The error names the lost node when that happens within the wait, and says
    "stopped answering" only when neither the node nor the actor is declared dead."""
    actor = b"\x11" * 16
    names = {actor.hex(): "learner rank 0"}
    unavailable = ray_exceptions.ActorUnavailableError("Socket closed", actor)

    looks = _stub_gcs(monkeypatch, node_dead_after=3)
    message = str(blame(unavailable, names, [], tmp_path))
    assert message.startswith("learner rank 0 died (its node ab12 (10.0.0.7) was lost: "), message
    assert looks["n"] >= 3  # it waited for the health checks rather than naming the first answer

    _stub_gcs(monkeypatch, node_dead_after=None, actor_dead_after=2)
    message = str(blame(unavailable, names, [], tmp_path))
    assert message.startswith("learner rank 0 died (on node ab12 (10.0.0.7): "), message

    clock = iter(range(0, 1000, 4))
    monkeypatch.setattr("actors.cluster_faults.time.monotonic", lambda: float(next(clock)))
    _stub_gcs(monkeypatch, node_dead_after=None)
    message = str(blame(unavailable, names, [], tmp_path))
    assert message.startswith("learner rank 0 stopped answering (ActorUnavailableError: "), message
    assert "Socket closed" in message
