"""CUDA graphs of mixed steps (prefill chunks and decodes together), one per padded token count.

In RL rollouts new requests arrive all the time (a group's prompts while other groups decode), so almost every step
holds a prefill chunk: without these graphs every such step runs the decoder eagerly, and for a small model that is
host-bound (tens of milliseconds of Python and launches for a step the GPU finishes in a few). A mixed step of N
tokens from R requests is padded to the smallest captured token count T >= N:

    requests 0 .. R-1   the step's chunks, in order (queries at the end of their keys, as `build_metadata`)
    request  R          one padding request holding the T - N padding tokens: positions 0.., written to the null
                        slot, reading only the null block (its output is never read)
    requests R+1 .. C   empty (no query, no key): C + 1 = min(T, max_num_seqs) + 1 request slots, static

Every shape is static: block tables `max_model_len / block_size` wide, the attention's `max_query_len` is T and its
`max_seq_len` `max_model_len` (upper bounds; the kernels read each request's own lengths). The graph covers the
decoder and the LM head on one row per request slot (the last query of each chunk that samples, row 0 elsewhere);
sampling runs eagerly after it, as for the decode graphs (`cuda_graphs.py`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from rlasync.engine.cuda_graphs import capture_graphs
from rlasync.engine.kv_cache import num_blocks_for
from rlasync.engine.paged_attention import KVPool, PagedAttentionMetadata

DEFAULT_TOKEN_COUNTS = (64, 128, 256, 384, 512, 768, 1024, 1536, 2048)
"""The largest is the bound of a step with running requests (`Scheduler.graphed_step_tokens`): 2048 holds the
steady mixed step of 256 running requests with ~11-token completions and ~45-token prompts (~1.3k tokens)."""


def mixed_token_counts(max_num_batched_tokens: int, counts: Sequence[int] = DEFAULT_TOKEN_COUNTS) -> tuple[int, ...]:
    """The token counts to capture: those of `counts` (above 1: a mixed step has a prefill) within the step budget."""
    return tuple(sorted(count for count in counts if 1 < count <= max_num_batched_tokens))


class StagedMixed:
    """Host (pinned) and device buffers of one token count's graph inputs, laid out in two flat buffers per dtype
    so a step's inputs go to the GPU in two copies."""

    def __init__(self, tokens: int, slots: int, max_blocks: int, device: torch.device) -> None:
        self.tokens, self.slots, self.max_blocks = tokens, slots, max_blocks
        pin = device.type == "cuda"
        self.host64 = torch.zeros(3 * tokens + slots, dtype=torch.int64, pin_memory=pin)
        self.host32 = torch.zeros(3 * slots + 2 + slots * max_blocks, dtype=torch.int32, pin_memory=pin)
        self.dev64 = self.host64.to(device)
        self.dev32 = self.host32.to(device)
        self.copied: torch.cuda.Event | None = None  # recorded after the last host-to-device copies

    def views(self, buffer64: torch.Tensor, buffer32: torch.Tensor) -> dict[str, torch.Tensor]:
        """Named views into a (host or device) pair of buffers."""
        t, s = self.tokens, self.slots
        return {
            "input_ids": buffer64[:t],
            "positions": buffer64[t : 2 * t],
            "slot_mapping": buffer64[2 * t : 3 * t],
            "rows": buffer64[3 * t :],
            "seq_lens": buffer32[:s],
            "query_start_loc": buffer32[s : 2 * s + 1],
            "seq_start_loc": buffer32[2 * s + 1 : 3 * s + 2],
            "block_tables": buffer32[3 * s + 2 :].view(s, self.max_blocks),
        }


