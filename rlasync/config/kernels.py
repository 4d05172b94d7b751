"""The learner's kernel switches, one typed value (`KernelSettings`): the tree attention backend, FlexAttention's
kernel options, and how the chunked LM head compiles and what it keeps (docs/algorithms.md §4.2, §5.1).

It is the `kernels` section of a trainer config (`kernels: {tree_attention: varlen}` in YAML,
`--set kernels.head_keep=probs`, `AsyncGRPOConfig(kernels={"tree_attention": "varlen"})`), a field of
`LearnerSettings`, so it crosses Ray with the settings to every learner rank, where the learner hands it to the model
code (`TreeScorer(model, kernels)`). Nothing here is read from the environment: a run on an existing cluster (`ray
job submit`, KubeRay) gets the same kernels as a local one. The defaults are the tuned choices.

Part of the config (no torch, no other rlasync package); `rlasync.model` reads it.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Literal

TREE_ATTENTION = ("auto", "flex", "varlen", "dense")
HEAD_KEEP = ("logits", "probs")
HEAD_DYNAMIC = ("rows", "all")


@dataclass(frozen=True)
class KernelSettings:
    """The kernel switches of the learner's tree forward and LM head (picklable: it travels to the actors)."""

    tree_attention: Literal["auto", "flex", "varlen", "dense"] = "auto"
    """The tree attention backend (docs/algorithms.md §4.2): "auto" (flex on CUDA, dense elsewhere), "flex"
    (compiled FlexAttention over a BlockMask), "varlen" (FlashAttention varlen over root-path segments, torch >=
    2.10 on CUDA; a reference loop on CPU) or "dense" (a bool mask through SDPA)."""
    flex_kernel_options: dict[str, Any] | str | None = None
    """FlexAttention `kernel_options`, e.g. {"BLOCK_M1": 32, "BLOCK_N1": 64, "BLOCK_M2": 64, "BLOCK_N2": 32} for the
    backward's tiles (a dict, or a JSON object string): a tuning knob for a GPU (bench/flex_tiles.py); None: torch
    chooses."""
    head_compile: bool = True
    """torch.compile the chunked LM head's two dense passes on CUDA (False: eager; never compiled on CPU)."""
    head_keep: Literal["logits", "probs"] = "logits"
    """What a chunk of the LM head keeps from forward to backward: its raw "logits" or softmax "probs" (no dense
    backward pass where it applies, docs/algorithms.md §5.1)."""
    head_dynamic: Literal["rows", "all"] = "rows"
    """Which sizes of the head's compiled passes are dynamic: "rows" (the chunk length; the vocabulary a constant
    of the graph) or "all" (every size, how the passes were compiled before; kept for the A/B on a GPU)."""

    def __post_init__(self) -> None:
        _one_of("tree_attention", self.tree_attention, TREE_ATTENTION)
        _one_of("head_keep", self.head_keep, HEAD_KEEP)
        _one_of("head_dynamic", self.head_dynamic, HEAD_DYNAMIC)
        if not isinstance(self.head_compile, bool):
            raise ValueError(f"kernels.head_compile={self.head_compile!r}: use true or false")
        object.__setattr__(self, "flex_kernel_options", parse_kernel_options(self.flex_kernel_options))

    @classmethod
    def of(cls, value: KernelSettings | dict[str, Any] | None) -> KernelSettings:
        """`value` as `KernelSettings`: itself, a mapping of its fields (the config's `kernels` section) or None
        (the defaults). An unknown key is an error naming the fields."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"kernels: expected a mapping of kernel settings, got {type(value).__name__}")
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(value) - set(names))
        if unknown:
            raise ValueError(f"kernels.{unknown[0]}: not a kernel setting; the settings are {', '.join(names)}")
        return cls(**value)

    def describe(self) -> dict[str, Any]:
        """The settings as a plain dict (what the learner reports)."""
        return dataclasses.asdict(self)


def parse_kernel_options(value: Any) -> dict[str, Any] | None:
    """FlexAttention kernel options from a dict or a JSON object string (None or "": torch chooses)."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    options = value
    if isinstance(value, str):
        try:
            options = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"kernels.flex_kernel_options: not JSON ({exc}); give a mapping, e.g. '{{\"BLOCK_M\": 64}}'"
            ) from None
    if not isinstance(options, dict) or not all(isinstance(k, str) for k in options):
        raise ValueError(
            f"kernels.flex_kernel_options={value!r}: expected a mapping of FlexAttention kernel options, "
            'e.g. {"BLOCK_M1": 32, "BLOCK_N1": 64}'
        )
    return dict(options) or None


def _one_of(name: str, value: Any, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"kernels.{name}={value!r}: use one of {', '.join(map(repr, allowed))}")


__all__ = ["HEAD_DYNAMIC", "HEAD_KEEP", "TREE_ATTENTION", "KernelSettings", "parse_kernel_options"]
