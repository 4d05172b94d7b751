import asyncio
import logging

import numpy as np
import pytest

from rlasync.algorithms.distill.loop import AsyncDistillationLoop, resolve_max_inflight_tasks
from rlasync.engine.base import EngineError


def _loop(fakes, rows, *, teachers=None, student=None, clock=None, args=None, **kwargs):
    clock = clock or fakes.Clock()
    metrics = []
    loop = AsyncDistillationLoop(
        config=args or fakes.args(),
        tokenizer=fakes.Tokenizer(),
        student=student or fakes.Student(clock=clock),
        teachers=teachers if teachers is not None else fakes.Teacher(clock=clock),
        prompt_source=kwargs.pop("source", None) or fakes.Source(rows),
        sink=kwargs.pop("sink", None) or fakes.Sink(),
        metrics_callback=metrics.extend,
        clock=clock,
        wall_clock=clock,
        sleep=clock.sleep,
        **kwargs,
    )
    return loop, metrics


def _values(metrics, key):
    return [value for name, value in metrics if name == key]


def test_one_row_one_sample_scored_teacher_forced_on_the_completion(fakes):
    clock = fakes.Clock()
    teacher = fakes.Teacher(clock=clock)
    loop, _ = _loop(fakes, [fakes.row("ab"), fakes.row("c")], teachers=teacher, clock=clock)
    asyncio.run(loop.run())
    samples = loop.sink.samples
    assert sorted(s.prompt_id for s in samples) == [0, 1]
    sample = next(s for s in samples if s.prompt_id == 0)
    prompt_ids = [1, ord("a") % 50 + 10, ord("b") % 50 + 10, 3]
    assert sample.input_ids.tolist() == prompt_ids + [70, 71, 2]
    assert sample.completion_mask.tolist() == [0, 0, 0, 0, 1, 1, 1]
    assert sample.completion == [{"role": "assistant", "content": "FG<eos>"}]  # special tokens kept
    # the teacher scored prompt + completion from the prompt's end, top-k = teacher_top_k
    assert (prompt_ids + [70, 71, 2], 4, 2, {}) in teacher.requests
    # K+1 wide: top-2 by rank, then the realised token (outside the top-k) with its log-prob
    assert sample.teacher_topk_ids.shape == (7, 3)
    assert (sample.teacher_topk_ids[:4] == -1).all()
    assert sample.teacher_topk_ids[4:].tolist() == [[500, 501, 70], [501, 502, 71], [502, 503, 2]]
    np.testing.assert_allclose(sample.teacher_topk_logprobs[4], [-0.1, -0.2, -5.0], rtol=1e-6)
    assert sample.teacher_id == "default" and sample.enqueued_at == clock.now


def test_single_teacher_scores_every_row_whatever_its_teacher_id(fakes):
    teacher = fakes.Teacher()
    loop, metrics = _loop(fakes, [fakes.row("a", teacher_id="x"), fakes.row("b")], teachers={"only": teacher})
    asyncio.run(loop.run())
    assert len(teacher.requests) == 2
    assert {s.teacher_id for s in loop.sink.samples} == {"only"}
    assert not any(name.startswith("teacher_score_s/") for name, _ in metrics)


def test_mopd_routes_each_row_to_its_teacher_and_logs_per_teacher_score_time(fakes):
    clock = fakes.Clock()
    math_t, code_t = (
        fakes.Teacher(base=500, clock=clock, score_s=0.25),
        fakes.Teacher(base=900, clock=clock, score_s=0.5),
    )
    rows = [fakes.row("a", teacher_id="code"), fakes.row("b", teacher_id="math"), fakes.row("c", teacher_id="code")]
    loop, metrics = _loop(fakes, rows, teachers={"math": math_t, "code": code_t}, clock=clock)
    asyncio.run(loop.run())
    assert len(math_t.requests) == 1 and len(code_t.requests) == 2
    by_prompt = {s.prompt_id: s for s in loop.sink.samples}
    assert [by_prompt[i].teacher_id for i in range(3)] == ["code", "math", "code"]
    assert by_prompt[0].teacher_topk_ids[-3, 0] == 900 and by_prompt[1].teacher_topk_ids[-3, 0] == 500
    assert _values(metrics, "teacher_score_s/math") == [(0.25, 1.0)]
    assert _values(metrics, "teacher_score_s/code") == [(0.5, 1.0), (0.5, 1.0)]
    assert sorted(_values(metrics, "rollout/score_s")) == [(0.25, 1.0), (0.5, 1.0), (0.5, 1.0)]


