"""The TorchEngine's host side per decode step, on the CPU: what a step costs besides the model forward.

For a small model at ~256 concurrent requests a decode step's GPU work is a few milliseconds, so the host side of
each engine step (scheduling, block tables, the decode graph's staged inputs, sampler tensors, unpacking results,
per-request bookkeeping) is a large share of it. That host side runs the same on the CPU, so it is measured here:

  * the TorchEngine on the CPU with a tiny random Llama (`--vocab` tokens), `--concurrency` requests of
    `--prompt-len` random tokens, `--new-tokens` new tokens each (EOS ignored, temperature 1);
  * `--path graphs` (default): the CUDA decode path as on a GPU (asynchronous scheduling, the decode-graph staging of
    `cuda_graphs.py`), with the graph replay replaced by a stand-in that returns fixed logits: the staging, the copies
    and the feedback of the previous step's ids run as on CUDA, the forward costs ~0. `--path eager`: the engine as
    it runs on the CPU (reference attention, `build_metadata`, synchronous steps), its forward timed and subtracted;
  * per decode step (full batch, every request feeding one token, steady state): the process's CPU time between
    consecutive launches (`time.process_time`: the machine may be shared, and CPU time does not count the time the
    process waits for a core; `step_wall_ms` is the wall period), the forward's CPU time in it, the sampler call's
    (the eager sampler computes on the CPU here; on CUDA it only launches kernels), and the rest: `host_cpu_ms` =
    step - forward, `host_excl_sampler_cpu_ms` = step - forward - sampler (medians over the steps; means too);
  * Python's garbage collections inside those periods (`gc_ms_mean`, `gc_collections_per_step`): every step
    allocates per request, and a full collection walks the whole heap (`--freeze-heap`: freeze it first, as the
    GenerationActor does once its engine is built; vLLM's engine core does the same);
  * each of the four modes: unseeded / seeded (a seed per request) x 0 / 8 log-probs;
  * a cProfile top list of one decode phase (steps run inline on the profiled thread).

    python3 bench/engine_host.py --label before          # writes bench/results/engine_host_cpu.json["before"]
    python3 bench/engine_host.py --label after --concurrency 256,64

The JSON keeps one entry per `--label` (each with its command, git commit and date), so before and after sit side by
side; the profile goes to `--profile-out` (one file per label).
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import datetime
import gc
import io
import json
import platform
import pstats
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlasync.engine import SamplingParams, TorchEngine  # noqa: E402
from rlasync.engine import sampler as sampler_module  # noqa: E402
from rlasync.metrics.gc_pauses import freeze_heap  # noqa: E402

MODES = (("unseeded", False, 0), ("unseeded_logprobs8", False, 8), ("seeded", True, 0), ("seeded_logprobs8", True, 8))
ROOT = Path(__file__).resolve().parents[1]


def tiny_llama(vocab: int, max_len: int):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        vocab_size=vocab,
        max_position_embeddings=max_len,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


class Clock:
    """Per-launch timestamps and the forward / sampler time spent inside each launch."""

    def __init__(self) -> None:
        self.steps: list[dict] = []
        self.current: dict | None = None

    def start(self, num_chunks: int, decode_only: bool) -> None:
        self.current = {
            "t": time.perf_counter(),
            "c": time.process_time(),
            "chunks": num_chunks,
            "decode": decode_only,
            "fwd": 0.0,
            "smp": 0.0,
            "gc": 0.0,
            "gcn": 0,
        }
        self.steps.append(self.current)

    def add(self, key: str, seconds: float) -> None:
        if self.current is not None:
            self.current[key] += seconds

    def gc_callback(self, phase: str, info: dict) -> None:
        """Python's collections, timed into the step they fall in (any thread)."""
        if phase == "start":
            self._gc_started = time.perf_counter()
        elif getattr(self, "_gc_started", None) is not None:
            self.add("gc", time.perf_counter() - self._gc_started)
            self.add("gcn", 1)
            self._gc_started = None


