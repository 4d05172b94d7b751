"""`kill -9` of a driver that started its own Ray local cluster: every process of that cluster is gone within
seconds (the raylet's agents used to outlive it; actors/reaper.py). Linux only (it reads /proc)."""

import os
import signal
import subprocess
import sys
import time

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.faults]

DRIVER = """
import os, time
import ray
from actors.reaper import start_reaper

ray.init(address="local", include_dashboard=False)  # a cluster of its own, as actors.cluster.connect starts one
start_reaper(ray.get_runtime_context().get_session_name())

@ray.remote(num_cpus=0)
class Pinger:
    def ping(self):
        return os.getpid()

pinger = Pinger.remote()
ray.get(pinger.ping.remote())
print(ray.get_runtime_context().get_session_name(), flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_killed_driver_takes_every_process_of_its_ray_cluster_with_it(tmp_path):
    from actors.reaper import _scan, session_processes

    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    driver = subprocess.Popen([sys.executable, "-c", DRIVER], stdout=subprocess.PIPE, text=True, env=env)
    session = driver.stdout.readline().strip()
    taken = set()
    try:
        assert session.startswith("session_"), session
        time.sleep(2.0)  # the reaper's scans see the agents too
        parents, commands, _ = _scan()
        taken = session_processes(parents, commands, driver.pid, session)
        names = " ".join(commands[pid] for pid in taken)
        assert "raylet" in names and "ray::DashboardAgent" in names and "ray::Pinger" in names, names
        driver.send_signal(signal.SIGKILL)
        driver.wait()
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline and any(_alive(pid) for pid in taken):
            time.sleep(0.2)
        left = [commands[pid][:60] for pid in taken if _alive(pid)]
        assert not left, f"alive 10 s after kill -9 of the driver: {left}"
    finally:
        if driver.poll() is None:
            driver.kill()
        for pid in taken:
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
