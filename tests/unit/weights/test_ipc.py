"""Same-device sharing of packed weights (`rlasync.weights.ipc`): on the CPU through shared memory, read back by
another process; stream/manifest mismatches are refused."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rlasync.weights import build_manifest, stream_parameters
from rlasync.weights.ipc import SharedWeights


def tiny_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config)


READER = """
import json, sys
from rlasync.weights.ipc import open_shared
handles = [(entries, tuple(handle)) for entries, handle in json.loads(sys.stdin.read())]
print(json.dumps({name: t.float().flatten().tolist() for name, t in open_shared(handles)}))
"""


@pytest.mark.parametrize("bucket_bytes", [64, 1 << 20])
def test_another_process_reads_the_packed_weights(bucket_bytes):
    model = tiny_model()
    manifest = build_manifest(model, dtype=torch.bfloat16)
    shared = SharedWeights.pack(stream_parameters(model, dtype=torch.bfloat16), manifest, "cpu", bucket_bytes)
    assert shared.num_bytes >= sum(entry.num_bytes for entry in manifest)
    handles = shared.handles()
    assert all(handle[0] == "file" for _, handle in handles)
    reader = subprocess.run(
        [sys.executable, "-c", READER], input=json.dumps(handles), capture_output=True, text=True, timeout=120
    )  # another process, unrelated to this one, maps the same memory
    assert reader.returncode == 0, reader.stderr[-2000:]
    received = json.loads(reader.stdout)
    expected = dict(stream_parameters(model, dtype=torch.bfloat16))
    assert list(received) == [entry.name for entry in manifest]
    for name, values in received.items():
        assert values == expected[name].float().flatten().tolist(), name
    shared.release()
    assert shared.num_bytes == 0 and not any(Path(handle[1]).exists() for _, handle in handles)


def test_a_stream_that_differs_from_the_manifest_is_refused():
    model = tiny_model()
    manifest = build_manifest(model)
    with pytest.raises(ValueError, match="stream and manifest differ"):
        SharedWeights.pack(stream_parameters(model, dtype=torch.bfloat16), manifest, "cpu")
    with pytest.raises(ValueError, match="after the last manifest entry"):
        SharedWeights.pack(stream_parameters(model), manifest[:-1], "cpu")
