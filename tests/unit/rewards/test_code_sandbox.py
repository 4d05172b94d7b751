"""The code sandbox (rlasync.rewards.code, docs/rewards.md §1): hostile programs score 0 within their limits, write
nothing outside the sandbox, reach no listener and leave no process behind; correct programs score 1, partial ones
their fraction, through the reward calling convention; the tool form returns the program's output.

Needs bubblewrap (`apt-get install bubblewrap`; .ci/run installs it): skipped only when `bwrap` is not installed.
The hostile programs run concurrently (a module fixture; the two CPU hogs last), each with 1 CPU second and 3 s of
wall time.
"""

import asyncio
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from rlasync.rewards import call_reward_funcs
from rlasync.rewards.code import (
    CodeReward,
    Limits,
    Sandbox,
    SandboxUnavailableError,
    code_reward,
    extract_program,
    run_python,
)
from rlasync.rewards.code import sandbox as sandbox_module
from rlasync.rewards.code.reward import score_programs

pytestmark = pytest.mark.skipif(
    sandbox_module.shutil.which("bwrap") is None,
    reason="bubblewrap is not installed (apt-get install bubblewrap)",
)

LIMITS = Limits(cpu_s=1, wall_s=3, memory_mb=512, processes=8, output_bytes=200_000)
SANDBOX = Sandbox(limits=LIMITS, max_concurrent=8)
ROOMY = Sandbox(limits=Limits(cpu_s=5, wall_s=20), max_concurrent=8)  # for programs that should pass, on a busy machine
SLACK_S = 4.0  # start-up and teardown on a loaded machine, beyond the wall limit
TESTS = ["assert f(2) == 4", "assert f(5) == 10"]
DOUBLE = "def f(x):\n    return 2 * x\n"
FLOOD = "import sys\nsys.stdout.write('x' * 100_000_000)\n" + DOUBLE  # 100 MB of output, then a passing f
TOKEN = uuid.uuid4().hex  # names the files the programs try to write
SECRET = uuid.uuid4().hex  # the trainer's secret: in a file outside the sandbox and in an environment variable
MARKERS = ("rlasync-sandbox-harness", f"31.{int(TOKEN[:8], 16)}")  # the harness; the orphan's `sleep` argument


def _leftover_processes() -> list[str]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(marker in cmdline for marker in MARKERS):
            found.append(f"{entry.name}: {cmdline[:120]}")
    return found


def _sandbox_dirs() -> set[str]:
    return {path.name for path in Path(tempfile.gettempdir()).glob("rlasync-sandbox-*")}


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    """Run every hostile program at once; returns {name: (score, execution wall seconds, stdout)} and the facts
    checked afterwards (files, connections, processes)."""
    secret_dir = tmp_path_factory.mktemp("trainer")
    secret_file = secret_dir / "secret.txt"
    secret_file.write_text(f"secret-{SECRET}")
    etc_target = Path(f"/etc/rlasync-sandbox-{TOKEN}")
    cwd_target = Path.cwd() / f"rlasync-sandbox-{TOKEN}.txt"
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    port = listener.getsockname()[1]
    environment = pytest.MonkeyPatch()  # the trainer's environment holds a secret (undone at the end)
    environment.setenv("TRAINER_SECRET_FOR_SANDBOX_TEST", SECRET)
    orphan = (
        "import os\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        f"        os.execv('/usr/bin/sleep', ['sleep', '{MARKERS[1]}'])\n"
        "    os._exit(0)\n"
    )
    programs = {
        "infinite_loop": "while True:\n    pass\n" + DOUBLE,
        "fork_bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
        + DOUBLE,
        "allocate_4gb": "blob = bytearray(4 * 2**30)\n" + DOUBLE,
        "write_etc": f"open({str(etc_target)!r}, 'w').write('x')\n" + DOUBLE,
        "write_trainer_cwd": f"open({str(cwd_target)!r}, 'w').write('x')\n" + DOUBLE,
        "read_secret_file": f"print(open({str(secret_file)!r}).read())\n" + DOUBLE,
        "read_trainer_env": "import os\nprint(os.environ['TRAINER_SECRET_FOR_SANDBOX_TEST'])\n" + DOUBLE,
        "connect_to_host": (
            f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1).sendall(b'hi')\n" + DOUBLE
        ),
        "print_100mb": FLOOD,
        "write_40mb_file": "open('/tmp/big', 'wb').write(b'x' * (40 << 20))\n" + DOUBLE,
        "orphan_child": orphan,
    }
    dirs_before = _sandbox_dirs()
    names = list(programs)
    try:
        # The two CPU hogs after the rest, so that the others reach what they try within their 3 s on 2 busy cores.
        hogs = ["infinite_loop", "fork_bomb"]
        runs_by_name = {}
        with ThreadPoolExecutor(max_workers=len(names)) as pool:
            for phase in ([name for name in names if name not in hogs], hogs):
                phase_runs = pool.map(lambda name: SANDBOX.run(programs[name], tests=TESTS), phase)
                runs_by_name.update(zip(phase, phase_runs, strict=True))
        runs = [runs_by_name[name] for name in names]
        # The orphan again as a script (stdin/stdout mode): the script itself exits at once.
        script_orphan = SANDBOX.run(orphan + "print('parent done')\n")
        scores = score_programs([programs[name] for name in names], [TESTS] * len(names), [[]] * len(names), SANDBOX)
        try:
            connection, _ = listener.accept()
            connection.close()
            connected = True
        except BlockingIOError:
            connected = False
        facts = {
            "etc_written": etc_target.exists(),
            "cwd_written": cwd_target.exists(),
            "connected": connected,
            "leftovers": _leftover_processes(),
            "new_dirs": _sandbox_dirs() - dirs_before,
            "script_orphan": script_orphan,
        }
    finally:
        listener.close()
        environment.undo()
        cwd_target.unlink(missing_ok=True)
    results = {name: (score, run) for name, score, run in zip(names, scores, runs, strict=True)}
    return results, facts


