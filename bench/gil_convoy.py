"""What a GIL release costs a thread while another thread runs Python, by the interpreter's switch interval (a part).

The GenerationActor's event loop gives the GIL up many times a turn (uvloop's poll, Ray's C++ calls, torch calls that
release it) while the engine's worker thread runs Python (building and reading back steps). A thread that gave the
GIL up gets it back only when the holder drops it: at its next blocking call, or when the waiter has waited a
switch interval (`sys.setswitchinterval`, 5 ms by default) and asks. So each release can cost the loop a whole
interval. This bench times `--releases` releases (`time.sleep(0)`) in a row on the main thread while a second thread
spins in Python, `--trials` times per interval, and reports the median and worst of those totals.

    python bench/gil_convoy.py --out bench/results/gil_convoy_cpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path


def spin(stop: threading.Event) -> None:
    count = 0
    while not stop.is_set():
        count += 1


def releases_s(releases: int) -> float:
    start = time.perf_counter()
    for _ in range(releases):
        time.sleep(0)  # releases the GIL and takes it back
    return time.perf_counter() - start


def measure(switch_s: float, releases: int, trials: int, busy: bool) -> list[float]:
    default = sys.getswitchinterval()
    sys.setswitchinterval(switch_s)
    stop = threading.Event()
    thread = threading.Thread(target=spin, args=(stop,), daemon=True) if busy else None
    try:
        if thread is not None:
            thread.start()
            time.sleep(0.02)
        return [releases_s(releases) for _ in range(trials)]
    finally:
        stop.set()
        if thread is not None:
            thread.join()
        sys.setswitchinterval(default)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--intervals-ms", default="5,1,0.5", help="switch intervals to try, comma-separated ms")
    parser.add_argument("--releases", type=int, default=20)
    parser.add_argument("--trials", type=int, default=30)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    rows = []
    for interval_ms in (float(x) for x in args.intervals_ms.split(",")):
        for busy in (False, True):
            totals = measure(interval_ms / 1000, args.releases, args.trials, busy)
            rows.append({
                "switch_interval_ms": interval_ms,
                "other_thread_running_python": busy,
                "median_ms": round(1000 * statistics.median(totals), 3),
                "max_ms": round(1000 * max(totals), 3),
            })  # fmt: skip
            print(json.dumps(rows[-1]))
    result = {
        "what": __doc__.splitlines()[0],
        "command": "python bench/gil_convoy.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "hardware": {"python": platform.python_version(), "cpus": os.cpu_count(), "machine": platform.machine()},
        "settings": vars(args),
        "rows": rows,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
