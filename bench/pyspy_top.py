"""Summarise py-spy's collapsed stacks (`py-spy record -f raw`): per file, the functions with the most samples,
self (the frame on top) and total (anywhere on the stack), as percentages of that process's samples. A file
recorded with `--subprocesses` (each stack rooted at `process PID:"command"`) is summarised per process; one recorded
with `--threads` (each stack rooted at `thread (0x...)`, after its process) per thread of each process, busiest first,
each thread's share of its process's samples in its title (with `--idle` too, so that a thread waiting for the GIL or
in a native call counts as much as one running Python; with `--gil`, only the thread that holds the GIL is sampled).

    python bench/pyspy_top.py pyspy_torch_RolloutActor.txt [...] [--top 25]
"""

from __future__ import annotations

import argparse
import collections
import re
from pathlib import Path


def frame_name(frame: str) -> str:
    """`func (path/to/file.py:123)` -> `func (file.py)`: one entry per function, not per line."""
    match = re.match(r"(.*) \((.*?):\d+\)$", frame)
    if not match:
        return frame
    return f"{match.group(1)} ({Path(match.group(2)).name})"


def summarise(path: Path, top: int) -> str:
    per_process: dict[str, list[tuple[list[str], int]]] = collections.defaultdict(list)
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        process = frames.pop(0) if frames[0].startswith("process ") and len(frames) > 1 else ""
        thread = frames.pop(0) if frames[0].startswith("thread ") and len(frames) > 1 else ""
        per_process[process].append((thread, [frame_name(f) for f in frames], int(count)))
    if not per_process:
        return f"== {path.name}: no samples\n"
    out = []
    for process, entries in sorted(per_process.items()):
        title = f"{path.name} {process}".strip()
        per_thread: dict[str, list[tuple[list[str], int]]] = collections.defaultdict(list)
        for thread, frames, n in entries:
            per_thread[thread].append((frames, n))
        if list(per_thread) == [""]:
            out.append(summarise_stacks(title, per_thread[""], top))
            continue
        process_total = sum(n for _, _, n in entries)
        by_size = sorted(per_thread.items(), key=lambda item: -sum(n for _, n in item[1]))
        for thread, stacks in by_size:
            share = 100 * sum(n for _, n in stacks) / process_total
            out.append(summarise_stacks(f"{title} {thread} ({share:.1f}% of the process)", stacks, top))
    return "".join(out)


def summarise_stacks(title: str, stacks: list[tuple[list[str], int]], top: int) -> str:
    own: collections.Counter[str] = collections.Counter()
    anywhere: collections.Counter[str] = collections.Counter()
    total = 0
    for frames, n in stacks:
        total += n
        own[frames[-1]] += n
        for name in set(frames):
            anywhere[name] += n
    lines = [f"== {title}: {total} samples"]
    lines += ["  self   total  function"]
    for name, n in own.most_common(top):
        lines.append(f"  {100 * n / total:5.1f}% {100 * anywhere[name] / total:5.1f}%  {name}")
    lines.append("  -- most total --")
    for name, n in anywhere.most_common(top):
        lines.append(f"  {100 * own[name] / total:5.1f}% {100 * n / total:5.1f}%  {name}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--top", type=int, default=25)
    args = parser.parse_args()
    for path in args.files:
        print(summarise(path, args.top))


if __name__ == "__main__":
    main()
