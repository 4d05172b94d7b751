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

import torch

from rlasync.engine.kv_cache import num_blocks_for
from rlasync.engine.paged_attention import KVPool, PagedAttentionMetadata

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


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
    ) -> None:
        self.pool = pool
        self.backend = backend
        self.batch_sizes = tuple(sorted(batch_sizes))
        self.max_model_len = max_model_len
        self.max_blocks = num_blocks_for(max_model_len, pool.block_size)
        size = self.batch_sizes[-1]
        on = dict(device=device)
        self.input_ids = torch.zeros(size, dtype=torch.int64, **on)
        self.positions = torch.zeros(size, dtype=torch.int64, **on)
        self.slot_mapping = torch.full((size,), pool.null_slot, dtype=torch.int64, **on)
        self.query_start_loc = torch.arange(size + 1, dtype=torch.int32, **on)
        self.seq_lens = torch.ones(size, dtype=torch.int32, **on)
        self.seq_start_loc = torch.arange(size + 1, dtype=torch.int32, **on)
        self.block_tables = torch.full((size, self.max_blocks), pool.null_block, dtype=torch.int32, **on)
        self._decoder = decoder
        self._logits_of = logits_of
        self._no_mask = no_mask
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
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
        mempool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # warm-up (lazy kernel and library init) outside any capture
                for _ in range(2):
                    self._forward(self.max_batch_size)
            torch.cuda.current_stream().wait_stream(side)
            for size in reversed(self.batch_sizes):  # largest first: later graphs reuse its memory
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=mempool):
                    logits = self._forward(size)
                self._graphs[size] = (graph, logits)
        torch.cuda.synchronize()

    def run(self, input_ids: torch.Tensor, meta: PagedAttentionMetadata) -> torch.Tensor:
        """Replay the graph of `meta`'s (padded) batch size on its inputs; returns that graph's logits [B, V].

        `meta` must be a decode step built with `max_blocks=self.max_blocks` and padded to a captured size. The
        returned tensor is the graph's own output buffer: read it before the next replay."""
        size = int(input_ids.shape[0])
        self.input_ids[:size].copy_(input_ids, non_blocking=True)
        self.positions[:size].copy_(meta.positions, non_blocking=True)
        self.slot_mapping[:size].copy_(meta.slot_mapping, non_blocking=True)
        self.seq_lens[:size].copy_(meta.seq_lens, non_blocking=True)
        self.seq_start_loc[: size + 1].copy_(meta.seq_start_loc, non_blocking=True)
        self.block_tables[:size].copy_(meta.block_tables, non_blocking=True)
        graph, logits = self._graphs[size]
        graph.replay()
        return logits
