"""The trainers build a RunSpec (no Ray): the rollout kind and its arguments, the learner objective, the queue
settings, the horizon, the hang limit; and train() makes its one call into actors/ with it."""

import json
import sys
import types

import pytest

from rlasync.algorithms import registry
from rlasync.config import AsyncDistillationConfig, AsyncGRPOConfig
from rlasync.rewards import last_number_reward
from rlasync.trainers import AsyncDistillationTrainer, AsyncGRPOTrainer

ROWS = [{"prompt": [{"role": "user", "content": f"What is {i} + 1?"}], "answer": str(i + 1)} for i in range(10)]


def grpo(tmp_path, **changes):
    args = AsyncGRPOConfig(output_dir=str(tmp_path), **{"max_steps": 3, **changes})
    return AsyncGRPOTrainer(model="some/model", reward_funcs=last_number_reward, args=args, train_dataset=ROWS)


def test_grpo_spec(tmp_path):
    spec = grpo(tmp_path).build_spec(None)
    assert spec.algorithm is registry.get("grpo") and spec.rollout.reward_funcs == [last_number_reward]
    assert spec.rollout.loop_kwargs == {"reward_funcs": [last_number_reward]}  # no tools, no environments
    assert spec.algorithm.reward_actors and not spec.algorithm.teachers and spec.algorithm.group_size(spec.config) == 8
    assert spec.horizon == 3 and spec.model == "some/model"
    assert spec.queue.num_rows == 10 and spec.queue.num_epochs is None  # max_steps ends the run: endless stream
    assert spec.hang_timeout_s == spec.config.rollout_worker_timeout and spec.start_step == 0 and spec.version == 0
    assert set(spec.requests) == {"generation", "learner", "rollout", "reward", "queue"}
    epochs = grpo(tmp_path, max_steps=-1, num_train_epochs=2.0).build_spec(None)
    assert epochs.horizon is None and epochs.queue.num_epochs == 2.0


def test_distillation_spec(tmp_path):
    args = AsyncDistillationConfig(
        output_dir=str(tmp_path),
        max_steps=-1,
        num_train_epochs=1.0,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=1,
        teacher_server_urls={"a": "http://localhost:1", "b": "http://localhost:2"},
    )
    trainer = AsyncDistillationTrainer(model="student", args=args, train_dataset=ROWS)
    spec = trainer.build_spec(None)
    assert (
        spec.algorithm is registry.get("distillation") and spec.algorithm.rollout_name == "distillation rollout actor"
    )
    assert spec.algorithm.teachers and spec.algorithm.group_size(args) == 1 and spec.algorithm.engine_arg == "student"
    assert spec.horizon == 5 and spec.learner.max_steps == 5  # the epoch ceiling: 10 rows / 2 per step
    assert spec.learner.teacher_ids == ["a", "b"] and spec.rollout.loop_kwargs == {"max_inflight_tasks": 8}
    assert [t.base_url for t in spec.teachers.values()] == ["http://localhost:1", "http://localhost:2"]
    assert spec.hang_timeout_s == args.heartbeat_stale_after_s and spec.hang_setting == "heartbeat_stale_after_s"
    assert "reward" not in spec.requests and spec.requests["teacher client"][0] == 2
    assert not hasattr(trainer, "tools") and not hasattr(trainer, "reward_funcs")  # no stubbed GRPO attributes


def test_train_makes_one_launch_call_with_the_spec_and_resumes_from_the_newest_complete_checkpoint(
    tmp_path, monkeypatch
):
    calls = []

    def launch(spec, *, state, actor_ids):
        calls.append(spec)
        state.update(global_step=spec.start_step + 1)
        actor_ids.append("abc")
        return dict(state)

    monkeypatch.setitem(sys.modules, "actors.cluster", types.SimpleNamespace(launch=launch))
    monkeypatch.setattr("rlasync.trainers.preflight.run_preflight", lambda trainer: None)  # "some/model" is fake
    trainer = grpo(tmp_path)
    assert trainer.train()["global_step"] == 1 and trainer.actor_ids == ["abc"]
    assert calls[0].resume_dir is None

    done = tmp_path / "checkpoint-2"
    done.mkdir()
    (done / "trainer_state.json").write_text(json.dumps({"global_step": 2}))
    (done / "rollout_state.json").write_text(json.dumps({"prompt_index": 5, "model_version": 4}))
    (done / "model.safetensors").write_bytes(b"\x02" + b"\x00" * 7 + b"{}")  # a complete one holds its weights
    (tmp_path / "checkpoint-3").mkdir()  # incomplete: skipped
    assert trainer.train(resume_from_checkpoint=True)["global_step"] == 3
    spec = calls[1]
    assert (spec.resume_dir, spec.start_step, spec.version, spec.resume_state.prompt_index) == (str(done), 2, 4, 5)
    assert spec.model == str(done)  # a resumed run loads the checkpoint's weights


