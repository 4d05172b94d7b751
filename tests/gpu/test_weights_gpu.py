"""Weight sync and the learner group on CUDA.

  * NCCL WeightGroup (two processes, one GPU each): bucketed broadcast GPU -> GPU reproduces every tensor; a stalled
    sender is a TimeoutError naming the group, not a hang.
  * gloo fallback from a GPU sender (one GPU is enough): tensors go through the CPU and arrive equal.
  * Two LearnerActor ranks on two GPUs (Ray, NCCL training group, FSDP2): metrics reduced over ranks, a checkpoint
    resumes with the same weights and the same next update.

Run through the device tool: `pytest -m gpu tests/gpu/test_weights_gpu.py`.
"""

import os
import threading

import numpy as np
import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

two_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 visible GPUs")


def tiny_model(seed=0, vocab=256, tied=True):
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(seed)
    config = Qwen3Config(
        vocab_size=vocab,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        tie_word_embeddings=tied,
    )
    return AutoModelForCausalLM.from_config(config)


def source_model():
    model = tiny_model(1)
    model.model.norm.weight.data = model.model.norm.weight.data.to(torch.bfloat16)  # a second dtype in the stream
    return model


# one rank of an NCCL weight group, run as its own process: argv = rank port bucket_bytes mode ("send" | "stall")
RANK_SCRIPT = r"""
import os, sys, time
import torch
from tests_gpu_weights_source import source_model  # written by the test into a folder on PYTHONPATH
from rlasync.weights import build_manifest, stream_parameters
from rlasync.weights.broadcast import WeightGroup

rank, port, bucket_bytes, mode = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
device = torch.device("cuda", rank)
torch.cuda.set_device(device)
model = source_model().to(device)
manifest = build_manifest(model)
group = WeightGroup.open("127.0.0.1", port, rank, 2, timeout_s=60.0, backend="nccl", device=device,
                         bucket_bytes=bucket_bytes)
if mode == "stall":
    group.timeout_s = 3.0
    if rank == 1:
        try:
            list(group.receive(manifest))
            result = "no error"
        except TimeoutError as exc:
            result = f"TimeoutError: {exc}"
    else:
        time.sleep(10)  # alive, but never sends
        result = "idle"
    print("RESULT", result, flush=True)
    os._exit(0)  # a stalled NCCL kernel cannot be torn down cleanly: leave without destroying the group
if rank == 0:
    group.send(stream_parameters(model), manifest)
    result = "sent"
else:
    received = {name: tensor.clone() for name, tensor in group.receive(manifest)}
    expected = dict(stream_parameters(model))
    bad = [n for n, t in expected.items() if received[n].device != device or not torch.equal(received[n], t)]
    result = f"mismatch {bad}" if bad else "equal"
print("RESULT", result, flush=True)
"""


def run_nccl_pair(tmp_path, bucket_bytes, mode="send"):
    import inspect
    import subprocess
    import sys
    from pathlib import Path

    from rlasync.weights.broadcast import free_port

    helper = tmp_path / "tests_gpu_weights_source.py"
    helper.write_text("import torch\n\n" + inspect.getsource(tiny_model) + "\n\n" + inspect.getsource(source_model))
    root = str(Path(__file__).resolve().parents[2])
    path = [str(tmp_path), root] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}  # the helper's folder and the repository
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK_SCRIPT, str(rank), str(port), str(bucket_bytes), mode],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=root,
        )
        for rank in range(2)
    ]
    out = {}
    for rank, proc in enumerate(procs):
        try:
            text, _ = proc.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            proc.kill()
            text, _ = proc.communicate()
        lines = [line for line in text.splitlines() if line.startswith("RESULT ")]
        out[rank] = lines[-1].removeprefix("RESULT ") if lines else f"no result (rc {proc.returncode}): {text[-2000:]}"
    return out


@two_gpus
@pytest.mark.parametrize("bucket_bytes", [1, 64 << 10, 64 << 20], ids=["per_tensor", "buckets", "one_bucket"])
def test_nccl_bucketed_broadcast_gpu_to_gpu(tmp_path, bucket_bytes):
    assert run_nccl_pair(tmp_path, bucket_bytes) == {0: "sent", 1: "equal"}


@two_gpus
def test_nccl_stalled_sender_is_a_timeout(tmp_path):
    out = run_nccl_pair(tmp_path, 1 << 20, mode="stall")
    assert out[1].startswith("TimeoutError") and "weight-sync group 127.0.0.1" in out[1] and "(nccl)" in out[1], out


