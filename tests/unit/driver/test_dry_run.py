"""`rlasync train CONFIG --dry-run` on the CPU (rlasync.driver.dry_run): the plan of the configured cluster without
Ray or any actor: placement as Ray packs the actors' requests, the engines' KV cache as the built-in engine sizes
it, the learner rank's memory estimated (no GPU here), and the fit: exit 0 when it fits, 1 with the numbers when it
does not, 2 on bad input. The CLI runs in this process (seconds: the model is built on the meta device)."""

import json
import sys
from pathlib import Path

import pytest

from rlasync.cli import main
from rlasync.driver.dry_run import GIB, ActorPlan, engine_memory, place_on_gpus
from rlasync.engine.kv_cache import kv_bytes_per_token, kv_cache_tokens

REPO = Path(__file__).resolve().parents[3]
QWEN2_7B = {  # Qwen2-7B's shape (config.json only: the dry run builds the model on the meta device)
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "num_hidden_layers": 28,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "vocab_size": 152064,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}


@pytest.fixture
def qwen2_7b(tmp_path):
    folder = tmp_path / "qwen2-7b"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(QWEN2_7B))
    return folder


RAY_INITS: list[tuple] = []


@pytest.fixture(autouse=True)
def _no_ray_init(monkeypatch):
    """`ray.init` recorded and refused while a test of this module runs (the suite's Ray cluster may already be up
    in this process, so "not initialised" alone would not say whether the dry run started one)."""
    RAY_INITS.clear()
    if "ray" in sys.modules:

        def refuse(*args, **kwargs):
            RAY_INITS.append((args, kwargs))
            raise AssertionError("the dry run called ray.init")

        monkeypatch.setattr(sys.modules["ray"], "init", refuse)


def dry_run(capsys, *args: str) -> tuple[int, str]:
    was_up = "ray" in sys.modules and sys.modules["ray"].is_initialized()
    code = main(["train", *args, "--dry-run", "--set", "output_dir=/tmp/rlasync-dry-run-test"])
    captured = capsys.readouterr()
    assert not RAY_INITS, "the dry run must not start Ray"
    assert was_up or "ray" not in sys.modules or not sys.modules["ray"].is_initialized(), "the dry run started Ray"
    return code, captured.out + captured.err


def test_quickstart_prints_the_cpu_placement_and_fits(capsys):
    code, out = dry_run(capsys, str(REPO / "configs/quickstart.yaml"))
    assert code == 0, out
    for line in ("generation actor 0             0.5 CPU  0 GPU  -> CPU", "learner rank 0", "rollout actor 0", "queue"):
        assert line in out, out
    assert "host memory estimated" in out and "fits: 0 GPU(s), 1.35 CPUs" in out, out


def test_a_two_gpu_layout_places_engine_and_learner_on_their_own_gpus(capsys):
    code, out = dry_run(capsys, str(REPO / "configs/countdown_gpu.yaml"), "--json", "--gpu-memory-gib", "80")
    assert code == 0, out
    plan = json.loads(out.strip().splitlines()[-1])
    actors = {a["label"]: a for a in plan["actors"]}
    assert actors["generation actor 0"]["gpu_ids"] == [0] and actors["learner rank 0"]["gpu_ids"] == [1]
    assert [actors[f"rollout actor {i}"]["gpu_ids"] for i in range(4)] == [[]] * 4
    assert plan["num_gpus"] == 2 and plan["fits"] and plan["gpu_bytes"] == 80 * GIB
    # SmolLM2-135M: 30 layers x 3 KV heads x 64 x 2 x bf16; 256 seqs x 2048 tokens fit 90% of 80 GiB: the cap wins
    kv_tokens = 256 * 2048
    assert (
        f"{kv_tokens} tokens x 30 layers x 3 KV heads x 64 head dim x 2 x 2 bytes"
        in actors["generation actor 0"]["note"]
    )
    assert (
        not plan["learner"]["measured"]
        and "no GPU: learner memory estimated, not measured" in plan["learner"]["summary"]
    )


def test_one_gpu_shared_by_halves_fits_and_both_land_on_gpu_0(capsys):
    code, out = dry_run(
        capsys,
        str(REPO / "configs/countdown_gpu.yaml"),
        "--set",
        "cluster.learner_num_gpus=0.5",
        "--set",
        "cluster.generation_num_gpus=0.5",
    )
    assert code == 0, out
    assert "-> GPU 0" in out and "GPU 1" not in out and "fits: 1 GPU(s)" in out, out