def test_distillation_refuses_a_grpo_config():
    with pytest.raises(ValueError, match="args must be an AsyncDistillationConfig"):
        AsyncDistillationTrainer(model="m", args=AsyncGRPOConfig(max_steps=1), train_dataset=ROWS)


def test_two_local_teachers_fit_a_two_core_machine_with_the_default_requests(tmp_path):
    """MOPD with two local teachers: a student engine, two TeacherScorers, a learner, a rollout actor and the queue
    ask for at most 2 CPUs with the cluster defaults (the README's promise), and the resource check passes."""
    from rlasync.driver import check_resources

    args = AsyncDistillationConfig(output_dir=str(tmp_path), max_steps=2)
    trainer = AsyncDistillationTrainer(
        model="org/student", args=args, train_dataset=ROWS, teacher_model={"math": "org/t1", "code": "org/t2"}
    )
    requests = trainer.build_spec(None).requests
    assert requests["teacher"][:2] == (2, args.cluster.teacher_num_cpus)
    assert requests["generation"][0] == 1  # the student's engine alone; teachers are their own role
    assert sum(count * cpus for count, cpus, _ in requests.values()) <= 2.0
    check_resources(requests, {"CPU": 2.0}, autoscaling=False, nodes=[{"CPU": 2.0}])  # raises when short


def test_a_short_cluster_names_the_teacher_fields(tmp_path):
    from rlasync.driver import check_resources

    args = AsyncDistillationConfig(output_dir=str(tmp_path), max_steps=2)
    args.cluster.teacher_num_cpus = 1.0
    trainer = AsyncDistillationTrainer(
        model="org/student", args=args, train_dataset=ROWS, teacher_model={"a": "org/t1", "b": "org/t2"}
    )
    with pytest.raises(ValueError, match=r"2 teacher x 1 \(cluster.teacher_num_cpus\)"):
        check_resources(trainer.build_spec(None).requests, {"CPU": 2.0}, autoscaling=False)
    gpus = {"teacher": (2, 0.1, 1.0), "generation": (1, 0.1, 1.0)}
    with pytest.raises(ValueError, match=r"cluster.generation_num_gpus\)") as error:
        check_resources(gpus, {"CPU": 2.0, "GPU": 1.0}, autoscaling=False)
    assert "teacher_num_gpus" not in str(error.value)  # no such field: a local teacher's GPUs are the engines'


def test_an_eval_dataset_reaches_the_spec_and_bad_ones_are_refused(tmp_path):
    args = AsyncGRPOConfig(output_dir=str(tmp_path), max_steps=3, eval_strategy="steps", eval_steps=1)
    make = lambda eval_dataset: AsyncGRPOTrainer(  # noqa: E731
        model="some/model", reward_funcs=last_number_reward, args=args, train_dataset=ROWS, eval_dataset=eval_dataset
    )
    spec = make(ROWS[:3]).build_spec(None)
    assert spec.eval_dataset == ROWS[:3] and spec.eval_steps_per_epoch == 10  # 10 rows x 8 generations / 8 a step
    assert grpo(tmp_path).build_spec(None).eval_dataset is None
    for bad, message in [
        (None, "pass eval_dataset= to the trainer"),  # eval_strategy="steps" without one
        ([], "eval_dataset is empty"),
        ({"a": ROWS}, "a dict of several eval datasets is not supported"),
        ([{"question": "q"}], "no 'prompt' column"),
        ([{"prompt": "What is 1 + 1?"}], "row 0: the prompt is a plain string"),
    ]:
        with pytest.raises(ValueError, match=message):
            make(bad)
    with pytest.raises(ValueError, match="not supported by distillation"):
        AsyncDistillationConfig(output_dir=str(tmp_path), eval_strategy="epoch")
