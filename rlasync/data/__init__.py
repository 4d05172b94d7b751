"""Datasets for GRPO: prompt validation and rendering, procedurally generated tasks.

Importing this package loads neither torch, transformers nor datasets (`*_dataset` imports datasets on use).
"""

from rlasync.data.code_tasks import code_dataset, code_rows
from rlasync.data.from_spec import DATASET_NAMES, build_dataset
from rlasync.data.prompts import (
    PROMPT_COLUMN,
    is_conversational,
    render_prompt,
    row_prompt,
    validate_prompt,
    validate_prompt_dataset,
    with_environment_prompts,
)
from rlasync.data.streaming import is_streaming
from rlasync.data.tasks import (
    arithmetic_dataset,
    arithmetic_rows,
    countdown_dataset,
    countdown_rows,
)

__all__ = [
    "DATASET_NAMES",
    "PROMPT_COLUMN",
    "arithmetic_dataset",
    "arithmetic_rows",
    "build_dataset",
    "code_dataset",
    "code_rows",
    "countdown_dataset",
    "countdown_rows",
    "is_conversational",
    "render_prompt",
    "row_prompt",
    "validate_prompt",
    "is_streaming",
    "validate_prompt_dataset",
    "with_environment_prompts",
]
