"""A real (small) reward model driving GRPO: SmolLM2-135M's backbone with a head fitted to prefer correct sums.

Issue 33's GPU acceptance (docs/rewards.md §2). Two stages, one command:

1. **Fit.** SmolLM2-135M-Instruct loaded as `AutoModelForSequenceClassification` (num_labels=1: its backbone, a new
   `score` head). Two-digit sums ("What is 37 + 48?") each get a group of replies in one phrasing: a correct one and
   `--fit-negatives` wrong ones that differ from it only in the final number (the one the exact verifier reads), so
   the reward model must check the arithmetic. Phrasings range from a bare number to sentences with correct working
   before the answer ("Adding the tens: 30 + 40 = 70. ... So 37 + 48 = 85."); wrong sums are mostly hard (off by 1,
   2 or 10, the carry forgotten: 37 + 48 -> 75, digits swapped, an operand), and a tenth of the groups have a reply
   cut before its answer or without a number. `--fit-policy-questions` more groups come from the policy's own
   replies (HF `generate`, temperature 1, up to --max-completion-length tokens): each reply with its last number set
   to the sum and to wrong sums (its own answer first when wrong). Texts are rendered and padded exactly as the
   RewardActor scores them (the reward model's chat template, `RewardModelScorer.render` / `encode`, right padding,
   the head pooling the last non-pad token). `--fit-mode finetune` (default) trains backbone and head together:
   Bradley-Terry loss on the (correct, wrong) pairs of a group plus `--fit-bce` x BCE (correct above 0, wrong below:
   one scale across phrasings, as a GRPO group mixes them), AdamW with warmup and linear decay, bf16 autocast over
   fp32 weights on cuda. `--fit-mode head` is the earlier fit: an L2 logistic regression (LBFGS) on the frozen
   backbone's pooled features, its weights folded into the `score` head (bias dropped: a constant shift changes no
   GRPO advantage). The model is saved with the tokenizer as a reward-model folder. Recorded on a fifth of the
   questions held out: pairwise accuracy (correct above wrong, same question and phrasing; also per epoch, and
   apart for the synthetic and the policy's groups), accuracy at 0, AUC over all held-out replies, `fit_s`; and the
   saved folder loaded back as `RewardModel(folder)` (dtype auto: bf16 on a GPU) scores the held-out replies again
   (`saved_held_out_pairwise_accuracy`, `saved_scores_max_abs_diff`).
2. **GRPO.** The policy (SmolLM2-135M-Instruct) trains on two-digit sums with `reward_funcs=[RewardModel(folder)]`
   on one GPU (learner 0.4, generation 0.4, the RewardActor `--reward-gpus` 0.2), and, for comparison, with the exact
   verifier (`last_number_reward`) as the reward (`--runs rm,verifier`). Both runs log the exact verifier's accuracy
   beside the reward (`sums/verifier_accuracy`, from a monitor that scores nothing: its column is None everywhere,
   so it never enters the reward). Per run, the JSON holds the per-step accuracy and reward, the first and last
   windows' accuracy, and the reward model's scoring rate (`rewards/sums_rm/scored_per_s`), batch sizes and the
   most rollout actors merged in one batch.

    python bench/reward_model_sums.py --out bench/results/reward_model_sums_h200.json          # one H200
    python bench/reward_model_sums.py --smoke --device cpu --steps 2 --rollout-actors 2 --out /tmp/rm.json  # CPU
    python bench/reward_model_sums.py --fit-only --out /tmp/rm_fit.json                        # the fit alone

`--smoke` replaces SmolLM2 with e2e_grpo's tiny random Qwen3 (the fit is then meaningless; it checks the path).
"""

from __future__ import annotations

import argparse
import json
import random
import re
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

