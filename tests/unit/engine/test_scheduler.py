"""The engine's scheduler and block allocator, without torch: admission by free blocks, chunked prefill, preemption
(counted, most recent first, resumed in order with its output kept) and no block leaks."""

import random

import pytest

from rlasync.engine.base import SamplingParams
from rlasync.engine.kv_cache import BlockAllocator, num_blocks_for
from rlasync.engine.request import FINISH_LENGTH, FINISH_STOP, Request
from rlasync.engine.scheduler import Scheduler


def make_request(request_id, prompt_len, max_tokens=8, stop_ids=()):
    return Request(
        request_id=request_id,
        prompt_ids=list(range(1, prompt_len + 1)),
        params=SamplingParams(max_tokens=max_tokens),
        seed=request_id,
        max_output_tokens=max_tokens,
        stop_ids=frozenset(stop_ids),
    )


def run_step(scheduler, token=100):
    """Schedule one step, mark it computed and append `token` to every request that samples; returns the output."""
    output = scheduler.schedule()
    apply(scheduler, output, token)
    return output


def apply(scheduler, output, token):
    scheduler.complete(output)
    for chunk in output.chunks:
        if chunk.samples:
            reason = chunk.request.append(token, -1.0)
            if reason is not None:
                chunk.request.finish_reason = reason
                scheduler.finish(chunk.request)


def test_allocator_hands_out_and_takes_back_blocks():
    allocator = BlockAllocator(num_blocks=4, block_size=16)
    blocks = allocator.allocate(3)
    assert sorted(blocks) == [0, 1, 2] and allocator.num_free == 1 and allocator.usage_frac == 0.75
    with pytest.raises(RuntimeError):
        allocator.allocate(2)
    allocator.free(blocks[:1])
    with pytest.raises(RuntimeError, match="twice"):
        allocator.free(blocks[:1])
    assert allocator.num_free == 2 and allocator.capacity_tokens == 64
    assert [num_blocks_for(n, 16) for n in (1, 16, 17, 32)] == [1, 1, 2, 2]


def test_admission_stops_at_the_first_request_whose_blocks_do_not_fit():
    scheduler = Scheduler(BlockAllocator(num_blocks=5, block_size=4), max_num_seqs=8, max_num_batched_tokens=100)
    requests = [make_request(0, 6), make_request(1, 7), make_request(2, 3), make_request(3, 1)]
    for request in requests:
        scheduler.add(request)
    output = scheduler.schedule()
    # 2 + 2 blocks admitted; the third needs 1 block and fits, the fourth (1 block) no longer does
    assert [chunk.request.request_id for chunk in output.chunks] == [0, 1, 2]
    assert [chunk.num_tokens for chunk in output.chunks] == [6, 7, 3]
    assert all(chunk.samples for chunk in output.chunks)
    assert scheduler.num_running == 3 and scheduler.num_waiting == 1
    assert scheduler.allocator.num_free == 0


def test_max_num_seqs_and_the_token_budget_bound_a_step_and_long_prompts_are_chunked():
    scheduler = Scheduler(BlockAllocator(num_blocks=64, block_size=4), max_num_seqs=2, max_num_batched_tokens=10)
    for i, length in enumerate((4, 15, 3)):
        scheduler.add(make_request(i, length))
    first = run_step(scheduler)
    assert [(c.request.request_id, c.start, c.num_tokens, c.samples) for c in first.chunks] == [
        (0, 0, 4, True),
        (1, 0, 6, False),
    ]
    second = run_step(scheduler)  # request 0 decodes, request 1 continues its prefill; max_num_seqs keeps 2 out
    assert [(c.request.request_id, c.start, c.num_tokens, c.samples) for c in second.chunks] == [
        (0, 4, 1, True),
        (1, 6, 9, True),
    ]
    assert scheduler.num_waiting == 1


def test_pause_schedules_nothing():
    scheduler = Scheduler(BlockAllocator(num_blocks=8, block_size=4), max_num_seqs=8, max_num_batched_tokens=64)
    scheduler.add(make_request(0, 5))
    scheduler.paused = True
    assert scheduler.schedule().chunks == []
    scheduler.paused = False
    assert len(scheduler.schedule().chunks) == 1


