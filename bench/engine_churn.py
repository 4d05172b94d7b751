"""The TorchEngine's host side in the GRPO regime, on the CPU: short completions, requests arriving all the time.

`bench/engine_host.py` times steady decode steps (every request in lockstep, hundreds of tokens each). A GRPO run on
a nearly solved task is another regime: on SmolLM2 two-digit sums the completions are ~11 tokens, so at 256 running
requests ~8% of them finish and as many are admitted every step; almost every step is a mixed step (prefill chunks of
new prompts with the decodes), and the engine keeps a queue of ~750 waiting requests. On an H200 that run generated
11.6k tokens/s at 256 running requests and 7.8k at 512 (`bench/results/sums_e2e_h200.json`): twice the requests made
a step three times longer, which the GPU work of a 135M model does not explain; per-request host work would.

This runs the engine as the CUDA path does (asynchronous scheduling, the decode graphs' and the mixed-step graphs'
staging of inputs) with each graph replay replaced by fixed logits, so what is timed is the host side:

  * a closed loop of `--outstanding` requests in groups of `--group` sharing a `--prompt-len`-token prompt (random
    tokens; a group's requests are submitted together, as a rollout actor does), each with a completion length
    drawn from `--new-tokens` (EOS ignored); a finished group is replaced by a new one;
  * after `--warmup` finished requests, the next `--requests`: the process CPU time per finished request and per
    engine step (the load's prompts are drawn beforehand; its one task per group and `gather`, as a GenerationActor
    runs one task per request, are counted), with the forward (the eager decoder of steps no graph holds) and the eager sampler's time apart
    (on CUDA the sampler only launches kernels); steps per request, the share of mixed steps, tokens per step;
  * a cProfile top list of the measured phase (steps inline on the profiled thread) with `--profile-top`.

    # the engine before the bound (mixed-step graphs up to 1024 tokens, steps bounded only by the budget), after:
    python3 bench/engine_churn.py --label before --mixed-tokens 64,128,256,384,512,768,1024 --bounds off
    python3 bench/engine_churn.py --label after --bounds on

One JSON entry per `--label` in `--out` (command, commit, date), so before and after sit side by side.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import gc
import json
import random
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from engine_host import CpuDecodeGraphs, run_header, tiny_llama, write_entry, write_profile  # noqa: E402

from rlasync.engine import SamplingParams, TorchEngine  # noqa: E402
from rlasync.engine import sampler as sampler_module  # noqa: E402
from rlasync.engine.mixed_graphs import MixedGraphs, StagedMixed, mixed_token_counts  # noqa: E402
from rlasync.metrics.gc_pauses import freeze_heap  # noqa: E402


class Counters:
    """Seconds of process CPU spent in the forward and the sampler; per launched step (tokens, requests), appended
    at once from the engine's worker thread; the eager steps (no graph held them)."""

    def __init__(self) -> None:
        self.forward = self.sampler = 0.0
        self.eager_steps = 0
        self.launches: list[tuple[int, int, bool]] = []  # per step: tokens, requests, ran the decoder eagerly


class _Replayed:
    """A captured graph's stand-in: replaying it computes nothing (its output, fixed logits, is already there)."""

    def replay(self) -> None:
        pass


class CpuMixedGraphs(MixedGraphs):
    """`mixed_graphs.MixedGraphs` on the CPU: its own `run` (the staging of a step's inputs into the host buffers and
    their copies) with nothing captured; each token count's replay leaves fixed logits [slots, V]."""

    def __init__(self, pool, vocab: int, token_counts, max_num_seqs: int, max_model_len: int) -> None:
        from rlasync.engine.kv_cache import num_blocks_for

        self.pool, self.max_model_len = pool, max_model_len
        self.token_counts = tuple(sorted(token_counts))
        max_blocks = num_blocks_for(max_model_len, pool.block_size)
        cpu = torch.device("cpu")
        self._staged = {t: StagedMixed(t, min(t, max_num_seqs) + 1, max_blocks, cpu) for t in self.token_counts}
        generator = torch.Generator().manual_seed(2)
        self._graphs = {
            t: (_Replayed(), torch.randn(s.slots, vocab, generator=generator) * 3) for t, s in self._staged.items()
        }
        self.replays = 0


