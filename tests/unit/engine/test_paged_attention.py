"""The paged attention function (reference backend, CPU) against plain softmax attention over each request's whole
sequence: decodes, a fresh prefill and a chunk continuing one, with GQA and a sliding window."""

import pytest
import torch

from rlasync.engine.paged_attention import KVPool, build_metadata, choose_layout, paged_attention_forward


class Layer:
    layer_idx = 1


def dense_attention(q, k, v, positions, window):
    """q [Q, H, D] at `positions`, k/v [L, Hkv, D] at positions 0..L-1 -> [Q, H, D]."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / q.shape[-1] ** 0.5
    key_pos = torch.arange(k.shape[0])
    visible = key_pos[None, :] <= positions[:, None]
    if window:
        visible &= key_pos[None, :] > positions[:, None] - window
    weights = torch.softmax(scores.masked_fill(~visible, float("-inf")), -1)
    return torch.einsum("hqk,khd->qhd", weights, v)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("block_size", [1, 4, 16])
def test_reference_backend_equals_dense_attention_per_request(window, block_size):
    torch.manual_seed(0)
    heads, kv_heads, dim = 4, 2, 8
    pool = KVPool(2, 40, block_size, kv_heads, dim, torch.float32, "cpu")
    starts, lengths = (
        [9, 0, 6, 0, 2 * block_size + 1],
        [1, 7, 5, 1, 1],
    )  # decode, prefill, chunk, 1-token prompt, decode
    ends = [s + n for s, n in zip(starts, lengths)]
    free = torch.randperm(40).tolist()
    block_ids = [[free.pop() for _ in range(-(-end // block_size))] for end in ends]
    full_k = [torch.randn(end, kv_heads, dim) for end in ends]
    full_v = [torch.randn(end, kv_heads, dim) for end in ends]
    for blocks, k, v, start in zip(block_ids, full_k, full_v, starts):  # the cache already holds positions < start
        for pos in range(start):
            slot = blocks[pos // block_size] * block_size + pos % block_size
            pool.keys(1)[slot], pool.values(1)[slot] = k[pos], v[pos]
    queries = [torch.randn(n, heads, dim) for n in lengths]
    new_k = torch.cat([k[s:] for k, s in zip(full_k, starts)])
    new_v = torch.cat([v[s:] for v, s in zip(full_v, starts)])
    meta = build_metadata(pool, starts, lengths, block_ids, torch.device("cpu"))
    out, _ = paged_attention_forward(
        Layer(),
        torch.cat(queries).transpose(0, 1)[None],
        new_k.transpose(0, 1)[None],
        new_v.transpose(0, 1)[None],
        None,
        scaling=dim**-0.5,
        sliding_window=window,
        paged_attention=meta,
    )
    expected = torch.cat(
        [
            dense_attention(q, k, v, torch.arange(s, s + len(q)), window)
            for q, k, v, s in zip(queries, full_k, full_v, starts)
        ]
    )
    torch.testing.assert_close(out[0], expected, atol=1e-5, rtol=1e-5)
    assert pool.keys(0).abs().sum() == 0  # layer 0's storage untouched


def test_padding_rows_write_only_the_null_block():
    pool = KVPool(1, 4, 4, 1, 2, torch.float32, "cpu")
    meta = build_metadata(pool, [3, 0, 0], [1, 1, 1], [[2], [], []], torch.device("cpu"), max_blocks=3)
    assert meta.slot_mapping.tolist() == [2 * 4 + 3, pool.null_slot, pool.null_slot]
    assert meta.block_tables.tolist() == [[2, 4, 4], [4, 4, 4], [4, 4, 4]]
    assert meta.seq_lens.tolist() == [4, 1, 1] and meta.query_start_loc.tolist() == [0, 1, 2, 3]


def test_layout_on_cpu_is_the_reference_backend():
    cpu = torch.device("cpu")
    assert choose_layout("auto", None, cpu, torch.float32, 4, 2, 8) == ("reference", 16)
    assert choose_layout("reference", 32, cpu, torch.float32, 4, 2, 8) == ("reference", 32)
    with pytest.raises(ValueError, match="varlen"):
        choose_layout("varlen", None, cpu, torch.bfloat16, 4, 2, 8)
    with pytest.raises(ValueError, match="attention_backend"):
        choose_layout("flash", None, cpu, torch.float32, 4, 2, 8)


def compare_triton_with_reference(window: int, block_size: int) -> None:
    """The Triton kernel against the reference backend on a mixed step: decodes, a fresh prefill longer than one query
    tile and one key tile, a chunk continuing a request, GQA."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    heads, kv_heads, dim, num_blocks = 4, 2, 16, 64
    pool = KVPool(2, num_blocks, block_size, kv_heads, dim, torch.float32, device)
    pool.kv.normal_()
    starts, lengths = [9, 0, 70, 0, 2 * block_size + 1], [1, 80, 5, 1, 1]
    ends = [s + n for s, n in zip(starts, lengths)]
    free = torch.randperm(num_blocks).tolist()
    block_ids = [[free.pop() for _ in range(-(-end // block_size))] for end in ends]
    shapes = {"query": heads, "key": kv_heads, "value": kv_heads}
    tensors = {name: torch.randn(1, h, sum(lengths), dim, device=device) for name, h in shapes.items()}
    outputs = []
    for backend in ("reference", "triton"):
        meta = build_metadata(pool, starts, lengths, block_ids, device, backend)
        outputs.append(
            paged_attention_forward(
                Layer(),
                **tensors,
                attention_mask=None,
                scaling=dim**-0.5,
                sliding_window=window or None,
                paged_attention=meta,
            )[0]
        )
    torch.testing.assert_close(outputs[1], outputs[0], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("block_size", [4, 16])
def test_triton_backend_equals_the_reference(window, block_size, triton_check):
    triton_check(compare_triton_with_reference, __file__, window or 0, block_size)


def test_staged_decode_inputs_equal_build_metadata():
    """The decode CUDA graphs' host staging (pinned buffers, no torch ops) gives exactly the metadata `build_metadata`
    gives for the same step padded to the graph's size."""
    import numpy as np

    from rlasync.engine.cuda_graphs import stage_decode

    block_size, num_blocks, max_blocks, capacity, size = 4, 40, 6, 16, 8
    pool = KVPool(1, num_blocks, block_size, 1, 2, torch.float32, "cpu")
    positions = [0, 5, 23, 9, 12]
    free = torch.randperm(num_blocks).tolist()
    block_ids = [[free.pop() for _ in range(p // block_size + 1)] for p in positions]
    token_ids = [7, 8, 9, 10, 11]
    host64 = np.full((3, capacity), -5, dtype=np.int64)  # garbage from an earlier, larger step
    host32 = np.full(capacity * (2 + max_blocks) + 1, -5, dtype=np.int32)
    stage_decode(host64, host32, token_ids, positions, block_ids, size, block_size, pool.null_block, max_blocks)
    pad = size - len(positions)
    meta = build_metadata(
        pool, positions + [0] * pad, [1] * size, block_ids + [[]] * pad, torch.device("cpu"), "triton", max_blocks
    )
    assert host64[0, :size].tolist() == token_ids + [0] * pad
    assert host64[1, :size].tolist() == meta.positions.tolist()
    assert host64[2, :size].tolist() == meta.slot_mapping.tolist()
    assert host32[:size].tolist() == meta.seq_lens.tolist()
    assert host32[capacity : capacity + size + 1].tolist() == meta.seq_start_loc.tolist()
    table = host32[2 * capacity + 1 :].reshape(capacity, max_blocks)
    assert table[:size].tolist() == meta.block_tables.tolist()


def test_incremental_decode_staging_equals_stage_decode_over_changing_steps():
    """`DecodeStaging` rewrites only the block-table rows whose block list changed (another list, or grown in place);
    over steps where requests grow, finish, get replaced, shift rows and the batch shrinks and grows, every step's
    buffers equal `stage_decode`'s from scratch on the step's rows."""
    import random

    import numpy as np

    from rlasync.engine.cuda_graphs import DecodeStaging, stage_decode

    block_size, null, max_blocks, capacity = 4, 99, 6, 8
    staging = DecodeStaging(capacity, block_size, null, max_blocks)
    rng = random.Random(0)
    requests = [{"blocks": [rng.randrange(90)], "pos": rng.randrange(block_size)} for _ in range(6)]
    for step in range(60):
        for request in requests:  # one token each; a new block when the last one is full
            request["pos"] += 1
            if request["pos"] >= len(request["blocks"]) * block_size and len(request["blocks"]) < max_blocks:
                request["blocks"].append(rng.randrange(90))  # grown in place, as Scheduler._reserve does
            request["pos"] = min(request["pos"], len(request["blocks"]) * block_size - 1)
        if step % 7 == 3 and requests:
            requests.pop(rng.randrange(len(requests)))  # finished: later rows shift up
        if step % 5 == 1 and len(requests) < capacity:
            requests.insert(rng.randrange(len(requests) + 1), {"blocks": [rng.randrange(90)], "pos": 0})
        if step % 11 == 6 and requests:
            requests[0]["blocks"] = [rng.randrange(90)]  # replaced (preempted and readmitted)
            requests[0]["pos"] = 0
        n = len(requests)
        size = next(s for s in (1, 2, 4, 8) if s >= n) if n else 1
        token_ids = [rng.randrange(50) for _ in range(n)]
        positions = [r["pos"] for r in requests]
        blocks = [r["blocks"] for r in requests]
        staging.stage(token_ids, positions, blocks, size)
        want64 = np.full((3, capacity), -5, dtype=np.int64)
        want32 = np.full(capacity * (2 + max_blocks) + 1, -5, dtype=np.int32)
        stage_decode(want64, want32, token_ids, positions, blocks, size, block_size, null, max_blocks)
        got64, got32 = staging.host64.numpy(), staging.host32.numpy()
        assert (got64[:, :size] == want64[:, :size]).all(), step
        assert (got32[:size] == want32[:size]).all(), step
        assert (got32[capacity : capacity + size + 1] == want32[capacity : capacity + size + 1]).all(), step
        got_table = got32[2 * capacity + 1 :].reshape(capacity, max_blocks)[:size]
        want_table = want32[2 * capacity + 1 :].reshape(capacity, max_blocks)[:size]
        assert (got_table == want_table).all(), step
    written = staging.rows_written
    staging.stage(token_ids, positions, blocks, size)  # the same step again: no row rewritten
    assert staging.rows_written == written


if __name__ == "__main__":
    import sys

    compare_triton_with_reference(int(sys.argv[1]), int(sys.argv[2]))
