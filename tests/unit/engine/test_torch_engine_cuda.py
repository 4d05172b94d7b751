"""TorchEngine's GPU paths (the Triton kernel or FlashAttention varlen over the paged pool, decode CUDA graphs) against
its reference path.
Skipped without CUDA; run through the device tool."""

import asyncio
from types import SimpleNamespace

import pytest
import torch

from rlasync.engine import SamplingParams
from rlasync.engine.paged_attention import KVPool, build_metadata, paged_attention_forward, varlen_paged_available

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
PROMPTS = [
    [5],
    [17, 3, 99],
    list(range(20, 27)),
    [7, 1, 150, 64, 33, 2, 90, 11, 42, 8, 19, 100, 4],
    list(range(40, 90)),
]


def tiny_model(seed=0, init=0.3):
    from transformers import AutoModelForCausalLM, Qwen3Config

    config = Qwen3Config(
        vocab_size=160,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=512,
        initializer_range=init,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
    )
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


def engine_of(model, **kwargs):
    from rlasync.engine import TorchEngine

    options = dict(
        dtype="bfloat16", device="cuda", max_model_len=256, kv_cache_tokens=4096, eos_token_ids=[], max_num_seqs=16
    )
    return TorchEngine(model, **{**options, **kwargs})


def triton_fp32_engine(model, **kwargs):
    """The engine on our Triton kernel in float32: exact enough that greedy tokens compare across engine options."""
    return engine_of(model, dtype="float32", attention_backend="triton", **kwargs)


async def generate_all(engine, prompts, params):
    return await asyncio.gather(*(engine.generate(p, params) for p in prompts))


