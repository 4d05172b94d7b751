"""bench/flex_tiles.py: its pair counts against a brute-force count of the tree rule, and the harness on a CPU."""

import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "bench"))

import flex_tiles  # noqa: E402
from tree_packing import parse_shapes  # noqa: E402


def brute_force(subtree_end: torch.Tensor, block: int) -> tuple[int, int]:
    n = subtree_end.shape[0]
    q, k = torch.arange(n)[:, None], torch.arange(n)[None, :]
    visible = (k <= q) & (q < subtree_end[None, :])
    nb = -(-n // block)
    padded = torch.zeros(nb * block, nb * block, dtype=torch.bool)
    padded[:n, :n] = visible
    blocks = padded.view(nb, block, nb, block).any(3).any(1)
    return int(visible.sum()), int(blocks.sum()) * block * block


def test_pair_counts_match_the_tree_rule():
    row = flex_tiles.first_row(parse_shapes("40x9x3@300")[0], torch.device("cpu"))
    for block in (16, 32, 64):
        attended, computed = brute_force(row.subtree_end, block)
        assert flex_tiles.attended_pairs(row.subtree_end) == attended
        assert flex_tiles.computed_pairs(row.subtree_end, row.position_ids, block) == computed
    assert computed > attended  # completions straddle blocks: the kernel computes masked pairs too


def test_the_rectangular_block_mask_is_the_tree_rule_over_unequal_blocks():
    row = flex_tiles.first_row(parse_shapes("40x9x3@300")[0], torch.device("cpu"))
    n = row.num_tokens
    q, k = torch.arange(n)[:, None], torch.arange(n)[None, :]
    visible = (k <= q) & (q < row.subtree_end[None, :])
    for q_block, kv_block in ((16, 8), (8, 16), (32, 16)):
        mask = flex_tiles.rectangular_block_mask(row.subtree_end, row.position_ids, q_block, kv_block)
        nq, nk = -(-n // q_block), -(-n // kv_block)
        padded = torch.zeros(nq * q_block, nk * kv_block, dtype=torch.bool)
        padded[:n, :n] = visible
        pairs = padded.view(nq, q_block, nk, kv_block).sum((1, 3))
        full = torch.zeros(nq, nk, dtype=torch.bool)
        partial = torch.zeros(nq, nk, dtype=torch.bool)
        for i in range(nq):
            full[i, mask.full_kv_indices[0, 0, i, : mask.full_kv_num_blocks[0, 0, i]].long()] = True
            partial[i, mask.kv_indices[0, 0, i, : mask.kv_num_blocks[0, 0, i]].long()] = True
        assert torch.equal(full | partial, pairs > 0) and not (full & partial).any()  # exactly the nonempty blocks
        assert (pairs[full] == q_block * kv_block).all()  # a full block has every pair visible
        assert mask.BLOCK_SIZE == (q_block, kv_block)


def test_the_harness_runs_forward_on_cpu_and_records_refused_options(tmp_path, monkeypatch):
    monkeypatch.setitem(flex_tiles.SWEEP, "bad", {"BLOCK_M": 48})
    real = flex_tiles.run_config

    def refuse_bad(name, options, *args):  # the CPU kernel ignores tile options; a GPU refuses such a tile
        if name == "bad":
            raise ValueError("BLOCK_M must divide the sparse block size")
        return real(name, options, *args)

    monkeypatch.setattr(flex_tiles, "run_config", refuse_bad)
    out = tmp_path / "flex.json"
    flex_tiles.main(
        [
            "--tiny",
            "--device",
            "cpu",
            "--configs",
            "default,block64,bad,varlen,aligned,q128_kv64",
            "--iters",
            "1",
            "--out",
            str(out),
        ]
    )
    result = json.loads(out.read_text())
    assert result["row"]["attended_pairs"] > 0 and result["row"]["computed_over_attended"]["128"] >= 1
    assert result["configs"]["default"]["fwd_ms"] > 0 and "fwd_bwd_ms" not in result["configs"]["default"]
    assert result["configs"]["block64"]["max_abs_diff_vs_default"] < 1e-4  # same attention, other blocks
    assert result["configs"]["varlen"]["max_abs_diff_vs_default"] < 1e-4  # the segment path (its reference loop here)
    assert result["configs"]["q128_kv64"]["max_abs_diff_vs_default"] < 1e-4  # 128-query x 64-key mask blocks
    assert result["row"]["computed_over_attended"]["128x64"] <= result["row"]["computed_over_attended"]["128"]
    aligned = result["configs"]["aligned"]  # the row with padded segment starts, read back at its real tokens
    assert aligned["max_abs_diff_vs_default"] < 1e-4 and aligned["padding"] > 0
    assert aligned["tokens"] == result["row"]["tokens"] + aligned["padding"]
    assert aligned["blocks_128"]["nonempty"] == aligned["blocks_128"]["full"] + aligned["blocks_128"]["partial"]
    assert result["configs"]["bad"] == {
        "options": {"BLOCK_M": 48},
        "error": "ValueError: BLOCK_M must divide the sparse block size",
    }
    assert result["best"]["name"] in result["configs"]
