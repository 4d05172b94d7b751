"""The driver's death takes the Ray local cluster it started with it (Linux).

Ray shares the fate of the processes it starts directly with the driver (gcs_server, raylet, monitors: killed with
it), but the raylet's own children, the dashboard agent and the runtime-env agent, outlive a driver killed with
`kill -9` (found alive minutes later). So when the driver starts a local cluster (`actors.cluster.connect`) it also
starts this script, in its own session (a Ctrl-C to the driver's terminal does not reach it):

    python reaper.py DRIVER_PID SESSION_NAME

Every second it records the driver's descendants that belong to the Ray session (a process whose command line names
the session, and everything below it), with their start times; when the driver is gone, or on SIGTERM (the driver's
own `ray.shutdown()` is done: `stop_reaper`), it kills every recorded process still running (the same pid and start
time: never a reused pid) and exits. Standard library only: it runs as a plain script.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

POLL_S = 1.0


def session_processes(parents: Mapping[int, int], commands: Mapping[int, str], driver: int, session: str) -> set[int]:
    """The pids under `driver` (in the `parents` map pid -> ppid) that belong to the Ray session: a process whose
    command line (`commands`) names `session`, and every descendant of one."""
    children: dict[int, list[int]] = {}
    for pid, parent in parents.items():
        children.setdefault(parent, []).append(pid)
    found: set[int] = set()
    stack = [(child, False) for child in children.get(driver, [])]
    while stack:
        pid, inside = stack.pop()
        inside = inside or session in commands.get(pid, "")
        if inside:
            found.add(pid)
        stack += [(child, inside) for child in children.get(pid, [])]
    return found


def _stat(pid: int) -> tuple[int, int] | None:
    """(ppid, start time in clock ticks) of `pid`, None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # after "pid (comm) ": state ppid ... starttime (field 22)
    return int(fields[1]), int(fields[19])


def _scan() -> tuple[dict[int, int], dict[int, str], dict[int, int]]:
    """Every process: pid -> ppid, pid -> command line, pid -> start time."""
    parents, commands, starts = {}, {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        stat = _stat(pid)
        if stat is None:
            continue
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        parents[pid], commands[pid], starts[pid] = stat[0], command, stat[1]
    return parents, commands, starts


def run(driver: int, session: str, poll_s: float = POLL_S, stopping: list[bool] | None = None) -> int:
    """Watch `driver` until it is gone (or `stopping` is set: SIGTERM in `main`), then kill the recorded session
    processes; how many."""
    first = _stat(driver)
    tracked: dict[int, int] = {}  # pid -> start time
    stopping = stopping if stopping is not None else []
    while not stopping and first is not None and (_stat(driver) or (0, -1))[1] == first[1]:
        parents, commands, starts = _scan()
        found = session_processes(parents, commands, driver, session) - {os.getpid()}  # its argv names the session
        tracked.update({pid: starts[pid] for pid in found})
        time.sleep(poll_s)
    killed = 0
    for pid, started in tracked.items():
        stat = _stat(pid)
        if stat is not None and stat[1] == started:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except OSError:
                pass
    return killed


def start_reaper(session: str) -> subprocess.Popen[bytes] | None:
    """Start the reaper for this process's Ray `session` (Linux only; None elsewhere)."""
    if not sys.platform.startswith("linux") or not os.path.isdir("/proc"):
        return None
    return subprocess.Popen(
        [sys.executable, str(Path(__file__).resolve()), str(os.getpid()), session],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        close_fds=True,
    )


def stop_reaper(reaper: subprocess.Popen[bytes] | None, timeout_s: float = 10.0) -> None:
    """After `ray.shutdown()`: the reaper kills what the session left and exits."""
    if reaper is None or reaper.poll() is not None:
        return
    reaper.terminate()
    try:
        reaper.wait(timeout_s)
    except subprocess.TimeoutExpired:
        reaper.kill()
        reaper.wait()


def main(argv: list[str]) -> None:
    stopping: list[bool] = []
    signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    run(int(argv[0]), argv[1], stopping=stopping)


if __name__ == "__main__":
    main(sys.argv[1:])
