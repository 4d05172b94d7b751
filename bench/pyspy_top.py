"""Summarise py-spy's collapsed stacks (`py-spy record -f raw`): per file, the functions with the most samples,
self (the frame on top) and total (anywhere on the stack), as percentages of that process's samples. A file
recorded with `--subprocesses` (each stack rooted at `process PID:"command"`) is summarised per process.

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
        per_process[process].append(([frame_name(f) for f in frames], int(count)))
    if not per_process:
        return f"== {path.name}: no samples\n"
    return "".join(
        summarise_stacks(f"{path.name} {process}".strip(), stacks, top)
        for process, stacks in sorted(per_process.items())
    )


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
