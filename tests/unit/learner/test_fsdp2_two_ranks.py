"""FSDP2 over two gloo ranks on CPU, tree-packed: GRPO groups whose prompts are shared inside each rank's row,
gradient checkpointing on, the chunked head over several chunks with the sampler's top-K (score centering). One step of each rank's `GrpoLearnerStep` on its own
rows must land on the parameters of the obvious one-process reference: every row of both ranks scored by the
unsharded model (head in one chunk), each rank's `grpo_loss` backward, the gradients averaged over the two ranks
(what FSDP2's reduce-scatter does), one SGD step.

The ranks run this file as a script: `python test_fsdp2_two_ranks.py RANK WORLD INIT_FILE OUT_DIR`.
"""

import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[3]
VOCAB, WORLD, LR, HEAD_CHUNK = 64, 2, 0.5, 8


def tiny_model():
    from transformers import AutoModelForCausalLM, Qwen3Config

    from rlasync.model import prepare_for_training

    torch.manual_seed(5)
    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        tie_word_embeddings=True,
    )
    return prepare_for_training(AutoModelForCausalLM.from_config(config), gradient_checkpointing=True, compile=False)


def planned_rows(model):
    """Four GRPO groups (prompt 10, completions 3..7) with on-policy sampler log-probs, planned for two ranks.
    Returns (rows[rank][micro_batch], global_terms[micro_batch])."""
    from rlasync.model import sequence_logprobs
    from rlasync.packing import TokenBudgetBatcher, pack
    from rlasync.rollout import RolloutSample

    rng = np.random.default_rng(7)
    samples = []
    for group in range(4):
        prompt = rng.integers(0, VOCAB, 10).tolist()
        seqs = [prompt + rng.integers(0, VOCAB, int(rng.integers(3, 8))).tolist() for _ in range(4)]
        with torch.no_grad():
            lps = sequence_logprobs(model, seqs, [10] * len(seqs), packing="none")
        for seq, lp in zip(seqs, lps):
            sampler = np.zeros(len(seq), np.float32)
            sampler[10:] = lp.numpy() + rng.normal(0, 0.05, len(seq) - 10)  # slightly off-policy: ratios != 1
            mask = np.r_[np.zeros(10, np.int8), np.ones(len(seq) - 10, np.int8)]
            with torch.no_grad():  # the sampler's top-4 (score centering reads them through the head)
                top = torch.topk(model(torch.tensor([seq])).logits[0, :-1].log_softmax(-1), 4, dim=-1)
            ids, vals = np.full((len(seq), 4), -1, np.int64), np.full((len(seq), 4), -np.inf, np.float32)
            ids[1:], vals[1:] = top.indices.numpy(), top.values.numpy()
            samples.append(
                RolloutSample(
                    seq, mask, sampler, float(rng.normal()), group, sampler_topk_ids=ids, sampler_topk_logprobs=vals
                )
            )
    batches = TokenBudgetBatcher(num_ranks=WORLD, token_budget=40).plan(samples)
    rows = [[pack(batch.rows[rank]) for batch in batches] for rank in range(WORLD)]
    global_terms = [sum(rows[r][i].num_trained_tokens for r in range(WORLD)) for i in range(len(batches))]
    return rows, global_terms


def rank_main(rank: int, world: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist

    import rlasync.model.head as head
    from rlasync.algorithms.grpo.learner_step import GrpoLearnerStep
    from rlasync.algorithms.grpo.loss import LossConfig
    from rlasync.learner.parallel import shard_for_training

    torch.set_num_threads(1)
    chunks = []
    default = head.default_chunk_size
    head.default_chunk_size = lambda vocab: chunks.append(vocab) or HEAD_CHUNK  # several chunks per row
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        model = tiny_model()
        rows, global_terms = planned_rows(model)
        scorer = shard_for_training(model)
        optimizer = torch.optim.SGD(scorer.parameters(), lr=LR)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
        step = GrpoLearnerStep(scorer, optimizer, scheduler, LossConfig(), max_grad_norm=math.inf, num_ranks=world)
        metrics = step.step(rows[rank], global_terms)
        updated = {name: p.full_tensor().detach() for name, p in scorer.model.named_parameters()}
    finally:
        dist.destroy_process_group()
        head.default_chunk_size = default
    torch.save({"params": updated, "loss": metrics["loss"], "head_calls": len(chunks)}, Path(out_dir) / f"{rank}.pt")


def reference_step(model, rows, global_terms) -> list[float]:
    from rlasync.algorithms.grpo.loss import LossConfig, grpo_loss
    from rlasync.model import packed_row_to_tensors, packed_token_scores

    losses = []
    for rank_rows in rows:
        total = 0.0
        for row, terms in zip(rank_rows, global_terms):
            t = packed_row_to_tensors(row)
            scores = packed_token_scores(model, t)
            loss, _ = grpo_loss(
                scores.logprobs,
                t.sampler_logprobs,
                t.advantages,
                t.sample_index,
                config=LossConfig(),
                num_tokens_global=float(terms),
                num_ranks=WORLD,
                grad_accum_steps=len(rank_rows),
                entropy=scores.entropy.detach(),
                head_trainer_logprobs=scores.extra_logprobs,
                head_sampler_logprobs=t.sampler_topk_logprobs,
            )
            loss.backward()
            total += float(loss.detach())
        losses.append(total)
    with torch.no_grad():
        for p in model.parameters():
            p -= LR * p.grad / WORLD  # FSDP2 averages the ranks' gradients
    return losses


@pytest.mark.slow
def test_two_fsdp2_ranks_on_shared_prefix_rows_take_the_reference_step(tmp_path):
    model = tiny_model()
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    rows, global_terms = planned_rows(model)
    assert len(global_terms) >= 2  # micro-batches: gradient accumulation is exercised too
    assert all(r.num_raw_tokens > r.num_tokens for rank_rows in rows for r in rank_rows)  # prompts shared per row
    assert all(r.num_trained_tokens > HEAD_CHUNK for rank_rows in rows for r in rank_rows)  # the head chunks
    expected_losses = reference_step(model, rows, global_terms)

    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, str(rank), str(WORLD), str(tmp_path / "pg"), str(tmp_path)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(WORLD)
    ]
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(outputs)
    results = [torch.load(tmp_path / f"{rank}.pt") for rank in range(WORLD)]
    for rank, result in enumerate(results):
        assert result["loss"] == pytest.approx(expected_losses[rank], rel=1e-5, abs=1e-7)
        assert result["head_calls"] > 0
        for name, p in model.named_parameters():
            torch.testing.assert_close(result["params"][name], p.detach(), atol=2e-6, rtol=1e-5, msg=name)
    moved = [n for n, p in model.named_parameters() if not torch.equal(p.detach(), before[n])]
    assert len(moved) == len(before)  # every parameter took part, so the comparison covers them all


if __name__ == "__main__":
    rank_main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
