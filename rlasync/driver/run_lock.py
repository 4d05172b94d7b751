"""One run per folder: a lock file in `output_dir`, and no fresh run into another run's checkpoints.

    <output_dir>/.rlasync.lock   {"host", "pid", "started"}: written (O_EXCL) when a run starts, removed when it
                                 ends; a second run into the folder is refused naming the holder, while it lives
                                 (a holder on this host whose pid is gone is stale: its lock is taken over)

`check_run_folder` refuses, before Ray starts: an empty `output_dir`, and a fresh run (no resume) into a folder that
holds checkpoints of another run (a later `--resume` there would continue the old run) unless the user says
`--resume` or `--overwrite_output_dir` (then the old checkpoints are removed once the lock is held). Pure Python.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import shutil
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rlasync.driver.checkpoint import CHECKPOINT_PREFIX

if TYPE_CHECKING:
    from rlasync.config.base import TrainerConfig

logger = logging.getLogger(__name__)

LOCK_NAME = ".rlasync.lock"


class RunFolderError(ValueError):
    """`output_dir` cannot take this run (locked by another run, empty, or holding another run's checkpoints)."""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, owned by someone else
        return True
    return True


def check_output_dir_named(output_dir: Any) -> None:
    """An empty `output_dir` (`--set output_dir=`) would write the run into the current directory: refused."""
    if output_dir is None or not str(output_dir).strip():
        raise RunFolderError(
            f"output_dir={output_dir!r} is empty: name the run's folder, e.g. --set output_dir=runs/my_run"
        )


def previous_checkpoints(output_dir: str | os.PathLike) -> list[Path]:
    """The `checkpoint-*` folders (complete, partial or `.tmp`) already in `output_dir`."""
    path = Path(output_dir)
    if not path.is_dir():
        return []
    return sorted(p for p in path.glob(f"{CHECKPOINT_PREFIX}*") if p.is_dir())


def check_run_folder(output_dir: Any, resume: Any, overwrite: bool) -> None:
    """Before Ray: `output_dir` is named, not locked by a live run, and a fresh run does not start among another
    run's checkpoints (unless `overwrite`). `RunFolderError` naming the folder and the way out."""
    check_output_dir_named(output_dir)
    RunLock(output_dir).check()
    if resume or overwrite:
        return
    found = previous_checkpoints(output_dir)
    if found:
        names = ", ".join(p.name for p in found[-3:]) + (f" (and {len(found) - 3} more)" if len(found) > 3 else "")
        raise RunFolderError(
            f"output_dir={str(output_dir)!r} holds checkpoints of an earlier run ({names}): continue it with "
            "--resume, start over with --overwrite_output_dir (removes them), or choose another output_dir"
        )


def clear_previous_run(output_dir: str | os.PathLike) -> list[str]:
    """`overwrite_output_dir` on a fresh run: remove the earlier run's checkpoint folders (so that no `--resume`
    continues it); returns their names."""
    removed = []
    for path in previous_checkpoints(output_dir):
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path.name)
    if removed:
        logger.warning("overwrite_output_dir: removed the earlier run's %s", ", ".join(removed))
    return removed


def claim_run_folder(config: TrainerConfig, resume: bool | str | None) -> RunLock:
    """What `train()` does first: `check_run_folder`, take the lock, and with `overwrite_output_dir` on a fresh run
    remove the earlier run's checkpoints. Returns the held lock (released when the run ends; one left by a run
    that failed before it started is stale for any later run: its holder is this process or a dead one)."""
    overwrite = bool(config.overwrite_output_dir)
    check_run_folder(config.output_dir, resume, overwrite)
    lock = RunLock(config.output_dir)
    lock.acquire()
    if overwrite and not resume:
        clear_previous_run(config.output_dir)
    return lock


class RunLock:
    """The lock file of `output_dir` (a context manager: acquired on enter, released on exit)."""

    def __init__(self, output_dir: str | os.PathLike) -> None:
        self.output_dir = Path(output_dir)
        self.path = self.output_dir / LOCK_NAME
        self.held = False

    def holder(self) -> dict[str, Any] | None:
        """The lock file's content ({} when unreadable), or None when there is no lock."""
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return None
        except OSError:
            return {}
        try:
            holder = json.loads(text)
        except json.JSONDecodeError:
            return {}
        return holder if isinstance(holder, dict) else {}

    def is_stale(self, holder: dict[str, Any]) -> bool:
        """A lock whose holder is gone: on this host and its pid no longer exists (or it is this process: a lock an
        earlier run of this process left behind); an unreadable lock is stale as well."""
        pid = holder.get("pid")
        if not isinstance(pid, int) or not holder.get("host"):
            return True
        if holder["host"] != socket.gethostname():
            return False  # its liveness cannot be checked from here
        return pid == os.getpid() or not _pid_alive(pid)

    def _refusal(self, holder: dict[str, Any]) -> RunFolderError:
        return RunFolderError(
            f"output_dir={str(self.output_dir)!r} is in use by another run (host {holder.get('host')}, pid "
            f"{holder.get('pid')}, started {holder.get('started')}; lock {self.path}): wait for it to end, stop it, "
            "or choose another output_dir (delete the lock file only if that run is gone)"
        )

    def check(self) -> None:
        """Raise `RunFolderError` naming the holder if a live run holds the lock (acquires nothing)."""
        holder = self.holder()
        if holder is not None and not self.is_stale(holder):
            raise self._refusal(holder)

    def acquire(self) -> None:
        self.output_dir.mkdir(parents=True, exist_ok=True)
        record = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        }
        for _ in range(2):
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
            except FileExistsError:
                holder = self.holder()
                if holder is None:
                    continue  # released meanwhile
                if not self.is_stale(holder):
                    raise self._refusal(holder) from None
                logger.warning(
                    "taking over the stale lock %s (host %s, pid %s, started %s: that run is gone)",
                    self.path,
                    holder.get("host"),
                    holder.get("pid"),
                    holder.get("started"),
                )
                self.path.unlink(missing_ok=True)
                continue
            with os.fdopen(fd, "w") as f:
                f.write(json.dumps(record) + "\n")
            self.held = True
            return
        raise self._refusal(self.holder() or {})

    def release(self) -> None:
        """Remove the lock if this process holds it."""
        if not self.held:
            return
        self.held = False
        holder = self.holder()
        if holder and holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
            self.path.unlink(missing_ok=True)

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.release()


__all__ = [
    "LOCK_NAME",
    "RunFolderError",
    "RunLock",
    "check_output_dir_named",
    "claim_run_folder",
    "check_run_folder",
    "clear_previous_run",
    "previous_checkpoints",
]
