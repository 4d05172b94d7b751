"""The one hang check: a rollout actor's health report raises with the actor's name and the config field."""

import pytest

from rlasync.driver import check_actor_health


def test_an_error_names_the_actor():
    with pytest.raises(RuntimeError, match=r"^rollout actor 2 failed: ValueError: bad$"):
        check_actor_health("rollout actor 2", {"error": "ValueError: bad", "running": False}, 300.0)


def test_a_stale_heartbeat_while_running_is_a_hang():
    health = {"error": None, "running": True, "heartbeat_age_s": 301.0}
    with pytest.raises(
        RuntimeError,
        match=r"rollout actor 0: no heartbeat for 301 s \(> rollout_worker_timeout=300.0; its last at \d\d:\d\d:\d\d UTC\)",
    ):
        check_actor_health("rollout actor 0", health, 300.0)
    with pytest.raises(RuntimeError, match="heartbeat_stale_after_s=300"):
        check_actor_health("distillation rollout actor 0", health, 300.0, setting="heartbeat_stale_after_s")


def test_healthy_or_stopped_actors_pass():
    check_actor_health("rollout actor 0", {"error": None, "running": True, "heartbeat_age_s": 1.0}, 300.0)
    check_actor_health("rollout actor 0", {"error": None, "running": False, "heartbeat_age_s": 1e6}, 300.0)