@pytest.mark.parametrize("row_extra", [{}, {"teacher_id": "chem"}])
def test_mopd_missing_or_unknown_teacher_id_stops_the_loop(fakes, row_extra):
    student = fakes.Student()
    loop, _ = _loop(
        fakes, [fakes.row("a", **row_extra)], teachers={"m": fakes.Teacher(), "c": fakes.Teacher()}, student=student
    )
    with pytest.raises(ValueError, match="which is not among the teachers"):
        asyncio.run(loop.run())
    assert student.requests == []  # routed before generating
    with pytest.raises(RuntimeError, match="failed") as info:
        loop.check_health()
    assert isinstance(info.value.__cause__, ValueError)


def test_push_metrics_lengths_clipping_duration_and_rates(fakes):
    clock = fakes.Clock()
    student = fakes.Student(outputs=[([70, 71, 2], "stop"), ([80, 81, 82, 83], "length")], clock=clock, generate_s=1.0)
    teacher = fakes.Teacher(clock=clock, score_s=0.5)
    loop, metrics = _loop(
        fakes, [fakes.row("a"), fakes.row("b")], student=student, teachers=teacher, clock=clock, max_inflight_tasks=1
    )
    asyncio.run(loop.run())
    assert _values(metrics, "completions/mean_length") == [(3.0, 1.0), (4.0, 1.0)]
    assert _values(metrics, "completions/max_length") == [3.0, 4.0]
    assert _values(metrics, "completions/min_length") == [3.0, 4.0]
    assert _values(metrics, "completions/clipped_ratio") == [(0.0, 1.0), (1.0, 1.0)]  # EOS vs cut
    assert _values(metrics, "rollout/duration_s") == [1.5, 1.5]
    assert _values(metrics, "rollout/score_s") == [(0.5, 1.0), (0.5, 1.0)]
    assert _values(metrics, "rollout/inflight") == [0.0, 0.0]
    assert _values(metrics, "rollout/generated_tok_s") == [(3.0, 1.5), (4.0, 1.5)]
    assert "teacher_score_s/default" not in {name for name, _ in metrics}


def test_clipping_falls_back_to_last_token_without_finish_reason(fakes):
    student = fakes.Student(outputs=[([70, 2], None), ([70, 71], None)])
    loop, metrics = _loop(fakes, [fakes.row("a"), fakes.row("b")], student=student, max_inflight_tasks=1)
    asyncio.run(loop.run())
    assert _values(metrics, "completions/clipped_ratio") == [(0.0, 1.0), (1.0, 1.0)]


def test_transient_errors_are_retried_with_backoff_and_counted(fakes):
    clock = fakes.Clock()
    student, teacher = fakes.Student(clock=clock), fakes.Teacher(clock=clock)
    student.fail, teacher.fail = 2, 1
    loop, metrics = _loop(fakes, [fakes.row("a")], student=student, teachers=teacher, clock=clock)
    asyncio.run(loop.run())
    assert len(loop.sink.samples) == 1
    assert _values(metrics, "rollout/vllm_retry_count") == [1.0, 1.0, 1.0]
    assert clock.slept == [1.0, 2.0, 1.0]
    assert loop.counters["student_retries"] == 2 and loop.counters["teacher_retries"] == 1


def test_exhausted_retries_stop_the_loop(fakes):
    teacher = fakes.Teacher()
    teacher.fail = 10
    loop, metrics = _loop(fakes, [fakes.row("a")], teachers=teacher)
    loop.max_request_attempts = 3
    with pytest.raises(EngineError, match="teacher hiccup"):
        asyncio.run(loop.run())
    assert len(_values(metrics, "rollout/vllm_retry_count")) == 2
    assert loop.sink.samples == []


