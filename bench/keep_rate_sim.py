"""How long the learner waits for rollouts when most groups are dropped: a discrete-event run of the real queue.

The StalenessQueue's core (`rlasync.pipeline.QueueService`: dispatcher, token allowance, sample queue) driven on a
simulated clock by a generator and a learner that take no real time, so a run of hundreds of steps takes
milliseconds and is the same every time (one seeded RNG):

    generator  admits a group whenever the allowance opens and fewer than `max_inflight_groups` are in flight (the
               rollout side's concurrency cap); an engine runs `engine_slots` groups at once, each for `group_s`
               seconds (others wait their turn, FIFO): a fixed rollout rate and concurrency. A finished group is
               kept with probability `keep_rate` (its samples queued, `put_group`) or dropped for zero reward spread
               (`drop_group(..., "zero_std", tokens)`); its `group_size` samples are `sample_tokens` ± 25% raw tokens
    learner    takes fresh samples (`take`, up to the step's token target) until it holds `groups_per_step` groups'
               worth of tokens, trains `step_s` seconds, then `finish_step` and a weight sync (`set_policy_version`:
               weight_sync_steps = 1)

The learner's wait is its `perf/rollout_wait_s` (from the end of a step to the moment its next step's samples are
all taken); `rollout_wait_frac` is mean wait over mean step time from the second step on (`perf/step_s` is timed
from the end of the step before), as `bench/sums_e2e.py` reads it from a real run. Each run is made twice: with the
allowance's learned keep rate (`keep_rate_floor` 1/16, the default) and without it (floor 1.0: in-flight rollouts
counted at full, as before issue 35). `--keep-rate-start` ramps the true keep rate linearly from that value to
`--keep-rate` over the run (a task being solved).

Per run: `rollout_wait_frac`, `staleness_max` and `staleness_mean` of the trained samples (current version minus
the sample's version when taken: never above `max_staleness`, the queue drops older ones), `dropped_stale_frac`
(queued samples dropped as stale, of all queued), `ahead_tokens_mean_over_allowance` (per kept group, the tokens
that reached the queue ahead of it from its admission on, over the allowance `max_staleness × tokens_per_step` at
its admission: what the gate bounds, ≈ 1 or below with the keep rate, far below 1 without it, never near
1 / keep_rate), `ahead_over_allowance_frac` (kept groups with that ratio ≥ 1: the ones at risk of going stale),
`queue_tokens_mean_over_allowance` (time-weighted) and `queue_tokens_max_over_allowance`, `inflight_groups_max`,
`keep_rate_final` (the allowance's estimate at the end, the `rollout/keep_rate` gauge).

    python3 bench/keep_rate_sim.py --out bench/results/keep_rate_sim_cpu.json
    python3 bench/keep_rate_sim.py --keep-rate 0.2 --keep-rate-start 0.9 --steps 400
"""

from __future__ import annotations

import argparse
import datetime
import heapq
import json
import random
import shlex
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from rlasync.pipeline import KEEP_RATE_FLOOR, QueueEntry, QueueService
from rlasync.pipeline.dispatcher import PromptDispatcher

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class SimSettings:
    """One simulated run (see the module docstring)."""

    keep_rate: float = 0.2
    keep_rate_start: float | None = None
    learn_keep_rate: bool = True
    max_staleness: int = 2
    steps: int = 200
    group_size: int = 8
    sample_tokens: int = 80
    groups_per_step: int = 8
    step_s: float = 0.3
    group_s: float = 0.3
    engine_slots: int = 96
    max_inflight_groups: int = 128
    seed: int = 0

    def true_keep_rate(self, step: int) -> float:
        """The probability that a group finishing during `step` is kept."""
        if self.keep_rate_start is None:
            return self.keep_rate
        frac = min(1.0, step / max(1, self.steps - 1))
        return self.keep_rate_start + (self.keep_rate - self.keep_rate_start) * frac


@dataclass(frozen=True)
class SimResult:
    rollout_wait_frac: float
    rollout_wait_s_mean: float
    step_s_mean: float
    staleness_max: int
    staleness_mean: float
    dropped_stale_frac: float
    ahead_tokens_mean_over_allowance: float
    ahead_over_allowance_frac: float
    queue_tokens_mean_over_allowance: float
    queue_tokens_max_over_allowance: float
    inflight_groups_max: int
    keep_rate_final: float
    groups_generated: int
    groups_kept: int
    wall_s: float