def test_gloo_fallback_from_a_gpu_sender():
    """The shared-GPU case: the sender's tensors live on the GPU, the group is gloo, the receiver gets CPU tensors."""
    from rlasync.weights import build_manifest, stream_parameters
    from rlasync.weights.broadcast import WeightGroup, free_port

    model = source_model().cuda()
    manifest = build_manifest(model)
    port = free_port()
    received, errors = {}, []

    def receiver():
        try:
            group = WeightGroup.open("127.0.0.1", port, 1, 2, 30.0, backend="gloo", bucket_bytes=64 << 10)
            received.update({name: tensor.clone() for name, tensor in group.receive(manifest)})
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    thread = threading.Thread(target=receiver, daemon=True)
    thread.start()
    sender = WeightGroup.open("127.0.0.1", port, 0, 2, 30.0, backend="gloo", bucket_bytes=64 << 10)
    sender.send(stream_parameters(model), manifest)
    thread.join(60)
    assert not errors, errors
    for name, tensor in stream_parameters(model):
        assert received[name].device.type == "cpu" and torch.equal(received[name], tensor.cpu()), name


# ---- two learner ranks on two GPUs (Ray) ---------------------------------------------------------------------------


def make_samples(vocab, num_groups=6, group_size=4, seed=0):
    from rlasync.rollout import RolloutSample

    rng = np.random.default_rng(seed)
    samples = []
    for group in range(num_groups):
        prompt = rng.integers(0, vocab, int(rng.integers(8, 16))).tolist()
        advantages = rng.normal(size=group_size)
        for advantage in advantages - advantages.mean():
            completion = rng.integers(0, vocab, int(rng.integers(6, 12))).tolist()
            ids = np.array(prompt + completion)
            mask = np.r_[np.zeros(len(prompt), np.int8), np.ones(len(completion), np.int8)]
            sampler = np.where(mask == 1, -np.log(vocab) + rng.normal(0, 0.1, len(ids)), 0.0).astype(np.float32)
            samples.append(RolloutSample(ids, mask, sampler, float(advantage), group))
    return samples


@two_gpus
def test_two_learner_ranks_on_two_gpus_reduce_metrics_and_resume(tmp_path):
    ray = pytest.importorskip("ray")
    from actors.learner import LearnerActor
    from rlasync.algorithms.grpo.spec import GRPO
    from rlasync.config import AsyncGRPOConfig
    from rlasync.packing import TokenBudgetBatcher

    model_dir = tmp_path / "model"
    tiny_model(2).save_pretrained(model_dir)
    args = AsyncGRPOConfig(
        output_dir=str(tmp_path),
        max_steps=10,
        learning_rate=1e-3,
        gradient_checkpointing=True,
        seed=0,
        score_centering=False,
        num_sampler_logprobs=0,
        dtype="float32",
    )
    samples = make_samples(256)
    budget = 128
    settings = GRPO.learner_settings(args, token_budget=budget)
    per_rank = [0, 0]
    for batch in TokenBudgetBatcher(2, budget).plan(samples):
        for rank, row in enumerate(batch.pack()):
            per_rank[rank] += len(row.target_ids)

    started = not ray.is_initialized()
    if started:
        ray.init(num_gpus=2, include_dashboard=False, log_to_driver=True)

    def group(resume_dir=None):
        learners = [
            LearnerActor.options(num_gpus=1, num_cpus=1).remote(
                rank=rank, world_size=2, model=str(model_dir), settings=settings
            )
            for rank in range(2)
        ]
        master = ray.get(learners[0].address.remote(), timeout=120)
        infos = ray.get([learner.setup.remote(master, 120.0, resume_dir) for learner in learners], timeout=600)
        assert all(info["device"].startswith("cuda") and info["sharded"] for info in infos), infos
        return learners

    def checksum(learners):
        values = ray.get([learner.checksum.remote() for learner in learners], timeout=120)
        assert values[0] == pytest.approx(values[1], rel=1e-9)
        return values[0]

    def stop(learners):
        ray.get([learner.close.remote() for learner in learners], timeout=60)
        for learner in learners:
            ray.kill(learner)

    try:
        refs = [ray.put(sample) for sample in samples]
        learners = group()
        try:
            first, second = ray.get([learner.train_step.remote(refs) for learner in learners], timeout=600)
            assert second == []
            metrics = dict(first)
            assert metrics["batch/trained_tokens_per_step"] == sum(per_rank)
            assert metrics["entropy"][1] == sum(per_rank)
            assert np.isfinite(metrics["grad_norm"]) and np.isfinite(metrics["loss"])
            checkpoint = tmp_path / "checkpoint-1"
            ray.get([learner.save.remote(str(checkpoint)) for learner in learners], timeout=600)
            saved = checksum(learners)
            ray.get([learner.train_step.remote(refs) for learner in learners], timeout=600)
            two_steps = checksum(learners)
        finally:
            stop(learners)
        resumed = group(str(checkpoint))
        try:
            assert checksum(resumed) == pytest.approx(saved, rel=1e-7)
            ray.get([learner.train_step.remote(refs) for learner in resumed], timeout=600)
            assert checksum(resumed) == pytest.approx(two_steps, rel=1e-5)
        finally:
            stop(resumed)
    finally:
        if started:
            ray.shutdown()
