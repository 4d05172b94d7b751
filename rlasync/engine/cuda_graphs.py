"""CUDA graphs of the decode step: one graph per padded batch size, replayed with static input buffers.

A decode step (every request feeds one token) is padded to the smallest captured batch size that holds it; padding
rows feed token 0 at position 0, write to the pool's null slot and read only the null block (`paged_attention`), so
every shape is static: block tables are `max_model_len / block_size` wide and FlashAttention's `max_seq_len` is
max_model_len (the kernel reads each request's blocks up to its own `seq_lens` entry only). The graph covers the
decoder and the LM head (logits [B, V] float32 for every row); sampling runs eagerly after it. Steps with a prefill,
or more requests than the largest graph, run eagerly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from rlasync.engine.kv_cache import num_blocks_for
from rlasync.engine.paged_attention import KVPool, PagedAttentionMetadata

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


def decode_batch_sizes(max_num_seqs: int, sizes: Sequence[int] = DEFAULT_BATCH_SIZES) -> tuple[int, ...]:
    """The captured sizes up to `max_num_seqs` (which is always one of them, so every decode step fits)."""
    kept = sorted({size for size in sizes if size < max_num_seqs} | {max_num_seqs})
    return tuple(kept)


class DecodeGraphs:
    def __init__(
        self,
        decoder: torch.nn.Module,
        logits_of: Callable[[torch.Tensor], torch.Tensor],
        pool: KVPool,
        device: torch.device,
        batch_sizes: Sequence[int],
        max_model_len: int,
        no_mask: torch.Tensor,
        backend: str = "varlen",
        warm_every_size: bool = False,
    ) -> None:
        """`warm_every_size`: run every batch size once before any capture (a compiled decoder compiles for the
        shapes it specialises on, size 1, and the fused layers' Triton kernels for the sizes they specialise on,
        outside the capture); otherwise only the largest, twice."""
        self.pool = pool
        self.backend = backend
        self.batch_sizes = tuple(sorted(batch_sizes))
        self.warm_every_size = warm_every_size
        self.max_model_len = max_model_len
        self.max_blocks = num_blocks_for(max_model_len, pool.block_size)
        size = self.batch_sizes[-1]
        on = dict(device=device)
        # the graphs' inputs live in two flat device buffers, filled from two pinned host buffers per step (`stage`)
        self.staging = DecodeStaging(size, pool.block_size, pool.null_block, self.max_blocks, pin_memory=True)
        self.host64, self.host32 = self.staging.host64, self.staging.host32
        self.dev64 = self.host64.to(device)
        self.dev32 = self.host32.to(device)
        self.input_ids, self.positions, self.slot_mapping = self.dev64
        self.seq_lens = self.dev32[:size]
        self.seq_start_loc = self.dev32[size : 2 * size + 1]
        self.block_tables = self.dev32[2 * size + 1 :].view(size, self.max_blocks)
        self.query_start_loc = torch.arange(size + 1, dtype=torch.int32, **on)
        self._decoder = decoder
        self._logits_of = logits_of
        self._no_mask = no_mask
        self._copied: torch.cuda.Event | None = None  # recorded after the last step's host-to-device copies
        self._capture_all()

    @property
    def max_batch_size(self) -> int:
        return self.batch_sizes[-1]

    def padded_size(self, num_requests: int) -> int:
        return next(size for size in self.batch_sizes if size >= num_requests)

    def _metadata(self, size: int) -> PagedAttentionMetadata:
        return PagedAttentionMetadata(
            pool=self.pool,
            backend=self.backend,
            positions=self.positions[:size],
            slot_mapping=self.slot_mapping[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            seq_lens=self.seq_lens[:size],
            seq_start_loc=self.seq_start_loc[: size + 1],
            block_tables=self.block_tables[:size],
            max_query_len=1,
            max_seq_len=self.max_model_len,
            reference=None,
        )

    def _forward(self, size: int) -> torch.Tensor:
        hidden = self._decoder(
            input_ids=self.input_ids[None, :size],
            position_ids=self.positions[None, :size],
            attention_mask=self._no_mask,
            use_cache=False,
            paged_attention=self._metadata(size),
        ).last_hidden_state[0]
        return self._logits_of(hidden)

    def _capture_all(self) -> None:
        # every size runs once before any capture: a compiled decoder (`compiled_layers`) compiles for each shape it
        # specialises on (size 1) outside the capture
        self._graphs = capture_graphs(self._forward, self.batch_sizes, warmup=[self.max_batch_size, *self.batch_sizes])

    def run_decode(
        self,
        token_ids: Sequence[int],
        positions: Sequence[int],
        block_ids: Sequence[Sequence[int]],
        feedback: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Replay the graph of the smallest captured size holding this decode step (request i feeds `token_ids[i]` at
        `positions[i]`, its KV in blocks `block_ids[i]`); returns that graph's logits [size, V] (rows past the step's
        requests are padding). Host inputs are staged in pinned memory and sent in two copies. `feedback`
        (rows [F] int64, ids [F] int64, on the device) overwrites those rows' input ids after the copies.

        The returned tensor is the graph's own output buffer, and the host buffers are reused by the next step: read
        the logits (which synchronises) before the next call."""
        size = self.padded_size(len(token_ids))
        if self._copied is not None:  # asynchronous scheduling: the last step's copies may still read the host buffers
            self._copied.synchronize()
        self.staging.stage(token_ids, positions, block_ids, size)
        self.dev64.copy_(self.host64, non_blocking=True)
        self.dev32.copy_(self.host32, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        if feedback is not None:  # input ids sampled by the previous step, still on the device
            self.input_ids.index_copy_(0, *feedback)
        graph, logits = self._graphs[size]
        graph.replay()
        return logits


def capture_graphs(
    forward: Callable[[int], torch.Tensor], sizes: Sequence[int], warmup: Sequence[int]
) -> dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]]:
    """One CUDA graph of `forward(size)` per size, sharing one memory pool: `forward` runs first for each size of
    `warmup` on a side stream (lazy kernel and library init outside any capture), then the sizes are captured
    largest first (later graphs reuse its memory). Returns {size: (graph, its output tensor)}."""
    graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
    mempool = torch.cuda.graph_pool_handle()
    with torch.inference_mode():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for size in warmup:
                forward(size)
        torch.cuda.current_stream().wait_stream(side)
        for size in sorted(sizes, reverse=True):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=mempool):
                output = forward(size)
            graphs[size] = (graph, output)
    torch.cuda.synchronize()
    return graphs


