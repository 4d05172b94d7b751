"""AsyncGRPOTrainer's `tools=` and `environment_factory=` (TRL's names): checks before any actor starts, and the
placeholder dataset an environment may write its prompts into (docs/algorithms.md §3.4). No Ray is started."""

import threading

import pytest

from rlasync.config import AsyncGRPOConfig
from rlasync.rewards import last_number_reward
from rlasync.trainers import AsyncGRPOTrainer

ROWS = [{"prompt": [{"role": "user", "content": "What is 1 + 1?"}], "answer": "2"}]


def get_weather(city: str) -> str:
    """The weather of a city.

    Args:
        city: the city
    """
    return "sunny"


class Game:
    def reset(self, **row):
        return "Guess a number."

    def guess(self, number: int) -> str:
        """Guess.

        Args:
            number: the guess
        """
        return "higher"

    def get_reward(self) -> float:
        return 1.0


class Sandbox:
    def reset(self, **row):
        return None

    def run(self, code: str) -> str:
        """Run code.

        Args:
            code: the code
        """
        return ""


class NoReset:
    def step(self):
        return 0


class LockedTool:
    """A callable holding a lock: it cannot be pickled to the rollout actors."""

    __name__ = "locked"

    def __init__(self):
        self.lock = threading.Lock()

    def __call__(self) -> str:
        return "x"


def make(train_dataset=ROWS, reward_funcs=last_number_reward, max_steps=3, **kwargs):
    args = AsyncGRPOConfig(
        output_dir="unused", max_steps=max_steps, per_device_train_batch_size=4, gradient_accumulation_steps=2
    )
    return AsyncGRPOTrainer(
        model="some/model", reward_funcs=reward_funcs, args=args, train_dataset=train_dataset, **kwargs
    )


def test_tools_and_environments_are_kept_for_the_rollout_actors():
    trainer = make(tools=[get_weather], environment_factory={"game": Game, "sandbox": Sandbox})
    assert trainer.tools == [get_weather]
    assert trainer.environment_factory == {"game": Game, "sandbox": Sandbox}
    assert make().tools is None and make().environment_factory is None


def test_bad_tools_are_refused_with_the_field_named():
    with pytest.raises(ValueError, match="tools: 'get_weather' is not callable"):
        make(tools=["get_weather"])
    with pytest.raises(ValueError, match="tools must be a list"):
        make(tools=get_weather)
    with pytest.raises(ValueError, match="two tools are named 'get_weather'"):
        make(tools=[get_weather, type("Clash", (), {"__name__": "get_weather", "__call__": lambda self: 0})()])
    with pytest.raises(ValueError, match="tools: .*cannot be pickled.*module level"):
        make(tools=[LockedTool()])


def test_bad_environment_factories_are_refused_with_the_field_named():
    with pytest.raises(ValueError, match=r"environment_factory\['x'\]: environment NoReset has no reset method"):
        make(environment_factory={"x": NoReset})
    with pytest.raises(ValueError, match="environment_factory: 5 is not callable"):
        make(environment_factory=5)
    lock = threading.Lock()
    with pytest.raises(ValueError, match="environment_factory: .*cannot be pickled"):
        make(environment_factory=lambda: (lock, Game())[1])


def test_an_environment_with_get_reward_is_a_reward_source():
    make(reward_funcs=None, environment_factory=Game)
    make(reward_funcs=None, environment_factory=lambda: Game())  # only known when called: the loop checks it
    with pytest.raises(ValueError, match="No reward source"):
        make(reward_funcs=None, environment_factory=Sandbox)


def test_a_single_environment_may_write_the_prompts_of_a_placeholder_dataset():
    trainer = make(train_dataset=None, environment_factory=Game)
    assert trainer.train_dataset == [{"prompt": [{"role": "user", "content": ""}]}] * 8  # B x GA rows
    with pytest.raises(ValueError, match="`train_dataset` is required"):
        make(train_dataset=None)
    with pytest.raises(ValueError, match="requires a `train_dataset`"):
        make(train_dataset=None, environment_factory={"game": Game})
    with pytest.raises(ValueError, match="max_steps"):
        make(train_dataset=None, environment_factory=Game, max_steps=-1)
