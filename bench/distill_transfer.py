"""Does on-policy distillation transfer a skill? A GRPO-trained SmolLM2 teaches the base SmolLM2 two-digit sums.

Teachers: SmolLM2-135M-Instruct after a GRPO run of `configs/sums_gpu.yaml` (`--teacher CHECKPOINT`, e.g. the one
`bench/sums_e2e.py` leaves; without it the script trains one first for `--teacher-steps`), and for MOPD a second one
trained the same way on another procedural task of `rlasync.data.tasks` (`diffs`: two-digit differences, the
arithmetic task with `ops: ["-"]`; `--teacher2 CHECKPOINT` or trained here). The student is the base SmolLM2.

    distill  AsyncDistillationTrainer with the sums teacher alone: forward KL to its top-8 plus the tail bucket, no
             reward anywhere in the loss, on sums prompts from which the evaluation questions are removed
    mopd     two teachers, each row routed by its `teacher_id` column (`sums` / `diffs`), rows of both tasks mixed

Distillation has no `eval_dataset`, so the script saves the student every `--eval-every` steps and, after the run,
scores each checkpoint (and the base student, step 0) itself: the built-in engine, greedy, `--max-tokens` new tokens,
the exact verifier (`last_number_reward`: the reply's last number equals the answer) on `--eval-prompts` held-out
questions per task. The JSON holds per run the accuracy curve `[step, seconds since the command, accuracy]`,
`jsd` per logged step, the wall minutes, and at the top `student_accuracy_start`, `student_accuracy_final`,
`minutes` of the `distill` run. Each run merges into `--out`, so the runs may go in separate calls.

    python3 bench/distill_transfer.py --runs distill --teacher /tmp/sums_e2e/sums_torch/checkpoint-200 \\
        --out $OUT/distill_transfer_h200.json                                   # one H200, SmolLM2 in the cache
    python3 bench/distill_transfer.py --runs mopd --teacher CKPT --out $OUT/distill_transfer_h200.json
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
CONFIG = ROOT / "configs" / "sums_gpu.yaml"
STUDENT = "smollm2-135m-instruct"
# task -> the arithmetic task's operators (two-digit operands, as configs/sums_gpu.yaml)
TASKS = {"sums": ("+",), "diffs": ("-",)}
EVAL_SEED = 977  # the held-out questions' seed (training rows use others, and the questions are removed from them)


# ---- the data ------------------------------------------------------------------------------------------------------


def question(row: dict[str, Any]) -> str:
    return row["prompt"][-1]["content"]


def task_rows(task: str, n: int, seed: int) -> list[dict[str, Any]]:
    """`n` rows of `task` (two-digit operands), each with its `teacher_id` column (the task's name)."""
    from rlasync.data import arithmetic_rows

    if task not in TASKS:
        raise ValueError(f"task {task!r}: choose one of {sorted(TASKS)}")
    return [{**row, "teacher_id": task} for row in arithmetic_rows(n, seed, max_operand=99, ops=TASKS[task])]


def eval_rows(task: str, n: int) -> list[dict[str, Any]]:
    """`n` distinct held-out questions of `task`."""
    rows, seen = [], set()
    for row in task_rows(task, 4 * n, EVAL_SEED):
        if question(row) not in seen and len(rows) < n:
            seen.add(question(row))
            rows.append(row)
    return rows


def train_rows(tasks: list[str], n: int, seed: int, held_out: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """About `n` rows of each task, interleaved (task by task), without any held-out question."""
    excluded = {question(row) for row in held_out}
    per_task = [
        [r for r in task_rows(task, n, seed + i) if question(r) not in excluded] for i, task in enumerate(tasks)
    ]
    mixed = [row for group in zip(*per_task) for row in group]
    if not mixed:
        raise ValueError("no training rows left after removing the held-out questions: raise --train-rows")
    return mixed


# ---- evaluation ----------------------------------------------------------------------------------------------------


async def accuracy(engine: Any, tokenizer: Any, rows: list[dict[str, Any]], max_tokens: int) -> dict[str, Any]:
    """Greedy replies to `rows`, scored by the exact verifier; the accuracy and two sample replies."""
    from rlasync.data.prompts import render_prompt
    from rlasync.engine import SamplingParams
    from rlasync.rewards import last_number_reward

    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    turns = await asyncio.gather(*(engine.generate(render_prompt(tokenizer, r["prompt"]), greedy) for r in rows))
    replies = [tokenizer.decode(t.output_ids, skip_special_tokens=True) for t in turns]
    scores = last_number_reward(replies, answer=[r["answer"] for r in rows])
    correct = sum(float(s or 0.0) for s in scores)
    return {"accuracy": correct / len(rows), "n": len(rows), "samples": [[question(rows[0]), replies[0]]]}


def evaluate_model(path: str, rows_by_task: dict[str, list[dict[str, Any]]], max_tokens: int) -> dict[str, Any]:
    """Each task's greedy accuracy of the model at `path` (a folder or alias), with the built-in engine on the
    GPU when there is one (eager: a short run does not pay for graph capture)."""
    import torch
    from transformers import AutoTokenizer

    from rlasync.engine import TorchEngine
    from rlasync.model.registry import resolve_model

    folder = resolve_model(path)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    cuda = torch.cuda.is_available()
    count = max(len(rows) for rows in rows_by_task.values())
    engine = TorchEngine(
        folder,
        dtype="bfloat16" if cuda else "float32",
        max_model_len=512,
        kv_cache_tokens=count * 512 + 1024,
        max_num_seqs=count,
        cuda_graphs=False,
    )

    async def run() -> dict[str, Any]:
        try:
            return {task: await accuracy(engine, tokenizer, rows, max_tokens) for task, rows in rows_by_task.items()}
        finally:
            await engine.close()

    result = asyncio.run(run())
    if cuda:
        torch.cuda.empty_cache()
    return result


def checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """The complete `checkpoint-<step>` folders of a run, by step."""
    found = []
    for path in run_dir.glob("checkpoint-*"):
        step = path.name.split("-")[-1]
        if step.isdigit() and (path / "trainer_state.json").is_file():
            found.append((int(step), path))
    return sorted(found)


def curve(evaluations: dict[int, dict[str, Any]], step_times: dict[int, float], task: str) -> list[list[Any]]:
    """`[step, seconds since the command (None when the step was not logged), accuracy]` for `task`, by step."""
    return [
        [step, round(step_times[step], 1) if step in step_times else None, round(result[task]["accuracy"], 4)]
        for step, result in sorted(evaluations.items())
    ]


def first_reaching(points: list[list[Any]], target: float) -> list[Any] | None:
    """The first `[step, seconds, accuracy]` of a curve at or above `target`, else None."""
    return next((point for point in points if point[2] >= target), None)


def ends(series: list[list[Any]], count: int = 5) -> tuple[float | None, float | None]:
    """Means of the first and of the last `count` values of a `[step, value]` series (None values left out)."""
    values = [value for _, value in series if value is not None]
    if not values:
        return None, None
    return sum(values[:count]) / len(values[:count]), sum(values[-count:]) / len(values[-count:])


# ---- the runs ------------------------------------------------------------------------------------------------------


def train_teacher(task: str, steps: int, run_dir: Path) -> tuple[str, float]:
    """A GRPO run of configs/sums_gpu.yaml on `task` for `steps` steps; its last checkpoint and wall seconds."""
    ops = json.dumps(list(TASKS[task]))
    sets = [f"output_dir={run_dir}", f"max_steps={steps}", f"dataset.ops={ops}", "save_steps=100000"]
    command = [sys.executable, "-m", "rlasync", "train", str(CONFIG), "--overwrite_output_dir"]
    command += [x for s in sets for x in ("--set", s)]
    print(f"--- teacher {task}: {' '.join(command)}", flush=True)
    started = time.time()
    subprocess.run(command, cwd=ROOT, check=True)
    found = checkpoints(run_dir)
    if not found:
        raise RuntimeError(f"the {task} teacher's run left no checkpoint in {run_dir}")
    return str(found[-1][1]), time.time() - started


def distill_config(args: argparse.Namespace, output_dir: Path, teachers: int) -> Any:
    """On-policy distillation on one GPU: learner 0.4, the student's engine and each teacher an equal share of the
    rest; forward KL to the teacher's top-8 plus the tail bucket (beta 0), no reward term. `--device cpu`: the same
    run small, on CPUs (a smoke test)."""
    from rlasync.config import AsyncDistillationConfig

    gpu = args.device == "cuda"
    share = round(0.6 / (1 + teachers), 3)
    cluster = {
        "num_rollout_actors": 4 if gpu else 1,
        "rollout_num_cpus": 1 if gpu else 0.25,
        "generation_num_cpus": 1 if gpu else 0.25,
        "learner_num_cpus": 1 if gpu else 0.25,
        "teacher_num_cpus": 0.25,
        "learner_num_gpus": 0.4 if gpu else 0.0,
        "generation_num_gpus": share if gpu else 0.0,
        "weight_sync_backend": "ipc" if gpu else "auto",
        "engine_kwargs": {"max_model_len": 512, "kv_cache_tokens": 131072 if gpu else 4096, "max_num_seqs": 256},
    }
    return AsyncDistillationConfig(
        output_dir=str(output_dir),
        max_steps=args.steps,
        logging_steps=1,
        save_steps=args.eval_every,
        seed=0,
        learning_rate=args.learning_rate,
        lr_scheduler_type="constant",
        max_completion_length=48 if gpu else 8,
        temperature=1.0,
        token_budget=8192 if gpu else 256,
        max_staleness=2,
        weight_sync_steps=1,
        gradient_checkpointing=False,
        dtype="auto" if gpu else "float32",
        report_to="none",
        teacher_top_k=8,
        beta=0.0,
        cluster=cluster,
    )


def run_distill(
    args: argparse.Namespace, name: str, teachers: dict[str, str], started: float, base: dict[str, Any]
) -> dict[str, Any]:
    """One distillation run with `teachers` (task -> checkpoint), then every checkpoint's held-out accuracy."""
    import datasets

    from rlasync import AsyncDistillationTrainer

    tasks = list(teachers)
    held_out = {task: eval_rows(task, args.eval_prompts) for task in tasks}
    rows = train_rows(tasks, args.train_rows, seed=1, held_out=[r for rs in held_out.values() for r in rs])
    output_dir = Path(args.run_root) / name
    shutil.rmtree(output_dir, ignore_errors=True)
    trainer = AsyncDistillationTrainer(
        model=args.student,
        args=distill_config(args, output_dir, len(teachers)),
        train_dataset=datasets.Dataset.from_list(rows),
        teacher_model=dict(teachers) if len(teachers) > 1 else teachers[tasks[0]],
    )
    t0 = time.time()
    trainer.train()
    train_s = time.time() - t0
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    records = [r for r in records if isinstance(r.get("step"), int)]
    step_times = {0: t0 - started, **{r["step"]: r["time"] - started for r in records}}
    evaluations = {0: base}
    for step, path in checkpoints(output_dir):
        evaluations[step] = evaluate_model(str(path), {t: held_out[t] for t in tasks}, args.max_tokens)
        print(f"{name} step {step}: {json.dumps({t: evaluations[step][t]['accuracy'] for t in tasks})}", flush=True)
    curves = {task: curve(evaluations, step_times, task) for task in tasks}
    jsd = [[r["step"], r.get("jsd")] for r in records]
    result: dict[str, Any] = {
        "teachers": teachers,
        "train_s": train_s,
        "minutes": train_s / 60,
        "steps": max((r["step"] for r in records), default=0),
        "rows": len(rows),
        "eval_prompts_per_task": args.eval_prompts,
        "curves": curves,
        "accuracy_start": {task: base[task]["accuracy"] for task in tasks},
        "accuracy_final": {task: evaluations[max(evaluations)][task]["accuracy"] for task in tasks},
        "samples_final": {task: evaluations[max(evaluations)][task]["samples"] for task in tasks},
        "reached_0_8": {task: first_reaching(curves[task], 0.8) for task in tasks},  # [step, seconds, accuracy]
        "jsd_first5_last5": ends(jsd),  # falling when the student learns the teacher's distribution
        "jsd": jsd,
        "teacher_jsd": {t: [[r["step"], r.get(f"teacher_jsd/{t}")] for r in records] for t in tasks if len(tasks) > 1},
        "config": {k: v for k, v in vars(args).items() if k not in ("out",)},
    }
    if not args.keep_checkpoints:
        for _, path in checkpoints(output_dir):
            shutil.rmtree(path, ignore_errors=True)
    return result


def merge(out: Path, updates: dict[str, Any]) -> None:
    data = json.loads(out.read_text()) if out.exists() else {}
    data.update(updates)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--runs",
        default="distill,mopd",
        help="comma-separated, in this order: distill, mopd; or teachers: only train (and evaluate) the teachers "
        "MOPD needs that were not given (a device call of its own when the whole would not fit in one)",
    )
    parser.add_argument("--teacher", default=None, help="the sums teacher's checkpoint (default: train one here)")
    parser.add_argument("--teacher2", default=None, help="mopd: the diffs teacher's checkpoint (default: train one)")
    parser.add_argument("--teacher-steps", type=int, default=200, help="GRPO steps of a teacher trained here")
    parser.add_argument("--steps", type=int, default=60, help="distillation steps of each run")
    parser.add_argument("--eval-every", type=int, default=10, help="steps between the student's checkpoints")
    parser.add_argument("--eval-prompts", type=int, default=256, help="held-out questions per task")
    parser.add_argument("--max-tokens", type=int, default=48, help="new tokens of an evaluation reply")
    parser.add_argument("--train-rows", type=int, default=20000, help="training rows per task")
    parser.add_argument("--learning-rate", type=float, default=1e-5)
    parser.add_argument("--run-root", default="/tmp/distill_transfer")
    parser.add_argument("--student", default=STUDENT, help="the student (an alias, hub id or folder)")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: a small smoke run")
    parser.add_argument("--keep-checkpoints", action="store_true", help="keep the student's checkpoints")
    parser.add_argument("--out", default="bench/results/distill_transfer_h200.json")
    args = parser.parse_args(argv)
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    if runs == ["teachers"]:
        runs = []
        teachers_only = True
    elif not runs or any(r not in ("distill", "mopd") for r in runs):
        parser.error(f"--runs {args.runs!r}: a comma-separated list of distill, mopd; or teachers")
    else:
        teachers_only = False
    if args.eval_every < 1 or args.steps < args.eval_every:
        parser.error(f"--eval-every {args.eval_every}: between 1 and --steps ({args.steps})")

    started = time.time()
    out = Path(args.out)
    merge(
        out,
        {
            "what": "on-policy distillation (no reward in the loss) from GRPO-trained SmolLM2 teachers to the base "
            "SmolLM2: held-out greedy accuracy by the exact verifier",
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        },
    )
    teachers: dict[str, dict[str, Any]] = {}
    needed = ["sums"] + (["diffs"] if "mopd" in runs or teachers_only else [])
    for task, given in (("sums", args.teacher), ("diffs", args.teacher2)):
        if task not in needed:
            continue
        if given:
            teachers[task] = {"checkpoint": given, "trained_here": False}
        else:
            path, seconds = train_teacher(task, args.teacher_steps, Path(args.run_root) / f"teacher_{task}")
            teachers[task] = {
                "checkpoint": path,
                "trained_here": True,
                "grpo_steps": args.teacher_steps,
                "train_s": seconds,
            }
    held_out = {task: eval_rows(task, args.eval_prompts) for task in needed}
    base = evaluate_model(args.student, held_out, args.max_tokens)
    for task, info in teachers.items():
        info["accuracy"] = evaluate_model(info["checkpoint"], {task: held_out[task]}, args.max_tokens)[task]["accuracy"]
    merge(out, {"teachers": teachers, "student_base": {t: base[t]["accuracy"] for t in needed}})
    print(json.dumps({"teachers": teachers, "student_base": {t: base[t]["accuracy"] for t in needed}}), flush=True)
    for name in runs:
        chosen = {task: teachers[task]["checkpoint"] for task in (["sums"] if name == "distill" else needed)}
        result = run_distill(args, name, chosen, started, base)
        updates: dict[str, Any] = {name: result}
        if name == "distill":
            updates.update(
                student_accuracy_start=result["accuracy_start"]["sums"],
                student_accuracy_final=result["accuracy_final"]["sums"],
                minutes=result["minutes"],
                student_accuracy_curve=result["curves"]["sums"],
            )
        else:
            updates["mopd_curves"] = result["curves"]
        merge(out, updates)
        print(json.dumps({k: v for k, v in updates.items() if k not in (name,)}, indent=1), flush=True)


if __name__ == "__main__":
    main()
