"""Per-step throughput and MFU metrics of the documents (docs/algorithms.md §8), computed by the driver from the
learner's step metrics and the step's wall-clock time:

    num_tokens                              forwarded tokens so far (a prefix shared by a tree is counted once)
    perf/fwd_bwd_forwarded_tokens_per_s     forwarded tokens / perf/fwd_bwd_s (the compute alone)
    perf/wall_clock_forwarded_tokens_per_s  forwarded tokens / perf/step_s (the whole step, rollout waits included)
    perf/wall_clock_trained_tokens_per_s    trained (completion) tokens / perf/step_s
    perf/fwd_bwd_mfu, perf/wall_clock_mfu   6·N FLOPs per forwarded token x tokens/s / (peak FLOPs x learner
                                            devices), in percent; only where the peak is known (a GPU of PEAK_FLOPS)

    rollout/generated_tokens_per_s          tokens the rollout actors generated since the last step (all of them:
                                            Σ rollout/generated_tokens_total) / perf/step_s (`system_generation_rate`)

The rates are (numerator, denominator) pairs, so a logging window reduces them as Σ tokens / Σ seconds. No torch.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from rlasync.records import MetricValue

# Dense peak FLOPs per device in bf16 (TRL's table; the first name that matches the device name wins).
PEAK_FLOPS: tuple[tuple[str, float], ...] = (
    ("GB300", 2.5e15),
    ("GB200", 2.5e15),
    ("B300", 2.25e15),
    ("B200", 2.25e15),
    ("H100 NVL", 835e12),
    ("H100 PCIe", 756e12),
    ("H100", 989e12),
    ("H200 NVL", 835e12),
    ("H200", 989e12),
    ("H20", 148e12),
    ("RTX PRO 6000", 500e12),
    ("A100", 312e12),
    ("A6000", 154.85e12),
    ("A10G", 125e12),
    ("A10", 125e12),
    ("L40S", 362e12),
    ("L4", 121e12),
    ("MI355X", 2500e12),
    ("MI325X", 1300e12),
    ("MI300X", 1300e12),
    ("MI250X", 191.5e12),
)


def peak_flops(device_name: str | None) -> float | None:
    """Dense bf16 peak FLOPs of a device by its name (`torch.cuda.get_device_name`); None when unknown or CPU."""
    if not device_name:
        return None
    name = device_name.casefold()
    for model, peak in PEAK_FLOPS:
        if re.search(rf"\b{re.escape(model.casefold())}\b", name):
            return peak
    return None


@dataclass
class StepPerf:
    """Turns one step's learner metrics into the documents' throughput metrics. `num_params` (N) and
    `peak_flops_per_device` enable MFU (both needed); `num_devices` is the learner ranks' count."""

    num_params: int | None = None
    peak_flops_per_device: float | None = None
    num_devices: int = 1
    num_tokens: float = 0.0
    _history: list[float] = field(default_factory=list, repr=False)

    @property
    def mfu_enabled(self) -> bool:
        return bool(self.num_params) and bool(self.peak_flops_per_device)

    def mfu(self, tokens_per_s: float) -> float:
        """Percent of the learners' peak: 6·N FLOPs per token (forward 2N + backward 4N)."""
        assert self.num_params and self.peak_flops_per_device
        return 100.0 * 6.0 * self.num_params * tokens_per_s / (self.peak_flops_per_device * self.num_devices)

    def step_metrics(self, step: Mapping[str, float | None], step_s: float | None) -> list[tuple[str, MetricValue]]:
        """Items for one step from its reduced metrics (`batch/forwarded_tokens_per_step`,
        `batch/trained_tokens_per_step`, `perf/fwd_bwd_s`) and its wall-clock seconds (None for the first step,
        which has no predecessor: no wall-clock rates then, as TRL)."""
        forwarded = step.get("batch/forwarded_tokens_per_step") or 0.0
        trained = step.get("batch/trained_tokens_per_step") or 0.0
        fwd_bwd_s = step.get("perf/fwd_bwd_s") or 0.0
        self.num_tokens += forwarded
        items: list[tuple[str, MetricValue]] = [("num_tokens", self.num_tokens)]
        if forwarded <= 0:
            return items
        if fwd_bwd_s > 0:
            items.append(("perf/fwd_bwd_forwarded_tokens_per_s", (forwarded, fwd_bwd_s)))
            if self.mfu_enabled:
                items.append(("perf/fwd_bwd_mfu", self.mfu(forwarded / fwd_bwd_s)))
        if step_s is not None and step_s > 0:
            items.append(("perf/wall_clock_forwarded_tokens_per_s", (forwarded, step_s)))
            items.append(("perf/wall_clock_trained_tokens_per_s", (trained, step_s)))
            if self.mfu_enabled:
                items.append(("perf/wall_clock_mfu", self.mfu(forwarded / step_s)))
        return items


GENERATED_RATE = "rollout/generated_tokens_per_s"
GENERATED_TOTAL = "rollout/generated_tokens_total"


def system_generation_rate(items: list[tuple[str, MetricValue]], step_s: float | None) -> list[tuple[str, MetricValue]]:
    """The rollout actors' metrics drained after a step, with their per-actor `rollout/generated_tokens_per_s`
    (each actor's tokens over its own time: with N actors, a rate N times too low for the system) replaced by the
    system's: Σ `rollout/generated_tokens_total` of these items over the step's wall time. Before the first timed
    step (`step_s` None) the per-actor rates are dropped and nothing replaces them."""
    kept = [(name, value) for name, value in items if name != GENERATED_RATE]
    if step_s is None or step_s <= 0:
        return kept
    tokens = [float(value) for name, value in items if name == GENERATED_TOTAL and isinstance(value, (int, float))]
    if not tokens:
        return kept
    return [*kept, (GENERATED_RATE, (sum(tokens), float(step_s)))]


__all__ = ["GENERATED_RATE", "GENERATED_TOTAL", "PEAK_FLOPS", "StepPerf", "peak_flops", "system_generation_rate"]
