"""Sequence-classification reward models as reward functions (docs/rewards.md §2).

`reward_model.py` the public `RewardModel` and what `reward_funcs` accepts (a folder, a cached hub id, a loaded
model); `batcher.py` the merging of concurrent groups into one batch (pure asyncio); `scorer.py` rendering with the
reward model's own tokenizer and template, and the length-sorted forward (torch); `loading.py` loading it in the
process that scores. Importing this package loads neither torch nor transformers.
"""

from rlasync.rewards.model.batcher import (
    REQUEST_SOURCE,
    BatchRecord,
    RequestBatcher,
    RewardModelError,
    set_request_source,
)
from rlasync.rewards.model.reward_model import RewardModel, as_reward_model, reward_model_folder

__all__ = [
    "REQUEST_SOURCE",
    "BatchRecord",
    "RequestBatcher",
    "RewardModel",
    "RewardModelError",
    "as_reward_model",
    "reward_model_folder",
    "set_request_source",
]
