"""Which tokens of which requests the next engine step computes (pure Python, no torch).

Two queues: `waiting` (FCFS; preempted requests go back to its front) and `running` (in admission order). Each
`schedule()`:

  1. every running request gets its next tokens: one for a decoding request, the rest of its prompt (or of its
     recomputation after a preemption) for a prefilling one, bounded by the step's token budget
     (`max_num_batched_tokens`; a long prefill is split over several steps: chunked prefill). With
     `graphed_step_tokens` (the largest mixed-step CUDA graph, `mixed_graphs.py`) a step that has running requests
     is bounded by it too (never below one token per running request: decodes are not held back), so it replays
     a graph: a step over it runs the decoder eagerly, host-bound and several times slower for a small model.
     In a GRPO run with short completions requests finish and are admitted
     at every step (SmolLM2 on two-digit sums: ~23 of 256 per step, ~1.2k tokens a step with 45-token prompts), so
     without the bound most steps would run eagerly. A step with nothing running (the first, or after a weight sync
     preempted every request) keeps the whole budget: one large prefill;
  2. when a running request needs a new block and none is free, the most recently admitted running request is
     preempted: its blocks are freed, it goes to the front of `waiting` with its output kept, and it will
     recompute its tokens when readmitted (counted in `num_preemptions`);
  3. if nothing was preempted, waiting requests are admitted in order while their next chunk's blocks fit, the
     budget lasts and fewer than `max_num_seqs` run. Admission stops at the first that does not fit (no skipping:
     a long prompt is not starved by short ones).

Prefix caching (when the allocator has it on): a request admitted from scratch takes the cached blocks of its
prompt's longest cached prefix and computes only the rest (a GRPO group's `num_generations` requests share their
prompt's KV); the full prompt blocks a step computes are registered as it is scheduled.

A running request holds a slot (`Request.slot`, in [0, max_num_seqs)): its row in the runner's per-slot sampling
tensors (`slot_sampling.py`); preemption and `finish` give it back.

While `paused`, nothing is scheduled. `complete(output)` marks the scheduled tokens computed once the step ran;
`finish` / `abort` drop a request and free its blocks.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from rlasync.engine.kv_cache import BlockAllocator, num_blocks_for, prompt_block_keys
from rlasync.engine.request import Request


@dataclass(slots=True)
class ScheduledChunk:
    """`request.token_ids[start : start + num_tokens]` are computed this step; `samples`: the chunk reaches the
    request's last token, whose logits give its next sample. Never changed once made (not a frozen dataclass only
    because a frozen one's `__init__` costs ~5x a plain one's, and one is made per request per step)."""

    request: Request
    start: int
    num_tokens: int
    samples: bool

    @classmethod
    def next_of(cls, request: Request, num_tokens: int) -> ScheduledChunk:
        start = request.num_computed_tokens
        return cls(request, start, num_tokens, start + num_tokens == request.num_tokens)

    @property
    def end(self) -> int:
        return self.start + self.num_tokens


@dataclass(slots=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(chunk.num_tokens for chunk in self.chunks)

    @property
    def is_decode_only(self) -> bool:
        return all(chunk.num_tokens == 1 for chunk in self.chunks)


class Scheduler:
    def __init__(
        self,
        allocator: BlockAllocator,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        graphed_step_tokens: int | None = None,
    ) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError(
                f"need max_num_seqs >= 1 and max_num_batched_tokens >= 1, got {max_num_seqs} and "
                f"{max_num_batched_tokens}"
            )
        if graphed_step_tokens is not None and graphed_step_tokens < 1:
            raise ValueError(f"graphed_step_tokens={graphed_step_tokens}: must be >= 1 or None")
        self.allocator = allocator
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.graphed_step_tokens = graphed_step_tokens  # a step with running requests stays within it (docstring)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_prefix_hit_tokens = 0  # prompt tokens whose KV came from the prefix cache (cumulative)
        self.paused = False
        self._free_slots = list(range(max_num_seqs - 1, -1, -1))  # pop() gives the lowest free slot

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, request: Request) -> None:
        if request.num_tokens > self.allocator.capacity_tokens:
            raise ValueError(
                f"request {request.request_id} needs {request.num_tokens} KV slots but the cache holds "
                f"{self.allocator.capacity_tokens}"
            )
        if self.allocator.enable_caching and not request.prompt_block_keys:
            request.prompt_block_keys = prompt_block_keys(request.prompt_ids, self.allocator.block_size)
        self.waiting.append(request)

    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput()
        if self.paused:
            return output
        budget = self.max_num_batched_tokens
        if self.graphed_step_tokens is not None and self.running:  # never below one token per running request
            budget = min(budget, max(self.graphed_step_tokens, len(self.running)))
        budget = self._schedule_running(output, budget)
        if not output.preempted:
            self._admit_waiting(output, budget)
        return output

    def _schedule_running(self, output: SchedulerOutput, budget: int) -> int:
        running = self.running
        block_size = self.allocator.block_size
        chunks = output.chunks
        index = 0
        while index < len(running) and budget > 0:
            request = running[index]
            start = request.num_computed_tokens
            num_tokens = len(request.token_ids)
            num_new = min(num_tokens - start, budget)
            if num_new == 0:  # async scheduling: its last token is being sampled by the step in flight
                index += 1
                continue
            end = start + num_new
            keys = request.prompt_block_keys
            if end <= len(request.block_ids) * block_size and (not keys or start >= len(keys) * block_size):
                # the common decode: its blocks hold the new tokens and its full prompt blocks are registered
                # (`_reserve` and `_schedule_chunk` would do nothing else)
                chunks.append(ScheduledChunk(request, start, num_new, end == num_tokens))
                budget -= num_new
                index += 1
                continue
            while not self._reserve(request, end):
                victim = running.pop()
                self._preempt(victim)
                output.preempted.append(victim)
                if victim is request:
                    return budget
            self._schedule_chunk(output, request, num_new)
            budget -= num_new
            index += 1
        return budget

    def _admit_waiting(self, output: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting[0]
            hit_tokens = self._take_cached_prefix(request)
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if not self._reserve(request, request.num_computed_tokens + num_new):
                if hit_tokens:
                    self._release(request)  # it waits: give the cached blocks back
                return
            self.waiting.popleft()
            self.running.append(request)
            request.slot = self._free_slots.pop()
            self.num_prefix_hit_tokens += hit_tokens
            self._schedule_chunk(output, request, num_new)
            budget -= num_new

    def _take_cached_prefix(self, request: Request) -> int:
        """A request starting from scratch takes the cached blocks of its prompt's longest cached prefix (always
        leaving one token to compute: its logits give the first sample); returns the tokens it skips."""
        if request.block_ids or not request.prompt_block_keys:
            return 0
        blocks = []
        for key in request.prompt_block_keys:
            block = self.allocator.lookup(key)
            if block is None:
                break
            blocks.append(block)
        block_size = self.allocator.block_size
        if blocks and len(blocks) * block_size >= request.num_tokens:
            blocks.pop()
        for block in blocks:
            self.allocator.acquire(block)
        request.block_ids = blocks
        request.num_computed_tokens = len(blocks) * block_size
        return request.num_computed_tokens

    def _schedule_chunk(self, output: SchedulerOutput, request: Request, num_new: int) -> None:
        """Schedule the request's next `num_new` tokens; the full prompt blocks they complete are registered in the
        prefix cache now: a request admitted later in this same step may already share them, since every layer
        writes the step's keys and values before any query attends."""
        output.chunks.append(ScheduledChunk.next_of(request, num_new))
        keys = request.prompt_block_keys
        block_size = self.allocator.block_size
        if keys and request.num_computed_tokens < len(keys) * block_size:  # not past the prompt's full blocks
            first = request.num_computed_tokens // block_size
            last = min((request.num_computed_tokens + num_new) // block_size, len(keys))
            for index in range(first, last):
                self.allocator.cache(request.block_ids[index], keys[index])

    def _reserve(self, request: Request, num_tokens: int) -> bool:
        """Grow the request's blocks to hold `num_tokens` tokens; False (nothing taken) if they are not free."""
        missing = num_blocks_for(num_tokens, self.allocator.block_size) - len(request.block_ids)
        if missing <= 0:
            return True
        if missing > self.allocator.num_free:
            return False
        request.block_ids.extend(self.allocator.allocate(missing))
        return True

    def _preempt(self, request: Request) -> None:
        self._release(request)
        self.waiting.appendleft(request)
        self.num_preemptions += 1

    def _release(self, request: Request) -> None:
        if request.slot is not None:
            self._free_slots.append(request.slot)
            request.slot = None
        self.allocator.free(request.block_ids)
        request.block_ids = []
        request.num_computed_tokens = 0

    def complete(self, output: SchedulerOutput) -> None:
        """The step of `output` ran: its tokens' KV is in the cache (requests dropped meanwhile are skipped)."""
        for chunk in output.chunks:
            request = chunk.request
            if request.finish_reason is None and request.block_ids:  # not finished, not preempted
                request.num_computed_tokens = chunk.start + chunk.num_tokens

    def preempt_all(self) -> list[Request]:
        """Preempt every running request (their KV is invalid, e.g. after a weight update); order is kept."""
        preempted = []
        while self.running:
            victim = self.running.pop()
            self._preempt(victim)
            preempted.append(victim)
        return preempted

    def finish(self, request: Request) -> None:
        """Drop a request (finished, aborted or failed) from whichever queue holds it and free its blocks."""
        if request.slot is not None:  # it runs (a request holds a slot exactly while it is in `running`)
            self.running.remove(request)
        elif request in self.waiting:  # (not scanned for a running request: the queue may be long)
            self.waiting.remove(request)
        self._release(request)