class DecodeStaging:
    """The host buffers of the decode graphs' inputs (`stage_decode`'s layout) for batches up to `capacity` rows,
    pinned for asynchronous copies on CUDA; `stage` fills them for one step as `stage_decode` does.

    Consecutive decode steps mostly hold the same requests in the same rows with the same blocks (a request takes
    a new block every `block_size` tokens), so the block table is written incrementally: a row is rewritten only when
    its request's block list is another list object or has another length than at its last write. This relies on the
    scheduler's contract for `Request.block_ids`: a list only grows in place (blocks appended) or is replaced."""

    def __init__(self, capacity: int, block_size: int, null_block: int, max_blocks: int, pin_memory: bool = False):
        self.capacity, self.block_size, self.null_block, self.max_blocks = capacity, block_size, null_block, max_blocks
        self.host64 = torch.zeros(3, capacity, dtype=torch.int64, pin_memory=pin_memory)
        self.host32 = torch.zeros(capacity * (2 + max_blocks) + 1, dtype=torch.int32, pin_memory=pin_memory)
        self._np64, self._np32 = self.host64.numpy(), self.host32.numpy()
        self._table = self._np32[2 * capacity + 1 :].reshape(capacity, max_blocks)
        self._table[:] = null_block
        self._source: list[Sequence[int] | None] = [None] * capacity  # the block list each row was last written from
        self._filled = [0] * capacity  # the row's entries before its null padding
        self.rows_written = 0  # table rows (re)written (for tests)
        self.stage([], [], [], capacity)

    def stage(
        self, token_ids: Sequence[int], positions: Sequence[int], block_ids: Sequence[Sequence[int]], size: int
    ) -> None:
        """Fill the buffers for a decode step padded to `size` rows (`stage_decode`)."""
        n = len(token_ids)
        table, source, filled, null = self._table, self._source, self._filled, self.null_block
        for row in range(n):
            blocks = block_ids[row]
            count = len(blocks)
            if source[row] is blocks and filled[row] == count:
                continue
            table[row, :count] = blocks
            if filled[row] > count:
                table[row, count : filled[row]] = null
            source[row], filled[row] = blocks, count
            self.rows_written += 1
        for row in range(n, size):  # padding rows read only the null block
            if filled[row]:
                table[row, : filled[row]] = null
                filled[row] = 0
            source[row] = None
        _stage_rows(self._np64, self._np32, token_ids, positions, size, self.block_size, self.null_block)


def stage_decode(
    host64: np.ndarray,
    host32: np.ndarray,
    token_ids: Sequence[int],
    positions: Sequence[int],
    block_ids: Sequence[Sequence[int]],
    size: int,
    block_size: int,
    null_block: int,
    max_blocks: int,
) -> None:
    """Fill the host buffers of a decode step padded to `size` rows, exactly as `build_metadata` would for it
    (padding rows feed token 0 at position 0 into the null slot and read only the null block).

    host64 [3, S] int64: input ids, positions, slot mapping; host32 [S * (2 + max_blocks) + 1] int32: seq_lens [S],
    seq_start_loc [S + 1], block_tables [S, max_blocks]."""
    capacity = host64.shape[1]
    table = host32[2 * capacity + 1 :].reshape(capacity, max_blocks)
    table[:size] = null_block
    for row, blocks in enumerate(block_ids):
        table[row, : len(blocks)] = blocks
    _stage_rows(host64, host32, token_ids, positions, size, block_size, null_block)


def _stage_rows(
    host64: np.ndarray,
    host32: np.ndarray,
    token_ids: Sequence[int],
    positions: Sequence[int],
    size: int,
    block_size: int,
    null_block: int,
) -> None:
    """`stage_decode` past the block table (filled already): ids, positions, slot mapping, lengths."""
    n = len(token_ids)
    capacity = host64.shape[1]
    ids, pos, slots = host64
    seq_lens = host32[:capacity]
    seq_start_loc = host32[capacity : 2 * capacity + 1]
    table = host32[2 * capacity + 1 :].reshape(capacity, -1)
    ids[:size] = 0
    pos[:size] = 0
    if n:
        ids[:n] = token_ids
        pos[:n] = positions
    p = pos[:n]
    slots[:n] = table[np.arange(n), p // block_size].astype(np.int64) * block_size + p % block_size
    slots[n:size] = null_block * block_size
    seq_lens[:size] = 1
    seq_lens[:n] = p + 1
    seq_start_loc[0] = 0
    np.cumsum(seq_lens[:size], out=seq_start_loc[1 : size + 1])