def instrument(
    engine: TorchEngine, counters: Counters, args: argparse.Namespace, max_num_seqs: int, bound: bool
) -> None:
    """Install the stand-in graphs (and, as the engine does on CUDA, bound a step with running requests by the
    largest mixed-step graph unless `bound` is False) and count each launch, the eager forward's and the sampler's
    CPU time."""
    from rlasync.engine.cuda_graphs import decode_batch_sizes

    runner, vocab, max_len = engine.runner, args.vocab, args.max_model_len
    runner.graphs = CpuDecodeGraphs(runner.pool, vocab, decode_batch_sizes(max_num_seqs), max_len, _NullClock())
    counts = mixed_token_counts(args.max_num_batched_tokens, _token_counts(args.mixed_tokens))
    runner.mixed = CpuMixedGraphs(runner.pool, vocab, counts, max_num_seqs, max_len)
    engine.bound_steps(runner.mixed.max_tokens if bound else None)
    decoder_forward = runner.decoder.forward

    def timed_decoder(*args, **kwargs):  # only steps no graph holds (a burst of prefills) run the decoder
        counters.eager_steps += 1
        start = time.process_time()
        try:
            return decoder_forward(*args, **kwargs)
        finally:
            counters.forward += time.process_time() - start

    runner.decoder.forward = timed_decoder
    launch = runner.launch

    def counted_launch(chunks, previous=None):
        eager_before = counters.eager_steps
        try:
            return launch(chunks, previous)
        finally:  # one append per step, once it ran: the figures of a phase are a slice of this list
            eager = counters.eager_steps > eager_before
            counters.launches.append((sum(len(chunk.token_ids) for chunk in chunks), len(chunks), eager))

    runner.launch = counted_launch
    sample = sampler_module.sample

    def timed_sample(*args, **kwargs):
        start = time.process_time()
        try:
            return sample(*args, **kwargs)
        finally:
            counters.sampler += time.process_time() - start

    sampler_module.sample = timed_sample


def _token_counts(text: str) -> tuple[int, ...]:
    from rlasync.engine.mixed_graphs import DEFAULT_TOKEN_COUNTS

    return tuple(int(x) for x in text.split(",")) if text else DEFAULT_TOKEN_COUNTS


class _NullClock:
    def add(self, key: str, seconds: float) -> None:
        pass


