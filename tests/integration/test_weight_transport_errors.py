"""A restarted GenerationActor's weight sync fails with a typed error (`WeightTransportNotOpen`) that the driver
recognises by its type across a real Ray actor call, not by the text of its message."""

import pytest


def test_a_sync_before_the_transport_is_open_is_recognised_by_type_across_ray(ray_cluster, tiny_model_dir):
    from actors.cluster_weights import _gone_or_fresh, _settle
    from actors.generation import GenerationActor
    from rlasync.weights.transport import WeightTransportNotOpen

    handle = GenerationActor.options(num_cpus=0.5, max_restarts=0).remote(
        model=tiny_model_dir, engine_kwargs={"max_model_len": 64, "kv_cache_tokens": 1024, "max_num_seqs": 4}
    )
    try:
        with pytest.raises(WeightTransportNotOpen) as caught:  # what a restarted incarnation answers
            ray_cluster.get(handle.sync_weights.remote(None, 1), timeout=120)
        assert isinstance(caught.value, ray_cluster.exceptions.RayTaskError)  # Ray's error, an instance of the cause
        assert _gone_or_fresh(caught.value)
        [settled] = _settle([handle.sync_weights.remote(None, 1)], 60)  # how the weight sync collects its calls
        assert isinstance(settled, WeightTransportNotOpen) and _gone_or_fresh(settled)
        # the type decides, not the message: the same words in another error are not a restart
        assert not _gone_or_fresh(RuntimeError(str(caught.value)))
    finally:
        ray_cluster.kill(handle)


def test_no_collection_starts_inside_a_sync_and_a_failed_sync_turns_collection_back_on(ray_cluster, tiny_model_dir):
    """Through a real actor call: while the receiver loads, automatic garbage collection is off in the
    GenerationActor's process; after the sync, and after one whose load raised, it is on again."""
    from actors.generation import GenerationActor

    class Receiver:  # stands in for a transport's receiver: reports what it saw while loading
        def __init__(self, fail):
            self.fail = fail

        async def load_into(self, engine, ticket):
            import gc

            if self.fail:
                raise RuntimeError("the load failed")
            return {"pause_s": 0.0, "load_s": 0.0, "resume_s": 0.0, "total_s": 0.0, "gc_on": gc.isenabled()}

    def install(fail):
        def put(actor):
            actor.receiver = Receiver(fail)

        return put

    def collection_state(actor):
        import gc

        return gc.isenabled(), actor.gc_hold.held, actor.gc_hold.holds

    handle = GenerationActor.options(num_cpus=0.5, max_restarts=0).remote(
        model=tiny_model_dir, engine_kwargs={"max_model_len": 64, "kv_cache_tokens": 1024, "max_num_seqs": 4}
    )
    try:
        ray_cluster.get(handle.__ray_call__.remote(install(False)), timeout=120)
        phases = ray_cluster.get(handle.sync_weights.remote("ticket", 1), timeout=60)
        assert phases["gc_on"] is False  # off while loading
        assert ray_cluster.get(handle.__ray_call__.remote(collection_state), timeout=60) == (True, False, 1)
        ray_cluster.get(handle.__ray_call__.remote(install(True)), timeout=60)
        with pytest.raises(RuntimeError, match="the load failed"):
            ray_cluster.get(handle.sync_weights.remote("ticket", 2), timeout=60)
        assert ray_cluster.get(handle.__ray_call__.remote(collection_state), timeout=60) == (True, False, 2)
    finally:
        ray_cluster.kill(handle)
