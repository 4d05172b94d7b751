"""Rollout actors get the actors they talk to by Ray name (`actors.fanout.Named`) and the training rows from the queue
actor: a handle or object ref among a restartable actor's constructor arguments makes Ray log an error at every
start. Names resolve to working handles; a name whose actor is gone is left out of a list (a restarted rollout actor
whose engine was removed since), and a list with none left fails by name."""

import pytest


def test_names_resolve_and_gone_ones_are_left_out_of_a_list(ray_cluster):
    import ray

    from actors.fanout import Named, resolve_named

    @ray.remote(num_cpus=0)
    class Echo:
        def __init__(self, word):
            self.word = word

        def say(self):
            return self.word

    alive = Echo.options(name="rlasync-test-named-alive").remote("alive")
    gone = Echo.options(name="rlasync-test-named-gone").remote("gone")
    ray.get([alive.say.remote(), gone.say.remote()])
    ray.kill(gone, no_restart=True)
    import time

    for _ in range(50):  # until the name is released
        try:
            ray.get_actor("rlasync-test-named-gone")
        except ValueError:
            break
        time.sleep(0.1)
    try:
        one = resolve_named(Named("rlasync-test-named-alive"))
        assert ray.get(one.say.remote()) == "alive"
        wired = resolve_named(
            {"engines": [Named("rlasync-test-named-gone"), Named("rlasync-test-named-alive")], "n": 3}
        )
        assert wired["n"] == 3 and [ray.get(h.say.remote()) for h in wired["engines"]] == ["alive"]
        assert resolve_named(None) is None and resolve_named([]) == []
        with pytest.raises(ValueError, match="none of the actors"):
            resolve_named([Named("rlasync-test-named-gone")])
    finally:
        ray.kill(alive, no_restart=True)


def test_the_queue_actor_hands_out_the_rows_it_holds(ray_cluster):
    import ray

    from actors.staleness_queue import QueueActor
    from rlasync.pipeline.settings import QueueSettings

    queue = QueueActor.options(num_cpus=0).remote(
        settings=QueueSettings(num_rows=5, num_epochs=1, max_staleness=1, tokens_per_step=64)
    )
    try:
        with pytest.raises(ray.exceptions.RayTaskError, match="holds no training rows"):
            ray.get(queue.dataset.remote())
        rows = [{"prompt": f"q{i}"} for i in range(5)]
        ray.get(queue.hold_dataset.remote([ray.put(rows)]))
        [ref] = ray.get(queue.dataset.remote())
        assert ray.get(ref) == rows
    finally:
        ray.kill(queue, no_restart=True)