@pytest.mark.skipif(not varlen_paged_available(), reason="torch without paged varlen_attn")
@pytest.mark.parametrize("block_size", [16, 256])
def test_varlen_attention_matches_the_reference_on_a_mixed_step(block_size):
    torch.manual_seed(0)
    heads, kv_heads, head_dim = 8, 2, 64
    pool = KVPool(1, 64, block_size, kv_heads, head_dim, torch.bfloat16, "cuda")
    pool.kv.normal_()
    # decode, fresh prefill, a chunk continuing a prefill, another decode, a long decode across blocks
    starts, lengths = [37, 0, 16, 5, 3 * block_size + 2], [1, 20, 9, 1, 1]
    needed = [(s + n + block_size - 1) // block_size for s, n in zip(starts, lengths)]
    free = torch.randperm(64).tolist()
    block_ids = [[free.pop() for _ in range(k)] for k in needed]
    n = sum(lengths)
    query = torch.randn(1, heads, n, head_dim, dtype=torch.bfloat16, device="cuda")
    key = torch.randn(1, kv_heads, n, head_dim, dtype=torch.bfloat16, device="cuda")
    value = torch.randn(1, kv_heads, n, head_dim, dtype=torch.bfloat16, device="cuda")
    module = SimpleNamespace(layer_idx=0)
    outputs = {}
    for backend in ("reference", "varlen"):
        meta = build_metadata(pool, starts, lengths, block_ids, torch.device("cuda"), backend)
        outputs[backend] = paged_attention_forward(
            module, query, key, value, None, scaling=head_dim**-0.5, paged_attention=meta
        )[0].float()
    torch.testing.assert_close(outputs["varlen"], outputs["reference"], atol=2e-2, rtol=2e-2)


def test_gpu_engine_greedy_equals_its_reference_path_with_and_without_cuda_graphs():
    """In float32 (the Triton kernel then multiplies in IEEE fp32): greedy tokens must agree exactly. In bf16 this
    large-init model's attention is peaked enough that rounding flips argmaxes."""
    model = tiny_model()
    params = SamplingParams(max_tokens=40, temperature=0)
    results = {}
    for name, kwargs in {
        "reference": dict(attention_backend="reference", cuda_graphs=False),
        "eager": dict(attention_backend="triton", cuda_graphs=False),
        "graphs": dict(attention_backend="triton", cuda_graphs=True),
        "auto_graphs": dict(cuda_graphs=True),
    }.items():
        engine = engine_of(model, dtype="float32", **kwargs)
        results[name] = asyncio.run(generate_all(engine, PROMPTS, params))
    for name in ("eager", "graphs", "auto_graphs"):
        assert [r.output_ids for r in results[name]] == [r.output_ids for r in results["reference"]], name


def test_gpu_engine_sampled_logprobs_match_a_full_forward():
    from rlasync.engine.sampler import BatchSampling, processed_logprobs

    model = tiny_model(init=0.05)
    engine = engine_of(model)
    params = SamplingParams(max_tokens=24, temperature=0.8, top_k=20, top_p=0.9, seed=5)
    records = asyncio.run(generate_all(engine, PROMPTS * 4, params))
    outside = total = 0
    for record in records:
        ids = record.prompt_ids + record.output_ids
        with torch.no_grad():
            logits = model(torch.tensor([ids], device="cuda")).logits[0, len(record.prompt_ids) - 1 : -1]
        batch = BatchSampling.from_params([params] * logits.shape[0], [params.seed] * logits.shape[0], "cuda")
        expected = processed_logprobs(logits.float(), batch).gather(
            1, torch.tensor(record.output_ids, device="cuda")[:, None]
        )
        expected = expected[:, 0].cpu()
        # in bf16 a token at the edge of the top-k/top-p set can fall outside the recomputed set (-inf): rare
        inside = torch.isfinite(expected)
        outside += int((~inside).sum())
        total += len(expected)
        torch.testing.assert_close(torch.tensor(record.output_log_probs)[inside], expected[inside], atol=5e-2, rtol=0)
    assert outside <= 0.02 * total, f"{outside} of {total} sampled tokens fall outside the recomputed candidate set"


def test_many_concurrent_requests_finish_on_gpu_with_preemption():
    engine = engine_of(tiny_model(init=0.05), kv_cache_tokens=512, max_num_seqs=64)
    params = SamplingParams(max_tokens=60, temperature=1.0)
    prompts = [[(3 * i + j) % 160 for j in range(1 + i % 17)] for i in range(96)]
    records = asyncio.run(generate_all(engine, prompts, params))
    assert all(len(r.output_ids) == 60 for r in records)
    stats = engine.stats()
    assert stats.num_preemptions > 0 and stats.kv_cache_usage_frac == 0


async def _staggered(engine, prompts, params, gap_s=0.01):
    """Requests arriving while others decode: most steps mix prefill chunks with decodes."""
    tasks = []
    for prompt in prompts:
        tasks.append(asyncio.ensure_future(engine.generate(prompt, params)))
        await asyncio.sleep(gap_s)
    return await asyncio.gather(*tasks)


def test_mixed_step_graphs_give_the_eager_tokens_with_requests_arriving_mid_decode():
    """fp32, Triton kernel: greedy tokens of steps replayed from the mixed-step graphs equal the eager steps', and the
    graphs were used."""
    model = tiny_model()
    params = SamplingParams(max_tokens=30, temperature=0)
    prompts = PROMPTS * 6
    results, engines = {}, {}
    for name, kwargs in {
        "eager": dict(cuda_graphs=False),
        "decode_graphs": dict(cuda_graphs=True, mixed_cuda_graphs=False),
        "mixed_graphs": dict(cuda_graphs=True, mixed_cuda_graphs=True, max_num_batched_tokens=256),
    }.items():
        engines[name] = triton_fp32_engine(model, **kwargs)
        results[name] = asyncio.run(_staggered(engines[name], prompts, params))
    mixed = engines["mixed_graphs"]
    assert mixed._runner.mixed.replays > 0
    # a step with running requests is held to the largest graph; the steps no graph held are counted
    assert mixed._scheduler.graphed_step_tokens == mixed._runner.mixed.max_tokens == 256
    assert engines["decode_graphs"]._scheduler.graphed_step_tokens is None
    extra = mixed.stats().extra
    assert extra["num_eager_steps"] < extra["num_steps"] and "num_eager_steps" not in engines["eager"].stats().extra
    for name in ("decode_graphs", "mixed_graphs"):
        assert [r.output_ids for r in results[name]] == [r.output_ids for r in results["eager"]], name


def test_compiled_layers_under_cuda_graphs_give_the_eager_layers_tokens(tmp_path, monkeypatch):
    """fp32, Triton kernel, decode and mixed-step graphs: the layers compiled by inductor (`compiled_layers`) before
    the graphs capture them give the eager layers' greedy tokens, no fallback, and the graphs replay."""
    monkeypatch.setenv("RLASYNC_CACHE", str(tmp_path))  # inductor's cache under it
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    model = tiny_model()
    params = SamplingParams(max_tokens=30, temperature=0)
    prompts = PROMPTS * 6
    results = {}
    for compiled in (False, True):
        engine = triton_fp32_engine(model, max_num_batched_tokens=256, compiled_layers=compiled)
        results[compiled] = asyncio.run(_staggered(engine, prompts, params))
        assert engine.runner_info()["compiled_layers"] is compiled  # compiled ones did not fall back
        assert engine._runner.mixed.replays > 0
    assert [r.output_ids for r in results[True]] == [r.output_ids for r in results[False]]


@pytest.mark.skipif(not varlen_paged_available(), reason="needs torch's paged varlen FlashAttention")
def test_mixed_step_graphs_with_flash_attention_agree_with_eager_in_bf16():
    model = tiny_model(init=0.05)
    params = SamplingParams(max_tokens=30, temperature=0)
    prompts = PROMPTS * 6
    outputs = {}
    for mixed in (False, True):
        engine = engine_of(model, attention_backend="varlen", cuda_graphs=True, mixed_cuda_graphs=mixed)
        outputs[mixed] = asyncio.run(_staggered(engine, prompts, params))
        if mixed:
            assert engine._runner.mixed.replays > 0
    same = sum(a == b for x, y in zip(outputs[False], outputs[True]) for a, b in zip(x.output_ids, y.output_ids))
    total = sum(len(x.output_ids) for x in outputs[False])
    assert same >= 0.9 * total, f"{same} of {total} greedy tokens agree (bf16 rounding flips only a few)"


def _records(records):
    return [(r.output_ids, r.finish_reason, r.output_sampler_logprobs is not None) for r in records]


def test_async_scheduling_gives_the_sync_tokens_with_cuda_graphs():
    """fp32, Triton kernel, decode and mixed-step graphs: all requests at once, length stops only, so both modes run
    the same batches: same tokens, log-probs and top-N; the async run fed its decode inputs back on the device."""
    model = tiny_model(init=0.05)
    jobs = [
        (p, SamplingParams(max_tokens=10 + 7 * i, temperature=1.0, seed=i, top_k=30, num_logprobs=3))
        for i, p in enumerate(PROMPTS * 3)
    ]
    out = {}
    for mode in (False, True):
        engine = triton_fp32_engine(model, max_num_batched_tokens=256, async_scheduling=mode)
        assert engine.async_scheduling is mode

        async def run_all(engine=engine):
            return await asyncio.gather(*(engine.generate(p, s) for p, s in jobs))

        out[mode] = asyncio.run(run_all())
        assert engine._runner.graphs is not None and engine._runner.mixed is not None
    for a, b in zip(out[True], out[False]):
        assert a.output_ids == b.output_ids
        torch.testing.assert_close(
            torch.tensor(a.output_log_probs), torch.tensor(b.output_log_probs), atol=1e-5, rtol=0
        )
        assert [sorted(t) for t in a.output_sampler_logprobs] == [sorted(t) for t in b.output_sampler_logprobs]


def test_async_scheduling_on_cuda_agrees_with_sync_under_arrivals_stops_preemption_and_a_weight_sync():
    model = tiny_model()
    greedy = SamplingParams(max_tokens=40, temperature=0, stop_token_ids=[7, 8, 9])
    prompts = [[(3 * i + j) % 160 for j in range(1 + i % 17)] for i in range(48)]
    outputs, stats = {}, {}
    for mode in (False, True):
        engine = triton_fp32_engine(
            model,
            kv_cache_tokens=768,
            max_num_seqs=32,
            max_num_batched_tokens=256,
            async_scheduling=mode,
        )
        outputs[mode] = asyncio.run(_staggered(engine, prompts, greedy, gap_s=0.002))
        stats[mode] = engine.stats()
    assert _records(outputs[True]) == _records(outputs[False])
    assert {r.finish_reason for r in outputs[True]} == {"stop", "length"}
    assert stats[True].num_preemptions > 0 and stats[True].kv_cache_usage_frac == 0

    engine = triton_fp32_engine(model, async_scheduling=True)
    state = {k: v.detach().clone() for k, v in model.named_parameters()}

    async def with_sync():
        tasks = [asyncio.ensure_future(engine.generate(p, greedy)) for p in prompts[:16]]
        await asyncio.sleep(0.05)
        await engine.pause()
        requests = [*engine._scheduler.running, *engine._scheduler.waiting]
        assert all(r.num_pending == 0 for r in requests)
        await engine.load_weights(state.items())  # the same weights: the outputs must not change
        await engine.resume()
        return await asyncio.gather(*tasks)

    assert _records(asyncio.run(with_sync())) == _records(outputs[False][:16])


def _greedy_choices(model, record):
    ids = record.prompt_ids + record.output_ids
    with torch.no_grad():
        logits = model(torch.tensor([ids], device="cuda")).logits[0].float()
    return logits[len(record.prompt_ids) - 1 : -1].argmax(-1).tolist()


@pytest.mark.parametrize("copy_event", [False, True], ids=["waits", "records_event"])
def test_loads_between_overlapped_graphed_steps_switch_every_request_from_the_old_to_the_new_model_at_one_token(
    copy_event,
):
    """Async scheduling, decode and mixed-step graphs, fp32 Triton: weights loaded between steps from another
    thread (no pause) while 48 requests decode. The copies queue behind the launched steps, so each record is the old
    model's greedy tokens up to some point and the new model's after it (a step that read half-copied weights, or
    new weights over stale KV, would break that); loading the same weights again changes no token. With a copy
    event (an IPC sync's: the load returns once its copies are queued) the same holds, and the event completes."""
    import copy

    old = tiny_model().cuda().float()
    new = copy.deepcopy(old)
    with torch.no_grad():
        for param in new.parameters():
            param.add_(0.2 * torch.randn_like(param))
    greedy = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    prompts = [[(3 * i + j) % 160 for j in range(1 + i % 17)] for i in range(48)]
    engine = triton_fp32_engine(copy.deepcopy(old), max_num_seqs=32, max_num_batched_tokens=256, async_scheduling=True)

    async def run(states):
        tasks = [asyncio.ensure_future(engine.generate(p, greedy)) for p in prompts]
        for state in states:
            await asyncio.sleep(0.02)
            event = torch.cuda.Event(interprocess=True) if copy_event else None
            await asyncio.to_thread(engine.load_between_steps, state.items(), event)
            assert not engine.is_paused
            if event is not None:
                event.synchronize()
                assert event.query()
        return await asyncio.gather(*tasks)

    same = {k: v.detach().clone() for k, v in old.named_parameters()}
    plain = asyncio.run(run([]))
    assert _records(asyncio.run(run([same, same]))) == _records(plain)
    switched = asyncio.run(run([{k: v.detach().clone() for k, v in new.named_parameters()}]))
    assert engine.stats().num_preemptions > 0
    changed = 0
    for record in switched:
        under_old, under_new = _greedy_choices(old, record), _greedy_choices(new, record)
        tokens = record.output_ids
        k = 0
        while k < len(tokens) and tokens[k] == under_old[k]:
            k += 1
        assert tokens[k:] == under_new[k:] or any(
            tokens[j:] == under_new[j:] and tokens[:j] == under_old[:j] for j in range(len(tokens) + 1)
        ), record
        changed += tokens != under_old
    assert changed > 0  # the load reached requests mid-decode
