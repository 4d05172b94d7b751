"""`trainer.accelerator`: what TRL scripts call on accelerate's `Accelerator`, for the driver process.

An rlasync run has one driver process (the one that calls `train()`, fires the callbacks and writes the outputs)
and the learner / generation / rollout actors on Ray. A TRL script's code around `train()` runs in the driver, so
it is the main process, the local main process and the last one; `num_processes` is the learners' data-parallel
size (`cluster.num_learners`, the P of `per_device_train_batch_size x gradient_accumulation_steps x P`), the world
the batch is split over; collective calls (`wait_for_everyone`, `gather`, `reduce`) are identities, there being
nothing to wait for in the driver. `unwrap_model` loads a lazy model (rlasync.driver.model_proxy).

    trainer.accelerator.print("done")            # printed once (the driver is the main process)
    model = trainer.accelerator.unwrap_model(trainer.model)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from rlasync.driver.model_proxy import unwrap


class DriverAccelerator:
    """accelerate's `Accelerator` surface in the driver process (module docstring)."""

    is_main_process = True
    is_local_main_process = True
    is_last_process = True
    process_index = 0
    local_process_index = 0
    distributed_type = "NO"
    """The driver is not distributed: the learners are (`num_processes` of them)."""

    def __init__(self, num_processes: int = 1, mixed_precision: str = "no") -> None:
        self.num_processes = int(num_processes)
        self.mixed_precision = mixed_precision

    @property
    def device(self) -> Any:
        """The driver's device (the CPU: the models train on the learner actors' devices)."""
        import torch

        return torch.device("cpu")

    def print(self, *args: Any, **kwargs: Any) -> None:
        """`print`, once (accelerate prints on the main process only; the driver is it)."""
        print(*args, **kwargs)

    def wait_for_everyone(self) -> None:
        """Nothing to wait for: the driver is one process (the learners synchronise among themselves)."""

    def unwrap_model(self, model: Any, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True) -> Any:
        """The torch module: a lazy model (`trainer.model`, a callback's `model`) is loaded; others are returned."""
        return unwrap(model)

    def save(self, obj: Any, f: Any, safe_serialization: bool = False) -> None:
        """`torch.save(obj, f)` (a state dict with `safe_serialization=True`: safetensors)."""
        if safe_serialization:
            from safetensors.torch import save_file

            save_file(obj, f, metadata={"format": "pt"})
            return
        import torch

        torch.save(obj, f)

    def gather(self, tensor: Any) -> Any:
        return tensor

    def gather_for_metrics(self, data: Any, use_gather_object: bool = False) -> Any:
        return data

    def reduce(self, tensor: Any, reduction: str = "sum", scale: float = 1.0) -> Any:
        return tensor * scale if scale != 1.0 else tensor

    @contextlib.contextmanager
    def main_process_first(self) -> Iterator[None]:
        yield

    @contextlib.contextmanager
    def local_main_process_first(self) -> Iterator[None]:
        yield

    def on_main_process(self, function: Callable[..., Any]) -> Callable[..., Any]:
        return function

    def on_local_main_process(self, function: Callable[..., Any]) -> Callable[..., Any]:
        return function

    def end_training(self) -> None:
        """Nothing to release in the driver (train() removed the actors)."""

    def __repr__(self) -> str:
        return f"DriverAccelerator(driver process of {self.num_processes} learner rank(s))"


__all__ = ["DriverAccelerator"]