def simulate(settings: SimSettings) -> SimResult:
    """Run the queue under `settings` on a simulated clock (pure Python, deterministic for a seed)."""
    s = settings
    rng = random.Random(s.seed)
    now = 0.0
    tokens_per_step = s.groups_per_step * s.group_size * s.sample_tokens
    service = QueueService(
        PromptDispatcher(num_rows=1_000_000, num_epochs=None),
        max_staleness=s.max_staleness,
        tokens_per_step=tokens_per_step,
        clock=lambda: now,
        keep_rate_floor=KEEP_RATE_FLOOR if s.learn_keep_rate else 1.0,
    )
    events: list[tuple[float, int, str, Any]] = []  # (time, seq, kind, payload): a heap
    seq = 0
    engine_free = s.engine_slots
    engine_waiting: list[Any] = []  # groups admitted, waiting for an engine slot (FIFO)
    inflight = 0
    version = 0
    step = 0
    # the learner
    training = False
    step_tokens = 0
    fill_started = 0.0
    last_step_end: float | None = None
    waits: list[float] = []
    step_times: list[float] = []
    staleness: list[int] = []
    queued_samples = stale_samples = 0
    generated = kept = 0
    inflight_max = 0
    queue_area = 0.0  # ∫ queued tokens dt
    put_tokens = 0  # tokens queued so far
    ahead: list[float] = []  # per kept group: tokens queued ahead of it since its admission, over the allowance then
    queue_max = 0
    last_t = 0.0

    def push(at: float, kind: str, payload: Any = None) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (at, seq, kind, payload))

    def run_on_engine(group: Any) -> None:
        nonlocal engine_free
        engine_free -= 1
        push(now + s.group_s, "group_done", group)

    def admit() -> None:
        nonlocal inflight, inflight_max
        while inflight < s.max_inflight_groups:
            lease = service.try_next_group(s.group_size)
            if lease is None:
                return
            inflight += 1
            inflight_max = max(inflight_max, inflight)
            group = (lease, version, service.queue.num_tokens, put_tokens, service.allowance.allowance_tokens)
            if engine_free > 0:
                run_on_engine(group)
            else:
                engine_waiting.append(group)

    def fill() -> None:
        """The learner takes what is fresh; a full step starts training."""
        nonlocal training, step_tokens, stale_samples
        if training:
            return
        while step_tokens < tokens_per_step:
            result = service.take(tokens_per_step - step_tokens, now=now)
            stale_samples += len(result.dropped_stale)
            if not result.entries:
                return
            staleness.extend(version - entry.policy_version for entry in result.entries)
            step_tokens += result.num_tokens
        waits.append(now - fill_started)
        training = True
        push(now + s.step_s, "step_done")

    admit()
    while step < s.steps:
        at, _, kind, payload = heapq.heappop(events)
        queue_area += service.queue.num_tokens * (at - last_t)
        now = last_t = at
        if kind == "group_done":
            lease, admitted_version, queued_then, put_then, allowance_then = payload
            engine_free += 1
            if engine_waiting:
                run_on_engine(engine_waiting.pop(0))
            inflight -= 1
            generated += 1
            sizes = [max(1, round(s.sample_tokens * rng.uniform(0.75, 1.25))) for _ in range(s.group_size)]
            if rng.random() < s.true_keep_rate(step):
                kept += 1
                queued_samples += len(sizes)
                ahead.append((queued_then + put_tokens - put_then) / allowance_then)
                put_tokens += sum(sizes)
                service.put_group(
                    [
                        QueueEntry(payload=None, group_id=lease.group_id, policy_version=admitted_version, num_tokens=n)
                        for n in sizes
                    ],
                    now=now,
                )
            else:
                service.drop_group(lease.group_id, "zero_std", num_tokens=sum(sizes))
            queue_max = max(queue_max, service.queue.num_tokens)
            fill()
        else:  # step_done: publish the step, sync the weights, start filling the next one
            service.finish_step(step_tokens)
            version += 1
            service.set_policy_version(version)
            step += 1
            if last_step_end is not None:
                step_times.append(now - last_step_end)
            last_step_end = now
            training, step_tokens, fill_started = False, 0, now
            fill()
        admit()

    timed_waits = waits[1 : len(step_times) + 1]  # the steps that have a step time (from the second on)
    allowance = s.max_staleness * service.allowance.tokens_per_step
    return SimResult(
        rollout_wait_frac=sum(timed_waits) / sum(step_times),
        rollout_wait_s_mean=sum(timed_waits) / len(timed_waits),
        step_s_mean=sum(step_times) / len(step_times),
        staleness_max=max(staleness),
        staleness_mean=sum(staleness) / len(staleness),
        dropped_stale_frac=stale_samples / max(1, queued_samples),
        ahead_tokens_mean_over_allowance=sum(ahead) / len(ahead),
        ahead_over_allowance_frac=sum(a >= 1.0 for a in ahead) / len(ahead),
        queue_tokens_mean_over_allowance=queue_area / now / allowance,
        queue_tokens_max_over_allowance=queue_max / allowance,
        inflight_groups_max=inflight_max,
        keep_rate_final=service.allowance.keep_rate,
        groups_generated=generated,
        groups_kept=kept,
        wall_s=now,
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="keep_rate_sim.py",
        description="A discrete-event run of the queue (dispatcher, token allowance, sample queue) with a generator "
        "of fixed rate and concurrency and a learner of fixed step time, most groups dropped for zero spread: the "
        "learner's rollout wait with and without the allowance's learned keep rate, and the trained staleness.",
    )
    defaults = SimSettings()
    parser.add_argument("--keep-rate", type=float, default=defaults.keep_rate, help="true keep rate (at the end)")
    parser.add_argument("--keep-rate-start", type=float, default=None, help="ramp the keep rate from this value")
    parser.add_argument("--max-staleness", type=int, default=defaults.max_staleness)
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--group-size", type=int, default=defaults.group_size)
    parser.add_argument("--sample-tokens", type=int, default=defaults.sample_tokens, help="mean raw tokens/sample")
    parser.add_argument("--groups-per-step", type=int, default=defaults.groups_per_step)
    parser.add_argument("--step-s", type=float, default=defaults.step_s, help="learner seconds per step")
    parser.add_argument("--group-s", type=float, default=defaults.group_s, help="engine seconds per group")
    parser.add_argument("--engine-slots", type=int, default=defaults.engine_slots, help="groups the engine runs")
    parser.add_argument("--max-inflight-groups", type=int, default=defaults.max_inflight_groups)
    parser.add_argument("--seeds", default="0,1,2,3,4", help="comma-separated RNG seeds, one run per seed and mode")
    parser.add_argument("--out", type=Path, default=None, help="write the JSON here (else print it)")
    args = parser.parse_args()
    runs: dict[str, list[dict[str, Any]]] = {"learned": [], "full": []}
    for seed in [int(x) for x in args.seeds.split(",") if x.strip()]:
        for mode, learn in (("learned", True), ("full", False)):
            settings = SimSettings(
                keep_rate=args.keep_rate,
                keep_rate_start=args.keep_rate_start,
                learn_keep_rate=learn,
                max_staleness=args.max_staleness,
                steps=args.steps,
                group_size=args.group_size,
                sample_tokens=args.sample_tokens,
                groups_per_step=args.groups_per_step,
                step_s=args.step_s,
                group_s=args.group_s,
                engine_slots=args.engine_slots,
                max_inflight_groups=args.max_inflight_groups,
                seed=seed,
            )
            runs[mode].append({"seed": seed, **asdict(simulate(settings))})
    summary = {
        mode: {
            "rollout_wait_frac_mean": sum(r["rollout_wait_frac"] for r in rows) / len(rows),
            "rollout_wait_frac_max": max(r["rollout_wait_frac"] for r in rows),
            "staleness_max": max(r["staleness_max"] for r in rows),
            "dropped_stale_frac_max": max(r["dropped_stale_frac"] for r in rows),
            "ahead_tokens_mean_over_allowance_max": max(r["ahead_tokens_mean_over_allowance"] for r in rows),
            "queue_tokens_mean_over_allowance_max": max(r["queue_tokens_mean_over_allowance"] for r in rows),
        }
        for mode, rows in runs.items()
    }
    report = {
        "command": shlex.join(["python3", "bench/keep_rate_sim.py", *sys.argv[1:]]),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "hardware": "CPU (pure Python, simulated clock)",
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "summary": summary,
        "runs": runs,
    }
    text = json.dumps(report, indent=1, default=str)
    if args.out is None:
        print(text)
    else:
        args.out.write_text(text + "\n")
        print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
