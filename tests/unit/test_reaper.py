"""actors/reaper.py: which processes a dead driver takes with it (the Ray session's, never others)."""

import os
import signal
import subprocess
import sys
import time

import pytest

import actors.reaper as reaper_module
from actors.reaper import session_processes


def test_only_the_session_processes_under_the_driver_and_their_descendants_are_taken():
    parents = {10: 1, 11: 10, 12: 11, 13: 12, 20: 10, 21: 20, 30: 1, 31: 30, 40: 10}
    commands = {
        10: "python train.py",
        11: "raylet --session-name=session_x",
        12: "ray::DashboardAgent",  # rewritten title: taken because its parent is the session's
        13: "ray::IDLE",
        20: "vllm serve m",  # the user's own child: not Ray's
        21: "python worker",
        30: "raylet --session-name=session_x",  # another driver's tree
        31: "ray::RuntimeEnvAgent",
        40: "gcs_server --session-name=session_y",  # another session of the same driver
    }
    assert session_processes(parents, commands, 10, "session_x") == {11, 12, 13}
    assert session_processes(parents, commands, 10, "session_y") == {40}
    assert session_processes(parents, commands, 99, "session_x") == set()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_dead_driver_takes_its_recorded_session_processes():
    """A stand-in driver with a session child that ignores SIGTERM and an unrelated child: once the driver is killed
    the reaper script kills the session child, leaves the other alone and exits."""
    script = (
        "import subprocess, sys, time\n"
        "ray = subprocess.Popen([sys.executable, '-c', 'import signal, time; signal.signal(signal.SIGTERM, "
        "signal.SIG_IGN); time.sleep(60)', 'session_test_reaper'])\n"
        "other = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "print(ray.pid, other.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    driver = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    ray_pid, other_pid = map(int, driver.stdout.readline().split())
    reaper = subprocess.Popen([sys.executable, reaper_module.__file__, str(driver.pid), "session_test_reaper"])
    try:
        time.sleep(2.0)  # the reaper's scans record the session child
        assert reaper.poll() is None and not _gone(ray_pid, wait_s=0)
        driver.kill()
        driver.wait()
        assert reaper.wait(15) == 0
        assert _gone(ray_pid) and not _gone(other_pid, wait_s=0)
    finally:
        for process in (driver, reaper):
            if process.poll() is None:
                process.kill()
        for pid in (ray_pid, other_pid):
            if not _gone(pid, wait_s=0):
                os.kill(pid, signal.SIGKILL)


def _gone(pid: int, wait_s: float = 5.0) -> bool:
    for _ in range(max(int(wait_s / 0.1), 1)):
        try:
            state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.1)
    return False
