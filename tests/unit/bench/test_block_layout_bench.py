"""bench/block_layout.py: its counts are those of the BlockMask the learner builds and of the dense mask, on the
benchmark's 8K shape aligned and not; the script writes its JSON with the command that made it (CPU)."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "bench"))

import block_layout  # noqa: E402
from learner_shapes import Shape, make_samples, plan_rows  # noqa: E402

from rlasync.model.block_mask import tree_block_mask  # noqa: E402
from rlasync.model.tree_mask import dense_tree_mask  # noqa: E402
from rlasync.packing import align_blocks, pack  # noqa: E402


def brute_counts(packed, block_size):
    """(nonempty, full, partial) blocks from the dense [N, N] mask, and its per-block visible pairs. A block of the
    row's last, short block row or column counts as partial (FlexAttention masks the positions past the row there)."""
    mask = dense_tree_mask(torch.as_tensor(packed.subtree_end)).numpy()
    n = mask.shape[0]
    nb = -(-n // block_size)
    padded = np.zeros((nb * block_size, nb * block_size), dtype=bool)
    padded[:n, :n] = mask
    pairs = padded.reshape(nb, block_size, nb, block_size).sum((1, 3))
    full = pairs == block_size**2
    return int((pairs > 0).sum()), int(full.sum()), int(((pairs > 0) & ~full).sum()), pairs


@pytest.mark.parametrize(
    ("shared", "align", "expected"),
    [(0, None, (360, 157, 203)), (1, None, (340, 168, 172)), (1, "segments", (315, 210, 105))],
    ids=["bench", "shared_first", "shared_first_aligned"],
)
def test_the_counts_are_the_block_mask_and_the_dense_mask(shared, align, expected):
    """The 8K benchmark row (5 groups of 544 + 8 x 128), the numbers recorded in block_layout_cpu.json."""
    shape = Shape(544, 128, 8, 8192)
    row = plan_rows(make_samples(shape, 5, 151936, 0, shared_prefix=shared), shape.row_tokens, share=True)[0]
    packed = pack(row)
    if align:
        packed = align_blocks(packed, 128, at=align, pad_token_id=-1)
    counts = block_layout.block_counts(packed, 128)
    assert (counts["nonempty"], counts["full"], counts["partial"]) == expected
    block_mask = tree_block_mask(torch.as_tensor(packed.subtree_end), torch.as_tensor(packed.position_ids))
    partial, full = int(block_mask.kv_num_blocks.sum()), int(block_mask.full_kv_num_blocks.sum())
    assert (partial + full, full, partial) == expected
    nonempty, full, partial, pairs = brute_counts(packed, 128)
    assert (nonempty, full, partial) == expected
    assert np.array_equal(block_layout.block_pairs(packed.subtree_end, 128), pairs)
    pads = packed.input_ids == -1  # a padding query sees its root path (its parent's keys and its chain), no more
    assert pairs.sum() == packed.load + (packed.position_ids[pads] + 1).sum()
    real_pairs = block_layout.block_pairs(packed.subtree_end, 128, real=~pads)
    assert real_pairs.sum() == packed.load and (real_pairs <= pairs).all()
    real = np.flatnonzero(~pads)
    dense = dense_tree_mask(torch.as_tensor(packed.subtree_end)).numpy()
    for q_block, k_block in [(10, 5), (40, 38), (60, 60)]:  # a few blocks, real pairs from the dense mask
        q = real[(real >= 128 * q_block) & (real < 128 * q_block + 128)]
        k = real[(real >= 128 * k_block) & (real < 128 * k_block + 128)]
        assert real_pairs[q_block, k_block] == dense[np.ix_(q, k)].sum()


def test_the_script_writes_its_json_with_the_command(tmp_path):
    out = tmp_path / "layout.json"
    block_layout.main(["--shapes", "54x12x4@400", "--groups", "6", "--blocks", "16", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["command"].startswith("python bench/block_layout.py --shapes 54x12x4@400")
    shape = result["shapes"]["p54_c12_g4_row400"]
    assert set(shape) == {"bench", "shared_first", "mix_as_sampled", "mix_longest_first", "mix_shortest_first"}
    layouts = shape["bench"]["blocks"]["16"]
    assert set(layouts) == {"none", "roots", "segments", "segments_pad<=4"}
    none, segments = layouts["none"], layouts["segments"]
    assert none["padding"] == 0 and segments["padding"] > 0 and "nonempty_vs_none" in segments
    assert none["nonempty"] == none["full"] + none["partial"] and 0 < none["density"] <= 1
    with pytest.raises(SystemExit, match="--sets: unknown"):
        block_layout.main(["--sets", "bench,other"])