@pytest.mark.parametrize(
    "name",
    [
        "infinite_loop",
        "fork_bomb",
        "allocate_4gb",
        "write_etc",
        "write_trainer_cwd",
        "read_secret_file",
        "read_trainer_env",
        "connect_to_host",
        "print_100mb",
        "write_40mb_file",
        "orphan_child",
    ],
)
def test_hostile_program_scores_zero_within_its_limit(hostile, name):
    results, _ = hostile
    score, run = results[name]
    assert score == 0.0
    assert run.passed == ()
    assert not run.ok
    assert run.wall_s <= LIMITS.wall_s + SLACK_S, f"{name} ran {run.wall_s:.1f} s"
    assert SECRET not in run.stdout + run.stderr  # neither the secret file nor the environment variable leaked


def test_an_output_flood_is_stopped_at_the_output_limit():
    """The flood alone with a roomy wall limit: the output limit, not the clock, stops it, its output cut there."""
    flood = Sandbox(limits=Limits(cpu_s=5, wall_s=20, output_bytes=LIMITS.output_bytes), max_concurrent=1)
    run = flood.run(FLOOD, tests=TESTS)
    assert run.status == "output_limit"
    assert len(run.stdout) == LIMITS.output_bytes and not run.ok


def test_limits_report_what_stopped_the_program(hostile):
    results, _ = hostile
    assert results["infinite_loop"][1].status == "timeout"
    # among nine programs on two busy cores the flood may still be starting when its 3 s run out ("timeout"); its
    # status is checked alone below, its kept output here
    assert results["print_100mb"][1].status in ("output_limit", "timeout")
    assert len(results["print_100mb"][1].stdout) <= LIMITS.output_bytes
    assert "MemoryError" in results["allocate_4gb"][1].stderr
    assert "FileNotFoundError" in results["read_secret_file"][1].stderr
    assert "KeyError" in results["read_trainer_env"][1].stderr
    assert "File too large" in results["write_40mb_file"][1].stderr  # RLIMIT_FSIZE (file_mb=16)


def test_nothing_escapes_the_sandbox(hostile):
    _, facts = hostile
    assert not facts["etc_written"]
    assert not facts["cwd_written"]
    assert not facts["connected"], "a sandboxed program reached a listener on the host's 127.0.0.1"
    assert facts["leftovers"] == [], "processes outlived their sandbox"
    assert facts["new_dirs"] == set(), "sandbox directories were left in the temporary directory"
    script_orphan = facts["script_orphan"]
    assert script_orphan.ok and script_orphan.stdout == "parent done\n"  # the parent exited; its child was killed


def test_executions_are_bounded_per_process(monkeypatch):
    running, peak = [0], [0]

    def fake_execute(sandbox, mechanism, program, tests, stdin):
        running[0] += 1
        peak[0] = max(peak[0], running[0])
        time.sleep(0.05)
        running[0] -= 1
        return sandbox_module.Execution(status="ok", returncode=0, stdout="", stderr="", passed=(0, 1))

    monkeypatch.setattr(sandbox_module, "_execute", fake_execute)
    bounded = Sandbox(limits=LIMITS, max_concurrent=2)
    scores = score_programs(["x = 1"] * 8, [TESTS] * 8, [[]] * 8, bounded)
    assert scores == [1.0] * 8
    assert peak[0] == 2


