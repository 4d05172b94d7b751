"""What the queue actor's process spends per group, on the CPU: a lease, then the group's samples put or its drop.

A part, not the system. In the default SmolLM2 sums run every group passes the named queue actor (`next_group`, then
`put_group` with its 8 samples, or a drop when its rewards have no spread); late in the run ~340 groups a second go
through it and its process runs at ~1.1-1.4 CPU-seconds a second (`perf/queue_cpu_frac`), more than a core. If more
engines raise generation, this process is the next one to saturate. Here `--clients` Ray actors stand in for the
rollout actors: each keeps `--inflight` groups going, leasing with the real `QueuePromptSource` call (`next_group`)
and handing over through the real sink calls (`put_group` of the group packed by `actors.group_payload.pack_group`,
or with `--by-value` of `QueueEntry.for_sample(s, payload=s)`; samples shaped as the sums run's: a 45-token prompt,
an 11-token completion, 8 sampler log-probs a token; `drop_group` with the group's tokens, or with
`--drops-with-lease` on the next `next_group`, as with `--kept-with-lease` a kept group) with probability
`--keep-rate`; a learner stand-in takes what is queued
(`wait_take`, `finish_step`, `set_policy_version`) and frees it. The queue actor is `actors.staleness_queue.QueueActor`
itself. Measured in its process: CPU seconds (all threads) per group, split by running all-drop and all-put phases,
and groups a second.

    python bench/queue_actor_load.py --seconds 8 --out bench/results/queue_actor_load_cpu.json
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import platform
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import ray  # noqa: E402, TID251 - a driver script, as actors.cluster


def make_sample(group_id: int, version: int, prompt_len: int, completion_len: int, logprobs: int):
    from rlasync.records import RolloutSample

    n = prompt_len + completion_len
    mask = np.zeros(n, dtype=bool)
    mask[prompt_len:] = True
    return RolloutSample(
        input_ids=np.arange(n, dtype=np.int64) + 100,
        completion_mask=mask,
        sampler_logprobs=np.full(n, -0.5, dtype=np.float32),
        advantage=0.5,
        group_id=group_id,
        policy_version=version,
        sampler_topk_ids=np.zeros((n, logprobs), dtype=np.int64),
        sampler_topk_logprobs=np.full((n, logprobs), -1.0, dtype=np.float32),
        metrics={"reward": 1.0, "reward_std": 0.35, "rewards/last_number_reward": 1.0},
        prompt="What is 47 + 38? Answer with the number.",
        completion="85",
        rollout_id="0123456789abcdef",
    )


@ray.remote(num_cpus=0)
class Client:
    """A rollout actor's queue traffic, without generation: lease, then put (kept) or drop, `inflight` at a time."""

    def __init__(self, queue, index: int, group_size: int, args: dict) -> None:
        from rlasync.pipeline import QueueEntry

        self.queue, self.group_size, self.args = queue, group_size, args
        self.owner = f"client {index}#bench"
        self.entry = QueueEntry
        self.rng = np.random.default_rng(index)
        self.groups = 0
        self.drops: list = []  # `--drops-with-lease`: held for the next `next_group` call, as QueuePromptSource does
        self.kept: list = []  # `--kept-with-lease`: the same for kept groups

    async def run(self, seconds: float, keep_rate: float) -> int:
        self.groups = 0
        end = time.monotonic() + seconds
        await asyncio.gather(*(self._one(end, keep_rate) for _ in range(self.args["inflight"])))
        return self.groups

    async def _one(self, end: float, keep_rate: float) -> None:
        a = self.args
        while time.monotonic() < end:
            (drops, self.drops), (kept, self.kept) = (self.drops, []), (self.kept, [])
            answer = await self.queue.next_group.remote(self.group_size, 0.5, self.owner, drops, kept)
            lease = answer.lease
            if lease is None:
                continue
            tokens = self.group_size * (a["prompt_len"] + a["completion_len"])
            if self.rng.random() < keep_rate:
                samples = [
                    make_sample(
                        lease.group_id, answer.policy_version, a["prompt_len"], a["completion_len"], a["logprobs"]
                    )
                    for _ in range(self.group_size)
                ]
                if a["by_value"]:  # the rollout actors' way before 2026-12-07 13:30
                    await self.queue.put_group.remote([self.entry.for_sample(s, payload=s) for s in samples])
                else:  # packed by the rollout actor, as `RolloutActor`'s sink does
                    from actors.group_payload import pack_group

                    if a["kept_with_lease"]:  # held for the next next_group call, as QueuePromptSource.keep does
                        self.kept.append(pack_group(samples))
                    else:
                        await self.queue.put_group.remote(*pack_group(samples))
            elif a["drops_with_lease"]:
                self.drops.append((lease.group_id, "zero_std", tokens, "constant", None))
            else:
                await self.queue.drop_group.remote(lease.group_id, "zero_std", tokens, "constant", None)
            self.groups += 1


