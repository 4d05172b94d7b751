"""WeightGroup over gloo (threads of one process, CPU): bucketed send/receive reproduces every tensor, the stream is
checked against the manifest, a stalled peer is a TimeoutError naming the group (the choice of transport:
test_transport.py)."""

import threading

import pytest
import torch

from rlasync.weights import ManifestEntry, bucket_layout, build_manifest, stream_parameters
from rlasync.weights.broadcast import WeightGroup, free_port


def tiny_model(seed=0, dtype=torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config).to(dtype)


def run_ranks(world_size, target, timeout_s=20.0):
    """Run `target(rank, group)` for every rank in its own thread; returns results, re-raises the first error."""
    port = free_port()
    results, errors = [None] * world_size, [None] * world_size

    def body(rank):
        try:
            group = WeightGroup.open("127.0.0.1", port, rank, world_size, timeout_s, **target.open_kwargs)
            results[rank] = target(rank, group)
        except BaseException as exc:  # noqa: BLE001 - handed to the main thread
            errors[rank] = exc

    threads = [threading.Thread(target=body, args=(rank,), daemon=True) for rank in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout_s + 30)
    for error in errors:
        if error is not None:
            raise error
    return results


def with_open(**kwargs):
    def wrap(func):
        func.open_kwargs = kwargs
        return func

    return wrap


def test_bucket_layout_aligns_every_entry():
    bucket = [
        ManifestEntry("a", "bfloat16", (3,)),
        ManifestEntry("b", "float32", (2, 2)),
        ManifestEntry("c", "int8", ()),
    ]
    offsets, size = bucket_layout(bucket)
    assert offsets == [0, 16, 32] and size == 33


@pytest.mark.parametrize("bucket_bytes", [1, 600, 1 << 20], ids=["one_per_tensor", "mixed", "one_bucket"])
def test_bucketed_send_receive_reproduces_every_tensor(bucket_bytes):
    """Two engines receive a model (mixed dtypes, a scalar, tensors larger than a bucket) bit for bit."""
    source = tiny_model(1)
    source.model.norm.weight.data = source.model.norm.weight.data.to(torch.bfloat16)  # a second dtype in the stream
    manifest = build_manifest(source)
    assert {e.dtype for e in manifest} == {"float32", "bfloat16"}

    @with_open(bucket_bytes=bucket_bytes)
    def rank_body(rank, group):
        if rank == 0:
            buckets = group.buckets(manifest)
            return group.send(stream_parameters(source), manifest), len(buckets)
        return {name: tensor.clone() for name, tensor in group.receive(manifest)}

    (sent, num_buckets), *received = run_ranks(3, rank_body)
    if bucket_bytes == 1:
        assert num_buckets == len(manifest)
    elif bucket_bytes == 1 << 20:
        assert num_buckets == 1
    else:
        assert 1 < num_buckets < len(manifest)
    assert sent >= sum(e.num_bytes for e in manifest)
    expected = dict(stream_parameters(source))
    for got in received:
        assert list(got) == [e.name for e in manifest]
        for name, tensor in expected.items():
            assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def test_received_weights_load_into_an_engine_model():
    from rlasync.engine.weights import load_named_weights

    source, target = tiny_model(2), tiny_model(3)
    manifest = build_manifest(source)

    @with_open(bucket_bytes=4096)
    def rank_body(rank, group):
        if rank == 0:
            return group.send(stream_parameters(source), manifest)
        return load_named_weights(target, group.receive(manifest))

    run_ranks(2, rank_body)
    for (name, a), (_, b) in zip(source.named_parameters(), target.named_parameters()):
        assert torch.equal(a, b), name


def test_a_stream_that_disagrees_with_the_manifest_is_refused():
    source = tiny_model()
    manifest = build_manifest(source)
    wrong = [(name, tensor) for name, tensor in stream_parameters(source)][1:]  # first entry missing

    @with_open(bucket_bytes=1)
    def rank_body(rank, group):
        if rank == 0:
            return group.send(wrong, manifest)
        return None

    with pytest.raises(ValueError, match="manifest"):
        run_ranks(2, rank_body)


def test_a_stalled_sender_is_a_timeout_naming_the_group():
    manifest = build_manifest(tiny_model())

    @with_open()
    def rank_body(rank, group):
        if rank == 1:
            return list(group.receive(manifest))  # rank 0 never sends
        return None

    with pytest.raises(TimeoutError, match=r"weight-sync group 127\.0\.0\.1:\d+ \(gloo\).*rank 1"):
        run_ranks(2, rank_body, timeout_s=2.0)


def test_a_missing_peer_is_a_timeout_at_open():
    with pytest.raises(TimeoutError, match="could not join"):
        WeightGroup.open("127.0.0.1", free_port(), 0, 2, timeout_s=1.0)


def test_open_checks_backend_and_device():
    with pytest.raises(ValueError, match="backend"):
        WeightGroup.open("127.0.0.1", free_port(), 0, 1, backend="mpi")
    with pytest.raises(ValueError, match="CPU"):
        WeightGroup.open("127.0.0.1", free_port(), 0, 1, backend="gloo", device="cuda")