def test_correct_partial_and_broken_programs_score_their_fraction():
    tests = ["assert f([1, 2, 3]) == 6", "assert f([]) == 0", "assert f([-1, 1]) == 0", "assert f([5]) == 5"]
    completions = [
        "Here it is:\n```python\ndef f(xs):\n    return sum(xs)\n```",
        "```python\ndef f(xs):\n    return sum(x for x in xs if x > 0)\n```",  # fails [-1, 1]
        "```python\ndef f(xs):\n    return len(xs)\n```",  # passes [] only... and [5]? no: 1 != 5
        "I cannot write code.",
        "```python\ndef f(xs) return 0\n```",  # syntax error
    ]
    scores = CodeReward(ROOMY)(completions, tests=[tests] * len(completions))
    assert scores == [1.0, 0.75, 0.25, 0.0, 0.0]


def test_stdin_stdout_cases_are_compared_outside_the_sandbox():
    cases = [{"input": "3 4\n", "output": "7\n"}, {"input": "10 -2", "output": "8"}, {"input": "0 0\n", "output": "0"}]
    programs = [
        "a, b = map(int, input().split())\nprint(a + b)   \n\n",  # trailing spaces and blank lines are ignored
        "a, b = map(int, input().split())\nprint(a + b if a < 5 else 0)\n",
        "print('PASS')\n",
        "import sys\nprint(7)\nsys.exit(0)\n",
    ]
    scores = CodeReward(ROOMY)(programs, io_tests=[cases] * len(programs))
    assert scores == [1.0, pytest.approx(2 / 3), 0.0, pytest.approx(1 / 3)]


def test_reward_function_on_a_group_with_the_calling_convention():
    group = [
        [{"role": "assistant", "content": "```python\ndef f(x):\n    return 2 * x\n```"}],
        [{"role": "assistant", "content": "```python\ndef f(x):\n    return 4\n```"}],
        [{"role": "assistant", "content": "```python\nimport os\nos._exit(0)\n```"}],  # exits before any test
        [{"role": "assistant", "content": "```python\nprint('no f here')\n```"}],
    ]
    table = asyncio.run(
        call_reward_funcs(
            [code_reward, CodeReward(ROOMY, name="code_roomy")],
            prompts=[[{"role": "user", "content": "write f"}]] * len(group),
            completions=group,
            completion_ids=[[1, 2]] * len(group),
            reward_kwargs={"tests": [TESTS] * len(group), "difficulty": ["easy"] * len(group)},
        )
    )
    assert table.names == ("code_reward", "code_roomy")
    assert table.column("code_reward").tolist() == [1.0, 0.5, 0.0, 0.0]
    assert table.column("code_roomy").tolist() == [1.0, 0.5, 0.0, 0.0]


def test_rows_without_tests_are_unscored_and_missing_columns_are_named():
    assert code_reward(["def f(x): return 2 * x"], tests=[[]], io_tests=[None]) == [None]
    with pytest.raises(ValueError, match="`tests` column"):
        code_reward(["def f(x): return x"], difficulty=["easy"])
    with pytest.raises(ValueError, match="`io_tests` of row 0"):
        code_reward(["print(1)"], io_tests=["1"])


def test_program_extraction():
    assert extract_program("text\n```python\nprint(1)\n```\nmore\n```py\nprint(2)\n```") == "print(2)"
    assert extract_program("```\nprint(3)\n```") == "print(3)"
    assert extract_program("```bash\nls\n```") == ""  # another language is not Python
    assert extract_program("print(4)\n") == "print(4)"  # no fence: the whole text
    assert extract_program("```python\nprint(5)\n") == "print(5)"  # cut at the token limit
    assert extract_program("```json\n{}\n```\n```python\nx = 1\n```") == "x = 1"


def test_the_tool_returns_the_output_or_the_error():
    assert run_python("print(6 * 7)") == "42"
    error = run_python("print('before')\nraise ValueError('boom')")
    assert error.startswith("before\n")
    assert "ValueError: boom" in error
    assert error.endswith("[exit status 1]")
    assert run_python("pass") == "[no output]"
    assert "[killed: output limit exceeded]" in run_python("print('y' * 5_000_000)")


