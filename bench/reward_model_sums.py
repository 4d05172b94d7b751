"""A real (small) reward model driving GRPO: SmolLM2-135M's backbone with a head fitted to prefer correct sums.

Issue 33's GPU acceptance (docs/rewards.md §2). Two stages, one command:

1. **Fit.** SmolLM2-135M-Instruct loaded as `AutoModelForSequenceClassification` (num_labels=1: its backbone, a new
   `score` head). Two-digit sums ("What is 37 + 48?") each get a correct reply and a wrong one (off by 1-10, digits
   swapped, or another two-digit number), phrased a few ways, rendered exactly as the RewardActor renders them (the
   reward model's own chat template, `RewardModelScorer.render` / `encode`). The pooled last-token features of the
   frozen backbone (the head replaced by an identity) are fitted with an L2 logistic regression; its weights
   (standardisation folded in, bias dropped: a constant shift changes no GRPO advantage) become the `score` head,
   saved with the tokenizer as a reward-model folder. Held-out accuracy and pairwise accuracy (correct above wrong
   for the same question) are recorded.
2. **GRPO.** The policy (SmolLM2-135M-Instruct) trains on two-digit sums with `reward_funcs=[RewardModel(folder)]`
   on one GPU (learner 0.4, generation 0.4, the RewardActor `--reward-gpus` 0.2), and, for comparison, with the exact
   verifier (`last_number_reward`) as the reward (`--runs rm,verifier`). Both runs log the exact verifier's accuracy
   beside the reward (`sums/verifier_accuracy`, from a monitor that scores nothing: its column is None everywhere,
   so it never enters the reward). Per run, the JSON holds the per-step accuracy and reward, the first and last
   windows' accuracy, and the reward model's scoring rate (`rewards/sums_rm/scored_per_s`), batch sizes and the
   most rollout actors merged in one batch.

    python bench/reward_model_sums.py --out bench/results/reward_model_sums_h200.json          # one H200
    python bench/reward_model_sums.py --smoke --device cpu --steps 2 --out /tmp/rm_sums.json   # tiny random, CPU

`--smoke` replaces SmolLM2 with e2e_grpo's tiny random Qwen3 (the fit is then meaningless; it checks the path).
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

RM_NAME = "sums_rm"
KEYS = (
    "sums/verifier_accuracy",
    f"rewards/{RM_NAME}/mean",
    f"rewards/{RM_NAME}/scored_per_s",
    f"rewards/{RM_NAME}/batch_size",
    f"rewards/{RM_NAME}/batch_requests",
    f"rewards/{RM_NAME}/batch_sources_max",
    "rewards/last_number_reward/mean",
    "reward",
    "perf/step_s",
)


class VerifierMonitor:
    """Logs the exact verifier's accuracy (`sums/verifier_accuracy`) and scores nothing (None for every completion:
    its column never enters the reward). Reports through the calling convention's `drain_metrics`."""

    __name__ = "verifier_monitor"

    def __init__(self) -> None:
        self.items: list[tuple[str, float]] = []

    def __call__(self, completions: list[Any], answer: list[Any], **kwargs: Any) -> list[None]:
        from rlasync.rewards import last_number_reward

        self.items += [("sums/verifier_accuracy", float(v or 0.0)) for v in last_number_reward(completions, answer)]
        return [None] * len(completions)

    def drain_metrics(self) -> list[tuple[str, float]]:
        items, self.items = self.items, []
        return items


# ---- stage 1: the reward model --------------------------------------------------------------------------------


def replies(a: int, b: int, rng: random.Random) -> tuple[str, str]:
    """(a correct reply, a wrong reply) to "What is a + b?", in the same phrasing."""
    total = a + b
    wrong = rng.choice(
        [
            total + rng.choice([-1, 1]) * rng.randint(1, 10),
            int(str(total)[::-1]) if str(total)[::-1] != str(total) else total + 11,
            rng.randint(10, 198),
        ]
    )
    if wrong == total:
        wrong = total + 1
    form = rng.choice(["{s}", "The answer is {s}.", "{a} + {b} = {s}", "{a} + {b} is {s}."])
    return form.format(a=a, b=b, s=total), form.format(a=a, b=b, s=wrong)


def fit_samples(n: int, seed: int) -> list[tuple[list[dict[str, str]], list[dict[str, str]], float, int]]:
    """(prompt, completion, label 1/0, question index) pairs: one correct and one wrong reply per question."""
    from rlasync.data.tasks import arithmetic_rows

    rng = random.Random(seed)
    samples = []
    for index, row in enumerate(arithmetic_rows(n, seed, max_operand=99, min_operand=10)):
        a, b = (int(x) for x in row["prompt"][-1]["content"].split("What is ")[-1].split("?")[0].split(" + "))
        right, wrong = replies(a, b, rng)
        samples.append((row["prompt"], [{"role": "assistant", "content": right}], 1.0, index))
        samples.append((row["prompt"], [{"role": "assistant", "content": wrong}], 0.0, index))
    return samples


