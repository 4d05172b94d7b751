"""Per-slot sampling tensors: a request's sampling parameters live on the device for as long as it runs.

A request's `SamplingParams` and seed never change between its steps, so instead of building a step's
`BatchSampling` from Python lists every step (`BatchSampling.from_params`: a host-to-device copy that waits for the
GPU), the runner keeps one row per request slot (`Request.slot`, assigned by the scheduler while the request runs)
of each field on the device, written only when a slot changes owner, and a step's batch is an `index_select` of its
slots (one small copy of the slot indices and token steps per step). The host keeps a mirror of the rows for the
batch's plan (which sampler stages run), so the result is the same `BatchSampling` `from_params` builds.

Consecutive decode steps mostly hold the same requests in the same order: when a step's slots are those of the step
before and no slot was written since, the previous step's batch (its gathered device rows, plan and log-prob width)
is reused and only the token steps are copied.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rlasync.engine.base import SamplingParams
from rlasync.engine.sampler import BatchSampling, _i64, _Plan


def host_to_device(data: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A small host list as a device tensor without waiting for the GPU: on CUDA through pinned memory and a
    non-blocking copy (a copy from pageable memory waits for the stream's queued work, which would undo the overlap
    of asynchronous scheduling); torch's pinned-memory cache reuses the block only once the copy has run."""
    tensor = torch.tensor(data, dtype=dtype)
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


class SlotSampling:
    """`capacity` rows of temperature, top_k, top_p, min_p, repetition penalty and seed on `device`."""

    def __init__(self, capacity: int, device: torch.device | str) -> None:
        if capacity < 1:
            raise ValueError(f"SlotSampling: capacity={capacity} must be >= 1")
        self.capacity = capacity
        self.device = torch.device(device)
        self.floats = torch.zeros(4, capacity, dtype=torch.float32, device=self.device)  # T, top_p, min_p, penalty
        self.ints = torch.zeros(2, capacity, dtype=torch.int64, device=self.device)  # top_k, seed
        self._owner: list[tuple[SamplingParams, int] | None] = [None] * capacity
        self._rows: list[tuple[float, int, float, float, float]] = [(1.0, 0, 1.0, 0.0, 1.0)] * capacity
        self._num_logprobs = [0] * capacity
        self._wants_candidates = [False] * capacity  # the owner filters and asks for its sampling mask
        self.num_writes = 0  # slot rows written (for tests: only when a slot changes owner)
        self.num_reused = 0  # steps that reused the previous step's batch (for tests)
        self._last: tuple[tuple[int, ...], BatchSampling, bool] | None = None  # (slots, batch, wants candidates)

    def batch(
        self, slots: Sequence[int], params: Sequence[SamplingParams], seeds: Sequence[int], steps: Sequence[int]
    ) -> tuple[BatchSampling, torch.Tensor]:
        """The step's `BatchSampling` (rows in the order of `slots`) and its `steps` [B] int64 tensor; rows whose
        slot holds other params or another seed are written first."""
        if not len(slots) == len(params) == len(seeds) == len(steps):
            raise ValueError(
                f"SlotSampling.batch: {len(slots)} slots, {len(params)} params, {len(seeds)} seeds, {len(steps)} steps"
            )
        owner = self._owner
        stale = []
        for i, slot in enumerate(slots):
            if not 0 <= slot < self.capacity:
                raise ValueError(f"SlotSampling: slot {slot} is outside [0, {self.capacity})")
            held = owner[slot]
            if held is None or held[0] is not params[i] or held[1] != seeds[i]:
                stale.append(i)
        if stale:
            self._write([slots[i] for i in stale], [params[i] for i in stale], [seeds[i] for i in stale])
        key = tuple(slots)
        last = self._last
        if last is not None and last[0] == key:  # same rows as the step before, none rewritten since
            self.num_reused += 1
            return last[1], host_to_device(list(steps), torch.int64, self.device)
        index_and_steps = host_to_device([list(slots), list(steps)], torch.int64, self.device)
        index = index_and_steps[0]
        floats = self.floats.index_select(1, index)
        ints = self.ints.index_select(1, index)
        rows = [self._rows[slot] for slot in slots]
        plan = _Plan.of(*zip(*rows)) if rows else _Plan.of([], [], [], [], [])
        num_logprobs = max((self._num_logprobs[slot] for slot in slots), default=0)
        batch = BatchSampling.from_packed(floats, ints, num_logprobs, plan)
        self._last = (key, batch, any(self._wants_candidates[slot] for slot in slots))
        return batch, index_and_steps[1]

    def wants_candidates(self, slots: Sequence[int]) -> bool:
        """Whether some owner of `slots` filters (top-k/top-p/min-p) and asks for its sampling mask (owners as of
        the last `batch`, which writes them)."""
        last = self._last
        if last is not None and last[0] == tuple(slots):
            return last[2]
        return any(self._wants_candidates[slot] for slot in slots)

    def _write(self, slots: list[int], params: list[SamplingParams], seeds: list[int]) -> None:
        if len(set(slots)) != len(slots):
            raise ValueError(f"SlotSampling: a step holds slot(s) twice with different params: {slots}")
        for slot, p, seed in zip(slots, params, seeds):
            self._owner[slot] = (p, seed)
            self._rows[slot] = (
                float(p.temperature),
                max(int(p.top_k), 0),
                float(p.top_p),
                float(p.min_p or 0.0),
                float(p.repetition_penalty),
            )
            self._num_logprobs[slot] = int(p.num_logprobs)
            self._wants_candidates[slot] = bool(p.filters and p.return_sampling_mask)
        self._last = None  # a rewritten slot may be in the last batch
        rows = [self._rows[slot] for slot in slots]
        index = host_to_device(slots, torch.int64, self.device)
        floats = host_to_device(
            [[r[0] for r in rows], [r[2] for r in rows], [r[3] for r in rows], [r[4] for r in rows]],
            torch.float32,
            self.device,
        )
        ints = host_to_device([[r[1] for r in rows], [_i64(int(s)) for s in seeds]], torch.int64, self.device)
        self.floats.index_copy_(1, index, floats)
        self.ints.index_copy_(1, index, ints)
        self.num_writes += len(slots)