def test_a_7b_model_on_a_quarter_of_a_gpu_is_refused_with_the_numbers(capsys, qwen2_7b):
    code, out = dry_run(
        capsys,
        str(REPO / "configs/countdown_gpu.yaml"),
        "--set",
        f"model={qwen2_7b}",
        "--set",
        "cluster.learner_num_gpus=0.25",
    )
    assert code == 1, out
    assert "does not fit:" in out and "7615.6M parameters" in out, out
    # float32 master weights + gradients + AdamW moments alone: 7.6e9 x 16 bytes = 113 GiB, a quarter is 35 GiB
    problem = next(line for line in out.splitlines() if "learner rank 0 needs" in line)
    needed = float(problem.split("needs ")[1].split(" GiB")[0])
    assert needed > 113 and "asks Ray for 0.25 of a GPU (35.0 GiB of 139.8" in problem, problem
    assert "cluster.learner_num_gpus" in problem


def test_a_hub_id_not_in_the_cache_is_bad_input_naming_the_model(capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    code, out = dry_run(capsys, str(REPO / "configs/quickstart.yaml"), "--set", "model=nobody-here/no-such-model")
    assert code == 2, out
    assert "model='nobody-here/no-such-model'" in out and "without downloading" in out, out


def test_fractions_share_a_gpu_and_whole_numbers_take_their_own():
    actors = [ActorPlan(f"a{i}", "generation", 1.0, gpus) for i, gpus in enumerate([0.5, 1.0, 0.25, 0.5, 2.0, 0.0])]
    place_on_gpus(actors)
    assert [a.gpu_ids for a in actors] == [(0,), (1,), (0,), (2,), (3, 4), ()]


def test_the_engine_kv_cache_is_sized_as_the_built_in_engine_sizes_it():
    from transformers import Qwen2Config

    config = Qwen2Config(**{k: v for k, v in QWEN2_7B.items() if k not in ("architectures", "model_type")})
    per_token = kv_bytes_per_token(28, 4, 128, 2)
    assert per_token == 57344
    kwargs = {"max_model_len": 4096, "kv_cache_tokens": 8192}
    memory, note = engine_memory(config, "torch", kwargs, gpu_bytes=80 * GIB, used_bytes=0)
    assert "8192 tokens" in note and memory - 8192 * per_token > 14 * GIB  # bf16 weights of 7.6B params
    # no kv_cache_tokens: 90% of the GPU minus what is used, at most max_num_seqs x max_model_len
    free = engine_memory(config, "torch", {"max_model_len": 32768}, gpu_bytes=80 * GIB, used_bytes=40 * GIB)
    capped = engine_memory(config, "torch", {"max_model_len": 64, "max_num_seqs": 4}, gpu_bytes=80 * GIB, used_bytes=0)
    assert free[0] < 0.9 * 80 * GIB and "256 tokens" in capped[1]
    assert engine_memory(config, "vllm", {"gpu_memory_utilization": 0.3}, gpu_bytes=80 * GIB, used_bytes=0)[0] == int(
        0.3 * 80 * GIB
    )
    with pytest.raises(ValueError, match="kv_cache_tokens=100 is below max_model_len=4096"):
        kv_cache_tokens(100, max_model_len=4096, max_num_seqs=1, bytes_per_token=1, budget_bytes=1)


def test_with_a_gpu_the_learner_rank_is_measured_on_samples_that_fill_its_rows(capsys, monkeypatch):
    """The measured branch, with the GPU and the child process stood in for: what the rank is handed, and how its
    peak enters the plan."""
    import types

    import torch

    import rlasync.learner.dry_run as rank

    calls = []

    def measured(model, settings, world_size, samples, *, steps):
        calls.append((settings, world_size, samples, steps))
        return {"peak_gib": 3.0, "world_size": world_size}

    monkeypatch.setattr(rank, "measure_in_subprocess", measured)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _: types.SimpleNamespace(total_memory=80 * GIB))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda _: "Stand-in GPU")
    code, out = dry_run(capsys, str(REPO / "configs/countdown_gpu.yaml"), "--json")
    assert code == 0, out
    plan = json.loads(out.strip().splitlines()[-1])
    ((settings, world_size, samples, steps),) = calls
    assert world_size == 1 and steps == 2 and settings.token_budget == 16384 and settings.bf16
    groups, completion = len({s.group_id for s in samples}), int(samples[0].completion_mask.sum())
    assert len(samples) == 8 * groups and completion <= 1024  # num_generations per group; max_completion_length
    assert groups * (len(samples[0]) + 7 * completion) == 16384  # one row of token_budget, full (step_shape)
    four_ranks = dry_run(capsys, str(REPO / "configs/countdown_gpu.yaml"), "--set", "cluster.num_learners=4")
    assert four_ranks[0] == 0 and calls[-1][1] == 4, four_ranks[1]
    assert len(calls[-1][2]) == 4 * len(samples)  # the whole step: every rank's row (each rank plans them all)
    assert {len(s) for s in samples} == {len(samples[0])} and samples[0].sampler_topk_ids.shape[1] == 8
    learner = next(a for a in plan["actors"] if a["label"] == "learner rank 0")
    assert learner["memory_bytes"] == int(3.5 * GIB) and learner["note"].startswith("measured")
    assert plan["learner"]["measured"] and plan["gpu_memory_source"] == "torch.cuda: Stand-in GPU"