def test_the_tool_schema_comes_from_its_signature_and_docstring():
    from transformers.utils import get_json_schema

    schema = get_json_schema(run_python)["function"]
    assert schema["name"] == "run_python"
    assert schema["parameters"]["required"] == ["code"]
    assert schema["parameters"]["properties"]["code"]["type"] == "string"


def test_limits_and_sandbox_fields_are_checked():
    with pytest.raises(ValueError, match=r"Limits\.cpu_s"):
        Limits(cpu_s=0)
    with pytest.raises(ValueError, match=r"Limits\.memory_mb"):
        Limits(memory_mb=10)
    with pytest.raises(ValueError, match=r"Sandbox\.max_concurrent"):
        Sandbox(max_concurrent=0)
    with pytest.raises(ValueError, match="CodeReward"):
        CodeReward(sandbox="bwrap")


def test_without_bubblewrap_it_refuses_unless_unsandboxed_is_allowed(monkeypatch):
    monkeypatch.setattr(sandbox_module.shutil, "which", lambda name: None)
    sandbox_module._probe.cache_clear()
    try:
        with pytest.raises(SandboxUnavailableError, match="apt-get install bubblewrap"):
            Sandbox(limits=LIMITS).run("print(1)")
        with pytest.raises(SandboxUnavailableError):
            code_reward(["def f(x): return 2 * x"], tests=[TESTS])
        monkeypatch.setattr(sandbox_module, "_warned", False)
        with pytest.warns(RuntimeWarning, match="WITHOUT a sandbox"):
            run = Sandbox(limits=LIMITS, allow_unsandboxed=True).run("import os\nprint(os.environ.get('HOME'))")
        assert run.ok and "rlasync-sandbox-" in run.stdout  # its own directory and environment, but no isolation
    finally:
        sandbox_module._probe.cache_clear()


_AS_ANOTHER_USER = """
import importlib.util, json, sys
spec = importlib.util.spec_from_file_location("sandbox", sys.argv[1])
sandbox = sys.modules["sandbox"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(sandbox)
box = sandbox.Sandbox(limits=sandbox.Limits(cpu_s=1, wall_s=3, processes=8))
found, reason = sandbox._probe(box.interpreter)
if not found:
    print(json.dumps({"skip": reason}))
    raise SystemExit(0)
uid = box.run("import os\\nprint(os.getuid())")
tests = box.run("def f(x):\\n    return 2 * x\\n", tests=["assert f(1) == 2", "assert f(2) == 5"])
bomb = box.run("import os\\nwhile True:\\n    try:\\n        os.fork()\\n    except OSError:\\n        pass\\n")
net = box.run("import socket\\nsocket.create_connection(('127.0.0.1', 22), timeout=1)")
print(json.dumps({"mechanism": found, "uid": uid.stdout.strip(), "passed": list(tests.passed), "bomb": bomb.status,
                  "net": net.status}))
"""


@pytest.mark.skipif(
    os.geteuid() != 0 or not Path("/usr/bin/python3").exists() or sandbox_module.shutil.which("setpriv") is None,
    reason="needs root, setpriv and /usr/bin/python3 to run the sandbox as another user",
)
def test_as_another_user_the_sandbox_uses_a_user_namespace():
    """The non-root path (a trainer on a cluster): bwrap maps the user to uid 65534 in a new user namespace."""
    box = Path(tempfile.mkdtemp(prefix="rlasync-userns-test-"))
    try:
        box.chmod(0o755)
        for name in ("sandbox.py", "harness.py"):
            (box / name).write_text((Path(sandbox_module.__file__).parent / name).read_text())
        (box / "check.py").write_text(_AS_ANOTHER_USER)
        done = subprocess.run(
            [
                "setpriv",
                "--reuid=4321",
                "--regid=4321",
                "--clear-groups",
                "/usr/bin/python3",
                str(box / "check.py"),
                str(box / "sandbox.py"),
            ],
            capture_output=True,
            text=True,
            timeout=120,
            env={"PATH": "/usr/bin:/bin", "HOME": str(box)},
            check=False,
        )
    finally:
        shutil.rmtree(box, ignore_errors=True)
    assert done.returncode == 0, done.stderr
    facts = json.loads(done.stdout.strip().splitlines()[-1])
    if "skip" in facts:
        pytest.skip(f"unprivileged user namespaces are not available here: {facts['skip']}")
    assert facts == {"mechanism": "bwrap-userns", "uid": "65534", "passed": [0], "bomb": "timeout", "net": "error"}
    assert _leftover_processes() == []