class CpuDecodeGraphs:
    """The decode-graph path of `cuda_graphs.DecodeGraphs` on the CPU: the same staging of the step's inputs into
    host buffers, the same copies to the (here CPU) input buffers and the same feedback of the previous step's ids;
    the replay (GPU work) is replaced by fixed logits [size, V]."""

    def __init__(self, pool, vocab: int, batch_sizes, max_model_len: int, clock: Clock) -> None:
        from rlasync.engine import cuda_graphs

        self.pool = pool
        self.batch_sizes = tuple(sorted(batch_sizes))
        self.max_model_len = max_model_len
        self.max_blocks = cuda_graphs.num_blocks_for(max_model_len, pool.block_size)
        size = self.batch_sizes[-1]
        self.stager = cuda_graphs.DecodeStaging(size, pool.block_size, pool.null_block, self.max_blocks)
        self.dev64 = self.stager.host64.clone()
        self.dev32 = self.stager.host32.clone()
        self.input_ids = self.dev64[0]
        generator = torch.Generator().manual_seed(1)
        self.logits = torch.randn(size, vocab, generator=generator) * 3
        self.clock = clock

    @property
    def max_batch_size(self) -> int:
        return self.batch_sizes[-1]

    def padded_size(self, num_requests: int) -> int:
        return next(size for size in self.batch_sizes if size >= num_requests)

    def run_decode(self, token_ids, positions, block_ids, feedback=None):
        size = self.padded_size(len(token_ids))
        self.stager.stage(token_ids, positions, block_ids, size)
        self.dev64.copy_(self.stager.host64)
        self.dev32.copy_(self.stager.host32)
        if feedback is not None:
            self.input_ids.index_copy_(0, *feedback)
        start = time.process_time()
        logits = self.logits  # the replay: GPU work
        self.clock.add("fwd", time.process_time() - start)
        return logits


def instrument(engine: TorchEngine, clock: Clock, path: str, vocab: int, max_model_len: int, concurrency: int):
    """Wrap the runner's launch / forward / sampler calls with the clock; `--path graphs` installs the stand-in."""
    runner = engine.runner
    if path == "graphs":
        from rlasync.engine.cuda_graphs import decode_batch_sizes

        runner.graphs = CpuDecodeGraphs(runner.pool, vocab, decode_batch_sizes(concurrency), max_model_len, clock)
    else:  # the eager forward: the decoder and the LM head
        decoder_forward = runner.decoder.forward

        def timed_decoder(*args, **kwargs):
            start = time.process_time()
            try:
                return decoder_forward(*args, **kwargs)
            finally:
                clock.add("fwd", time.process_time() - start)

        runner.decoder.forward = timed_decoder
        logits = runner.logits

        def timed_logits(hidden):
            start = time.process_time()
            try:
                return logits(hidden)
            finally:
                clock.add("fwd", time.process_time() - start)

        runner.logits = timed_logits
    launch = runner.launch

    def timed_launch(chunks, previous=None):
        # every prompt is prefilled in one step (max_num_batched_tokens), so a step is all prefill or all decode:
        # its first and last chunks tell which (a check of every chunk would add to the host time measured)
        clock.start(len(chunks), bool(chunks) and len(chunks[0].token_ids) == 1 == len(chunks[-1].token_ids))
        return launch(chunks, previous)

    runner.launch = timed_launch


def timed_sampler(clock: Clock):
    """Wrap the eager sampler (`runner.sample_tensors` imports it at each call) so its time is counted."""
    sample = sampler_module.sample

    def wrapped(*args, **kwargs):
        start = time.process_time()
        try:
            return sample(*args, **kwargs)
        finally:
            clock.add("smp", time.process_time() - start)

    sampler_module.sample = wrapped


