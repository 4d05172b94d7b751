"""What the sampler's top-N log-probs cost a request on the host, from the engine's packed step output to the rollout
actor's side of the pickle, on the CPU (a part, not the system).

In the sums run a request is ~11 tokens with 8 sampler log-probs each (score centering), and the GenerationActor's
process is bound by its host side (py-spy: `unpack_packed` ~11% of its GIL time, pickling results ~5%). This replays
`--steps` steps of `--batch` requests through the engine's own code: `unpack_packed` on packed [B, 2 + 2N] float64
step outputs (as the runner's `collect` reads them), `Request.append`, `Request.to_turn_record`, `pickle.dumps` of the
record (what the engine channel sends) and `pickle.loads` (the rollout actor's side). Microseconds per request, the
median of `--repeats` timed passes; one JSON entry per `--label` in `--out`, so a checkout before a change and one after
sit side by side (run the script from each checkout: it imports the checkout it lives in).

    python bench/top_logprobs_host.py --label after --out bench/results/top_logprobs_host_cpu.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import pickle
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402


def packed_steps(batch: int, n: int, steps: int, vocab: int, seed: int) -> list[torch.Tensor]:
    """`steps` packed step outputs: per row the sampled id and log-prob, then N ranked ids and their log-probs."""
    generator = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, vocab, (batch, 1 + n), generator=generator).to(torch.float64)
        logprobs = -torch.rand(batch, 1 + n, generator=generator).sort(dim=1).values.to(torch.float64) * 5
        out.append(torch.cat([ids[:, :1], logprobs[:, :1], ids[:, 1:], logprobs[:, 1:]], 1))
    return out


def one_pass(steps: list[torch.Tensor], batch: int, n: int) -> dict[str, float]:
    from rlasync.engine.base import SamplingParams
    from rlasync.engine.request import Request
    from rlasync.engine.runner import unpack_packed

    params = SamplingParams(max_tokens=len(steps), temperature=1.0, num_logprobs=n)
    result = SimpleNamespace(topn_ids=torch.zeros(batch, n), candidate_ids=None, num_candidates=None)
    requests = [Request(i, [1, 2, 3], params, i, len(steps), frozenset()) for i in range(batch)]
    rows = [params] * batch
    t0 = time.perf_counter()
    for packed in steps:
        for request, token in zip(requests, unpack_packed(packed, result, rows)):
            request.append(*token)
    t1 = time.perf_counter()
    records = [request.to_turn_record() for request in requests]
    t2 = time.perf_counter()
    blobs = [pickle.dumps(record, protocol=5) for record in records]
    t3 = time.perf_counter()
    for blob in blobs:
        pickle.loads(blob)
    t4 = time.perf_counter()
    per = 1e6 / batch
    return {
        "unpack_append_us": (t1 - t0) * per,
        "record_us": (t2 - t1) * per,
        "pickle_us": (t3 - t2) * per,
        "engine_side_us": (t3 - t0) * per,
        "unpickle_us": (t4 - t3) * per,
        "pickled_bytes": sum(map(len, blobs)) / batch,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=256, help="requests a step (the sums run's max_num_seqs)")
    parser.add_argument("--logprobs", type=int, default=8, help="N, the sampler's top-N a token")
    parser.add_argument("--steps", type=int, default=11, help="tokens a request (the sums run's ~11)")
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--label", required=True)
    parser.add_argument("--out", default=str(ROOT / "bench/results/top_logprobs_host_cpu.json"))
    args = parser.parse_args()
    steps = packed_steps(args.batch, args.logprobs, args.steps, args.vocab, seed=0)
    one_pass(steps, args.batch, args.logprobs)  # warm-up
    passes = [one_pass(steps, args.batch, args.logprobs) for _ in range(args.repeats)]
    medians = {key: statistics.median(p[key] for p in passes) for key in passes[0]}
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    entry = {
        "command": "python " + shlex.join(sys.argv),
        "commit": commit.stdout.strip(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "hardware": f"{platform.processor() or platform.machine()}, this workstation's CPU",
        "median_of_repeats": medians,
    }
    out = Path(args.out)
    data = json.loads(out.read_text()) if out.exists() else {}
    data.setdefault("benchmark", __doc__.split("\n\n")[0])
    data[args.label] = entry
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=2) + "\n")
    print(args.label, json.dumps({k: round(v, 2) for k, v in medians.items()}))


if __name__ == "__main__":
    main()
