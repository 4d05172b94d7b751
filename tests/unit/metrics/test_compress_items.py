"""`compress_items`: a rollout actor's drained metric items folded per key, so that any window they join reduces
as it would over the raw items (checked against the sink over the raw items, drains split at random)."""

import math
import random

import pytest

from rlasync.metrics.reduce import MetricSink, compress_items

KEYS = {  # key -> how its values are made (the shapes the GRPO rollout side emits)
    "completions/mean_length": lambda r: (float(r.randint(2, 48)), 1.0),  # rate pair
    "rollout/generated_tokens_total": lambda r: float(r.randint(0, 500)),  # counter
    "completions/max_length": lambda r: float(r.randint(2, 48)),  # max
    "completions/min_terminated_length": lambda r: float(r.randint(2, 48)),  # min
    "rollout/duration_s": lambda r: r.random(),  # gauge: kept value by value
    "num_tokens": lambda r: float(r.randint(0, 10**6)),  # last
    "rewards/acc/std_max": lambda r: math.nan if r.random() < 0.3 else r.random(),  # max with NaNs
    "rewards/acc/count": lambda r: math.nan,  # a counter whose values were all NaN
}


def reduce(chunks):
    sink = MetricSink()
    for chunk in chunks:
        sink.update(chunk)
    return sink.reduce()


@pytest.mark.parametrize("seed", range(5))
def test_folded_drains_reduce_as_the_raw_items_in_any_window(seed):
    r = random.Random(seed)
    keys = list(KEYS)
    items = [(key, KEYS[key](r)) for key in (r.choice(keys) for _ in range(2000))]
    cuts = sorted(r.sample(range(1, len(items)), 6))
    drains = [items[a:b] for a, b in zip([0, *cuts], [*cuts, len(items)])]  # several actors' / drains' items
    raw, folded = reduce(drains), reduce([compress_items(d) for d in drains])
    assert raw.keys() == folded.keys()
    for key in raw:
        if raw[key] is None or math.isnan(raw[key]):
            assert folded[key] is None or math.isnan(folded[key]), key
        else:
            assert folded[key] == pytest.approx(raw[key], rel=1e-12), key
    compressed = sum(len(compress_items(d)) for d in drains)
    gauges = sum(1 for key, _ in items if key == "rollout/duration_s")
    assert compressed <= gauges + len(KEYS) * len(drains)  # only the gauge keeps its values


def test_a_key_of_mixed_shapes_is_left_as_it_is_so_the_sink_still_refuses_it():
    items = [("x/frac", (1.0, 2.0)), ("x/frac", 0.5), ("y_count", 2), ("y_count", 3)]
    assert compress_items(items) == [("x/frac", (1.0, 2.0)), ("x/frac", 0.5), ("y_count", 5.0)]
    with pytest.raises(ValueError, match="both as a rate pair and as a float"):
        MetricSink().update(compress_items(items))
    assert compress_items([("a", [1.0, 2.0]), ("a", [3.0, 4.0])]) == [("a", (4.0, 6.0))]  # pairs as Ray's lists
