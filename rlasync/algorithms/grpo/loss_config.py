"""Settings of the GRPO loss (docs/algorithms.md §5.2-§5.3): `LossConfig`, read once from the user's config (`from_config`).

Its own module so that both the loss (`rlasync.algorithms.grpo.loss`) and its metrics (`rlasync.algorithms.grpo.loss_metrics`) can
import it without importing each other.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch

if TYPE_CHECKING:
    from rlasync.config import AsyncGRPOConfig

#: Floor of 1 − P_H in the tail scale ρ_t (docs/algorithms.md §5.3).
TAIL_MASS_FLOOR = 1e-6

MaskedTokenCentering = Literal["keep", "drop"]


@dataclass(frozen=True)
class LossConfig:
    """Settings of the GRPO loss (TRL field names in `from_config`).

    `masked_token_centering` (docs/algorithms.md §5.3) is a switch: "keep" (default) keeps the centring
    term of a sampled token whose IS weight is masked (w(r_t) = 0), which is what makes the expected gradient
    vanish under a constant advantage; "drop" removes the whole term of such a token ("dropped from
    the loss"). It has no effect when `score_centering` is False (the mask already removes the whole term).
    """

    epsilon: float = 0.2
    epsilon_high: float | None = None
    score_centering: bool = True
    is_clip_min: float = 0.5
    is_clip_max: float = 5.0
    masked_token_centering: MaskedTokenCentering = "keep"

    def __post_init__(self) -> None:
        if not self.epsilon >= 0 or not self.epsilon_low_high[1] >= 0:
            raise ValueError(f"epsilon and epsilon_high must be >= 0, got {self.epsilon}, {self.epsilon_high}")
        if not 0 <= self.is_clip_min <= self.is_clip_max:
            raise ValueError(
                "need 0 <= vllm_importance_sampling_clip_min <= vllm_importance_sampling_clip_max, got "
                f"{self.is_clip_min}, {self.is_clip_max}"
            )
        if self.masked_token_centering not in ("keep", "drop"):
            raise ValueError(f"masked_token_centering must be 'keep' or 'drop', got {self.masked_token_centering!r}")

    @property
    def epsilon_low_high(self) -> tuple[float, float]:
        """(ε_low, ε_high): ε_high falls back to `epsilon`."""
        return self.epsilon, self.epsilon if self.epsilon_high is None else self.epsilon_high

    def importance_mask(self, ratio: torch.Tensor) -> torch.Tensor:
        """m = 1[C_min ≤ ratio ≤ C_max], elementwise bool (NaN ratios are masked)."""
        return (ratio >= self.is_clip_min) & (ratio <= self.is_clip_max)

    @classmethod
    def trl_1_16(cls, epsilon: float = 0.2, epsilon_high: float | None = None) -> LossConfig:
        """TRL 1.16's objective: clipped surrogate, no importance-sampling mask, no score centering."""
        return cls(epsilon, epsilon_high, score_centering=False, is_clip_min=0.0, is_clip_max=math.inf)

    @classmethod
    def from_config(cls, config: AsyncGRPOConfig) -> LossConfig:
        """The loss fields of an `AsyncGRPOConfig` (TRL's names: `vllm_importance_sampling_clip_*`)."""
        return cls(
            epsilon=config.epsilon,
            epsilon_high=config.epsilon_high,
            score_centering=config.score_centering,
            is_clip_min=config.vllm_importance_sampling_clip_min,
            is_clip_max=config.vllm_importance_sampling_clip_max,
            masked_token_centering=config.masked_token_centering,
        )