def pooled_features(scorer: Any, samples: list[Any], batch_size: int) -> Any:
    """The backbone's pooled last-token features of each sample, rendered and padded as the scorer does."""
    import torch

    head, scorer.model.score = scorer.model.score, torch.nn.Identity()
    try:
        ids = [scorer.encode(*scorer.render(prompt, completion)) for prompt, completion, *_ in samples]
        features = []
        with torch.inference_mode():
            for start in range(0, len(ids), batch_size):
                chunk = ids[start : start + batch_size]
                width = max(len(x) for x in chunk)
                input_ids = torch.full((len(chunk), width), scorer.pad_id, dtype=torch.long)
                mask = torch.zeros_like(input_ids)
                for row, x in enumerate(chunk):
                    input_ids[row, : len(x)], mask[row, : len(x)] = torch.tensor(x), 1
                out = scorer.model(input_ids=input_ids.to(scorer.device), attention_mask=mask.to(scorer.device))
                features.append(out.logits.float().cpu())
        return torch.cat(features)
    finally:
        scorer.model.score = head


def fit_head(features: Any, labels: Any, l2: float, steps: int) -> tuple[Any, Any, float]:
    """L2 logistic regression on standardised features; returns (weights on raw features, bias, final loss)."""
    import torch

    mean, std = features.mean(0), features.std(0).clamp_min(1e-6)
    x = (features - mean) / std
    w = torch.zeros(x.shape[1], requires_grad=True)
    b = torch.zeros((), requires_grad=True)
    optimizer = torch.optim.LBFGS([w, b], max_iter=steps, line_search_fn="strong_wolfe")

    def closure() -> Any:
        optimizer.zero_grad()
        loss = torch.nn.functional.binary_cross_entropy_with_logits(x @ w + b, labels) + l2 * (w * w).sum()
        loss.backward()
        return loss

    optimizer.step(closure)  # returns the loss before the first iteration: the final one is evaluated below
    with torch.no_grad():
        loss = torch.nn.functional.binary_cross_entropy_with_logits(x @ w + b, labels) + l2 * (w * w).sum()
    raw = (w / std).detach()
    return raw, (b - (w * mean / std).sum()).detach(), float(loss)