# Replies to "What is a + b?" the way SmolLM2-Instruct writes them; "{s}" is the final number (the verifier reads the
# last number), every other number in them is correct working: a correct and a wrong reply differ only in "{s}".
PHRASINGS = (
    "{s}",
    "{s}.",
    "The answer is {s}.",
    "{a} + {b} = {s}",
    "{a} + {b} is {s}.",
    "{a} + {b} = {s}.",
    "The sum of {a} and {b} is {s}.",
    "{a} plus {b} equals {s}.",
    "Sure! {a} + {b} = {s}",
    "To find the sum of {a} and {b}, we add them together: {a} + {b} = {s}.",
    "Adding the tens: {at}0 + {bt}0 = {tens}. Adding the ones: {ao} + {bo} = {ones}. So {a} + {b} = {s}.",
    "{a} + {b} = {at}0 + {bt}0 + {ao} + {bo} = {tens} + {ones} = {s}",
    "First, {ao} + {bo} = {ones}. Then {at}0 + {bt}0 = {tens}. {tens} + {ones} = {s}. The answer is {s}.",
    "Let's add {a} and {b}.\n\n{a} + {b} = {s}\n\nThe answer is {s}.",
    "What is {a} + {b}? The answer is {s}.",
    "The result of adding {a} and {b} is {s}.",
)
NO_NUMBER = ("I'm not sure.", "Let me think about this.", "To find the sum, we need to add the two numbers.", "")
# the last number of the verifier (rlasync.rewards.accuracy_rewards' pattern): the one a counterfactual replaces
LAST_NUMBER = re.compile(r"(?<!\d)-?\d+(?:\.\d+)?")


