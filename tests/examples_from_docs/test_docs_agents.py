"""The agent-training examples of TRL's AsyncGRPOTrainer document ("Agent training": tools, environments with
and without a dataset, environment and trainer rewards together, several environments routed by a dataset that
only names them) and the documented `IterableDataset` train_dataset. Only the import line changes.

The tiny random model never calls a tool, so an environment's `get_reward` is constant (the counter stays 0):
every group would have zero spread and no step would train. Where the example has no reward with spread,
`prompt_spread` (not in the document) is added: a spread reward that also raises unless the prompt is the one
the example promises (the reset observation, the dataset's prompt), so a wrong prompt fails the run.
"""

import functools
import random

import pytest

from rlasync import AsyncGRPOConfig, AsyncGRPOTrainer

pytestmark = pytest.mark.integration


def prompt_spread(prompts, completions, expected=None, **kwargs):
    """Not in the document: the share of digit words (spread), after checking each prompt holds `expected`."""
    for prompt in prompts:
        text = " ".join(str(m.get("content")) for m in prompt)
        if expected is not None and expected not in text:
            raise AssertionError(f"prompt {prompt!r} does not contain {expected!r}")
    out = []
    for completion in completions:
        words = completion[-1]["content"].split()
        out.append(sum(w.isdigit() for w in words) / max(len(words), 1))
    return out


# --- document, "Tools" ------------------------------------------------------------------------------------------
def multiply(a: int, b: int) -> int:
    """
    Multiplies two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The product of the two integers.
    """
    return a * b


async def async_add(a: int, b: int) -> int:
    """
    Asynchronously adds two integers.

    Args:
        a: The first integer.
        b: The second integer.

    Returns:
        The sum of the two integers.
    """
    return a + b


def test_tools_example(pickle_by_value, tiny_model_dir, tmp_path, docs):
    from rlasync.data import arithmetic_dataset

    trainer = AsyncGRPOTrainer(
        tools=[multiply, async_add],
        model=tiny_model_dir,
        reward_funcs=prompt_spread,
        args=AsyncGRPOConfig(**docs.fields(tmp_path)),
        train_dataset=arithmetic_dataset(16, seed=0),
    )
    trainer.train()
    keys = docs.keys(tmp_path)
    assert "tools/loop_exhausted_frac" in keys, sorted(keys)  # "only logged when the trainer has tools"
    # "tools/call_frequency: calls per completion over every rollout, dropped groups included; logged only when the
    # trainer has tools" (the random model never calls the tool: 0.0 is logged)
    assert "tools/call_frequency" in keys, sorted(keys)


# --- document, "Environments" (the environment owns the data: no train_dataset) ----------------------------------
class IncrementEnv:
    # Reserved methods
    def reset(self, **kwargs) -> str | None:  # required; called at the start of each rollout
        self.counter = 0
        self.target = random.randint(1, 6)  # self-sample the task
        return f"Increment the counter by {self.target}."  # returned string becomes the prompt

    def get_reward(self) -> float:  # optional: the environment scores itself from its own state
        return float(self.counter == self.target)

    # Public methods (exposed as tools)
    def increment(self, step: int) -> int:
        """
        Increment the internal counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        self.counter += step
        return self.counter


def test_environment_without_dataset_example(pickle_by_value, tiny_model_dir, tmp_path, docs):
    trainer = AsyncGRPOTrainer(
        model=tiny_model_dir,
        args=AsyncGRPOConfig(**docs.fields(tmp_path), chat_template_kwargs={"enable_thinking": False}),
        environment_factory=IncrementEnv,
        reward_funcs=functools.partial(prompt_spread, expected="Increment the counter by"),
    )
    trainer.train()
    records = docs.metrics(tmp_path)
    keys = set().union(*records)
    for key in ("env/reset_s", "env/reward_s", "rewards/IncrementEnv/mean", "tools/loop_exhausted_frac"):
        assert key in keys, sorted(keys)
    assert records[0]["rewards/IncrementEnv/mean"] == 0.0  # never called increment: counter 0 != target


# --- document, "Providing an external dataset (optional)" --------------------------------------------------------
class TargetIncrementEnv:  # the document's second `IncrementEnv` (renamed: the first one took the name)
    def reset(self, target, **kwargs) -> None:  # the row's `target` column arrives as a keyword argument
        self.counter = 0
        self.target = target

    def get_reward(self) -> float:
        return float(self.counter == self.target)

    def increment(self, step: int) -> int:  # exposed as a tool (see the full docstring above)
        """
        Increment the internal counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        self.counter += step
        return self.counter


