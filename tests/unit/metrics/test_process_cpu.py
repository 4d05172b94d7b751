"""ProcessCpu: CPU seconds per wall second between readings, against a busy loop and a sleep."""

import threading
import time

from rlasync.metrics.process_cpu import ProcessCpu


def _spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def test_a_busy_thread_reads_near_one_core_and_a_sleep_near_zero():
    meter = ProcessCpu()
    _spin(0.3)
    busy = meter.take()
    time.sleep(0.3)
    idle = meter.take()
    assert busy > 0.6  # one thread spinning (a shared CI core may lend less than all of it)
    assert idle < 0.2
    assert busy > 3 * idle


def test_every_thread_of_the_process_counts():
    meter = ProcessCpu()
    threads = [threading.Thread(target=_spin, args=(0.3,)) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    both = meter.take()
    assert both > 0.6  # two threads under one GIL: about one core, whatever the machine
    time.sleep(0.3)
    assert meter.take() < 0.2  # the reading reset: the spinning before it is not counted again
