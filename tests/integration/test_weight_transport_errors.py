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
