"""Run a model-written Python program in a fresh, locked-down child process (docs/rewards.md §1 for what this
protects against and what it does not).

Mechanism: bubblewrap (`bwrap`, the sandbox Flatpak uses; `apt-get install bubblewrap`). Each execution gets

- new network, PID, IPC, UTS and cgroup namespaces: no network at all (only a loopback of its own), its own process
  table (when its first process ends, the kernel kills every process left in the namespace), `--die-with-parent`;
- a file system of read-only `/usr` (and the interpreter's prefix), a fresh `/proc` and `/dev`, and one private
  temporary directory, mounted at `/sandbox` (the working directory) and `/tmp`: the only writable place. Nothing
  else of the host (not `/etc`, `/home`, `/root`, the trainer's working directory) exists inside;
- an empty environment (PATH, HOME=/sandbox, LANG, thread-count variables only: none of the trainer's variables);
- resource limits set before the program runs: CPU seconds, address space, size of any written file, open files,
  processes (RLIMIT_NPROC; counted per user, so see below), and no core dumps; the parent enforces the wall-clock
  limit and the output limit (stdout + stderr bytes) by killing the whole process group;
- no way to gain privileges: bwrap sets `no_new_privs`, and the program never runs as root. When the trainer runs
  as root (containers, CI) bwrap runs without a user namespace, keeps only CAP_SETUID/CAP_SETGID, and the harness
  switches to a random unprivileged uid (a fresh one per execution, so the process limit is per execution and
  nothing of one execution can signal another); otherwise bwrap maps the trainer's uid to uid 65534 in a new
  user namespace, where the kernel counts processes per namespace.

Without a working bwrap, `Sandbox.run` raises `SandboxUnavailableError` (what to install or allow) unless the
sandbox was built with `allow_unsandboxed=True`: then the program runs as a plain child (same limits, environment
and working directory, its own session) with a warning, and it can reach the network and the host's files.

Concurrency: executions hold a slot of a per-process semaphore (`max_concurrent`, default min(4, CPUs)), so a
RewardActor process never runs more sandboxes at once. Both choices are fields of the `Sandbox`, which travels with
the reward function (or tool) to the actor that runs it; no environment variable is read.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import os
import random
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

SANDBOX_DIR = "/sandbox"
"""Where the private temporary directory is mounted inside the sandbox (also mounted at /tmp)."""
_HARNESS = (Path(__file__).with_name("harness.py")).read_text(encoding="utf-8")
_NOBODY = 65534
_SANDBOX_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": SANDBOX_DIR,
    "TMPDIR": SANDBOX_DIR,
    "LANG": "C.UTF-8",
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONIOENCODING": "utf-8",
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}
_INSTALL_HINT = (
    "install bubblewrap (Debian/Ubuntu: `apt-get install bubblewrap`; Fedora/RHEL: `dnf install bubblewrap`; "
    "conda-forge: `conda install bubblewrap`)"
)


class SandboxUnavailableError(RuntimeError):
    """No working sandbox on this machine and unsandboxed execution was not allowed; the message says what to do."""


@dataclass(frozen=True, slots=True)
class Limits:
    """Per-execution limits (one program with all its tests, or one stdin/stdout case).

    cpu_s:         CPU seconds of each process (RLIMIT_CPU; rounded up to whole seconds): SIGXCPU, then SIGKILL
    wall_s:        wall-clock seconds from start to the kill of the whole process group
    memory_mb:     address space of each process (RLIMIT_AS), in MiB
    processes:     processes and threads the program may have at once (RLIMIT_NPROC)
    output_bytes:  stdout + stderr bytes kept; producing more kills the program
    file_mb:       the largest file the program may write (RLIMIT_FSIZE), in MiB
    open_files:    open file descriptors per process (RLIMIT_NOFILE)
    """

    cpu_s: float = 2.0
    wall_s: float = 5.0
    memory_mb: int = 1024
    processes: int = 32
    output_bytes: int = 1_000_000
    file_mb: int = 16
    open_files: int = 64

    def __post_init__(self) -> None:
        for spec in dataclasses.fields(self):
            value = getattr(self, spec.name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"Limits.{spec.name}={value!r}: must be a positive number")
        if self.processes < 2:
            raise ValueError(f"Limits.processes={self.processes}: needs at least 2 (the harness and the program)")
        if self.memory_mb < 64:
            raise ValueError(f"Limits.memory_mb={self.memory_mb}: the interpreter needs at least 64 MiB")

    def for_harness(self) -> dict[str, int]:
        return {
            "cpu_s": max(1, math.ceil(self.cpu_s)),
            "memory_bytes": int(self.memory_mb) << 20,
            "file_bytes": int(self.file_mb) << 20,
            "open_files": int(self.open_files),
            "processes": int(self.processes),
        }


@dataclass(frozen=True, slots=True)
class Execution:
    """What one execution did.

    status:     "ok" (exit 0), "error" (another exit status), "timeout" (wall or CPU limit), "output_limit",
                "killed" (another signal, e.g. the memory limit hit inside native code)
    returncode: the exit status (negative: the signal), None if it could not be read
    stdout / stderr: the output, decoded as UTF-8 with replacement, cut at `Limits.output_bytes` in all
    passed:     indices of the tests that passed (tests mode), in order
    wall_s:     seconds from start to the end of the process group
    """

    status: str
    returncode: int | None
    stdout: str
    stderr: str
    passed: tuple[int, ...] = ()
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclass(frozen=True)
class Sandbox:
    """How to run programs: the limits, the interpreter, and whether running without a sandbox is allowed.

    python:            the interpreter inside the sandbox (default: this process's `sys.executable`); its
                       prefix is mounted read-only, so its installed packages can be imported
    allow_unsandboxed: with no working bubblewrap, run programs as plain child processes (with a warning) instead
                       of raising `SandboxUnavailableError`; the program can then use the network and read the host
    max_concurrent:    executions at once in this process, shared by every Sandbox with the same value
                       (None: min(4, the machine's CPUs))
    """

    limits: Limits = field(default_factory=Limits)
    python: str | None = None
    allow_unsandboxed: bool = False
    max_concurrent: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.limits, Limits):
            raise ValueError(f"Sandbox.limits={self.limits!r}: pass a rlasync.rewards.code.Limits(...)")
        if self.max_concurrent is not None and (
            isinstance(self.max_concurrent, bool) or not isinstance(self.max_concurrent, int) or self.max_concurrent < 1
        ):
            raise ValueError(f"Sandbox.max_concurrent={self.max_concurrent!r}: must be a positive integer or None")

    @property
    def interpreter(self) -> str:
        return self.python or sys.executable

    def mechanism(self) -> str:
        """How programs run here: "bwrap" (as root: no user namespace, a random uid per run), "bwrap-userns", or
        "unsandboxed" when allowed; raises `SandboxUnavailableError` otherwise (probed once per process)."""
        found, reason = _probe(self.interpreter)
        if found:
            return found
        if self.allow_unsandboxed:
            _warn_unsandboxed(reason)
            return "unsandboxed"
        raise SandboxUnavailableError(
            f"cannot run code in a sandbox: {reason}. Either fix that, or build the reward/tool with "
            f"Sandbox(allow_unsandboxed=True) to run model-written programs WITHOUT "
            "isolation (network and host files reachable; only resource limits apply)"
        )

    def run(self, program: str, *, tests: Sequence[str] | None = None, stdin: str | None = None) -> Execution:
        """Run `program`: as a script (with `stdin`, default empty) when `tests` is None, else load it and run
        each test statement after it (`Execution.passed` lists the tests that passed)."""
        mechanism = self.mechanism()
        with _slots(self.max_concurrent):
            return _execute(self, mechanism, program, None if tests is None else list(tests), stdin)


def default_concurrency() -> int:
    """Executions at once per process when a Sandbox names none: min(4, CPUs)."""
    return max(1, min(4, os.cpu_count() or 1))


_slots_lock = threading.Lock()
_slot_semaphores: dict[int, threading.BoundedSemaphore] = {}


def _slots(max_concurrent: int | None) -> threading.BoundedSemaphore:
    size = max_concurrent or default_concurrency()
    with _slots_lock:
        if size not in _slot_semaphores:
            _slot_semaphores[size] = threading.BoundedSemaphore(size)
        return _slot_semaphores[size]


_warned = False


def _warn_unsandboxed(reason: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        message = (
            f"running model-written code WITHOUT a sandbox (allow_unsandboxed=True; {reason}): it can use the "
            "network and read and write the host's files; only CPU, memory, process, file-size, output and wall "
            "limits apply"
        )
        warnings.warn(message, RuntimeWarning, stacklevel=3)
        logger.warning(message)


@functools.lru_cache(maxsize=8)
def _probe(python: str) -> tuple[str | None, str]:
    """(mechanism, "") when bwrap runs `python` here, else (None, why not + what to do). Cached per process."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        return None, f"bubblewrap (bwrap) is not installed: {_INSTALL_HINT}"
    if not os.path.exists(python):
        return None, f"the interpreter {python!r} does not exist"
    mechanism = "bwrap" if os.geteuid() == 0 else "bwrap-userns"
    workdir = _make_dir()
    try:
        argv = _bwrap_argv(bwrap, mechanism, python, workdir) + ["-I", "-c", "print('sandbox-ok')"]
        try:
            done = subprocess.run(argv, capture_output=True, timeout=60, env=_SANDBOX_ENV, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return None, f"bwrap failed to start: {type(exc).__name__}: {exc}"
        if done.returncode == 0 and done.stdout.strip() == b"sandbox-ok":
            return mechanism, ""
        error = done.stderr.decode(errors="replace").strip()[-500:]
        hint = (
            "the interpreter could not be started inside the sandbox (it and its libraries must live under /usr or "
            "its own prefix; pass Sandbox(python=...) another one)"
            if "execvp" in error
            else "user namespaces look disabled: allow them (`sysctl -w kernel.unprivileged_userns_clone=1`, "
            "`user.max_user_namespaces` > 0; in Docker/Kubernetes a seccomp/AppArmor profile that allows "
            "`unshare`), or run the trainer as root in the container"
            if mechanism == "bwrap-userns"
            else "the container may forbid new namespaces: run it with CAP_SYS_ADMIN (`--cap-add SYS_ADMIN`, "
            "`--security-opt seccomp=unconfined`) or `--privileged`"
        )
        return None, f"bwrap cannot start a sandbox here (exit {done.returncode}: {error!r}); {hint}"
    finally:
        _remove_tree(workdir)


def _bwrap_argv(bwrap: str, mechanism: str, python: str, workdir: str) -> list[str]:
    argv = [bwrap, "--die-with-parent", "--new-session", "--unshare-ipc", "--unshare-pid", "--unshare-net"]
    argv += ["--unshare-uts", "--unshare-cgroup-try", "--hostname", "sandbox"]
    if mechanism == "bwrap":  # as root: no user namespace; the harness switches to an unprivileged uid
        argv += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        argv += ["--unshare-user", "--uid", str(_NOBODY), "--gid", str(_NOBODY)]
    argv += ["--ro-bind", "/usr", "/usr"]
    for top in ("bin", "sbin", "lib", "lib64", "lib32", "libx32"):
        path = Path("/") / top
        if path.is_symlink():
            argv += ["--symlink", os.readlink(path), str(path)]
        elif path.is_dir():
            argv += ["--ro-bind", str(path), str(path)]
    argv += ["--proc", "/proc", "--dev", "/dev"]
    argv += ["--bind", workdir, SANDBOX_DIR, "--bind", workdir, "/tmp", "--clearenv"]
    made = {"/tmp", SANDBOX_DIR, "/usr", "/proc", "/dev"}  # mount points already: left as they are
    for prefix in _interpreter_dirs(python):  # after /tmp, so that an interpreter under /tmp stays visible
        for parent in reversed(Path(prefix).parents[:-1]):  # readable parents, e.g. under a 0700 /root
            if str(parent) not in made:
                made.add(str(parent))
                argv += ["--perms", "0755", "--dir", str(parent)]
        argv += ["--ro-bind", prefix, prefix]
    for name, value in _SANDBOX_ENV.items():
        argv += ["--setenv", name, value]
    return argv + ["--", python]


def _interpreter_dirs(python: str) -> list[str]:
    """The directories the interpreter needs, outside /usr: its prefix (and a venv's base), and the directory of
    the real executable when the given path is a link."""
    dirs: list[str] = []
    if os.path.realpath(python) == os.path.realpath(sys.executable):
        dirs += [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]
    else:
        dirs.append(str(Path(python).parent.parent))
    dirs += [str(Path(os.path.realpath(python)).parent.parent), str(Path(python).parent)]
    unique: list[str] = []
    for directory in dirs:
        directory = os.path.normpath(directory)
        covered = any(directory == kept or directory.startswith(kept + os.sep) for kept in ["/usr", *unique])
        if not covered and directory not in ("/", "/bin", "/lib", "/lib64", "/sbin"):
            unique = [kept for kept in unique if not kept.startswith(directory + os.sep)] + [directory]
    return unique


def _execute(sandbox: Sandbox, mechanism: str, program: str, tests: list[str] | None, stdin: str | None) -> Execution:
    limits = sandbox.limits
    outer = _make_dir()  # 0700, the trainer's: no other host user gets in
    workdir = os.path.join(outer, "box")
    try:
        os.mkdir(workdir, 0o700)
        inside = SANDBOX_DIR if mechanism != "unsandboxed" else workdir
        Path(workdir, "program.py").write_text(program, encoding="utf-8")
        config: dict = {"limits": limits.for_harness(), "program": f"{inside}/program.py", "uid": None, "cwd": inside}
        config["mode"], config["tests"] = ("script", []) if tests is None else ("tests", tests)
        if stdin:
            Path(workdir, "stdin.txt").write_text(stdin, encoding="utf-8")
            config["stdin"] = f"{inside}/stdin.txt"
        if mechanism == "bwrap":
            uid = random.SystemRandom().randrange(1 << 20, 1 << 30)
            config["uid"] = uid
            os.chown(workdir, uid, uid)
            os.chmod(workdir, 0o711)  # root without capabilities (bwrap, before the switch) may pass through it
        if mechanism == "unsandboxed":
            env = dict(_SANDBOX_ENV, HOME=workdir, TMPDIR=workdir)
            argv = [sandbox.interpreter, "-I", "-c", _HARNESS]
        else:
            env = _SANDBOX_ENV
            argv = _bwrap_argv(shutil.which("bwrap") or "bwrap", mechanism, sandbox.interpreter, workdir)
            argv += ["-I", "-c", _HARNESS]
        return _supervise(argv, env, workdir, config, limits, bwrap=mechanism != "unsandboxed")
    finally:
        _remove_tree(outer)


def _supervise(
    argv: list[str], env: dict[str, str], cwd: str, config: dict, limits: Limits, *, bwrap: bool
) -> Execution:
    """Start the process group, feed the configuration, collect output until EOF, exit or a limit; always end
    by killing the whole group (and, under bwrap, waiting until every process of the sandbox is gone)."""
    results_read, results_write = os.pipe()
    info_read, info_write = os.pipe()
    if bwrap:  # bwrap writes {"child-pid": N} there: N is the init of the sandbox's PID namespace
        argv = [argv[0], "--info-fd", str(info_write), *argv[1:]]
    start = time.monotonic()
    try:
        process = subprocess.Popen(
            argv,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=(results_write, info_write),
            cwd=cwd,
            env=env,
            start_new_session=True,  # its own process group: killed as a whole
            close_fds=True,
        )
    except BaseException:
        os.close(results_read)
        os.close(info_read)
        raise
    finally:
        os.close(results_write)
        os.close(info_write)
    config = dict(config, results_fd=results_write)  # pass_fds keeps the number; bwrap passes it through
    status = None
    streams = {"stdout": bytearray(), "stderr": bytearray(), "results": bytearray(), "info": bytearray()}
    try:
        try:
            process.stdin.write(json.dumps(config).encode())
            process.stdin.close()
        except OSError:
            pass
        status = _collect(process, {"results": results_read, "info": info_read}, streams, limits, start)
    finally:
        sandbox_init = _sandbox_init(bytes(streams["info"]), info_read)
        _kill_group(process, sandbox_init)
        if bwrap:  # bwrap's forked child may outlive it when its set-up was cut short (`_kill_strays`)
            _kill_strays(cwd)
        os.close(results_read)
        os.close(info_read)
        for pipe in (process.stdout, process.stderr):
            pipe.close()
    wall_s = time.monotonic() - start
    returncode = process.returncode
    if status is None:
        status = _status(returncode)
    return Execution(
        status=status,
        returncode=returncode,
        stdout=bytes(streams["stdout"]).decode("utf-8", errors="replace"),
        stderr=bytes(streams["stderr"]).decode("utf-8", errors="replace"),
        passed=_passed(bytes(streams["results"])),
        wall_s=wall_s,
    )


def _collect(
    process: subprocess.Popen, fds: dict[str, int], streams: dict[str, bytearray], limits: Limits, start: float
) -> str | None:
    """Read stdout, stderr, the results and the bwrap info pipes until all reach EOF; "timeout" or
    "output_limit" when a limit ends it first (the caller kills the group)."""
    deadline = start + limits.wall_s
    selector = selectors.DefaultSelector()
    selector.register(process.stdout, selectors.EVENT_READ, "stdout")
    selector.register(process.stderr, selectors.EVENT_READ, "stderr")
    for name, fd in fds.items():
        selector.register(fd, selectors.EVENT_READ, name)
    output = 0
    try:
        while selector.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return "timeout"
            for key, _ in selector.select(timeout=min(remaining, 0.5)):
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    selector.unregister(key.fileobj)
                    continue
                if key.data in fds:
                    if len(streams[key.data]) < 1_000_000:
                        streams[key.data] += chunk
                    continue
                keep = max(0, limits.output_bytes - output)
                streams[key.data] += chunk[:keep]
                output += len(chunk)
                if output > limits.output_bytes:
                    return "output_limit"
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return "timeout"
        return None
    finally:
        selector.close()


def _sandbox_init(info: bytes, info_fd: int) -> int | None:
    """The host pid of the sandbox's first process (its PID namespace's init), from bwrap's --info-fd."""
    try:
        os.set_blocking(info_fd, False)
        while chunk := os.read(info_fd, 65536):
            info += chunk
    except (BlockingIOError, OSError):
        pass
    try:
        pid = json.loads(info.decode() or "{}").get("child-pid")
    except (ValueError, AttributeError):
        return None
    return pid if isinstance(pid, int) and pid > 1 else None


def _kill_group(process: subprocess.Popen, sandbox_init: int | None) -> None:
    """Kill everything the execution started. Under bwrap, killing the namespace's init first makes the kernel
    kill and reap every process in the namespace before bwrap (its parent, still alive, so the pid cannot have
    been reused) sees it exit: once `process` is waited for, nothing of the sandbox is left."""
    if sandbox_init is not None and process.poll() is None:
        try:
            os.kill(sandbox_init, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:  # pragma: no cover - a process stuck in the kernel
            logger.warning("sandbox %d did not end 10 s after its init was killed", process.pid)
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:  # pragma: no cover - a process stuck in the kernel
        logger.warning("sandbox process %d did not exit 10 s after SIGKILL", process.pid)


def _kill_strays(workdir: str, wait_s: float = 10.0) -> None:
    """SIGKILL what bwrap executions on this machine left behind, from one scan of /proc per pass: every process
    naming `workdir` (this execution's own folder, bound into the sandbox on bwrap's command line), waiting until
    none is left, and every process whose sandbox folders all belong to executions that are over (an orphan),
    killed without waiting.

    bwrap's forked child waits on an eventfd for its parent before it arms its parent-death signal, so a child
    whose parent dies during set-up waits forever: when this process kills an execution then (a limit hit under
    load), and when the process that started the execution is itself killed then (a RewardActor removed by
    `ray.kill` mid-execution: `--die-with-parent` ends bwrap, not yet its child). An execution is over once its
    folder is gone or the process that made it is dead; folders are named `rlasync-sandbox-<pid namespace>-<pid>-*`,
    and only this PID namespace's are looked at. A scan costs ~10 us per process on the host."""
    prefix = os.fsencode(os.path.join(tempfile.gettempdir(), f"{_DIR_PREFIX}{_pid_namespace()}-"))
    own = os.fsencode(workdir)
    deadline = time.monotonic() + wait_s
    while True:
        strays = []
        for pid, args in _processes_naming(b"\0" + prefix):
            if pid == os.getpid():
                continue
            if own in args:
                strays.append(pid)
            elif all(_execution_over(arg[len(prefix) :], arg) for arg in args if arg.startswith(prefix)):
                _kill(pid)
        if not strays:
            return
        for pid in strays:
            _kill(pid)
        if time.monotonic() >= deadline:  # pragma: no cover - a process stuck in the kernel
            logger.warning("sandbox processes %s did not exit %.0f s after SIGKILL", strays, wait_s)
            return
        time.sleep(0.01)


def _execution_over(name: bytes, path: bytes) -> bool:
    """Whether the execution whose folder is `path` (named `<pid>-<random>[/...]` after the prefix) is over: the
    folder is gone, or the process that made it is dead."""
    return not os.path.exists(path) or _maker_dead(os.fsdecode(name))


def _maker_dead(name: str) -> bool:
    """Whether the process that made a sandbox folder is dead; `name` is the folder's name after
    `rlasync-sandbox-<pid namespace>-`: `<pid>-<random>[/...]`."""
    pid = name.split("-", 1)[0]
    if not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except OSError:
        pass  # alive (another user's process)
    return False


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _processes_naming(needle: bytes) -> list[tuple[int, list[bytes]]]:
    """The live (not zombie) processes whose NUL-separated command line contains `needle`, with their arguments."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/cmdline", "rb") as handle:
                cmdline = b"\0" + handle.read()
            if needle not in cmdline:
                continue
            with open(f"/proc/{entry.name}/stat", "rb") as handle:
                if handle.read().rsplit(b")", 1)[-1].split()[0] == b"Z":  # exited; its parent reaps it
                    continue
        except OSError:
            continue
        found.append((int(entry.name), cmdline[1:].split(b"\0")))
    return found


def _status(returncode: int | None) -> str:
    """The status of a group that ended by itself (bwrap reports a child killed by signal N as exit 128 + N)."""
    if returncode == 0:
        return "ok"
    if returncode is None:
        return "killed"
    signal_number = -returncode if returncode < 0 else returncode - 128 if returncode > 128 else 0
    if signal_number == signal.SIGXCPU:
        return "timeout"
    return "killed" if signal_number else "error"


def _passed(results: bytes) -> tuple[int, ...]:
    passed: set[int] = set()
    for line in results.decode("ascii", errors="replace").splitlines():
        parts = line.split()
        if len(parts) >= 2 and parts[0].isdigit() and parts[1] == "pass":
            passed.add(int(parts[0]))
    return tuple(sorted(passed))


_DIR_PREFIX = "rlasync-sandbox-"
_SWEEP_EVERY_S = 30.0
_sweep_lock = threading.Lock()
_last_sweep = [-math.inf]


def _make_dir() -> str:
    """A fresh private directory `rlasync-sandbox-<pid namespace>-<pid>-<random>` in the temporary directory; at
    most every 30 s, first remove those of dead processes of this PID namespace (a reward actor killed mid-run)."""
    namespace = _pid_namespace()
    with _sweep_lock:
        due = time.monotonic() - _last_sweep[0] >= _SWEEP_EVERY_S
        if due:
            _last_sweep[0] = time.monotonic()
    if due:
        _sweep(namespace)
    return tempfile.mkdtemp(prefix=f"{_DIR_PREFIX}{namespace}-{os.getpid()}-")


def _pid_namespace() -> str:
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return "0"


def _sweep(namespace: str) -> None:
    for path in Path(tempfile.gettempdir()).glob(f"{_DIR_PREFIX}{namespace}-*-*"):
        if _maker_dead(path.name[len(_DIR_PREFIX) + len(namespace) + 1 :]):  # this process's own: alive, kept
            _remove_tree(str(path))


def _remove_tree(path: str) -> None:
    """Remove a directory the program may have filled with unreadable, unwritable entries."""

    def make_writable(function, target, _exc_info):  # noqa: ANN001
        parent = os.path.dirname(target)
        for item in (parent, target):
            try:
                os.chmod(item, stat.S_IRWXU)
            except OSError:
                pass
        try:
            function(target)
        except OSError:
            pass

    shutil.rmtree(path, onerror=make_writable)