def test_a_measured_step_that_runs_out_of_memory_is_a_layout_that_does_not_fit(capsys, monkeypatch):
    import types

    import torch

    import rlasync.learner.dry_run as rank

    def out_of_memory(*args, **kwargs):
        raise RuntimeError(
            "the dry run's learner rank failed (exit 1):\n...\ntorch.OutOfMemoryError: CUDA out of memory."
        )

    monkeypatch.setattr(rank, "measure_in_subprocess", out_of_memory)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _: types.SimpleNamespace(total_memory=80 * GIB))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda _: "Stand-in GPU")
    code, out = dry_run(capsys, str(REPO / "configs/countdown_gpu.yaml"))
    assert code == 1, out
    assert "learner rank 0: the measured step failed: torch.OutOfMemoryError: CUDA out of memory." in out, out


def stand_in_gpu(monkeypatch, measured: list) -> None:
    """A GPU of 139.8 GiB (an H200) and a measuring child that records its calls and reports a 3 GiB peak."""
    import types

    import torch

    import rlasync.learner.dry_run as rank

    def measure(model, settings, world_size, samples, *, steps):
        measured.append(model)
        return {"peak_gib": 3.0, "world_size": world_size}

    monkeypatch.setattr(rank, "measure_in_subprocess", measure)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    total = int(139.8 * GIB)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _: types.SimpleNamespace(total_memory=total))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda _: "Stand-in GPU")


def test_on_a_gpu_a_rank_whose_estimate_exceeds_its_share_is_refused_with_the_numbers_unmeasured(
    capsys, monkeypatch, qwen2_7b
):
    """A 7B model on a quarter of an H200: its step would run out of memory, so it is not run; the estimate's numbers
    refuse the layout as they do on the CPU (and a config-only folder needs no weights for that)."""
    measured: list = []
    stand_in_gpu(monkeypatch, measured)
    args = (str(REPO / "configs/countdown_gpu.yaml"), "--set", f"model={qwen2_7b}")
    code, out = dry_run(capsys, *args, "--set", "cluster.learner_num_gpus=0.25")
    assert code == 1 and not measured, out
    assert "estimated, not measured (the estimate is more than the 34.9 GiB the rank asks for" in out, out
    problem = next(line for line in out.splitlines() if "learner rank 0 needs" in line)
    assert float(problem.split("needs ")[1].split(" GiB")[0]) > 113, problem
    assert "asks Ray for 0.25 of a GPU (34.9 GiB of 139.8" in problem and "cluster.learner_num_gpus" in problem
    assert "measured step failed" not in out, out


def test_on_a_gpu_a_config_only_folder_that_fits_is_estimated_and_says_why(capsys, monkeypatch, tmp_path):
    measured: list = []
    stand_in_gpu(monkeypatch, measured)
    small = {**QWEN2_7B, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4}
    folder = tmp_path / "small"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({**small, "num_key_value_heads": 2, "vocab_size": 1024}))
    code, out = dry_run(capsys, str(REPO / "configs/countdown_gpu.yaml"), "--set", f"model={folder}")
    assert code == 0 and not measured, out
    assert f"estimated, not measured (no weights in {folder}: a config-only folder)" in out, out
    (folder / "model.safetensors").write_bytes(b"")  # weights present: the step is measured
    code, out = dry_run(capsys, str(REPO / "configs/countdown_gpu.yaml"), "--set", f"model={folder}")
    assert code == 0 and measured == [str(folder)] and "peak 3.00 GiB measured" in out, out


def test_distillation_places_its_local_teacher_as_an_engine(capsys):
    code, out = dry_run(
        capsys,
        str(REPO / "configs/distill_quickstart.yaml"),
        "--json",
        "--set",
        "cluster.generation_num_gpus=0.25",
        "--set",
        "cluster.learner_num_gpus=0.5",
    )
    assert code == 0, out
    plan = json.loads(out.strip().splitlines()[-1])
    actors = {a["label"]: a for a in plan["actors"]}
    assert plan["algorithm"] == "distill" and plan["num_gpus"] == 1, plan
    teacher, student = actors["teacher 'default'"], actors["generation actor 0"]
    assert teacher["gpu_ids"] == student["gpu_ids"] == actors["learner rank 0"]["gpu_ids"] == [0]
    assert "KV cache" in teacher["note"] and teacher["memory_bytes"] > 0.25 * GIB  # weights + KV + CUDA context
    assert "distillation rollout actor 0" in actors and "estimated" in plan["learner"]["summary"]