# --- document, "Rewards" (trainer-owned and environment-owned rewards together) -----------------------------------
def format_reward(completions, **kwargs):  # trainer-owned: scores the completion text
    return prompt_spread(prompts=[], completions=completions)  # the document's body is `...`


def test_environment_with_dataset_and_trainer_reward_example(pickle_by_value, tiny_model_dir, tmp_path, docs):
    from datasets import Dataset

    # Each row carries the prompt and the task data (here, the counter target to reach).
    dataset = Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": f"Increment the counter to {i}."}] for i in range(1, 7)],
            "target": list(range(1, 7)),
        }
    )
    trainer = AsyncGRPOTrainer(
        model=tiny_model_dir,
        args=AsyncGRPOConfig(**docs.fields(tmp_path)),
        train_dataset=dataset,  # the dataset owns the task; the "target" column reaches reset(target=...)
        reward_funcs=format_reward,  # trainer-owned: scores the completion
        environment_factory=TargetIncrementEnv,  # env-owned: scores its internal state via `get_reward`
    )
    trainer.train()
    keys = docs.keys(tmp_path)
    for key in ("rewards/format_reward/mean", "rewards/TargetIncrementEnv/mean", "env/reset_s", "reward"):
        assert key in keys, sorted(keys)


# --- document, "Multiple environments" (the dataset only routes: no prompt column) --------------------------------
class CodingEnv:
    def reset(self, **kwargs) -> str:
        n = random.randint(1, 20)
        return f"Compute the {n}th Fibonacci number."

    def run_code(self, code: str) -> str:  # exposed as a tool only for "coding" examples
        """Run the given Python code and return its stdout.

        Args:
            code: The Python source to execute.

        Returns:
            The captured standard output.
        """
        ...


class GameEnv:
    def reset(self, **kwargs) -> str:
        return "Reach the goal tile."

    def move(self, action: str) -> str:  # exposed as a tool only for "game" examples
        """Apply an action to the game and return the new observation.

        Args:
            action: One of "up", "down", "left", "right".

        Returns:
            The observation after the move.
        """
        ...


def route_checking_reward(prompts, completions, environment, **kwargs):
    """The document's `reward_func` is not shown: this one checks each prompt is its environment's reset
    observation (the routing), and has spread."""
    for prompt, name in zip(prompts, environment):
        expected = "Fibonacci" if name == "coding" else "goal tile"
        assert expected in prompt[-1]["content"], (name, prompt)
    return prompt_spread(prompts=prompts, completions=completions)


reward_func = route_checking_reward


def test_multiple_environments_with_a_routing_only_dataset_example(pickle_by_value, tiny_model_dir, tmp_path, docs):
    from datasets import Dataset

    dataset = Dataset.from_dict({"environment": ["coding", "game"] * 500})
    trainer = AsyncGRPOTrainer(
        model=tiny_model_dir,
        args=AsyncGRPOConfig(**docs.fields(tmp_path, max_steps=2), chat_template_kwargs={"enable_thinking": False}),
        train_dataset=dataset,
        reward_funcs=reward_func,
        environment_factory={"coding": CodingEnv, "game": GameEnv},
    )
    trainer.train()
    records = docs.metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2]
    assert "env/reset_s" in set().union(*records)


# --- the documented `train_dataset: Dataset | IterableDataset` ----------------------------------------------------
def test_a_streaming_iterable_dataset_trains(pickle_by_value, tiny_model_dir, tmp_path, docs):
    """A `datasets.IterableDataset` (no len(), no indexing) is leased from the stream, one pass without max_steps."""
    from datasets import Dataset

    from rlasync.data import arithmetic_rows

    streamed = Dataset.from_list(arithmetic_rows(4, seed=0)).to_iterable_dataset()
    trainer = AsyncGRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=prompt_spread,
        args=AsyncGRPOConfig(**docs.fields(tmp_path, max_steps=-1, save_steps=1000)),
        train_dataset=streamed,
    )
    state = trainer.train()
    records = docs.metrics(tmp_path)
    assert records and state["global_step"] == len(records) >= 1
    saved = (tmp_path / f"checkpoint-{state['global_step']}" / "rollout_state.json").read_text()
    assert '"prompt_index": 4' in saved  # the one pass over the 4 streamed rows was consumed