def stage_mixed(
    host: dict[str, np.ndarray],
    token_ids: Sequence[Sequence[int]],
    starts: Sequence[int],
    block_ids: Sequence[Sequence[int]],
    sample_rows: Sequence[int],
    block_size: int,
    null_block: int,
) -> None:
    """Fill the host views (`StagedMixed.views` as numpy arrays) for a step where request i feeds `token_ids[i]` at
    positions `starts[i]...` with its KV in blocks `block_ids[i]`, padded as the module docstring says.

    `sample_rows[j]` = the request whose last query gives logits row j (the chunks that sample, in order); the
    other rows read token 0. Equals `build_metadata` of the same chunks plus the padding request on every request
    and token it has (a unit test checks it)."""
    tokens = host["input_ids"].shape[0]
    slots = host["seq_lens"].shape[0]
    lengths = np.fromiter((len(ids) for ids in token_ids), dtype=np.int64, count=len(token_ids))
    n, r = int(lengths.sum()), len(token_ids)
    if n > tokens or r + 1 > slots:
        raise ValueError(f"a step of {n} tokens from {r} requests does not fit {tokens} tokens / {slots - 1} requests")
    pad = tokens - n
    starts_a = np.asarray(starts, dtype=np.int64).reshape(-1)
    q_begin = np.zeros(r + 1, dtype=np.int64)
    np.cumsum(lengths, out=q_begin[1:])
    owner = np.repeat(np.arange(r), lengths)  # request of each real token
    positions = starts_a[owner] + np.arange(n) - q_begin[:-1][owner]
    table = host["block_tables"]
    table[: r + 1] = null_block
    for i, blocks in enumerate(block_ids):
        table[i, : len(blocks)] = blocks
    host["input_ids"][:n] = np.fromiter((t for ids in token_ids for t in ids), dtype=np.int64, count=n)
    host["input_ids"][n:] = 0
    host["positions"][:n] = positions
    host["positions"][n:] = np.arange(pad)
    host["slot_mapping"][:n] = (
        table[owner, positions // block_size].astype(np.int64) * block_size + positions % block_size
    )
    host["slot_mapping"][n:] = null_block * block_size
    seq_lens = host["seq_lens"]
    seq_lens[:r] = starts_a + lengths
    seq_lens[r] = pad
    seq_lens[r + 1 :] = 0
    query_start_loc = host["query_start_loc"]
    query_start_loc[: r + 1] = q_begin
    query_start_loc[r + 1 :] = tokens  # the padding request's end, then empty requests
    seq_start_loc = host["seq_start_loc"]
    seq_start_loc[0] = 0
    np.cumsum(seq_lens, out=seq_start_loc[1:])
    rows = host["rows"]
    rows[:] = 0
    ends = q_begin[1:] - 1
    rows[: len(sample_rows)] = ends[np.asarray(sample_rows, dtype=np.int64)] if len(sample_rows) else []


class MixedGraphs:
    """One CUDA graph per token count of `token_counts` (see the module docstring); `run` replays the smallest that
    holds a step and returns its logits [slots, V] (row j: the j-th chunk that samples)."""

    def __init__(
        self,
        decoder: torch.nn.Module,
        logits_of: Callable[[torch.Tensor], torch.Tensor],
        pool: KVPool,
        device: torch.device,
        token_counts: Sequence[int],
        max_num_seqs: int,
        max_model_len: int,
        no_mask: torch.Tensor,
        backend: str,
    ) -> None:
        self.pool, self.backend, self.max_model_len = pool, backend, max_model_len
        self.token_counts = tuple(sorted(token_counts))
        max_blocks = num_blocks_for(max_model_len, pool.block_size)
        self._staged = {t: StagedMixed(t, min(t, max_num_seqs) + 1, max_blocks, device) for t in self.token_counts}
        self._decoder, self._logits_of, self._no_mask = decoder, logits_of, no_mask
        self.replays = 0  # steps run through these graphs (the engine reports it in its stats)
        self._capture_all()

    @property
    def max_tokens(self) -> int:
        return self.token_counts[-1]

    def fits(self, num_tokens: int, num_requests: int) -> bool:
        """Whether some graph holds a step of `num_tokens` tokens from `num_requests` requests."""
        return self._size_for(num_tokens, num_requests) is not None

    def _size_for(self, num_tokens: int, num_requests: int) -> int | None:
        """The smallest token count whose graph holds the step (its padding request included), or None."""
        return next((t for t in self.token_counts if t >= num_tokens and self._staged[t].slots > num_requests), None)

    def _forward(self, tokens: int) -> torch.Tensor:
        staged = self._staged[tokens]
        views = staged.views(staged.dev64, staged.dev32)
        meta = PagedAttentionMetadata(
            pool=self.pool,
            backend=self.backend,
            positions=views["positions"],
            slot_mapping=views["slot_mapping"],
            query_start_loc=views["query_start_loc"],
            seq_lens=views["seq_lens"],
            seq_start_loc=views["seq_start_loc"],
            block_tables=views["block_tables"],
            max_query_len=tokens,
            max_seq_len=self.max_model_len,
            reference=None,
        )
        hidden = self._decoder(
            input_ids=views["input_ids"][None],
            position_ids=views["positions"][None],
            attention_mask=self._no_mask,
            use_cache=False,
            paged_attention=meta,
        ).last_hidden_state[0]
        return self._logits_of(hidden.index_select(0, views["rows"]))

    def _stage_empty(self, tokens: int) -> None:
        """An all-padding step (warm-up and capture inputs)."""
        staged = self._staged[tokens]
        host = {k: v.numpy() for k, v in staged.views(staged.host64, staged.host32).items()}
        stage_mixed(host, [], [], [], [], self.pool.block_size, self.pool.null_block)
        staged.dev64.copy_(staged.host64)
        staged.dev32.copy_(staged.host32)

    def _capture_all(self) -> None:
        with torch.inference_mode():
            for tokens in self.token_counts:
                self._stage_empty(tokens)
        self._graphs = capture_graphs(self._forward, self.token_counts, warmup=self.token_counts)

    def run(
        self,
        token_ids: Sequence[Sequence[int]],
        starts: Sequence[int],
        block_ids: Sequence[Sequence[int]],
        sample_rows: Sequence[int],
        feedback: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Replay the graph for this step; returns its logits buffer (rows past `len(sample_rows)` are padding).
        As for the decode graphs, read the logits before the next call (the buffers are reused); `feedback` (flat
        token indices, ids, on the device) overwrites those input ids after the copies."""
        num_tokens = sum(len(ids) for ids in token_ids)
        tokens = self._size_for(num_tokens, len(token_ids))
        if tokens is None:
            raise ValueError(f"a step of {num_tokens} tokens from {len(token_ids)} requests fits no mixed-step graph")
        staged = self._staged[tokens]
        if staged.copied is not None:  # asynchronous scheduling: the last copies may still read the host buffers
            staged.copied.synchronize()
        host = {k: v.numpy() for k, v in staged.views(staged.host64, staged.host32).items()}
        stage_mixed(host, token_ids, starts, block_ids, sample_rows, self.pool.block_size, self.pool.null_block)
        staged.dev64.copy_(staged.host64, non_blocking=True)
        staged.dev32.copy_(staged.host32, non_blocking=True)
        if staged.dev64.is_cuda:  # (a CPU stand-in for the graphs, bench/engine_churn.py, has nothing to wait for)
            staged.copied = torch.cuda.Event()
            staged.copied.record()
        if feedback is not None:
            staged.dev64[:tokens].index_copy_(0, *feedback)
        graph, logits = self._graphs[tokens]
        graph.replay()
        self.replays += 1
        return logits
