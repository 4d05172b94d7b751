"""One run per folder (rlasync.driver.run_lock): the lock file refused while its holder lives and taken over when
stale, no fresh run into another run's checkpoints unless resumed or overwritten, no empty output_dir."""

import json
import os
import socket
import subprocess
import sys

import pytest

from rlasync.driver.run_lock import (
    LOCK_NAME,
    RunFolderError,
    RunLock,
    check_run_folder,
    claim_run_folder,
)


def dead_pid():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.fixture
def other_process():
    """A live process on this host that is not this one (the holder of another run's lock)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    yield proc.pid
    proc.kill()
    proc.wait()


def write_lock(folder, **holder):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / LOCK_NAME).write_text(json.dumps(holder))


def test_the_lock_records_its_holder_and_is_removed_on_release(tmp_path):
    with RunLock(tmp_path / "run") as lock:
        holder = json.loads(lock.path.read_text())
        assert holder["host"] == socket.gethostname() and holder["pid"] == os.getpid() and holder["started"]
    assert not (tmp_path / "run" / LOCK_NAME).exists()


def test_a_live_holder_refuses_the_second_run_naming_it(tmp_path, other_process):
    write_lock(tmp_path, host=socket.gethostname(), pid=other_process, started="2026-01-01T00:00:00+00:00")
    with pytest.raises(RunFolderError, match=rf"in use by another run \(host .*, pid {other_process}, started 2026"):
        RunLock(tmp_path).acquire()
    with pytest.raises(RunFolderError, match="in use by another run"):
        check_run_folder(tmp_path, resume=True, overwrite=False)
    assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == other_process  # the holder's lock untouched


def test_a_holder_on_another_host_is_not_second_guessed(tmp_path):
    write_lock(tmp_path, host="some-other-node", pid=1, started="x")
    with pytest.raises(RunFolderError, match="host some-other-node"):
        RunLock(tmp_path).acquire()


@pytest.mark.parametrize("holder", ["dead", "garbage"])
def test_a_stale_lock_is_taken_over(tmp_path, holder, caplog):
    if holder == "dead":
        write_lock(tmp_path, host=socket.gethostname(), pid=dead_pid(), started="x")
    else:
        (tmp_path / LOCK_NAME).write_text("{not json")
    check_run_folder(tmp_path, resume=None, overwrite=False)
    with caplog.at_level("WARNING"), RunLock(tmp_path) as lock:
        assert json.loads(lock.path.read_text())["pid"] == os.getpid()
    assert "taking over the stale lock" in caplog.text


def test_a_fresh_run_into_another_runs_checkpoints_is_refused_unless_resumed_or_overwritten(tmp_path):
    (tmp_path / "checkpoint-5").mkdir()
    (tmp_path / "checkpoint-5" / "trainer_state.json").write_text('{"global_step": 5}')
    with pytest.raises(RunFolderError, match=r"holds checkpoints of an earlier run \(checkpoint-5\).*--resume.*"):
        check_run_folder(tmp_path, resume=None, overwrite=False)
    check_run_folder(tmp_path, resume=True, overwrite=False)
    check_run_folder(tmp_path, resume=None, overwrite=True)


def test_overwrite_removes_the_earlier_checkpoints_once_the_lock_is_held(tmp_path):
    from rlasync.config import AsyncGRPOConfig

    for name in ("checkpoint-2", "checkpoint-4", "checkpoint-6.tmp"):
        (tmp_path / name).mkdir()
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n')
    config = AsyncGRPOConfig(output_dir=str(tmp_path), overwrite_output_dir=True)
    lock = claim_run_folder(config, resume=None)
    try:
        assert not list(tmp_path.glob("checkpoint-*")) and lock.held
    finally:
        lock.release()


@pytest.mark.parametrize("output_dir", ["", "  "])
def test_an_empty_output_dir_is_refused(output_dir):
    with pytest.raises(RunFolderError, match="output_dir=.* is empty"):
        check_run_folder(output_dir, resume=None, overwrite=False)
