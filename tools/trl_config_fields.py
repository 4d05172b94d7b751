"""Write tests/data/trl_1_16_config_fields.json: the field names and defaults of TRL 1.16's `AsyncGRPOConfig`
(trl.experimental.async_grpo) and `AsyncDistillationConfig` (trl.experimental.async_distillation), both dataclasses
over transformers' `TrainingArguments`. The test that compares our configs with TRL's reads the JSON, so the test
suite does not need trl installed.

    pip install --no-deps --target /tmp/trlpkg trl==1.16.0
    PYTHONPATH=/tmp/trlpkg python tools/trl_config_fields.py
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "trl_1_16_config_fields.json"


def _jsonable(value: object) -> object:
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if hasattr(value, "value"):  # an Enum (IntervalStrategy, OptimizerNames, ...): its string value
        return _jsonable(value.value)
    return repr(value)


def _default(f: dataclasses.Field) -> object:
    if f.default is not dataclasses.MISSING:
        return _jsonable(f.default)
    if f.default_factory is not dataclasses.MISSING:
        return _jsonable(f.default_factory())
    return "<required>"


def main() -> None:
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    import trl
    from trl.experimental.async_distillation import AsyncDistillationConfig
    from trl.experimental.async_grpo import AsyncGRPOConfig

    if not trl.__version__.startswith("1.16"):
        sys.exit(f"expected trl 1.16, found {trl.__version__}")
    data = {"trl_version": trl.__version__}
    for cls in (AsyncGRPOConfig, AsyncDistillationConfig):
        data[cls.__name__] = {f.name: _default(f) for f in dataclasses.fields(cls) if f.init}
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    print(f"wrote {OUT}: " + ", ".join(f"{k} {len(v)} fields" for k, v in data.items() if isinstance(v, dict)))


if __name__ == "__main__":
    main()
