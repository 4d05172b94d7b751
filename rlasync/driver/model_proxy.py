"""`LazyModel`: a model the driver process loads only when someone uses it.

The trained weights live on the learner actors; the driver (the process that runs `train()` and the callbacks) holds
no model. transformers' callbacks and TRL scripts still expect one (`model=` in every callback event,
`trainer.model` right after construction), so they get a proxy:

    model = LazyModel(lambda: "out/checkpoint-4" or the initial model path, dtype="float32")
    model.config.num_hidden_layers      # the first attribute access loads the folder (AutoModelForCausalLM)
    model.resolve()                     # the loaded torch module itself (isinstance checks, accelerator.unwrap_model)

`source()` names the folder to load; while it names the same folder the loaded model is reused, a new folder (a
newer checkpoint) is loaded on the next access. `latest_checkpoint_source(output_dir, initial)` is the step loop's
source: the newest complete checkpoint, else the model the run started from. Nothing is loaded while nobody looks,
so a callback that never reads `model` costs nothing. Nothing here imports ray.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

_OWN = ("_source", "_dtype", "_loaded", "_loaded_from", "_description")


def load_plain(path: str, dtype: str = "auto") -> Any:
    """A plain transformers causal LM (default attention, not the learner's tree attention) from `path`."""
    from transformers import AutoModelForCausalLM

    from rlasync.model.loading import resolve_dtype

    return AutoModelForCausalLM.from_pretrained(path, dtype="auto" if dtype == "auto" else resolve_dtype(dtype))


class LazyModel:
    """A proxy that loads `source()` (a model folder or hub id) on first use and forwards every attribute to it."""

    def __init__(self, source: Callable[[], str | None], dtype: str = "auto", description: str = "model") -> None:
        object.__setattr__(self, "_source", source)
        object.__setattr__(self, "_dtype", dtype)
        object.__setattr__(self, "_loaded", None)
        object.__setattr__(self, "_loaded_from", None)
        object.__setattr__(self, "_description", description)

    @property
    def source_path(self) -> str | None:
        """The folder (or hub id) the next access loads, without loading it."""
        return self._source()

    @property
    def is_loaded(self) -> bool:
        return self._loaded is not None

    def resolve(self) -> Any:
        """The loaded model (loaded now if needed, re-loaded when the source names a new folder)."""
        path = self._source()
        if path is None:
            raise RuntimeError(f"{self._description}: no model folder to load yet")
        if self._loaded is None or self._loaded_from != path:
            object.__setattr__(self, "_loaded", load_plain(str(path), self._dtype))
            object.__setattr__(self, "_loaded_from", path)
        return self._loaded

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in _OWN:  # copy/pickle protocol probes: not the model's
            raise AttributeError(name)
        return getattr(self.resolve(), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.resolve(), name, value)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.resolve()(*args, **kwargs)

    def __repr__(self) -> str:
        state = f"loaded from {self._loaded_from}" if self._loaded is not None else "not loaded yet"
        return f"LazyModel({self._description}: {self._source()!r}, {state})"


def latest_checkpoint_source(output_dir: str | Path, initial: str | None) -> Callable[[], str | None]:
    """The newest complete `checkpoint-<step>` under `output_dir`, else `initial` (the model the run started from)."""
    from rlasync.driver.checkpoint import Checkpointer

    checkpointer = Checkpointer(output_dir)

    def source() -> str | None:
        complete = checkpointer.complete_checkpoints()
        return str(complete[-1]) if complete else initial

    return source


def unwrap(model: Any) -> Any:
    """The torch module behind a `LazyModel` (loaded now), or `model` itself."""
    return model.resolve() if isinstance(model, LazyModel) else model


__all__ = ["LazyModel", "latest_checkpoint_source", "load_plain", "unwrap"]