async def closed_loop(engine: TorchEngine, args: argparse.Namespace, counters: Counters, seed: int) -> dict:
    """Keep `--outstanding` requests submitted (whole groups); returns the measured phase's figures."""
    rng = random.Random(seed)
    low, high = (int(x) for x in args.new_tokens.split("-"))
    finished = 0
    marks: dict[str, float] = {}
    done = asyncio.Event()
    total = args.warmup + args.requests
    # every group's prompt and sampling parameters drawn before the loop: the load's own making is not timed
    groups = iter(
        [
            (
                [rng.randrange(args.vocab) for _ in range(args.prompt_len)],
                [
                    SamplingParams(max_tokens=rng.randint(low, high), temperature=1.0, ignore_eos=True, num_logprobs=8)
                    for _ in range(args.group)
                ],
            )
            for _ in range(-(-(total + args.outstanding) // args.group) + 1)
        ]
    )

    async def group() -> None:
        nonlocal finished
        prompt, params = next(groups)
        await asyncio.gather(*(engine.generate(prompt, p) for p in params))
        before = finished
        finished += args.group
        if before < args.warmup <= finished:
            marks.update(
                cpu=time.process_time(),
                wall=time.perf_counter(),
                fwd=counters.forward,
                smp=counters.sampler,
                steps=len(counters.launches),
                finished=finished,
            )
        if finished >= total and not done.is_set():
            done.set()

    tasks: set[asyncio.Task] = set()

    def refill() -> None:
        while len(tasks) * args.group < args.outstanding and not done.is_set():
            task = asyncio.ensure_future(group())
            tasks.add(task)
            task.add_done_callback(lambda t: (tasks.discard(t), refill()))

    refill()
    await done.wait()
    cpu, wall = time.process_time() - marks["cpu"], time.perf_counter() - marks["wall"]
    requests = finished - marks["finished"]
    launches = counters.launches[marks["steps"] :]
    steps = max(len(launches), 1)  # (the short warm-up loop may end within the step that crossed its mark)
    forward, sampler = counters.forward - marks["fwd"], counters.sampler - marks["smp"]
    for task in list(tasks):
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    host = cpu - forward
    return {
        "requests": requests,
        "steps": steps,
        "wall_s": round(wall, 3),
        "cpu_s": round(cpu, 3),
        "host_cpu_us_per_request": round(host / requests * 1e6, 1),
        "host_excl_sampler_cpu_us_per_request": round((host - sampler) / requests * 1e6, 1),
        "host_cpu_ms_per_step": round(host / steps * 1e3, 3),
        "host_excl_sampler_cpu_ms_per_step": round((host - sampler) / steps * 1e3, 3),
        "sampler_cpu_ms_per_step": round(sampler / steps * 1e3, 3),
        "eager_forward_cpu_s": round(forward, 3),
        "steps_per_request": round(steps / requests, 4),
        "mixed_step_frac": round(sum(tokens != chunks for tokens, chunks, _ in launches) / steps, 4),
        "eager_step_frac": round(sum(eager for _, _, eager in launches) / steps, 4),
        "tokens_per_step": round(sum(tokens for tokens, _, _ in launches) / steps, 1),
        "requests_per_step": round(sum(chunks for _, chunks, _ in launches) / steps, 1),
    }


def build(args: argparse.Namespace, max_num_seqs: int, counters: Counters, bound: bool) -> TorchEngine:
    max_len = args.max_model_len
    engine = TorchEngine(
        tiny_llama(args.vocab, max_len),
        device="cpu",
        max_model_len=max_len,
        kv_cache_tokens=args.kv_cache_tokens,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        block_size=args.block_size,
        async_scheduling=True,
        compiled_sampler=False,
    )
    instrument(engine, counters, args, max_num_seqs, bound)
    return engine


def profile(engine: TorchEngine, args: argparse.Namespace, counters: Counters, label: str) -> str:
    """cProfile of one closed loop with the engine's steps inline on this thread; returns the file written."""

    async def inline(fn, *a, **kw):  # the profiler records its own thread only
        return fn(*a, **kw)

    profiler = cProfile.Profile()
    to_thread, asyncio.to_thread = asyncio.to_thread, inline
    try:
        profiler.enable()
        asyncio.run(closed_loop(engine, args, counters, seed=99))
        profiler.disable()
    finally:
        asyncio.to_thread = to_thread
    path = Path(args.profile_out) / f"engine_churn_cpu_{label}.txt"
    return write_profile(profiler, args.profile_top, path, "the closed loop (warm-up included), steps inline")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    parser.add_argument("--max-num-seqs", default="256,512", help="comma-separated (one run each)")
    parser.add_argument("--outstanding", type=int, default=1024, help="requests submitted at any time")
    parser.add_argument("--group", type=int, default=8, help="requests per prompt (num_generations)")
    parser.add_argument("--prompt-len", type=int, default=45)
    parser.add_argument("--new-tokens", default="8-13", help="completion lengths, LOW-HIGH (uniform)")
    parser.add_argument("--warmup", type=int, default=2048)
    parser.add_argument("--requests", type=int, default=6144, help="finished requests measured")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--kv-cache-tokens", type=int, default=262144)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192, help="as on CUDA")
    parser.add_argument("--block-size", type=int, default=256, help="the paged FlashAttention layout on an H200")
    parser.add_argument(
        "--mixed-tokens", default="", help="the mixed-step graphs' token counts (default: the engine's)"
    )
    parser.add_argument(
        "--bounds",
        default="on,off",
        help="on: a step with running requests is held to the largest mixed-step graph "
        "(the engine's behaviour on CUDA); off: only max_num_batched_tokens bounds it",
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--profile-top", type=int, default=45, help="cProfile rows (0: no profile)")
    parser.add_argument("--label", default="run")
    parser.add_argument("--out", default=str(ROOT / "bench/results/engine_churn_cpu.json"))
    parser.add_argument("--profile-out", default=str(ROOT / "bench/results/profiles"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    entry: dict = {
        **run_header(),
        "workload": {
            k: getattr(args, k)
            for k in ("outstanding", "group", "prompt_len", "new_tokens", "warmup", "requests", "block_size")
        },
        "runs": {},
    }
    first = True
    for max_num_seqs in (int(x) for x in args.max_num_seqs.split(",")):
        for bound in args.bounds.split(","):
            counters = Counters()
            engine = build(args, max_num_seqs, counters, bound == "on")
            warm = argparse.Namespace(**{**vars(args), "warmup": 64, "requests": 64})
            asyncio.run(closed_loop(engine, warm, counters, 7))
            gc.collect()
            freeze_heap()  # as the GenerationActor does once its engine is built
            runs = [asyncio.run(closed_loop(engine, args, counters, seed=r)) for r in range(args.repeats)]
            key = f"seqs{max_num_seqs}_bound_{bound}"
            entry["runs"][key] = {"repeats": runs}
            for name in ("host_excl_sampler_cpu_us_per_request", "eager_step_frac", "tokens_per_step"):
                entry["runs"][key][name + "_median"] = sorted(r[name] for r in runs)[len(runs) // 2]
            print(f"{key}: {json.dumps(runs)}", flush=True)
            if args.profile_top and first:
                entry["profile"] = profile(engine, args, counters, args.label)
            first = False
    benchmark = "engine_churn: the TorchEngine's host CPU per request in the GRPO regime (CPU)"
    write_entry(Path(args.out), args.label, entry, benchmark)


if __name__ == "__main__":
    main()