def wrong_answers(a: int, b: int, k: int, rng: random.Random) -> list[int]:
    """`k` distinct wrong sums, mostly hard ones: off by 1-2 or 10, digits swapped, the carry forgotten or added
    twice, an operand, the difference, or another number."""
    total = a + b
    ones = a % 10 + b % 10
    no_carry = (a // 10 + b // 10) * 10 + ones % 10 if ones >= 10 else total + 10
    kinds = [
        lambda: total + rng.choice([-1, 1]),
        lambda: total + rng.choice([-2, 2]),
        lambda: total + rng.choice([-10, 10]),
        lambda: int(str(total)[::-1]),
        lambda: no_carry,
        lambda: total + rng.choice([-20, 20, -11, 11, -9, 9]),
        lambda: rng.choice([a, b, abs(a - b)]),
        lambda: rng.randint(max(0, total - 30), total + 30),
        lambda: rng.randint(10, 198),
    ]
    weights = [3, 1, 3, 1, 3, 1, 1, 1, 1]
    wrong: list[int] = []
    for _ in range(100 * k):
        value = rng.choices(kinds, weights)[0]()
        if value != total and value >= 0 and value not in wrong:
            wrong.append(value)
        if len(wrong) == k:
            return wrong
    raise AssertionError(f"no {k} wrong sums for {a} + {b}")


def operands(row: dict[str, Any]) -> tuple[int, int]:
    a, b = row["prompt"][-1]["content"].split("What is ")[-1].split("?")[0].split(" + ")
    return int(a), int(b)


def synthetic_replies(a: int, b: int, k: int, rng: random.Random) -> list[str]:
    """A correct reply to "What is a + b?" then `k` wrong ones, in one phrasing: the wrong ones differ only in the
    final number, except (a tenth of the time) one that stops before it (truncated: the last number read is an
    operand or a step) or has no number at all."""
    total, ones, tens = a + b, a % 10 + b % 10, (a // 10 + b // 10) * 10
    form = rng.choice(PHRASINGS)
    values = {"a": a, "b": b, "at": a // 10, "bt": b // 10, "ao": a % 10, "bo": b % 10, "ones": ones, "tens": tens}
    replies = [form.format(s=s, **values) for s in [total, *wrong_answers(a, b, k, rng)]]
    if rng.random() < 0.1:
        cut = form[: form.rindex("{s}")].rstrip().format(s=total, **values)  # the text before the final number
        numbers = LAST_NUMBER.findall(cut)
        # wrong to the verifier: its last number is an operand or a step, not the sum (or there is none)
        usable = numbers[-1] != str(total) if numbers else rng.random() < 0.5
        replies[-1] = cut if usable else rng.choice(NO_NUMBER)
    return replies


def counterfactual_replies(text: str, a: int, b: int, k: int, rng: random.Random) -> list[str] | None:
    """A policy completion with its last number set to the sum, then to `k` wrong sums (its own answer first when it
    is wrong); None when it has no number."""
    matches = list(LAST_NUMBER.finditer(text))
    if not matches:
        return None
    match = matches[-1]
    own = match.group()
    wrong = wrong_answers(a, b, k, rng)
    if own.isdigit() and int(own) != a + b and int(own) not in wrong:
        wrong = [int(own), *wrong[: k - 1]]
    return [text[: match.start()] + str(v) + text[match.end() :] for v in [a + b, *wrong]]


def fit_groups(n: int, k: int, seed: int) -> list[tuple[list[dict[str, str]], list[str], int]]:
    """(prompt, [correct reply, k wrong replies], question index) for `n` synthetic questions."""
    from rlasync.data.tasks import arithmetic_rows

    rng = random.Random(seed)
    rows = arithmetic_rows(n, seed, max_operand=99, min_operand=10)
    return [(row["prompt"], synthetic_replies(*operands(row), k, rng), index) for index, row in enumerate(rows)]


def policy_groups(
    policy_dir: str, n: int, k: int, seed: int, args: argparse.Namespace
) -> list[tuple[list[dict[str, str]], list[str], int]]:
    """Counterfactual groups from the policy's own replies: `n` questions sampled once each (temperature 1, up to
    --max-completion-length tokens, HF generate), each reply with its last number set right and wrong."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rlasync.data.tasks import arithmetic_rows
    from rlasync.rewards import last_number_reward

    rng = random.Random(seed)
    rows = arithmetic_rows(n, seed, max_operand=99, min_operand=10)
    tokenizer = AutoTokenizer.from_pretrained(policy_dir, padding_side="left")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.bfloat16 if args.device == "cuda" else None)
    model = model.to(args.device).eval()
    torch.manual_seed(seed)
    groups = []
    for start in range(0, n, 256):
        chunk = rows[start : start + 256]
        if tokenizer.chat_template:
            texts = [
                tokenizer.apply_chat_template(r["prompt"], tokenize=False, add_generation_prompt=True) for r in chunk
            ]
        else:
            texts = [r["prompt"][-1]["content"] for r in chunk]
        batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(args.device)
        with torch.inference_mode():
            out = model.generate(
                **batch,
                do_sample=True,
                temperature=1.0,
                top_p=1.0,
                top_k=0,
                max_new_tokens=args.max_completion_length,
                pad_token_id=tokenizer.pad_token_id,
            )
        completions = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
        for offset, (row, text) in enumerate(zip(chunk, completions, strict=True)):
            replies = counterfactual_replies(text, *operands(row), k, rng)
            if replies is None:
                continue
            verdicts = last_number_reward(
                [[{"role": "assistant", "content": r}] for r in replies], [row["answer"]] * (k + 1)
            )
            if verdicts == [1.0] + [0.0] * k:  # the exact verifier agrees with every label
                groups.append((row["prompt"], replies, start + offset))
    del model
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return groups


def pad_batch(ids: list[list[int]], pad_id: int | None) -> tuple[Any, Any]:
    """Right-padded input ids and attention mask, as `RewardModelScorer.score_ids` pads."""
    import torch

    width = max(len(x) for x in ids)
    input_ids = torch.full((len(ids), width), pad_id or 0, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for row, x in enumerate(ids):
        input_ids[row, : len(x)], mask[row, : len(x)] = torch.tensor(x, dtype=torch.long), 1
    return input_ids, mask


def forward_scores(model: Any, ids: list[list[int]], pad_id: int | None, device: str) -> Any:
    """The pooled logit 0 of each sequence (bf16 autocast on cuda), as float32 on the device."""
    import torch

    input_ids, mask = pad_batch(ids, pad_id)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device == "cuda"):
        logits = model(input_ids=input_ids.to(device), attention_mask=mask.to(device)).logits
    return logits[:, 0].float()


def score_all(model: Any, ids: list[list[int]], pad_id: int | None, device: str, batch_size: int) -> Any:
    import torch

    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))  # length-sorted forwards pad little
    scores = torch.zeros(len(ids))
    with torch.inference_mode():
        for start in range(0, len(order), batch_size):
            chunk = order[start : start + batch_size]
            scores[chunk] = forward_scores(model, [ids[i] for i in chunk], pad_id, device).cpu()
    return scores


def pairwise(scores: Any, width: int) -> float:
    """The fraction of (correct, wrong) pairs scored correct first; `scores` are groups of `width` (correct first)."""
    grouped = scores.view(-1, width)
    return float((grouped[:, :1] > grouped[:, 1:]).float().mean()) if len(grouped) else float("nan")


def pooled_features(scorer: Any, ids: list[list[int]], batch_size: int) -> Any:
    """The backbone's pooled last-token features of each sequence, padded as the scorer pads."""
    import torch

    head, scorer.model.score = scorer.model.score, torch.nn.Identity()
    try:
        features = []
        with torch.inference_mode():
            for start in range(0, len(ids), batch_size):
                input_ids, mask = pad_batch(ids[start : start + batch_size], scorer.pad_id)
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


def finetune(
    model: Any, groups: list[list[list[int]]], held: list[list[list[int]]], width: int, pad_id: int | None, args: Any
) -> dict[str, Any]:
    """Fine-tune backbone + head: Bradley-Terry loss on (correct, wrong) pairs of one question and phrasing, plus
    `--fit-bce` x BCE (correct above 0, wrong below: a shared scale across phrasings); AdamW, linear warmup then
    linear decay, bf16 autocast on cuda over fp32 weights. Held-out pairwise accuracy after each epoch."""
    import torch
    import torch.nn.functional as F

    per_step = args.fit_step_questions
    steps = args.fit_epochs * max(1, len(groups) // per_step)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.fit_lr, weight_decay=0.0, betas=(0.9, 0.98))
    warmup = max(1, steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda i: min((i + 1) / warmup, max(0.0, (steps - i) / max(1, steps - warmup)))
    )
    labels = torch.zeros(per_step, width, device=args.device)
    labels[:, 0] = 1.0
    rng = random.Random(0)
    losses, epochs, step = [], [], 0
    deadline = time.perf_counter() + args.fit_max_s
    for _ in range(args.fit_epochs):
        if time.perf_counter() > deadline:
            break
        model.train()
        order = list(range(len(groups)))
        rng.shuffle(order)
        for start in range(0, len(order) - per_step + 1, per_step):
            if time.perf_counter() > deadline:
                print(f"fit: --fit-max-s {args.fit_max_s} reached at step {step}/{steps}", flush=True)
                break
            batch = [ids for i in order[start : start + per_step] for ids in groups[i]]
            scores = forward_scores(model, batch, pad_id, args.device).view(per_step, width)
            loss = -F.logsigmoid(scores[:, :1] - scores[:, 1:]).mean()
            if args.fit_bce:
                loss = loss + args.fit_bce * F.binary_cross_entropy_with_logits(scores, labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            losses.append(loss.item())
            step += 1
            if step % max(1, min(50, steps // 10)) == 0:
                recent = losses[-max(1, min(50, steps // 10)) :]
                print(f"fit step {step}/{steps}: loss {sum(recent) / len(recent):.4f}", flush=True)
        model.eval()
        held_ids = [ids for group in held for ids in group]
        epochs.append(pairwise(score_all(model, held_ids, pad_id, args.device, args.fit_batch), width))
        print(f"fit epoch {len(epochs)}: held-out pairwise accuracy {epochs[-1]:.4f}", flush=True)
    window = max(1, len(losses) // 10)
    return {
        "optimizer_steps": step,
        "optimizer_steps_planned": steps,
        "train_loss_first": sum(losses[:window]) / window if losses else None,
        "train_loss_last": sum(losses[-window:]) / window if losses else None,
        "epoch_held_out_pairwise_accuracy": epochs,
    }


def build_reward_model(args: argparse.Namespace, policy_dir: str, folder: Path) -> dict[str, Any]:
    """Fit the sums reward model (`--fit-mode`) and save it to `folder`; the fit's numbers."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from rlasync.rewards import RewardModel

    started = time.perf_counter()
    width = 1 + args.fit_negatives
    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    backbone = AutoModelForSequenceClassification.from_pretrained(policy_dir, num_labels=1, dtype=torch.float32)
    backbone.config.pad_token_id = tokenizer.pad_token_id
    backbone.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    del backbone
    # the scorer's own model, rendering and padding: what the RewardActor scores is what is fitted
    scorer = RewardModel(str(folder), device=args.device, dtype="float32").load()
    synthetic = fit_groups(args.fit_questions, args.fit_negatives, seed=1)
    policy = (
        policy_groups(policy_dir, args.fit_policy_questions, args.fit_negatives, 2, args)
        if args.fit_policy_questions
        else []
    )
    sampled_s = time.perf_counter() - started
    print(f"fit data: {len(synthetic)} synthetic groups, {len(policy)} from the policy's replies", flush=True)

    def encode(groups: list[Any]) -> list[list[list[int]]]:
        return [
            [scorer.encode(*scorer.render(prompt, [{"role": "assistant", "content": r}])) for r in replies]
            for prompt, replies, _ in groups
        ]

    def split(groups: list[Any]) -> tuple[list[Any], list[Any]]:  # a fifth of the questions held out
        pairs = list(zip(encode(groups), (q for *_, q in groups), strict=True))
        return [g for g, q in pairs if q % 5], [g for g, q in pairs if not q % 5]

    train_syn, held_syn = split(synthetic)
    train_pol, held_pol = split(policy)
    train, held = train_syn + train_pol, held_syn + held_pol
    held_ids = [ids for group in held for ids in group]
    result: dict[str, Any] = {
        "fit_mode": args.fit_mode,
        "questions": args.fit_questions,
        "negatives_per_question": args.fit_negatives,
        "policy_questions": args.fit_policy_questions,
        "policy_groups": len(policy),
        "train_groups": len(train),
        "held_out_groups": len(held),
        "mean_tokens": sum(len(x) for g in train for x in g) / max(1, sum(len(g) for g in train)),
        "sampling_s": sampled_s,
    }
    if args.fit_mode == "head":
        train_ids = [ids for group in train for ids in group]
        features = pooled_features(scorer, train_ids + held_ids, args.fit_batch)
        labels = torch.tensor([float(i % width == 0) for i in range(len(train_ids))])
        w, bias, loss = fit_head(features[: len(train_ids)], labels, args.l2, args.fit_steps)
        with torch.no_grad():
            scorer.model.score.weight.copy_(w.to(scorer.model.score.weight.dtype).view(1, -1))
        scores, threshold = features[len(train_ids) :] @ w, -float(bias)  # the saved head has no bias
        result.update(train_loss=loss, features=list(features.shape))
    else:
        model = scorer.model
        result.update(finetune(model, train, held, width, scorer.pad_id, args))
        scores, threshold = score_all(model, held_ids, scorer.pad_id, args.device, args.fit_batch), 0.0
    labels = torch.tensor([float(i % width == 0) for i in range(len(held_ids))])
    n_syn = len(held_syn) * width
    result.update(
        held_out_accuracy=float(((scores > threshold).float() == labels).float().mean()),
        held_out_pairwise_accuracy=pairwise(scores, width),
        held_out_pairwise_accuracy_synthetic=pairwise(scores[:n_syn], width),
        held_out_pairwise_accuracy_policy=pairwise(scores[n_syn:], width) if held_pol else None,
        held_out_auc=auc(scores, labels),
        fit_s=time.perf_counter() - started,
    )
    scorer.model.to("cpu").save_pretrained(folder)
    if args.device == "cuda":
        torch.cuda.empty_cache()
    # the saved folder, loaded as the RewardActor loads it (dtype auto: bf16 on a GPU), scores the held-out set alike
    saved = RewardModel(str(folder), device=args.device, batch_size=args.rm_batch).load()
    again = torch.tensor(saved.score_ids(held_ids))
    result.update(
        saved_held_out_pairwise_accuracy=pairwise(again, width),
        saved_scores_max_abs_diff=float((again - scores).abs().max()),
        saved_scores_dtype=str(saved.dtype).removeprefix("torch."),
    )
    del saved
    if args.device == "cuda":
        torch.cuda.empty_cache()
    return result


def auc(scores: Any, labels: Any) -> float:
    """The probability that a correct reply outscores a wrong one of any question (across phrasings: a GRPO group)."""
    correct, wrong = scores[labels == 1], scores[labels == 0]
    if not len(correct) or not len(wrong):
        return float("nan")
    return float((correct[:, None] > wrong[None, :]).float().mean())


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
    parser.add_argument(
        "--fit-mode",
        choices=["head", "finetune"],
        default="finetune",
        help="finetune: backbone + score head (pairwise loss); head: LBFGS logistic head on the frozen backbone",
    )
    parser.add_argument("--fit-questions", type=int, default=6000, help="synthetic questions of the fit")
    parser.add_argument(
        "--fit-policy-questions",
        type=int,
        default=1024,
        help="questions the policy answers once (HF generate) for counterfactual groups (0: none)",
    )
    parser.add_argument("--fit-negatives", type=int, default=3, help="wrong replies per question (1 correct each)")
    parser.add_argument("--fit-epochs", type=int, default=3)
    parser.add_argument("--fit-lr", type=float, default=5e-5, help="AdamW peak learning rate (finetune)")
    parser.add_argument("--fit-bce", type=float, default=0.2, help="weight of the BCE term beside the pairwise loss")
    parser.add_argument("--fit-max-s", type=float, default=120.0, help="stop the fine-tune's steps after this long")
    parser.add_argument("--fit-step-questions", type=int, default=32, help="questions (groups) per optimizer step")
    parser.add_argument("--fit-batch", type=int, default=256, help="texts per scoring / feature forward")
    parser.add_argument("--fit-steps", type=int, default=200, help="LBFGS iterations of the head fit (head mode)")
    parser.add_argument("--l2", type=float, default=1e-3, help="L2 of the head fit (head mode)")
    parser.add_argument("--fit-only", action="store_true", help="fit (and check) the reward model, no GRPO runs")
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
    save(args.out, results)  # after the fit and after each run: a stage cut by its limit keeps what finished
    if args.fit_only:
        runs = []
    import ray  # noqa: TID251 - a driver script, as actors.cluster

    if runs:
        ray.init(include_dashboard=False, log_to_driver=True)
    results["runs"] = {}
    try:
        for name in runs:
            print(f"--- GRPO with reward {name!r} ({args.steps} steps)", flush=True)
            results["runs"][name] = run_grpo(args, policy_dir, str(rm_dir), name, work)
            save(args.out, results)
    finally:
        if runs:
            ray.shutdown()
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    save(args.out, results)
    print(json.dumps(results, indent=2))


def save(out: str | None, results: dict[str, Any]) -> None:
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
