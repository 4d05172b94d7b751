"""bench/top_logprobs_host.py replays packed step outputs through the engine's own request path: the records it
times carry each request's top-N exactly as the packed steps held them."""

import importlib.util
import pickle
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def load_bench():
    spec = importlib.util.spec_from_file_location("top_logprobs_host", REPO / "bench" / "top_logprobs_host.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["top_logprobs_host"] = module
    spec.loader.exec_module(module)
    return module


def test_the_replayed_requests_hold_the_packed_top_n_and_the_timings_are_per_request():
    bench = load_bench()
    steps = bench.packed_steps(batch=4, n=3, steps=5, vocab=100, seed=1)
    timings = bench.one_pass(steps, batch=4, n=3)
    assert set(timings) >= {"engine_side_us", "unpickle_us", "pickled_bytes"} and timings["engine_side_us"] > 0
    assert timings["engine_side_us"] >= timings["pickle_us"]

    from types import SimpleNamespace

    import torch

    from rlasync.engine.base import SamplingParams
    from rlasync.engine.request import Request
    from rlasync.engine.runner import unpack_packed

    params = SamplingParams(max_tokens=5, num_logprobs=3)
    request = Request(0, [1], params, 0, 5, frozenset())
    result = SimpleNamespace(topn_ids=torch.zeros(4, 3), candidate_ids=None, num_candidates=None)
    for packed in steps:
        request.append(*unpack_packed(packed, result, [params] * 4)[0])
    top = pickle.loads(pickle.dumps(request.to_turn_record())).output_sampler_logprobs
    for t, packed in enumerate(steps):  # row 0 of each step: ids at columns 2-4, log-probs at 5-7
        ids, logprobs = packed[0, 2:5].to(torch.int64).tolist(), packed[0, 5:8].tolist()
        assert top[t] == dict(zip(ids, logprobs))