def test_rejected_request_fails_only_its_task(fakes):
    student = fakes.Student()
    student.reject = lambda prompt_ids: len(prompt_ids) > 4
    loop, metrics = _loop(fakes, [fakes.row("a"), fakes.row("long prompt"), fakes.row("b")], student=student)
    asyncio.run(loop.run())
    assert sorted(s.prompt_id for s in loop.sink.samples) == [0, 2]
    assert loop.prompt_source.released == [(1, "failed")]
    assert _values(metrics, "rollout/failed_task_count") == [1.0]


def test_concurrency_is_bounded_by_max_inflight_tasks(fakes):
    student = fakes.Student()

    async def main():
        student.gate = asyncio.Event()
        loop, _ = _loop(fakes, [fakes.row(c) for c in "abcdef"], student=student, max_inflight_tasks=2)
        runner = asyncio.create_task(loop.run())
        for _ in range(50):
            await asyncio.sleep(0)
        assert student.inflight == 2 and loop.num_inflight == 2
        student.gate.set()
        await runner
        return loop

    loop = asyncio.run(main())
    assert student.max_inflight == 2 and len(loop.sink.samples) == 6


def test_default_max_inflight_tasks_resolution(fakes):
    args = fakes.args(
        max_inflight_tasks=-1, max_staleness=3, per_device_train_batch_size=2, gradient_accumulation_steps=4
    )
    assert resolve_max_inflight_tasks(args, num_ranks=2) == 3 * 16
    assert (
        resolve_max_inflight_tasks(fakes.args(max_inflight_tasks=-1, max_staleness=0, per_device_train_batch_size=5))
        == 5
    )
    with pytest.raises(ValueError, match="max_inflight_tasks=0"):
        resolve_max_inflight_tasks(fakes.args(max_inflight_tasks=0))
    assert resolve_max_inflight_tasks(fakes.args(max_inflight_tasks=7)) == 7


def test_policy_version_is_read_when_the_task_starts(fakes):
    student = fakes.Student()

    async def main():
        student.gate = asyncio.Event()
        loop, _ = _loop(fakes, [fakes.row("a")], student=student, policy_version=3)
        runner = asyncio.create_task(loop.run())
        for _ in range(20):
            await asyncio.sleep(0)
        loop.update_policy_version(4)  # a weight sync while the task is generating
        student.gate.set()
        await runner
        return loop

    loop = asyncio.run(main())
    assert loop.sink.samples[0].policy_version == 3


def test_backpressure_is_lease_wait_plus_blocked_put(fakes):
    clock = fakes.Clock()
    sink = fakes.Sink()

    async def main():
        sink.gate = asyncio.Event()
        loop, metrics = _loop(
            fakes, [fakes.row("a")], clock=clock, sink=sink, source=fakes.Source([fakes.row("a")], 0.5)
        )
        runner = asyncio.create_task(loop.run())
        for _ in range(20):
            await asyncio.sleep(0)
        clock.now += 2.0  # the queue is full for 2 s
        sink.gate.set()
        await runner
        return metrics

    metrics = asyncio.run(main())
    assert _values(metrics, "rollout/backpressure_s") == [2.5]


def test_stop_cancels_inflight_tasks_and_releases_their_leases(fakes):
    student = fakes.Student()

    async def main():
        student.gate = asyncio.Event()  # never opens
        loop, _ = _loop(fakes, [fakes.row("a"), fakes.row("b")], student=student, max_inflight_tasks=2)
        runner = asyncio.create_task(loop.run())
        for _ in range(20):
            await asyncio.sleep(0)
        await loop.stop()
        await runner
        return loop

    loop = asyncio.run(main())
    assert sorted(loop.prompt_source.released) == [(0, "cancelled"), (1, "cancelled")]
    assert loop.sink.samples == [] and not loop.is_running


