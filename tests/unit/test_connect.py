"""`actors.cluster.connect`: which cluster a run joins and whether it says it started it (only a started one is shut
down and reaped at the end, and only a joined one is assumed to autoscale). `ray.init` is recorded, not called."""

import pytest

from actors import cluster


@pytest.fixture
def inits(monkeypatch):
    calls = []
    monkeypatch.setattr(cluster.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(cluster.ray, "init", lambda **kwargs: calls.append(kwargs))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    return calls


def test_a_running_ray_start_cluster_is_joined_and_not_called_started(inits, monkeypatch, caplog):
    monkeypatch.setattr(cluster, "started_by_ray_start", lambda: "10.0.0.5:6379")
    with caplog.at_level("INFO", logger="actors.cluster"):
        assert cluster.connect(None) is False
    assert inits == [{"address": "10.0.0.5:6379", "log_to_driver": True}]
    assert "ray_address: local" in caplog.text


def test_no_running_cluster_starts_a_local_one(inits, monkeypatch):
    monkeypatch.setattr(cluster, "started_by_ray_start", lambda: None)
    assert cluster.connect(None) is True
    assert inits == [{"address": "local", "include_dashboard": False, "log_to_driver": True}]


@pytest.mark.parametrize("where", ["config", "env"])
def test_local_starts_one_even_beside_a_running_cluster(inits, monkeypatch, where):
    monkeypatch.setattr(cluster, "started_by_ray_start", lambda: "10.0.0.5:6379")
    if where == "env":
        monkeypatch.setenv("RAY_ADDRESS", "local")
    assert cluster.connect("local" if where == "config" else None) is True
    assert inits[0]["address"] == "local"


def test_an_address_is_joined_without_looking_for_ray_start(inits, monkeypatch):
    monkeypatch.setattr(cluster, "started_by_ray_start", lambda: pytest.fail("looked up a ray start cluster"))
    monkeypatch.setenv("RAY_ADDRESS", "10.0.0.7:6379")
    assert cluster.connect(None) is False
    assert cluster.connect("ray://head:10001") is False
    assert [call["address"] for call in inits] == ["10.0.0.7:6379", "ray://head:10001"]


def test_an_initialised_ray_is_used_as_it_is(monkeypatch):
    monkeypatch.setattr(cluster.ray, "is_initialized", lambda: True)
    monkeypatch.setattr(cluster.ray, "init", lambda **kwargs: pytest.fail("ray.init called again"))
    assert cluster.connect("local") is False
