"""rollout/generated_tokens_per_s is the system's rate: Σ over rollout actors of a step's generated tokens / the
step's wall time (each actor's own rate, tokens over its own time, would be N times too low with N actors)."""

from rlasync.metrics import MetricSink
from rlasync.metrics.perf import GENERATED_RATE, GENERATED_TOTAL, system_generation_rate


def test_four_actors_generating_at_the_same_rate_give_four_times_one_actors_rate():
    per_actor = [(GENERATED_RATE, (500.0, 1.0)), (GENERATED_TOTAL, 500.0), ("rollout/concurrency", 8.0)]
    drained = per_actor * 4  # four actors, each 500 tokens in the step's one second
    items = system_generation_rate(drained, step_s=1.0)
    assert [value for name, value in items if name == GENERATED_RATE] == [(2000.0, 1.0)]
    sink = MetricSink()
    sink.update(items)
    sink.update(system_generation_rate(per_actor * 4, step_s=3.0))  # a slower step: 2000 tokens in 3 s
    reduced = sink.reduce()
    assert abs(reduced[GENERATED_RATE] - 4000.0 / 4.0) < 1e-9  # Σ tokens / Σ seconds over the window
    assert reduced[GENERATED_TOTAL] == 4000.0 and reduced["rollout/concurrency"] == 8.0


def test_before_the_first_timed_step_no_rate_is_logged_and_nothing_else_changes():
    drained = [(GENERATED_RATE, (500.0, 1.0)), (GENERATED_TOTAL, 500.0), ("rollout/score_s", 0.1)]
    assert system_generation_rate(drained, step_s=None) == [(GENERATED_TOTAL, 500.0), ("rollout/score_s", 0.1)]
    assert system_generation_rate([("rollout/score_s", 0.1)], step_s=2.0) == [("rollout/score_s", 0.1)]
