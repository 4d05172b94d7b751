"""Tree packing for GRPO: prefix-trie rows, their depth-first layout, micro-batch planners, collation, metrics.

Pure numpy: importing this package never loads torch or ray (docs/algorithms.md §4, docs/design.md §3 "Tree packing").

  trie     TreeRow: one rank's row as a prefix trie over its samples, priced by unique tokens / load / trained
  layout   pack(row) -> PackedRow: DFS layout, subtree_end mask rule, segments, loss terms; align_blocks (padding)
  planner  TokenBudgetBatcher / FixedCountBatcher -> MicroBatch (one TreeRow per rank)
  step_plan StepPlan / StepComposer: which queued samples one optimizer step takes (the learner's planner, run ahead)
  collate  pad_rows: stack a micro-batch's PackedRows into [P, ...] arrays with the broadcast scalars
  metrics  packing_metrics: the collator's batch/* and sample/* metrics
"""

from rlasync.packing.collate import pad_rows
from rlasync.packing.layout import IGNORE_INDEX, PackedRow, align_blocks, pack, sample_positions
from rlasync.packing.metrics import packing_metrics
from rlasync.packing.planner import (
    PLACEMENTS,
    FixedCountBatcher,
    MicroBatch,
    Placement,
    TokenBudgetBatcher,
    balance_groups,
)
from rlasync.packing.step_plan import StepComposer, StepPlan
from rlasync.packing.trie import TreeRow

__all__ = [
    "IGNORE_INDEX",
    "PLACEMENTS",
    "FixedCountBatcher",
    "MicroBatch",
    "PackedRow",
    "Placement",
    "StepComposer",
    "StepPlan",
    "TokenBudgetBatcher",
    "TreeRow",
    "align_blocks",
    "balance_groups",
    "pack",
    "packing_metrics",
    "pad_rows",
    "sample_positions",
]