def test_directories_of_dead_processes_are_swept(monkeypatch):
    """A reward actor killed mid-execution leaves its directory: the next execution in the PID namespace removes it,
    and never one of a live process."""
    dead = subprocess.Popen(["true"])
    dead.wait()
    namespace = sandbox_module._pid_namespace()
    root = Path(tempfile.gettempdir())
    orphaned = root / f"rlasync-sandbox-{namespace}-{dead.pid}-test{TOKEN[:6]}"
    alive = root / f"rlasync-sandbox-{namespace}-{os.getppid()}-test{TOKEN[:6]}"
    for path in (orphaned, alive):
        (path / "box").mkdir(parents=True)
        (path / "box" / "program.py").write_text("print(1)")
    try:
        monkeypatch.setattr(sandbox_module, "_last_sweep", [-float("inf")])
        assert SANDBOX.run("print(2)").stdout == "2\n"
        assert not orphaned.exists()
        assert alive.exists()
    finally:
        shutil.rmtree(orphaned, ignore_errors=True)
        shutil.rmtree(alive, ignore_errors=True)


def test_a_process_that_left_the_group_during_set_up_is_killed(monkeypatch, tmp_path):
    """bwrap forks its sandbox's first process, which calls setsid (--new-session) and arms its parent-death signal
    only after its parent has set it up: when the execution ends during set-up, killing bwrap's group misses it.
    A stand-in bwrap does exactly that (fork, setsid, wait); after the execution nothing naming its folder is left."""
    fake = tmp_path / f"bwrap-{TOKEN}"
    fake.write_text(f"#!{sys.executable}\nimport os, time\nif os.fork() == 0:\n    os.setsid()\ntime.sleep(120)\n")
    fake.chmod(0o755)
    monkeypatch.setattr(sandbox_module.shutil, "which", lambda name: str(fake) if name == "bwrap" else None)

    def survivors() -> list[int]:
        return [pid for pid, _ in sandbox_module._processes_naming(os.fsencode(str(fake)))]

    box = Sandbox(limits=Limits(cpu_s=1, wall_s=1.0), max_concurrent=1)
    execution = sandbox_module._execute(box, "bwrap", "print(1)", None, None)
    assert execution.status == "timeout"
    assert survivors() == []


def test_orphans_of_executions_that_are_over_are_killed_and_live_executions_are_not(tmp_path):
    """`_kill_strays` (after every bwrap execution) also kills what executions that are over left behind, whoever
    ran them: a process naming a sandbox folder that is gone (bwrap's blocked child of an execution this or another
    process ended), or one whose folder belongs to a dead process (a RewardActor killed mid-execution) is killed;
    one naming the folder of a live process's execution (this process's or another's) is left alone."""
    sandbox = sandbox_module
    base = os.path.join(tempfile.gettempdir(), f"rlasync-sandbox-{sandbox._pid_namespace()}-")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # its pid names a folder of a dead process (not reused within the test: pids wrap far later)
    made = [
        tempfile.mkdtemp(prefix=f"rlasync-sandbox-{sandbox._pid_namespace()}-{pid}-")
        for pid in (os.getpid(), os.getppid(), dead.pid)
    ]
    folders = {
        "gone": f"{base}{os.getpid()}-gone{TOKEN}/box",
        "other_gone": f"{base}{os.getppid()}-gone{TOKEN}/box",
        "live": os.path.join(made[0], "box"),
        "other_live": os.path.join(made[1], "box"),
        "dead_owner": os.path.join(made[2], "box"),
    }
    sleeper = "import time; time.sleep(60)"
    procs = {k: subprocess.Popen([sys.executable, "-c", sleeper, "--bind", v, "/sandbox"]) for k, v in folders.items()}
    try:
        for folder in made:
            os.mkdir(os.path.join(folder, "box"))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(
            folders[k].encode() not in Path(f"/proc/{p.pid}/cmdline").read_bytes() for k, p in procs.items()
        ):
            time.sleep(0.01)  # until each has exec'd with its arguments
        sandbox._kill_strays(f"{base}{os.getpid()}-current{TOKEN}")
        for name in ("gone", "other_gone", "dead_owner"):
            assert procs[name].wait(timeout=10) == -9, name
        assert procs["live"].poll() is None and procs["other_live"].poll() is None
    finally:
        for p in procs.values():
            p.kill()
            p.wait()
        for folder in made:
            shutil.rmtree(folder, ignore_errors=True)