async def generate_all(engine: TorchEngine, prompts, new_tokens: int, seeded: bool, logprobs: int) -> int:
    params = [
        SamplingParams(
            max_tokens=new_tokens, temperature=1.0, ignore_eos=True, num_logprobs=logprobs, seed=i if seeded else None
        )
        for i in range(len(prompts))
    ]
    outputs = await asyncio.gather(*(engine.generate(p, s) for p, s in zip(prompts, params)))
    return sum(len(o.output_ids) for o in outputs)


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "rlasync"], cwd=ROOT, capture_output=True, text=True)
        return out.stdout.strip() + (" (+ uncommitted changes in rlasync/)" if dirty.stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__
    )
    parser.add_argument("--concurrency", default="256,64", help="comma-separated request counts (one run each)")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=48, help="new tokens per request (decode steps)")
    parser.add_argument("--vocab", type=int, default=512, help="the tiny model's vocabulary (sampler cost on CPU)")
    parser.add_argument("--path", default="graphs", choices=["graphs", "eager"])
    parser.add_argument(
        "--modes", default=",".join(m[0] for m in MODES), help="subset of " + ",".join(m[0] for m in MODES)
    )
    parser.add_argument("--repeats", type=int, default=3, help="runs per mode (steps of all repeats pooled)")
    parser.add_argument("--skip", type=int, default=2, help="decode steps skipped at the start of each run")
    parser.add_argument(
        "--freeze-heap",
        action="store_true",
        help="gc.freeze() after each engine is built (what the GenerationActor does): full collections then walk only "
        "what the runs allocate",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: steadier on a busy box)")
    parser.add_argument("--profile-top", type=int, default=40, help="cProfile rows (0: no profile)")
    parser.add_argument("--profile-mode", default="unseeded_logprobs8")
    parser.add_argument("--commit", default=None, help="the commit to record (default: this checkout's HEAD)")
    parser.add_argument("--label", default="run", help="the JSON key of this run (e.g. before / after)")
    parser.add_argument("--out", default=str(ROOT / "bench/results/engine_host_cpu.json"))
    parser.add_argument("--profile-out", default=str(ROOT / "bench/results/profiles"))
    args = parser.parse_args()
    modes = [m for m in MODES if m[0] in args.modes.split(",")]
    if not modes:
        parser.error(f"--modes {args.modes!r} names none of {[m[0] for m in MODES]}")
    torch.set_num_threads(args.threads)
    levels = [int(c) for c in args.concurrency.split(",")]
    max_len = args.prompt_len + args.new_tokens
    prompts_all = torch.randint(
        0, args.vocab, (max(levels), args.prompt_len), generator=torch.Generator().manual_seed(0)
    )
    prompts_all = prompts_all.tolist()
    entry: dict = {
        **run_header(args.commit),
        "path": args.path,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "vocab": args.vocab,
        "runs": {},
    }
    entry["freeze_heap"] = args.freeze_heap
    clock = Clock()
    timed_sampler(clock)
    gc.callbacks.append(clock.gc_callback)
    for level in levels:
        engine = TorchEngine(
            tiny_llama(args.vocab, max_len),
            device="cpu",
            max_model_len=max_len,
            kv_cache_tokens=level * max_len + 1024,
            max_num_seqs=level,
            max_num_batched_tokens=level * args.prompt_len,  # every prompt in one step: then all decode together
            async_scheduling=args.path == "graphs",
            compiled_sampler=False,
        )
        instrument(engine, clock, args.path, args.vocab, max_len, level)
        prompts = prompts_all[:level]
        asyncio.run(generate_all(engine, prompts[:8], 4, False, 8))  # warm-up
        if args.freeze_heap:
            freeze_heap()
        for name, seeded, logprobs in modes:
            pooled = Clock()
            for _ in range(args.repeats):
                clock.steps, clock.current = [], None
                asyncio.run(generate_all(engine, prompts, args.new_tokens, seeded, logprobs))
                clock.current = None
                pooled.steps.extend(_runs_steps(clock, level, args.skip))
            stats = decode_stats_pooled(pooled.steps)
            entry["runs"][f"c{level}_{name}"] = stats
            print(f"c={level} {name}: {json.dumps(stats)}", flush=True)
        if args.profile_top and level == max(levels):
            entry["profile"] = profile(engine, prompts, args, level)
    write_entry(
        Path(args.out),
        args.label,
        entry,
        "engine_host: the TorchEngine's host ms per decode step besides the forward, on the CPU (bench/engine_host.py)",
    )


