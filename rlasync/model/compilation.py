"""How the learner compiles (docs/algorithms.md §5.5): whether its decoder layers are compiled, where inductor keeps
its cache, and how long a step spent compiling.

- `resolve_torch_compile(torch_compile, cuda=...)`: TRL's `torch_compile` made tri-state. None (rlasync's default)
  means "auto": compiled on CUDA, eager on the CPU; an explicit True / False keeps TRL's meaning (True compiles on
  the CPU too); a `torch_compile_backend` or `torch_compile_mode` turns it on (transformers' rule).
- `use_compile_cache()`: inductor's cache (and Triton's, which inductor keeps under it) in `inductor/` under rlasync's
  cache folder instead of a temporary folder, so a repeated or resumed run loads its compiled graphs instead of
  compiling them again; every rank of a node shares it (inductor locks its files). A value the user set is kept.
- `compile_seconds()`: the seconds this process has spent in Dynamo's frame compiles and AOTAutograd's backward
  compiles so far (torch's own timers, `torch._dynamo.utils.cumulative_time_spent_ns`); the learner logs the
  difference over a step as `perf/compile_s`.

This is the one place that sets torch's compile environment variables. Imports nothing of rlasync but
`rlasync.envs.cache_dir` (rlasync's cache folder).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

logger = logging.getLogger(__name__)

CACHE_SUBDIR = "inductor"
"""The folder of inductor's cache under rlasync's cache folder (`rlasync.envs.cache_dir()`)."""

COMPILE_TIMERS = ("entire_frame_compile", "entire_backward_compile")
"""torch's cumulative timers (`torch._dynamo.utils.cumulative_time_spent_ns`) that `compile_seconds` adds up: every
Dynamo frame compile (tracing + the backend's forward compile) and every lazy backward compile."""


def resolve_torch_compile(
    torch_compile: bool | None, *, cuda: bool, backend: str | None = None, mode: str | None = None
) -> bool:
    """Whether the learner compiles its decoder layers: an explicit `torch_compile` as TRL means it; None ("auto")
    compiles on CUDA only; a `backend` or `mode` asks for compilation."""
    if torch_compile not in (None, True, False):
        raise ValueError(
            f"torch_compile={torch_compile!r}: use true (compile), false (eager) or leave it unset "
            "(auto: compiled on CUDA, eager on the CPU)"
        )
    if backend is not None or mode is not None:
        return True
    if torch_compile is None:
        return bool(cuda)
    return bool(torch_compile)


def default_inductor_cache_dir() -> Path:
    """`inductor/` under the one cache folder rlasync keeps (`rlasync.envs.cache_dir()`, beside the converted
    models; `~/.cache/rlasync/inductor` by default)."""
    from rlasync.envs import cache_dir

    return cache_dir() / CACHE_SUBDIR


def _torch_default_cache_dir() -> str | None:
    try:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir
    except ImportError:  # pragma: no cover - another torch layout
        return None
    return os.path.abspath(default_cache_dir())


def use_compile_cache(directory: str | Path | None = None) -> Path:
    """Point inductor's cache at `directory` (default `default_inductor_cache_dir()`) unless TORCHINDUCTOR_CACHE_DIR
    names another folder already (the user's choice; torch's own temporary default, which inductor writes into the
    environment on its first use, counts as unset). Turns on the FX graph and AOTAutograd caches where torch's
    defaults leave them off and the user did not set them. Returns the folder in use."""
    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current and os.path.abspath(current) != _torch_default_cache_dir():
        return Path(current)
    chosen = Path(directory) if directory is not None else default_inductor_cache_dir()
    chosen.mkdir(parents=True, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(chosen)  # Triton's kernels follow: <dir>/triton/<device>
    _enable_local_caches()
    logger.info("torch.compile cache: %s (kept across runs; TORCHINDUCTOR_CACHE_DIR overrides it)", chosen)
    return chosen


def _enable_local_caches() -> None:
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    if "TORCHINDUCTOR_FX_GRAPH_CACHE" not in os.environ and not inductor_config.fx_graph_cache:
        inductor_config.fx_graph_cache = True
    if "TORCHINDUCTOR_AUTOGRAD_CACHE" not in os.environ and not functorch_config.enable_autograd_cache:
        functorch_config.enable_autograd_cache = True


def compile_seconds() -> float:
    """Seconds spent compiling in this process so far (Dynamo frames + backward graphs; 0.0 if torch's timers are
    not there)."""
    try:
        from torch._dynamo.utils import cumulative_time_spent_ns
    except ImportError:  # pragma: no cover - another torch layout
        return 0.0
    return sum(float(cumulative_time_spent_ns.get(name, 0.0)) for name in COMPILE_TIMERS) / 1e9


__all__ = [
    "CACHE_SUBDIR",
    "COMPILE_TIMERS",
    "compile_seconds",
    "default_inductor_cache_dir",
    "resolve_torch_compile",
    "use_compile_cache",
]
