"""`run_python`: the sandbox as a tool the model can call during a rollout (`tools=[run_python]`)."""

from __future__ import annotations

from rlasync.rewards.code.sandbox import Execution, Limits, Sandbox

TOOL_SANDBOX = Sandbox(limits=Limits(cpu_s=5.0, wall_s=10.0))
"""The sandbox `run_python` uses: 5 CPU seconds, 10 s wall, 1 GiB, 32 processes, 1 MB of output."""
TOOL_OUTPUT_CHARS = 4000
"""At most this many characters of output go back to the model (the middle is cut)."""

_STATUS_NOTES = {
    "timeout": "killed: time limit exceeded",
    "output_limit": "killed: output limit exceeded",
    "killed": "killed by a signal (a resource limit)",
}


def run_python(code: str) -> str:
    """Run a Python program in an isolated sandbox and return what it printed.

    The program runs as a fresh script with no network, an empty private working directory and limits on time,
    memory and output. Only what it prints is returned, so print the values you want to see.

    Args:
        code: The complete Python source code of the program to run.

    Returns:
        The program's standard output, then its standard error, then a note when it failed or hit a limit.
    """
    return format_execution(TOOL_SANDBOX.run(code))


def format_execution(execution: Execution, max_chars: int = TOOL_OUTPUT_CHARS) -> str:
    """The text a tool returns for an execution: stdout, stderr, and a bracketed note unless it exited with 0."""
    parts = [execution.stdout]
    if execution.stderr:
        parts.append(execution.stderr)
    if execution.status == "error":
        parts.append(f"[exit status {execution.returncode}]")
    elif not execution.ok:
        parts.append(f"[{_STATUS_NOTES.get(execution.status, execution.status)}]")
    text = "\n".join(part.rstrip("\n") for part in parts if part)
    if len(text) > max_chars:
        half = max_chars // 2
        text = f"{text[:half]}\n[... {len(text) - 2 * half} characters cut ...]\n{text[-half:]}"
    return text or "[no output]"