def _runs_steps(clock: Clock, concurrency: int, skip: int) -> list[tuple]:
    steps = clock.steps
    rows = []
    for step, nxt in zip(steps, steps[1:]):
        if step["decode"] and step["chunks"] == concurrency and nxt["decode"] and nxt["chunks"] == concurrency:
            rows.append((nxt["c"] - step["c"], step["fwd"], step["smp"], step["gc"], step["gcn"], nxt["t"] - step["t"]))
    return rows[skip:]


def decode_stats_pooled(rows: list[tuple]) -> dict:
    if not rows:
        return {"decode_steps": 0}

    def med(values):
        return round(statistics.median(values) * 1000, 4)

    def mean(values):
        return round(statistics.fmean(values) * 1000, 4)

    host = [r[0] - r[1] for r in rows]
    host_excl = [r[0] - r[1] - r[2] for r in rows]
    return {
        "decode_steps": len(rows),
        "step_wall_ms": med([r[5] for r in rows]),
        "step_cpu_ms": med([r[0] for r in rows]),
        "forward_cpu_ms": med([r[1] for r in rows]),
        "sampler_cpu_ms": med([r[2] for r in rows]),
        "host_cpu_ms": med(host),
        "host_excl_sampler_cpu_ms": med(host_excl),
        "host_cpu_ms_mean": mean(host),
        "host_excl_sampler_cpu_ms_mean": mean(host_excl),
        "gc_ms_mean": mean([r[3] for r in rows]),
        "gc_collections_per_step": round(statistics.fmean(r[4] for r in rows), 2),
    }


def profile(engine: TorchEngine, prompts, args, level: int) -> str:
    """cProfile of one run of `--profile-mode` with its steps inline on this thread; returns the file written."""
    name, seeded, logprobs = next(m for m in MODES if m[0] == args.profile_mode)

    async def inline(fn, *a, **kw):  # the profiler records its own thread only
        return fn(*a, **kw)

    runner = engine.runner
    launch = runner.launch
    profiler = cProfile.Profile()
    started = []

    def launch_then_profile(chunks, previous=None):  # from the first full decode step on (prefill steps left out)
        if not started and len(chunks) == level and all(len(chunk.token_ids) == 1 for chunk in chunks):
            started.append(True)
            profiler.enable()
        return launch(chunks, previous)

    to_thread, asyncio.to_thread = asyncio.to_thread, inline
    runner.launch = launch_then_profile
    try:
        asyncio.run(generate_all(engine, prompts, args.new_tokens, seeded, logprobs))
        profiler.disable()
    finally:
        asyncio.to_thread = to_thread
        runner.launch = launch
    note = (
        f"c={level} {name}, {args.new_tokens} new tokens after a {args.prompt_len}-token prompt, the decode steps "
        f"only, path {args.path}, steps inline"
    )
    return write_profile(profiler, args.profile_top, Path(args.profile_out) / f"engine_host_cpu_{args.label}.txt", note)


def write_profile(profiler: cProfile.Profile, top: int, path: Path, note: str) -> str:
    """The `top` rows by own time, headed by the command and `note`, with this checkout's and torch's folders cut
    from the file names; returns the path written (relative to the repository when inside it)."""
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    body = text.getvalue().replace(str(ROOT) + "/", "").replace(str(Path(torch.__file__).parents[1]) + "/", "")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"# {' '.join(['python3', *sys.argv])}\n# {note}\n{body}")
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def run_header(commit: str | None = None) -> dict:
    """What every entry of a CPU lab's JSON starts with: the command, the commit, the date, the machine, torch."""
    return {
        "command": " ".join(["python3", *sys.argv]),
        "commit": commit or git_commit(),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "hardware": platform.processor() or platform.machine(),
        "torch": torch.__version__,
    }


def write_entry(out: Path, label: str, entry: dict, benchmark: str) -> None:
    """Merge `entry` under `label` into the JSON at `out` (the other labels kept), `benchmark` describing the file."""
    data = json.loads(out.read_text()) if out.exists() else {}
    data.setdefault("benchmark", benchmark)
    data[label] = entry
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=2) + "\n")
    print(f"wrote {out} [{label}]")


if __name__ == "__main__":
    main()