def test_preemption_takes_the_latest_admitted_counts_it_and_resumes_in_order_with_output_kept():
    # 4 blocks of 4: three 4-token prompts take 3; the first decode step needs 2 more
    scheduler = Scheduler(BlockAllocator(num_blocks=4, block_size=4), max_num_seqs=8, max_num_batched_tokens=64)
    requests = [make_request(i, 4, max_tokens=6) for i in range(3)]
    for request in requests:
        scheduler.add(request)
    run_step(scheduler)  # prefill: every request samples its first token
    assert all(r.num_output_tokens == 1 for r in requests)

    output = run_step(scheduler, token=101)  # request 1 finds no block: request 2 (latest admitted) is preempted
    assert output.preempted == [requests[2]]
    assert [c.request.request_id for c in output.chunks] == [0, 1]
    assert scheduler.num_preemptions == 1
    assert list(scheduler.waiting) == [requests[2]]
    assert requests[2].block_ids == [] and requests[2].num_computed_tokens == 0
    assert requests[2].output_ids == [100]  # output kept

    resumed = []
    while scheduler.has_work:
        output = scheduler.schedule()
        if output.preempted:
            assert list(scheduler.waiting)[: len(output.preempted)] == output.preempted[::-1]  # order kept
        for chunk in output.chunks:  # a resumed request recomputes prompt + output, then samples its next step
            if chunk.start == 0 and chunk.request.num_output_tokens > 0:
                assert chunk.num_tokens == chunk.request.num_tokens and chunk.samples
                resumed.append(chunk.request.request_id)
        apply(scheduler, output, token=103)
    # request 1 was preempted later but went to the front: requests resume in their admission order
    assert resumed == [1, 2] and scheduler.num_preemptions == 2
    assert all(r.finish_reason == FINISH_LENGTH and r.num_output_tokens == 6 for r in requests)
    assert requests[1].output_ids[:2] == [100, 101] and requests[2].output_ids[:1] == [100]
    assert scheduler.allocator.num_free == 4


def test_preempt_all_keeps_order_and_counts():
    scheduler = Scheduler(BlockAllocator(num_blocks=16, block_size=4), max_num_seqs=8, max_num_batched_tokens=64)
    requests = [make_request(i, 3) for i in range(3)]
    for request in requests:
        scheduler.add(request)
    run_step(scheduler)
    assert scheduler.preempt_all() == requests[::-1]
    assert list(scheduler.waiting) == requests
    assert scheduler.num_preemptions == 3 and scheduler.allocator.num_free == 16


def test_stop_token_ends_a_request():
    request = make_request(0, 2, max_tokens=5, stop_ids={7})
    assert request.append(3, -0.1) is None
    assert request.append(7, -0.2) == FINISH_STOP
    assert request.output_ids == [3, 7] and request.output_log_probs == [-0.1, -0.2]


def test_allocator_shares_cached_blocks_by_reference_and_evicts_the_oldest_unreferenced():
    allocator = BlockAllocator(num_blocks=3, block_size=2, enable_caching=True)
    a, b = allocator.allocate(2)
    allocator.cache(a, (0, (1, 2)))
    assert allocator.lookup((0, (1, 2))) == a and allocator.lookup((0, (9, 9))) is None
    allocator.acquire(a)  # a second request shares it
    allocator.free([a, b])
    assert allocator.num_free == 2  # b is free; a is still held once
    allocator.free([a])
    assert allocator.num_free == 3 and allocator.num_cached == 1  # a: unreferenced but still cached
    allocator.acquire(allocator.lookup((0, (1, 2))))  # a hit takes it back out of the evictable set
    assert allocator.num_free == 2
    allocator.free([a])
    fresh = allocator.allocate(3)  # the free blocks first, then the cached one is evicted
    assert sorted(fresh) == [0, 1, 2] and allocator.num_cached == 0 and allocator.lookup((0, (1, 2))) is None
    allocator.free(fresh)
    with pytest.raises(RuntimeError, match="freed twice"):
        allocator.free([fresh[0]])
    allocator.cache(fresh[0], (0, (5, 5)))  # a registration without caching enabled is ignored:
    assert BlockAllocator(2, 2).lookup((0, (5, 5))) is None
    allocator.clear_cache()
    assert allocator.num_cached == 0 and allocator.num_free == 3


