"""Rewards: the calling convention (`call_reward_funcs`, `RewardTable`) and built-in reward functions.

Built-ins have TRL's signatures (`f(completions, ..., **kwargs) -> list[float | None]`) and are module-level
functions, so they pickle into a spawned rollout process. Importing this package does not load math-verify;
`accuracy_reward` imports it on first use. `RemoteReward(url)` scores with an HTTP reward server (`rewards.remote`);
`code_reward` runs model-written programs in a sandbox (`rewards.code`); `RewardModel(path)` scores with a
sequence-classification reward model in the RewardActor pool (`rewards.model`, loaded lazily: no torch here).
"""

from rlasync.rewards.accuracy_rewards import accuracy_reward, last_number_reward
from rlasync.rewards.calling import (
    RewardFunctionError,
    RewardTable,
    call_reward_funcs,
    reward_func_name,
    unique_names,
)
from rlasync.rewards.code import CodeReward, code_reward, run_python
from rlasync.rewards.countdown import countdown_reward
from rlasync.rewards.format_rewards import think_format_reward
from rlasync.rewards.model import RewardModel, RewardModelError
from rlasync.rewards.remote import RemoteReward, RemoteRewardError, RemoteRewardStats
from rlasync.rewards.text import completion_text

__all__ = [
    "CodeReward",
    "RemoteReward",
    "RemoteRewardError",
    "RemoteRewardStats",
    "RewardModel",
    "RewardModelError",
    "RewardFunctionError",
    "RewardTable",
    "accuracy_reward",
    "call_reward_funcs",
    "code_reward",
    "completion_text",
    "countdown_reward",
    "last_number_reward",
    "reward_func_name",
    "run_python",
    "think_format_reward",
    "unique_names",
]
