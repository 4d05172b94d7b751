"""What the rollout actors' channel to a generation actor costs the generation actor's process, per request, on the CPU.

A part, not the system: the engine is a stand-in that finishes each request after a few ticks of a fixed step clock
(as the built-in engine finishes a step's requests together), returning a TurnRecord shaped as the SmolLM2 sums run's
(~11 output tokens, 8 sampler log-probs each, as `TopLogprobs` arrays). The rollout side is `--rollout-actors` Ray actors, each keeping
`--inflight` requests in flight through `actors.engine_channel.EngineChannel` (one submission per event-loop turn,
results back through the channel's one stream as they finish), as the rollout actors do. What is measured in the
generation actor's process: CPU seconds (all its threads: the event loop, Ray's own threads) per request, the
submissions and the stream's yields per engine step, and requests per second. On a GPU the engine's own host work shares that process (and its GIL).

    python bench/channel_overhead.py --seconds 10 --out bench/results/channel_overhead_cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def spin(seconds: float, releases: int = 0) -> None:
    """Run Python for `seconds` of this thread's CPU time, giving the GIL up `releases` times on the way (as a
    torch call that releases it does) and taking it back each time."""
    for _ in range(releases + 1):
        end = time.thread_time() + seconds / (releases + 1)
        while time.thread_time() < end:
            pass
        if releases:
            time.sleep(0)


class TickEngine:
    """A stand-in engine: a request finishes after a number of steps of `tick_s` drawn from `ticks` (low, high).
    With `host_s` each step also runs that much Python in a worker thread and `loop_s` on the event loop, as the
    built-in engine's host side does (its launch and read-back in a thread, its scheduling on the loop), each giving
    the GIL up `releases` times (the torch calls among them)."""

    def __init__(
        self, tick_s: float, ticks: tuple[int, int], new_tokens: int, logprobs: int, host_s: float = 0.0,
        loop_s: float = 0.0, releases: int = 0,
    ) -> None:  # fmt: skip
        import random

        self.tick_s, self.ticks, self.new_tokens, self.logprobs = tick_s, ticks, new_tokens, logprobs
        self.host_s, self.loop_s, self.releases = host_s, loop_s, releases
        self.random = random.Random(0)
        self.step = 0
        self.waiting: dict[int, list[asyncio.Future]] = {}
        self._clock: asyncio.Task | None = None

    async def _run_clock(self) -> None:
        while True:
            await asyncio.sleep(max(self.tick_s - self.host_s - self.loop_s, 0.0))
            if self.host_s:
                await asyncio.to_thread(spin, self.host_s, self.releases)
            spin(self.loop_s, self.releases)
            self.step += 1
            for future in self.waiting.pop(self.step, []):
                if not future.done():
                    future.set_result(None)

    async def generate(self, prompt_ids, sampling):
        import numpy as np

        from rlasync.records import TopLogprobs, TurnRecord

        if self._clock is None:
            self._clock = asyncio.ensure_future(self._run_clock())
        future = asyncio.get_running_loop().create_future()
        self.waiting.setdefault(self.step + self.random.randint(*self.ticks), []).append(future)
        await future
        n, k = self.new_tokens, self.logprobs
        # the sampler's top-N as the built-in engine returns it: one packed row per token (ids, then log-probs)
        row = np.array([*range(k), *(-0.1 * (j + 1) for j in range(k))], dtype=np.float64)
        top = TopLogprobs.from_rows([row] * n, k) if k else None
        return TurnRecord(list(prompt_ids), list(range(n)), [-0.5] * n, None, None, top, "stop")


def make_actors(ray):
    @ray.remote
    class StubGeneration:
        def __init__(self, tick_s, ticks, new_tokens, logprobs, host_s, loop_s, releases, switch_s):
            from actors.engine_channel import ChannelHost

            if switch_s:
                sys.setswitchinterval(switch_s)
            self.engine = TickEngine(tick_s, ticks, new_tokens, logprobs, host_s, loop_s, releases)
            self.channels = ChannelHost(self.engine)  # as the GenerationActor hosts them
            self.calls = 0
            self.yields = 0

        async def submit(self, channel_id, requests):
            self.calls += 1
            await self.channels.submit(channel_id, requests)

        async def results(self, channel_id):
            async for ready in self.channels.results(channel_id):
                self.yields += 1
                yield ready

        async def ping(self):
            return None

        def counters(self):
            from rlasync.metrics.process_cpu import process_cpu_s

            return {"cpu_s": process_cpu_s(), "calls": self.calls, "yields": self.yields,
                    "steps": self.engine.step}  # fmt: skip

    @ray.remote
    class Rollouts:
        def __init__(self, handles, inflight, prompt_len, group=1, routing="request", member=None, members=1):
            from actors.engine_channel import EngineChannel
            from rlasync.rollout.engine_pool import EnginePool

            self.channels = [EngineChannel(handle, name=f"generation actor {i}") for i, handle in enumerate(handles)]
            self.pool = EnginePool(
                self.channels, max_concurrent=inflight, emit=lambda items: None, stats_interval_s=None
            )
            self.pool.place(member, members)  # None: every engine
            self.inflight, self.prompt = inflight, list(range(prompt_len))
            self.group, self.routing = group, routing
            self.done = 0

        async def run(self, seconds):
            from rlasync.engine.base import SamplingParams

            sampling = SamplingParams(max_tokens=16, num_logprobs=8)
            stop = time.monotonic() + seconds
            keys = iter(range(1 << 62))

            async def one(key):
                await self.pool.generate(self.prompt, sampling, affinity=key)
                self.done += 1

            async def worker():  # a group of `group` requests at a time, started in one event-loop turn
                while time.monotonic() < stop:
                    key = next(keys) if self.routing != "request" else None
                    await asyncio.gather(*(one(key) for _ in range(self.group)))

            await asyncio.gather(*(worker() for _ in range(max(1, self.inflight // self.group))))
            return self.done

        def count(self):
            return self.done

    return StubGeneration, Rollouts


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollout-actors", type=int, default=4)
    parser.add_argument("--engines", type=int, default=1, help="generation actors (stand-ins)")
    parser.add_argument("--group", type=int, default=1, help="requests started together (a GRPO group: 8)")
    parser.add_argument(
        "--routing",
        choices=["request", "group", "home"],
        default="request",
        help="request: each request to the least-loaded engine; group: a group's requests to one engine (affinity); "
        "home: that, and rollout actor i of N placed on its home engines (EnginePool.place: i mod E when E divides N)",
    )
    parser.add_argument("--inflight", type=int, default=64, help="requests each rollout actor keeps in flight")
    parser.add_argument("--tick-s", type=float, default=0.013, help="the stand-in engine's step (13 ms: the sums run)")
    parser.add_argument(
        "--ticks", default="3-20", help="steps a request lasts, LOW-HIGH uniform (the sums run: 2-48 tokens, ~11 mean)"
    )
    parser.add_argument("--new-tokens", type=int, default=11)
    parser.add_argument("--logprobs", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=45)
    parser.add_argument("--host-ms", type=float, default=0.0, help="Python a step runs in a worker thread")
    parser.add_argument("--loop-ms", type=float, default=0.0, help="Python a step runs on the event loop")
    parser.add_argument("--releases", type=int, default=0, help="GIL releases in each step's host and loop work")
    parser.add_argument("--switch-ms", type=float, default=None, help="the generation actor's GIL switch interval")
    parser.add_argument("--ping-ms", type=float, default=20.0, help="a call to the generation actor this often")
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--warmup-s", type=float, default=3.0)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    import ray  # noqa: TID251 - a driver script, as actors.cluster

    ray.init(num_cpus=args.rollout_actors + args.engines + 1, include_dashboard=False, log_to_driver=False)
    try:
        StubGeneration, Rollouts = make_actors(ray)
        low, _, high = args.ticks.partition("-")
        gens = [
            StubGeneration.remote(
                args.tick_s,
                (int(low), int(high or low)),
                args.new_tokens,
                args.logprobs,
                args.host_ms / 1000,
                args.loop_ms / 1000,
                args.releases,
                None if args.switch_ms is None else args.switch_ms / 1000,
            )  # fmt: skip
            for _ in range(args.engines)
        ]
        gen = gens[0]
        home = args.routing == "home"
        rollouts = [
            Rollouts.remote(
                gens,
                args.inflight,
                args.prompt_len,
                args.group,
                args.routing,
                i if home else None,
                args.rollout_actors,
            )  # fmt: skip
            for i in range(args.rollout_actors)
        ]
        runs = [r.run.remote(args.warmup_s + args.seconds) for r in rollouts]
        time.sleep(args.warmup_s)

        def counters():
            each = ray.get([g.counters.remote() for g in gens])
            return {key: sum(c[key] for c in each) for key in ("cpu_s", "calls", "yields", "steps")}

        before, done_before, t0 = counters(), sum(ray.get([r.count.remote() for r in rollouts])), time.monotonic()
        pings = []  # how long a call to the generation actor takes to come back (waiting for its loop included)
        while time.monotonic() < t0 + args.seconds:
            sent = time.perf_counter()
            ray.get(gen.ping.remote())
            pings.append(time.perf_counter() - sent)
            time.sleep(max(args.ping_ms / 1000 - (time.perf_counter() - sent), 0.0))
        after, done_after, t1 = counters(), sum(ray.get([r.count.remote() for r in rollouts])), time.monotonic()
        ray.get(runs)
    finally:
        ray.shutdown()
    requests = done_after - done_before
    steps = max(1, after["steps"] - before["steps"])  # summed over the engines: per engine step
    result = {
        "benchmark": "channel_overhead",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "hardware": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "settings": vars(args),
        "requests_per_s": round(requests / (t1 - t0), 1),
        "generation_actor_cpu_us_per_request": round(1e6 * (after["cpu_s"] - before["cpu_s"]) / max(1, requests), 1),
        "generation_actor_cpu_frac": round((after["cpu_s"] - before["cpu_s"]) / (t1 - t0), 3),
        "submissions_per_step": round((after["calls"] - before["calls"]) / steps, 2),
        "yields_per_step": round((after["yields"] - before["yields"]) / steps, 2),
        "requests_per_step": round(requests / steps, 2),
        "engine_steps_per_s": round(steps / (t1 - t0) / args.engines, 1),  # each engine
        "ping_ms_median": round(1000 * sorted(pings)[len(pings) // 2], 2),
        "ping_ms_p99": round(1000 * sorted(pings)[int(0.99 * (len(pings) - 1))], 2),
        "ping_ms_max": round(1000 * max(pings), 2),
    }
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