def test_requests_with_a_common_prompt_prefix_share_its_full_blocks_in_the_same_step():
    scheduler = Scheduler(BlockAllocator(num_blocks=32, block_size=4, enable_caching=True), 8, 100)
    prompt = list(range(1, 11))  # 10 tokens: two full blocks and a partial one
    first, second = make_request(0, 1), make_request(1, 1)
    first.prompt_ids, first.token_ids = list(prompt), list(prompt)
    second.prompt_ids, second.token_ids = list(prompt), list(prompt)
    exact = make_request(2, 8)  # 8 tokens = two full blocks of the same prefix: the last one is recomputed
    for request in (first, second, exact):
        scheduler.add(request)
    output = run_step(scheduler)
    chunks = {chunk.request.request_id: chunk for chunk in output.chunks}
    assert (chunks[0].start, chunks[0].num_tokens) == (0, 10)
    assert (chunks[1].start, chunks[1].num_tokens) == (8, 2)  # blocks 0-1 shared, written this same step
    assert (chunks[2].start, chunks[2].num_tokens) == (4, 4)
    assert second.block_ids[:2] == first.block_ids[:2] and exact.block_ids[0] == first.block_ids[0]
    assert second.block_ids[2] != first.block_ids[2]  # the partial block is private
    assert scheduler.num_prefix_hit_tokens == 8 + 4
    used = len({b for r in scheduler.running for b in r.block_ids})
    assert used == scheduler.allocator.num_used == 3 + 1 + 1


@pytest.mark.parametrize("graphed", [False, True])
@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("seed", range(5))
def test_random_workloads_finish_every_request_and_leak_no_block(seed, caching, graphed):
    """With prefix caching, prompts share prefixes (a few stems) and odd seeds clear the cache now and then (weight
    loads); blocks may be shared, so the invariant counts distinct blocks. `graphed`: a bound on steps with running
    requests (the largest mixed-step graph), as on CUDA."""
    rng = random.Random(100 * caching + seed)
    allocator = BlockAllocator(
        num_blocks=rng.randint(6 + 2 * caching, 20), block_size=rng.choice([1, 2, 4]), enable_caching=caching
    )
    budget = rng.randint(1, 24)
    bound = rng.randint(1, budget) if graphed else None
    scheduler = Scheduler(allocator, rng.randint(1, 8), budget, graphed_step_tokens=bound)
    capacity = allocator.capacity_tokens
    stems = [[rng.randint(0, 5) for _ in range(capacity)] for _ in range(3)]
    requests = []
    for i in range(20):
        prompt_len = rng.randint(1, capacity - 1)
        request = make_request(i, prompt_len, max_tokens=rng.randint(1, capacity - prompt_len))
        if caching:
            request.prompt_ids, request.token_ids = stems[i % 3][:prompt_len], stems[i % 3][:prompt_len]
        requests.append(request)
    pending = list(requests)
    for _ in range(100_000):
        if pending and rng.random() < 0.3:
            scheduler.add(pending.pop(0))
        if not scheduler.has_work and not pending:
            break
        had_running = len(scheduler.running)
        output = run_step(scheduler, token=rng.randint(0, 50))
        assert output.chunks or not scheduler.has_work
        assert len({b for r in scheduler.running for b in r.block_ids}) == allocator.num_used
        assert output.num_tokens <= scheduler.max_num_batched_tokens
        if bound is not None and had_running:
            assert output.num_tokens <= max(bound, had_running)
        slots = [r.slot for r in scheduler.running]  # every running request holds its own slot, waiting ones none
        assert len(set(slots)) == len(slots) and all(0 <= s < scheduler.max_num_seqs for s in slots)
        assert all(r.slot is None for r in scheduler.waiting)
        for request in scheduler.running:  # a request's blocks are distinct and cover its computed tokens
            assert len(set(request.block_ids)) == len(request.block_ids)
            assert len(request.block_ids) * allocator.block_size >= request.num_computed_tokens
        if caching and seed % 2 and rng.random() < 0.05:
            allocator.clear_cache()  # a weight load
    assert all(r.is_finished and r.num_output_tokens == r.max_output_tokens for r in requests)
    assert allocator.num_free == allocator.num_blocks
    assert all(r.slot is None for r in requests)
    if caching and seed % 2 == 0:
        assert scheduler.num_prefix_hit_tokens > 0


