"""bench/attention_parts.py: the cascade's parts it times cover exactly the tree rule's pairs, once each."""

import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "bench"))

import attention_parts  # noqa: E402
import flex_tiles  # noqa: E402
from tree_packing import parse_shapes  # noqa: E402

from rlasync.model.segment_attention import segment_plan  # noqa: E402
from rlasync.model.tree_mask import dense_tree_mask  # noqa: E402


def test_self_and_cross_parts_tile_the_tree_mask():
    row = flex_tiles.first_row(parse_shapes("40x9x3@300")[0], torch.device("cpu"))
    bounds, cross_rows, cross_keys = attention_parts.cascade_parts(segment_plan(row.subtree_end, row.position_ids))
    n = row.num_tokens
    seen = torch.zeros(n, n, dtype=torch.int64)
    for a, b in zip(bounds[:-1], bounds[1:]):
        seen[a:b, a:b] += torch.ones(b - a, b - a, dtype=torch.int64).tril()
    for rows, keys in zip(cross_rows, cross_keys):
        seen[torch.tensor(rows)[:, None], torch.tensor(keys)[None, :]] += 1
    assert cross_rows and seen.max() == 1
    assert torch.equal(seen.bool(), dense_tree_mask(row.subtree_end))


def test_a_deep_trie_puts_shared_keys_in_two_cross_entries():
    # 1 2 3 4 5 | 6 under 4 | 7 under 2
    bounds, rows, keys = attention_parts.cascade_parts(segment_plan([7, 7, 6, 6, 5, 6, 7], [0, 1, 2, 3, 4, 4, 2]))
    assert (bounds, rows, keys) == ([0, 5, 6, 7], [[5], [6]], [[0, 1, 2, 3], [0, 1]])
