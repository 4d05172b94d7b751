"""The program that runs first inside each sandbox (stdlib only; its source is passed to `python -I -c`).

It reads its configuration (JSON) from stdin until EOF, sets the resource limits, drops to the sandbox user when
asked (the root mode of `rlasync.rewards.code.sandbox`), points stdin at the case's input (or /dev/null), and then

- "script" mode: replaces itself with `python -I program.py` (the program runs as `__main__`, as a script would);
- "tests" mode: executes the program in a fresh namespace (named "solution", so an `if __name__ == "__main__":`
  block does not run), then each test statement in that namespace, writing `"<index> pass"` or
  `"<index> fail <exception type>"` to file descriptor `results_fd` as each one finishes, so that tests that passed before
  a limit killed the process still count.

Nothing here is a security boundary against the program once it runs (it shares this process in "tests" mode):
the boundary is the sandbox around it.
"""

# rlasync-sandbox-harness (the marker the tests look for among leftover processes)
import json
import os
import resource
import sys
import traceback


def _set_limits(limits):
    cpu = int(limits["cpu_s"])
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))  # SIGXCPU at the soft limit, SIGKILL at the hard one
    memory = int(limits["memory_bytes"])
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    file_bytes = int(limits["file_bytes"])
    resource.setrlimit(resource.RLIMIT_FSIZE, (file_bytes, file_bytes))
    files = int(limits["open_files"])
    resource.setrlimit(resource.RLIMIT_NOFILE, (files, files))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    processes = int(limits["processes"])
    resource.setrlimit(resource.RLIMIT_NPROC, (processes, processes))


_RESULTS_FD = [3]


def _report(line):
    try:
        os.write(_RESULTS_FD[0], (line + "\n").encode())
    except OSError:
        pass


def _run_tests(program_path, tests):
    with open(program_path, encoding="utf-8", errors="replace") as handle:
        source = handle.read()
    namespace = {"__name__": "solution", "__file__": program_path}
    try:
        exec(compile(source, "program.py", "exec"), namespace)
    except BaseException:  # SystemExit too: a program that exits while being loaded passes no test
        traceback.print_exc(limit=5)
        _report("program fail")
        return 1
    failed = 0
    for index, test in enumerate(tests):
        try:
            exec(compile(test, f"<test {index}>", "exec"), namespace)
        except BaseException as exc:
            failed += 1
            sys.stderr.write(f"test {index} failed: {type(exc).__name__}: {str(exc)[:200]}\n")
            _report(f"{index} fail {type(exc).__name__}")
        else:
            _report(f"{index} pass")
    return 1 if failed else 0


def main():
    config = json.loads(sys.stdin.buffer.read())
    _RESULTS_FD[0] = int(config.get("results_fd", 3))
    _set_limits(config["limits"])
    uid = config.get("uid")
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)  # from root to another user: every capability is dropped
    os.chdir(config["cwd"])  # after the switch: the directory belongs to the sandbox user
    fd = os.open(config.get("stdin") or os.devnull, os.O_RDONLY)
    os.dup2(fd, 0)
    os.close(fd)
    if config["mode"] == "script":
        os.closerange(3, 64)
        os.execv(sys.executable, [sys.executable, "-I", config["program"]])
    status = _run_tests(config["program"], config["tests"])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    main()
