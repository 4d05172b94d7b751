"""The distillation loop's settings: the common RolloutSettings (one task per lease, the in-flight budget, the
student's sampling) and the teachers' scoring, read from an AsyncDistillationConfig."""

import pytest

from rlasync.algorithms.distill.settings import TeacherSettings, resolve_max_inflight_tasks, rollout_settings
from rlasync.config import AsyncDistillationConfig


def test_rollout_settings_from_a_distillation_config():
    config = AsyncDistillationConfig(
        max_inflight_tasks=-1,
        max_staleness=2,
        per_device_train_batch_size=3,
        teacher_top_k=5,
        teacher_temperature=0.5,
        heartbeat_stale_after_s=9.0,
    )
    settings = rollout_settings(config, num_ranks=2)
    assert (settings.group_size, settings.max_concurrent, settings.heartbeat_timeout_s) == (1, 12, 9.0)
    assert TeacherSettings.from_config(config) == TeacherSettings(teacher_top_k=5, teacher_temperature=0.5)
    assert rollout_settings(config, max_inflight_tasks=3).max_concurrent == 3
    params = settings.sampling.with_seed(1)
    assert params.num_logprobs == 0 and not params.return_sampling_mask
    with pytest.raises(ValueError, match="max_inflight_tasks=0"):
        rollout_settings(AsyncDistillationConfig(max_inflight_tasks=0))


def test_teacher_settings_refuse_a_negative_top_k():
    with pytest.raises(ValueError, match="teacher_top_k=-1"):
        TeacherSettings(teacher_top_k=-1)
    assert resolve_max_inflight_tasks(AsyncDistillationConfig(max_inflight_tasks=7)) == 7