def build_reward_model(args: argparse.Namespace, policy_dir: str, folder: Path) -> dict[str, Any]:
    """Fit the sums head on the backbone's features and save the reward model to `folder`; the fit's numbers."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from rlasync.rewards import RewardModel

    started = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    backbone = AutoModelForSequenceClassification.from_pretrained(policy_dir, num_labels=1, dtype=torch.float32)
    backbone.config.pad_token_id = tokenizer.pad_token_id
    backbone.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    scorer = RewardModel(str(folder), device=args.device, dtype="float32").load()
    samples = fit_samples(args.fit_questions, seed=1)
    features = pooled_features(scorer, samples, args.fit_batch)
    labels = torch.tensor([label for *_, label, _ in samples])
    questions = torch.tensor([question for *_, question in samples])
    train = questions % 5 != 0  # a fifth of the questions held out
    w, bias, loss = fit_head(features[train], labels[train], args.l2, args.fit_steps)
    scores = features @ w
    held = ~train
    accuracy = float((((scores + bias) > 0).float() == labels)[held].float().mean())
    pair = scores.view(-1, 2)  # (correct, wrong) per question, in order
    pairwise = float((pair[:, 0] > pair[:, 1])[held.view(-1, 2)[:, 0]].float().mean())
    with torch.no_grad():
        scorer.model.score.weight.copy_(w.to(scorer.model.score.weight.dtype).view(1, -1))
    scorer.model.to("cpu").save_pretrained(folder)
    return {
        "questions": args.fit_questions,
        "held_out_accuracy": accuracy,
        "held_out_pairwise_accuracy": pairwise,
        "train_loss": loss,
        "features": list(features.shape),
        "fit_s": time.perf_counter() - started,
    }


# ---- stage 2: GRPO driven by it ---------------------------------------------------------------------------------


def make_config(args: argparse.Namespace, output_dir: Path) -> Any:
    from rlasync.config import AsyncGRPOConfig

    gpu = args.device == "cuda"
    return AsyncGRPOConfig(
        output_dir=str(output_dir),
        max_steps=args.steps,
        logging_steps=1,
        save_steps=10**9,
        seed=0,
        num_generations=args.num_generations,
        max_completion_length=args.max_completion_length,
        temperature=1.0,
        learning_rate=args.learning_rate,
        max_staleness=2,
        gradient_checkpointing=False,
        report_to="none",
        reward_timeout_s=600.0,
        cluster={
            "num_rollout_actors": args.rollout_actors,
            "num_reward_actors": 1,
            "learner_num_gpus": 0.4 if gpu else 0.0,
            "generation_num_gpus": 0.4 if gpu else 0.0,
            "reward_num_gpus": args.reward_gpus if gpu else 0.0,
            "rollout_num_cpus": 0.5 if gpu else 0.25,
            "collective_timeout_s": 600.0,
        },
    )


def run_grpo(args: argparse.Namespace, policy_dir: str, rm_dir: str, name: str, work: Path) -> dict[str, Any]:
    from rlasync import AsyncGRPOTrainer, RewardModel
    from rlasync.data import arithmetic_dataset
    from rlasync.rewards import last_number_reward

    output_dir = work / name
    shutil.rmtree(output_dir, ignore_errors=True)
    reward = (
        RewardModel(rm_dir, name=RM_NAME, batch_size=args.rm_batch, max_wait_s=args.max_wait_s)
        if name == "rm"
        else last_number_reward
    )
    trainer = AsyncGRPOTrainer(
        model=policy_dir,
        reward_funcs=[reward, VerifierMonitor()],
        args=make_config(args, output_dir),
        train_dataset=arithmetic_dataset(20000, seed=0, min_operand=10, max_operand=99),
    )
    started = time.perf_counter()
    state = trainer.train()
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    per_step = {key: [r.get(key) for r in records] for key in KEYS}
    accuracy = [v for v in per_step["sums/verifier_accuracy"] if v is not None]
    window = max(1, len(accuracy) // 5)
    result = {
        "global_step": state["global_step"],
        "wall_s": time.perf_counter() - started,
        "accuracy_first_window": sum(accuracy[:window]) / window if accuracy else None,
        "accuracy_last_window": sum(accuracy[-window:]) / window if accuracy else None,
        "per_step": per_step,
    }
    if name == "rm":
        rate = [v for v in per_step[f"rewards/{RM_NAME}/scored_per_s"] if v is not None]
        sources = [v for v in per_step[f"rewards/{RM_NAME}/batch_sources_max"] if v is not None]
        result["reward_actor"] = {
            "gpu_share": args.reward_gpus if args.device == "cuda" else 0.0,
            "scored_per_s_mean": sum(rate) / len(rate) if rate else None,
            "batch_sources_max": max(sources) if sources else None,
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="policy and reward-model backbone")
    parser.add_argument("--smoke", action="store_true", help="tiny random Qwen3 instead of --model (CPU check)")
    parser.add_argument("--runs", default="rm,verifier", help="which GRPO runs, in order: rm, verifier")
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--num-generations", type=int, default=8)
    parser.add_argument("--max-completion-length", type=int, default=32)
    parser.add_argument("--learning-rate", type=float, default=2e-6)
    parser.add_argument("--rollout-actors", type=int, default=4)
    parser.add_argument("--reward-gpus", type=float, default=0.2, help="cluster.reward_num_gpus of the RewardActor")
    parser.add_argument("--rm-batch", type=int, default=64, help="RewardModel batch_size")
    parser.add_argument("--max-wait-s", type=float, default=0.01, help="RewardModel max_wait_s")
    parser.add_argument("--fit-questions", type=int, default=2000)
    parser.add_argument("--fit-batch", type=int, default=128)
    parser.add_argument("--fit-steps", type=int, default=200, help="LBFGS iterations of the head fit")
    parser.add_argument("--l2", type=float, default=1e-3)
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--out", default=None, help="JSON result path")
    args = parser.parse_args()
    runs = [name.strip() for name in args.runs.split(",") if name.strip()]
    if not set(runs) <= {"rm", "verifier"}:
        parser.error(f"--runs {args.runs!r}: choose from rm, verifier")
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="rm_sums_"))
    work.mkdir(parents=True, exist_ok=True)
    if args.smoke:
        from e2e_grpo import build_random_model

        policy_dir = build_random_model(work / "policy", tiny=True, dtype="float32", device="cpu")
    else:
        from rlasync.model.registry import resolve_model

        policy_dir = resolve_model(args.model)
    results: dict[str, Any] = {
        "benchmark": "reward_model_sums",
        "date": time.strftime("%Y-%m-%d"),
        "command": "python " + " ".join([sys.argv[0], *sys.argv[1:]]),
        "model": "tiny random Qwen3 (smoke)" if args.smoke else args.model,
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "workdir")},
    }
    rm_dir = work / "sums_rm"
    print("--- fitting the sums reward model", flush=True)
    results["fit"] = build_reward_model(args, policy_dir, rm_dir)
    print(json.dumps(results["fit"], indent=1), flush=True)
    import ray  # noqa: TID251 - a driver script, as actors.cluster

    ray.init(include_dashboard=False, log_to_driver=True)
    results["runs"] = {}
    try:
        for name in runs:
            print(f"--- GRPO with reward {name!r} ({args.steps} steps)", flush=True)
            results["runs"][name] = run_grpo(args, policy_dir, str(rm_dir), name, work)
    finally:
        ray.shutdown()
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    text = json.dumps(results, indent=2)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
