"""`rollout_state.json` (docs/algorithms.md §7.1): where a resumed run starts reading prompts, and its policy version.

    {"prompt_index": <int>, "model_version": <int>, "allowance": {"tokens_per_step": <int>, ...}}

`prompt_index` is the first untrained prompt position (`PromptDispatcher.first_untrained_index()`), not the
generator's position. `model_version` keeps adapter names increasing across restarts; files written before it
existed resume at version 0. `allowance` is the token allowance's learned state (`AllowanceState`: the last step's
tokens, the mean tokens per rollout's counts, the keep rate's weights); files written before it existed resume the
allowance from its priors (keep rate 1.0, cold start). Pure Python: no torch, no ray.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlasync.pipeline.allowance import AllowanceState

logger = logging.getLogger(__name__)

ROLLOUT_STATE_FILENAME = "rollout_state.json"


@dataclass(frozen=True, slots=True)
class RolloutState:
    """The resume point of the prompt stream and the policy version to continue from."""

    prompt_index: int
    model_version: int = 0
    allowance: AllowanceState | None = None  # the token allowance's learned state; None: its priors

    def __post_init__(self) -> None:
        for name in ("prompt_index", "model_version"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"rollout state: {name} must be a non-negative integer, got {value!r}")
        if self.allowance is not None and not isinstance(self.allowance, AllowanceState):
            raise ValueError(f"rollout state: allowance must be an AllowanceState, got {self.allowance!r}")

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"prompt_index": self.prompt_index, "model_version": self.model_version}
        if self.allowance is not None:
            data["allowance"] = self.allowance.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RolloutState:
        """Read the JSON object; a missing `model_version` (older files) resumes at 0, a missing `allowance` from the
        allowance's priors."""
        if "prompt_index" not in data:
            raise ValueError(f"rollout state has no 'prompt_index': {dict(data)!r}")
        allowance = data.get("allowance")
        return cls(
            prompt_index=data["prompt_index"],
            model_version=data.get("model_version", 0),
            allowance=None if allowance is None else AllowanceState.from_dict(allowance),
        )


def write_rollout_state(checkpoint_dir: str | Path, state: RolloutState) -> Path:
    """Write `rollout_state.json` into `checkpoint_dir`; returns the file's path."""
    path = Path(checkpoint_dir) / ROLLOUT_STATE_FILENAME
    path.write_text(json.dumps(state.to_dict()) + "\n")
    return path


def read_rollout_state(checkpoint_dir: str | Path) -> RolloutState | None:
    """The state saved in `checkpoint_dir`, or None (with a warning) when the file is missing (docs/algorithms.md §7.2)."""
    path = Path(checkpoint_dir) / ROLLOUT_STATE_FILENAME
    if not path.is_file():
        logger.warning("no %s in %s: resuming the prompt stream from prompt 0", ROLLOUT_STATE_FILENAME, checkpoint_dir)
        return None
    try:
        data = json.loads(path.read_text())
        return RolloutState.from_dict(data)
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError, TypeError, AttributeError) as exc:
        raise ValueError(
            f'{path} is corrupt ({type(exc).__name__}: {exc}): expected {{"prompt_index": <int>, "model_version": '
            '<int>, "allowance": {...}} (allowance optional); resume from an earlier checkpoint-* or delete this one'
        ) from exc
