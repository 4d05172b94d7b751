"""Interruption that loses nothing (rlasync.driver.signals): the step loop stops admitting on a shutdown request,
trains what it took, writes a final checkpoint and raises `RunInterrupted`; `ShutdownGuard` turns SIGINT / SIGTERM /
SIGHUP into that request, exits at once on a second signal or past the grace period (no Ray, milliseconds)."""

import asyncio
import os
import signal
import threading
import time

import pytest

from rlasync.driver.checkpoint import is_complete
from rlasync.driver.signals import SIGNALS, RunInterrupted, ShutdownGuard, ShutdownRequest
from tests.unit.driver.test_step_loop import make_loop


class SignalAt:
    """A callback: request the shutdown (as the signal handler does) at on_step_end of step `step`."""

    def __init__(self, request, step, signum=signal.SIGTERM):
        self.request, self.step, self.signum = request, step, signum

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            self.request.request(self.signum)


def test_a_request_mid_run_trains_no_further_step_saves_a_final_checkpoint_and_raises(tmp_path):
    loop, journal, sink = make_loop(tmp_path, horizon=10, save_steps=100)
    loop.stop_request = request = ShutdownRequest()
    loop.callbacks.append(SignalAt(request, 2))
    with pytest.raises(RunInterrupted) as info:
        asyncio.run(loop.run(0, 0))
    assert info.value.signum == signal.SIGTERM and info.value.exit_code == 143
    assert info.value.checkpoint == str(tmp_path / "checkpoint-2")
    assert is_complete(tmp_path / "checkpoint-2") and not (tmp_path / "checkpoint-2.tmp").exists()
    assert journal.count("train") == 2 and journal.count("take") == 2  # no sample admitted after the signal
    assert [step for step, _ in sink.records] == [1, 2] and sink.closed
    assert "on_train_end" not in journal
    assert "checkpoint-2" in str(info.value) and "--resume" in str(info.value)


def test_a_request_while_the_step_is_half_taken_trains_the_short_step_then_saves(tmp_path):
    loop, journal, _ = make_loop(tmp_path, horizon=10, tokens_per_step=30)  # 3 takes per step
    loop.stop_request = request = ShutdownRequest()
    takes = loop.queue.take

    async def take(token_target, timeout_s):
        taken = await takes(token_target, timeout_s)
        if loop.queue.next_ref == 4:  # the first sample of step 2
            request.request(signal.SIGINT)
        return taken

    loop.queue.take = take
    with pytest.raises(RunInterrupted) as info:
        asyncio.run(loop.run(0, 0))
    assert [len(refs) for refs in loop.learners.trained] == [3, 1]  # the taken sample is trained, none is taken after
    assert info.value.exit_code == 130 and info.value.checkpoint == str(tmp_path / "checkpoint-2")


def test_a_request_before_any_step_names_the_newest_earlier_checkpoint(tmp_path):
    (tmp_path / "checkpoint-4").mkdir()
    (tmp_path / "checkpoint-4" / "trainer_state.json").write_text('{"global_step": 4}')
    loop, journal, _ = make_loop(tmp_path, horizon=10, empty_polls=1000)
    loop.stop_request = request = ShutdownRequest()
    request.request(signal.SIGHUP)
    with pytest.raises(RunInterrupted) as info:
        asyncio.run(loop.run(4, 0))
    assert "train" not in journal and "save" not in journal
    assert info.value.exit_code == 129 and info.value.checkpoint == str(tmp_path / "checkpoint-4")


class Exits:
    def __init__(self):
        self.calls = []
        self.event = threading.Event()

    def __call__(self, signum, why, output_dir):
        self.calls.append((signum, why))
        self.event.set()


def test_the_guard_turns_a_signal_into_a_request_and_a_second_signal_exits_at_once(tmp_path):
    previous = {signum: signal.getsignal(signum) for signum in SIGNALS}
    exits = Exits()
    with ShutdownGuard(30.0, str(tmp_path), exit_now=exits) as guard:
        assert guard.installed
        guard.loop_running = True
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        assert guard.request.signum == signal.SIGTERM and exits.calls == []
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
        assert exits.calls and exits.calls[0][0] == signal.SIGINT and "second signal" in exits.calls[0][1]
    assert {signum: signal.getsignal(signum) for signum in SIGNALS} == previous  # restored


def test_the_guard_exits_once_the_grace_period_is_over(tmp_path):
    exits = Exits()
    with ShutdownGuard(0.2, str(tmp_path), exit_now=exits) as guard:
        guard.loop_running = True
        os.kill(os.getpid(), signal.SIGHUP)
        assert exits.event.wait(5.0)
    assert exits.calls[0][0] == signal.SIGHUP and "shutdown_grace_s=0.2" in exits.calls[0][1]


def test_a_shutdown_that_ends_in_time_cancels_the_grace_exit(tmp_path):
    exits = Exits()
    with ShutdownGuard(0.3, str(tmp_path), exit_now=exits) as guard:
        guard.loop_running = True
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
    assert not exits.event.wait(0.6) and exits.calls == []


def test_before_the_loop_runs_the_signal_raises_at_once(tmp_path):
    with pytest.raises(RunInterrupted) as info, ShutdownGuard(30.0, str(tmp_path), exit_now=Exits()):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(1.0)
    assert info.value.exit_code == 143 and info.value.checkpoint is None
    assert "no checkpoint" in str(info.value)


def test_shutdown_grace_s_must_be_positive():
    from rlasync.config import AsyncGRPOConfig

    assert AsyncGRPOConfig().shutdown_grace_s == 25.0
    with pytest.raises(ValueError, match="shutdown_grace_s=0"):
        AsyncGRPOConfig(shutdown_grace_s=0)


def test_before_the_run_sigterm_and_sighup_raise_like_sigint():
    from rlasync.driver.signals import interrupt_early

    previous = {signum: signal.getsignal(signum) for signum in SIGNALS}
    restore = interrupt_early()
    try:
        with pytest.raises(RunInterrupted) as info:
            os.kill(os.getpid(), signal.SIGHUP)
            time.sleep(1.0)
        assert info.value.exit_code == 129
        assert signal.getsignal(signal.SIGINT) == previous[signal.SIGINT]  # Ctrl-C keeps KeyboardInterrupt
    finally:
        restore()
    assert {signum: signal.getsignal(signum) for signum in SIGNALS} == previous
