"""Model-written code run in a sandbox, as a reward function (`code_reward`, `CodeReward`) and as a tool
(`run_python`). docs/rewards.md §1 says what the sandbox protects against and what it does not."""

from rlasync.rewards.code.reward import CodeReward, code_reward, extract_program, outputs_match, score_programs
from rlasync.rewards.code.sandbox import Execution, Limits, Sandbox, SandboxUnavailableError
from rlasync.rewards.code.tool import format_execution, run_python

__all__ = [
    "CodeReward",
    "Execution",
    "Limits",
    "Sandbox",
    "SandboxUnavailableError",
    "code_reward",
    "extract_program",
    "format_execution",
    "outputs_match",
    "run_python",
    "score_programs",
]
