"""Interruption that loses nothing: SIGINT, SIGTERM and SIGHUP of the driver end the run with a final checkpoint.

    signal (1st)  ->  the step loop stops admitting: it trains what it has already taken (or nothing), writes a
                      complete checkpoint, the actors are torn down, and `train()` raises `RunInterrupted`
                      (the CLI prints where the checkpoint is and exits 128 + the signal number)
    grace period  ->  `shutdown_grace_s` after the first signal the process exits at once (128 + signal), naming
                      the newest complete checkpoint, whatever the shutdown was still doing
    signal (2nd)  ->  exits at once (128 + signal)

`ShutdownGuard` installs the handlers, and must be entered after `ray.init()`: the Ray core worker installs a C++
failure handler for SIGTERM when the driver connects (it prints a stack dump and kills the driver), which a Python
handler installed before `ray.init()` does not survive. The previous handlers are restored on exit. Outside the
main thread (where Python cannot install handlers) the guard does nothing.

Before the step loop runs (actors being built), the first signal raises `RunInterrupted` at once (like Ctrl-C's
`KeyboardInterrupt`): there is nothing to save yet. Pure Python: no Ray.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, name))
"""The signals that end a run gracefully."""


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


class RunInterrupted(KeyboardInterrupt):
    """The run stopped on a signal. `signum`; `checkpoint`: the newest complete checkpoint to resume from (None if
    none exists); `exit_code`: 128 + signum. A `KeyboardInterrupt`, so code that handles Ctrl-C handles it."""

    def __init__(self, signum: int, checkpoint: str | None = None, output_dir: str | None = None) -> None:
        self.signum, self.checkpoint, self.output_dir = signum, checkpoint, output_dir
        super().__init__(self.message())

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    def message(self) -> str:
        where = (
            f"final checkpoint {self.checkpoint}; resume with --resume"
            if self.checkpoint
            else f"no checkpoint was written (nothing trained yet{' in ' + self.output_dir if self.output_dir else ''})"
        )
        return f"interrupted by {signal_name(self.signum)}: {where}"


class ShutdownRequest:
    """Set by the first signal; the step loop polls `requested` (and awaits `wait()`) and stops admitting."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self.received_at: float | None = None

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def request(self, signum: int) -> None:
        if self.signum is None:
            self.signum, self.received_at = signum, time.monotonic()

    async def wait(self, poll_s: float = 0.2) -> int:
        """Return the signal number once a shutdown is requested."""
        while self.signum is None:
            await asyncio.sleep(poll_s)
        return self.signum


def newest_checkpoint(output_dir: str | os.PathLike | None) -> str | None:
    """The newest complete `checkpoint-N` in `output_dir`, or None."""
    if not output_dir:
        return None
    from rlasync.driver.checkpoint import Checkpointer

    complete = Checkpointer(output_dir).complete_checkpoints()
    return str(complete[-1]) if complete else None


def _exit_now(signum: int, why: str, output_dir: str | None) -> None:
    checkpoint = newest_checkpoint(output_dir)
    where = f"newest complete checkpoint: {checkpoint}" if checkpoint else "no complete checkpoint"
    try:
        sys.stderr.write(f"error: {why}; exiting now ({where})\n")
        sys.stderr.flush()
    finally:
        os._exit(128 + signum)


class ShutdownGuard:
    """A context manager: while entered, SIGINT / SIGTERM / SIGHUP request a graceful shutdown (`request`), a second
    signal or the end of `grace_s` exits the process at once. `loop_running` is set by the caller while the step
    loop runs; before that, the first signal raises `RunInterrupted` where the main thread is."""

    def __init__(
        self,
        grace_s: float,
        output_dir: str | None = None,
        *,
        exit_now: Callable[[int, str, str | None], None] = _exit_now,
    ) -> None:
        self.grace_s, self.output_dir = grace_s, output_dir
        self.request = ShutdownRequest()
        self.loop_running = False
        self.installed = False
        self._previous: dict[int, Any] = {}
        self._timer: threading.Timer | None = None
        self._exit_now = exit_now

    def __enter__(self) -> ShutdownGuard:
        if threading.current_thread() is not threading.main_thread():
            logger.info("not in the main thread: signals keep their handlers (no graceful shutdown on SIGTERM)")
            return self
        for signum in SIGNALS:
            self._previous[signum] = signal.getsignal(signum)
            signal.signal(signum, self._handle)
        self.installed = True
        return self

    def __exit__(self, *exc: Any) -> None:
        self.uninstall()

    def uninstall(self) -> None:
        """Restore the previous handlers and cancel the grace timer (the shutdown finished in time)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self.installed:
            for signum, previous in self._previous.items():
                signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
            self.installed = False

    def _handle(self, signum: int, frame: Any) -> None:
        name = signal_name(signum)
        if self.request.requested:
            self._exit_now(signum, f"second signal ({name}) during the shutdown", self.output_dir)
            return
        self.request.request(signum)
        self._timer = threading.Timer(
            self.grace_s,
            self._exit_now,
            (signum, f"the shutdown took longer than shutdown_grace_s={self.grace_s:g}", self.output_dir),
        )
        self._timer.daemon = True
        self._timer.start()
        sys.stderr.write(
            f"{name} received: stopping after the step in flight and writing a final checkpoint "
            f"(at most {self.grace_s:g} s; a second signal exits at once)\n"
        )
        sys.stderr.flush()
        if not self.loop_running:
            raise RunInterrupted(signum, newest_checkpoint(self.output_dir), self.output_dir)


def interrupt_early(signals: tuple[int, ...] = tuple(s for s in SIGNALS if s != signal.SIGINT)) -> Callable[[], None]:
    """Before a run's `ShutdownGuard` (the CLI reading the config, preflight): SIGTERM and SIGHUP raise
    `RunInterrupted` (exit 128 + signal) where the main thread is, as SIGINT raises `KeyboardInterrupt`. Returns a
    function that restores the previous handlers."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def _raise(signum: int, frame: Any) -> None:
        raise RunInterrupted(signum)

    previous = {signum: signal.getsignal(signum) for signum in signals}
    for signum in signals:
        signal.signal(signum, _raise)

    def restore() -> None:
        for signum, handler in previous.items():
            signal.signal(signum, handler if handler is not None else signal.SIG_DFL)

    return restore


def interrupted_error(request: ShutdownRequest, checkpoint: str | None, output_dir: str | None) -> RunInterrupted:
    """The `RunInterrupted` a step loop raises after its final checkpoint (`checkpoint`, else the newest one)."""
    assert request.signum is not None
    if checkpoint is None:
        checkpoint = newest_checkpoint(output_dir)
    return RunInterrupted(request.signum, checkpoint, output_dir)


__all__ = [
    "SIGNALS",
    "RunInterrupted",
    "ShutdownGuard",
    "ShutdownRequest",
    "interrupt_early",
    "interrupted_error",
    "newest_checkpoint",
    "signal_name",
]