def test_steps_with_running_requests_stay_within_the_largest_graph_and_a_step_with_none_keeps_the_budget():
    """With `graphed_step_tokens` (the largest mixed-step CUDA graph) a step that has running requests computes at
    most that many tokens, the last admitted prompt chunked to fit; a step with nothing running (the first, or after
    a weight sync preempted everyone) keeps `max_num_batched_tokens`. Nothing is starved: every request finishes."""
    scheduler = Scheduler(
        BlockAllocator(num_blocks=512, block_size=4),
        max_num_seqs=16,
        max_num_batched_tokens=200,
        graphed_step_tokens=24,
    )
    for i in range(16):
        scheduler.add(make_request(i, 10, max_tokens=3))
    first = run_step(scheduler)
    assert first.num_tokens == 160 and scheduler.num_running == 16  # nothing was running: the whole budget
    for i in range(16, 40):
        scheduler.add(make_request(i, 10, max_tokens=3))
    steps = 0
    bounded = unbounded = 0
    while scheduler.has_work:
        had_running = bool(scheduler.running)
        output = run_step(scheduler)
        steps += 1
        if had_running:
            assert output.num_tokens <= 24, [(c.request.request_id, c.num_tokens) for c in output.chunks]
            bounded += 1
        else:
            unbounded += output.num_tokens > 24
        assert steps < 200
    assert bounded > 5 and unbounded >= 1  # both kinds of step happened
    chunked = Scheduler(
        BlockAllocator(num_blocks=512, block_size=4),
        max_num_seqs=16,
        max_num_batched_tokens=200,
        graphed_step_tokens=24,
    )
    chunked.add(make_request(0, 4, max_tokens=5))
    run_step(chunked)
    chunked.add(make_request(1, 30))
    second = run_step(chunked)  # 1 decode + 23 of the new prompt's 30 tokens
    assert [(c.request.request_id, c.start, c.num_tokens, c.samples) for c in second.chunks] == [
        (0, 4, 1, True),
        (1, 0, 23, False),
    ]
    uncapped = Scheduler(BlockAllocator(num_blocks=512, block_size=4), max_num_seqs=16, max_num_batched_tokens=200)
    uncapped.add(make_request(0, 4, max_tokens=5))
    run_step(uncapped)
    uncapped.add(make_request(1, 30))
    assert run_step(uncapped).num_tokens == 31
    many = Scheduler(BlockAllocator(num_blocks=64, block_size=4), 8, 200, graphed_step_tokens=4)
    for i in range(6):
        many.add(make_request(i, 2, max_tokens=4))
    run_step(many)  # nothing running: the whole budget admits all six
    assert [c.num_tokens for c in run_step(many).chunks] == [1] * 6  # more decodes than the bound: none held back
    with pytest.raises(ValueError, match="graphed_step_tokens=0"):
        Scheduler(BlockAllocator(num_blocks=8, block_size=4), 2, 16, graphed_step_tokens=0)


def test_finish_drops_a_running_a_preempted_and_a_waiting_request_and_frees_their_blocks_and_slots():
    scheduler = Scheduler(BlockAllocator(num_blocks=6, block_size=4), max_num_seqs=2, max_num_batched_tokens=100)
    requests = [make_request(i, 5) for i in range(4)]
    for request in requests:
        scheduler.add(request)
    run_step(scheduler)  # requests 0 and 1 run (two slots), 2 and 3 wait
    running, waiting = list(scheduler.running), list(scheduler.waiting)
    assert running == requests[:2] and waiting == requests[2:]
    assert all(r.slot is not None for r in running) and all(r.slot is None for r in waiting)
    scheduler.finish(requests[1])  # running: out of `running`, its slot and blocks back
    scheduler.finish(requests[3])  # waiting
    assert scheduler.running == [requests[0]] and list(scheduler.waiting) == [requests[2]]
    assert requests[1].slot is None and requests[1].block_ids == []
    victim = scheduler.preempt_all()[0]  # preempted: back in `waiting`, without a slot
    scheduler.finish(victim)
    assert scheduler.running == [] and list(scheduler.waiting) == [requests[2]]
    scheduler.finish(requests[2])
    assert not scheduler.has_work and scheduler.allocator.num_free == 6
    run_step(scheduler)  # nothing left to schedule, and both slots are free for new requests
    for request in [make_request(10 + i, 3) for i in range(2)]:
        scheduler.add(request)
    run_step(scheduler)
    assert sorted(r.slot for r in scheduler.running) == [0, 1]
