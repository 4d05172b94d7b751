"""Host staging of the mixed-step CUDA graphs (`rlasync.engine.mixed_graphs`): pure numpy, checked on CPU against
`build_metadata` of the same chunks plus the padding request. (The graphs themselves are checked on a GPU in
tests/unit/engine/test_torch_engine_cuda.py.)"""

import numpy as np
import pytest
import torch

from rlasync.engine.mixed_graphs import StagedMixed, mixed_token_counts, stage_mixed
from rlasync.engine.paged_attention import KVPool, build_metadata


def _step(block_size, num_blocks):
    """Three decodes and two prefill chunks (one mid-prompt), random pages."""
    starts = [5, 0, 23, 9, 16]
    lengths = [1, 7, 1, 4, 1]
    free = torch.randperm(num_blocks - 1).tolist()
    block_ids = [[free.pop() for _ in range((s + n - 1) // block_size + 1)] for s, n in zip(starts, lengths)]
    token_ids = [[100 + 10 * i + k for k in range(n)] for i, n in enumerate(lengths)]
    return token_ids, starts, block_ids


@pytest.mark.parametrize("block_size", [4, 16])
def test_staged_mixed_inputs_equal_build_metadata_with_the_padding_request(block_size):
    num_blocks, max_blocks, tokens, max_num_seqs = 64, 8, 32, 12
    pool = KVPool(1, num_blocks, block_size, 1, 2, torch.float32, "cpu")
    token_ids, starts, block_ids = _step(block_size, num_blocks)
    staged = StagedMixed(tokens, min(tokens, max_num_seqs) + 1, max_blocks, torch.device("cpu"))
    staged.host64.fill_(-5)  # garbage from an earlier step
    staged.host32.fill_(-5)
    host = {k: v.numpy() for k, v in staged.views(staged.host64, staged.host32).items()}
    sample_rows = [0, 2, 3, 4]  # chunk 1 is mid-prompt: it does not sample
    stage_mixed(host, token_ids, starts, block_ids, sample_rows, block_size, pool.null_block)

    n = sum(map(len, token_ids))
    pad = tokens - n
    meta = build_metadata(
        pool, [*starts, 0], [*map(len, token_ids), pad], [*block_ids, []], torch.device("cpu"), "triton", max_blocks
    )
    r = len(token_ids) + 1  # the real requests and the padding request
    assert host["input_ids"].tolist() == [t for ids in token_ids for t in ids] + [0] * pad
    assert host["positions"].tolist() == meta.positions.tolist()
    assert host["slot_mapping"][:n].tolist() == meta.slot_mapping[:n].tolist()
    assert set(host["slot_mapping"][n:].tolist()) == {pool.null_block * block_size}  # padding writes the null slot
    assert host["seq_lens"][:r].tolist() == meta.seq_lens.tolist()
    assert host["query_start_loc"][: r + 1].tolist() == meta.query_start_loc.tolist()
    assert host["seq_start_loc"][: r + 1].tolist() == meta.seq_start_loc.tolist()
    assert host["block_tables"][:r].tolist() == meta.block_tables.tolist()
    # the empty request slots: no query (start = end = the last token), no key
    assert host["seq_lens"][r:].tolist() == [0] * (staged.slots - r)
    assert host["query_start_loc"][r:].tolist() == [tokens] * (staged.slots + 1 - r)
    keys = sum(s + len(t) for s, t in zip(starts, token_ids)) + pad
    assert host["seq_start_loc"][r:].tolist() == [keys] * (staged.slots + 1 - r)
    # logits rows: the last query of each sampling chunk, then row 0
    ends = np.cumsum([len(t) for t in token_ids]) - 1
    assert host["rows"].tolist() == [int(ends[i]) for i in sample_rows] + [0] * (staged.slots - len(sample_rows))


def test_a_step_that_does_not_fit_is_refused_and_counts_stay_in_budget():
    staged = StagedMixed(8, 3, 4, torch.device("cpu"))
    host = {k: v.numpy() for k, v in staged.views(staged.host64, staged.host32).items()}
    with pytest.raises(ValueError, match="does not fit"):
        stage_mixed(host, [[1] * 5, [2] * 4], [0, 0], [[0], [1]], [0, 1], 4, 7)  # 9 tokens > 8
    with pytest.raises(ValueError, match="does not fit"):
        stage_mixed(host, [[1], [2], [3]], [0, 0, 0], [[0], [1], [2]], [0], 4, 7)  # 3 requests + padding > 3 slots
    assert mixed_token_counts(512) == (64, 128, 256, 384, 512)
    assert mixed_token_counts(8192)[-1] == 2048 and mixed_token_counts(1536)[-1] == 1536