def test_teacher_temperature_passed_when_score_takes_it_else_warned(fakes, caplog):
    tempered = fakes.TemperatureTeacher()
    loop, _ = _loop(fakes, [fakes.row("a")], teachers=tempered, args=fakes.args(teacher_temperature=0.7))
    asyncio.run(loop.run())
    assert tempered.requests[0][3] == {"temperature": 0.7}
    plain = fakes.Teacher()
    with caplog.at_level(logging.WARNING, logger="rlasync.algorithms.distill.loop"):
        loop, _ = _loop(fakes, [fakes.row("a")], teachers=plain, args=fakes.args(teacher_temperature=0.7))
    assert "takes no temperature" in caplog.text
    asyncio.run(loop.run())
    assert plain.requests[0][3] == {} and len(loop.sink.samples) == 1


def test_student_request_has_no_logprobs_and_the_configured_sampling(fakes):
    student = fakes.Student()
    loop, _ = _loop(
        fakes,
        [fakes.row("a"), fakes.row("b")],
        student=student,
        args=fakes.args(max_completion_length=5, temperature=0.6, top_p=0.9),
    )
    asyncio.run(loop.run())
    sampling = [s for _, s in student.requests]
    assert all(s.num_logprobs == 0 and s.max_tokens == 5 and s.temperature == 0.6 and s.top_p == 0.9 for s in sampling)
    assert sampling[0].seed != sampling[1].seed


def test_log_completions_prints_every_n_samples(fakes, capsys):
    loop, _ = _loop(
        fakes,
        [fakes.row(c) for c in "abcde"],
        max_inflight_tasks=1,
        args=fakes.args(log_completions=True, log_completions_steps=2),
    )
    asyncio.run(loop.run())
    assert capsys.readouterr().out.count("[distill] prompt") == 2


def test_teacher_and_student_rejections_fail_only_their_task_counted_under_their_own_cause(fakes):
    """A rejected teacher score is a task failure like a rejected student request (never swallowed, never stops
    the loop), and the cause says which side rejected it."""
    failures = []

    class Source(fakes.Source):
        def report_failure(self, lease, cause, detail):
            failures.append((lease.row_index, cause, detail))

    student, teacher = fakes.Student(), fakes.Teacher()
    student.reject = lambda prompt_ids: len(prompt_ids) > 4
    loop, metrics = _loop(
        fakes,
        [fakes.row("a"), fakes.row("long prompt")],
        student=student,
        teachers=teacher,
        source=Source([fakes.row("a"), fakes.row("long prompt")]),
    )
    asyncio.run(loop.run())
    assert [cause for _, cause, _ in failures] == ["rejected"]  # the student's ("prompt too long": no max_model_len)
    assert len(loop.sink.samples) == 1

    failures.clear()
    teacher = fakes.Teacher()
    teacher.reject = True
    loop, metrics = _loop(fakes, [fakes.row("a")], teachers=teacher, source=Source([fakes.row("a")]))
    asyncio.run(loop.run())
    assert loop.sink.samples == [] and loop.prompt_source.released == [(0, "failed")]
    assert [cause for _, cause, _ in failures] == ["teacher_rejected"]
    assert "teacher 'default' rejected the scoring request" in failures[0][2]
    assert _values(metrics, "rollout/failed_task_count") == [1.0]


def test_failure_cause_tells_a_too_long_prompt_apart_for_either_side(fakes):
    from rlasync.algorithms.distill.policy import TeacherRejectedError
    from rlasync.engine.base import RequestRejectedError

    loop, _ = _loop(fakes, [fakes.row("a")])
    policy = loop  # the loop is the policy (AsyncDistillationLoop subclasses DistillationPolicy)
    too_long = RequestRejectedError("prompt of 600 tokens is longer than max_model_len=512")
    assert policy.failure_cause(too_long) == "too_long"
    assert policy.failure_cause(TeacherRejectedError(f"teacher 't' rejected: {too_long}")) == "teacher_too_long"
    assert policy.failure_cause(RuntimeError("boom")) == "error"