@ray.remote(num_cpus=0)
class Learner:
    """Takes whatever is queued, as fast as it comes, so the allowance keeps admitting."""

    def __init__(self, queue, token_target: int) -> None:
        self.queue, self.token_target = queue, token_target
        self.version = 0

    async def run(self, seconds: float) -> dict:
        end, steps = time.monotonic() + seconds, 0
        while time.monotonic() < end:
            result = await self.queue.wait_take.remote(self.token_target, 0.2)
            tokens = sum(e.num_tokens for e in result.entries)
            if not result.entries:
                continue
            await self.queue.finish_step.remote(max(tokens, 1))
            self.version += 1
            steps += 1
            await self.queue.set_policy_version.remote(self.version)
        return {"steps": steps}


def phase(queue, clients, learner, seconds: float, keep_rate: float, pid: int) -> dict:
    """One measured phase: the clients' groups, the queue process's CPU seconds over it (all its threads)."""
    ticks = os.sysconf("SC_CLK_TCK")

    def cpu_s() -> float:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / ticks  # utime + stime

    start_cpu, start = cpu_s(), time.monotonic()
    learner_ref = learner.run.remote(seconds)
    groups = sum(ray.get([c.run.remote(seconds, keep_rate) for c in clients]))
    wall = time.monotonic() - start
    steps = ray.get(learner_ref)["steps"]
    used = cpu_s() - start_cpu
    return {
        "keep_rate": keep_rate,
        "groups": groups,
        "groups_per_s": groups / wall,
        "learner_steps": steps,
        "queue_cpu_s": used,
        "queue_cpu_frac": used / wall,
        "queue_cpu_us_per_group": 1e6 * used / max(groups, 1),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--seconds", type=float, default=8.0, help="per phase")
    parser.add_argument("--clients", type=int, default=2, help="rollout-actor stand-ins")
    parser.add_argument("--inflight", type=int, default=32, help="groups each client keeps going")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=45)
    parser.add_argument("--completion-len", type=int, default=11)
    parser.add_argument("--logprobs", type=int, default=8)
    parser.add_argument("--keep-rates", default="0,1,0.15", help="one phase each: 0 all drops, 1 all puts")
    parser.add_argument(
        "--drops-with-lease",
        action="store_true",
        help="a dropped group rides on the client's next next_group call (the rollout actors' way since 2026-12-07) "
        "instead of its own drop_group call",
    )
    parser.add_argument(
        "--kept-with-lease",
        action="store_true",
        help="a kept group (packed) rides on the client's next next_group call (the rollout actors' way since "
        "2026-12-07 13:40) instead of its own put_group call",
    )
    parser.add_argument(
        "--by-value",
        action="store_true",
        help="a kept group's samples go by value (Ray pickles them; the queue unpickles and ray.puts them) instead "
        "of packed by the client (actors.group_payload.pack_group, the rollout actors' way)",
    )
    parser.add_argument("--label", default="run")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)

    from actors.staleness_queue import QueueActor
    from rlasync.pipeline.settings import QueueSettings

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        tokens_per_step = 64 * args.group_size * (args.prompt_len + args.completion_len)
        settings = QueueSettings(num_rows=100_000, num_epochs=None, max_staleness=2, tokens_per_step=tokens_per_step)
        queue = QueueActor.options(num_cpus=0).remote(settings=settings)
        pid = ray.get(queue.__ray_call__.remote(lambda self: os.getpid()))
        shape = {
            k: getattr(args, k)
            for k in (
                "inflight",
                "prompt_len",
                "completion_len",
                "logprobs",
                "drops_with_lease",
                "by_value",
                "kept_with_lease",
            )
        }
        clients = [Client.remote(queue, i, args.group_size, shape) for i in range(args.clients)]
        learner = Learner.remote(queue, tokens_per_step)
        phase(queue, clients, learner, 2.0, 0.5, pid)  # warm-up: imports, first calls
        phases = [phase(queue, clients, learner, args.seconds, float(k), pid) for k in args.keep_rates.split(",")]
    finally:
        ray.shutdown()
    by_rate = {p["keep_rate"]: p for p in phases}
    summary = {}
    if 0.0 in by_rate:
        summary["drop_group_cpu_us"] = by_rate[0.0]["queue_cpu_us_per_group"]  # lease + drop
    if 1.0 in by_rate:
        summary["put_group_cpu_us"] = by_rate[1.0]["queue_cpu_us_per_group"]  # lease + put of group_size samples
    entry = {
        "command": "python3 "
        + shlex.join(["bench/queue_actor_load.py", *(argv if argv is not None else sys.argv[1:])]),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "hardware": {"cpus": os.cpu_count(), "machine": platform.machine(), "ray": ray.__version__},
        "settings": vars(args) | {"out": str(args.out)},
        "phases": phases,
        "summary": summary,
    }
    print(json.dumps(entry["summary"] | {"phases": [{k: round(v, 1) for k, v in p.items()} for p in phases]}, indent=1))
    if args.out is not None:
        existing = json.loads(args.out.read_text()) if args.out.exists() else {
            "benchmark": "queue_actor_load: the queue actor's CPU per group (lease + put or drop), stand-in clients (CPU)"
        }  # fmt: skip
        existing[args.label] = entry
        args.out.write_text(json.dumps(existing, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
