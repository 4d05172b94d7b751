"""The code sandbox in a run (docs/rewards.md §1): `code_reward` scores programs on a RewardActor, tiny random Llama
on the procedural code task. The policy's own completions are noise, so the reward function under test is wrapped:
it hands the sandbox the row's reference solution for even-numbered completions and a wrong program for the others,
so every group scores exactly [1, 0, 1, 0] if and only if the sandbox ran the programs against the hidden tests."""

import json
import math
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from tests.integration.tiny_runs import tiny_grpo_config

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        shutil.which("bwrap") is None, reason="bubblewrap is not installed (apt-get install bubblewrap)"
    ),
    pytest.mark.usefixtures("pickle_by_value"),
]


def reference_or_wrong(completions, solution, tests, pid_dir, **kwargs):
    """code_reward on the reference solution (even indices) or a constant function (odd ones); records its pid."""
    from rlasync.rewards import code_reward

    Path(pid_dir[0], str(os.getpid())).touch()
    programs = [
        f"```python\n{answer}```" if index % 2 == 0 else "```python\ndef f(xs):\n    return None\n```"
        for index, answer in enumerate(solution)
    ]
    return code_reward(programs, tests=tests)


def test_code_reward_runs_in_the_reward_actor(ray_cluster, tiny_model_dir, tmp_path):
    from rlasync import AsyncGRPOTrainer
    from rlasync.data import code_dataset
    from rlasync.rewards.code import Sandbox
    from rlasync.rewards.code import sandbox as sandbox_module

    pids = tmp_path / "pids"
    pids.mkdir()
    sandbox_dirs_before = set(Path(tempfile.gettempdir()).glob("rlasync-sandbox-*"))
    config = tiny_grpo_config(
        tmp_path / "run",
        max_steps=2,
        token_budget=512,
        top_k=0,  # AsyncGRPOConfig's default (no top-k), not the tiny runs' 16
        reward_timeout_s=120.0,
        cluster={
            "num_reward_actors": 1,
            "engine_kwargs": {"max_num_seqs": 16, "kv_cache_tokens": 4096, "max_model_len": 256},
        },
    )
    rows = code_dataset(32, seed=0).add_column("pid_dir", [str(pids)] * 32)
    trainer = AsyncGRPOTrainer(model=tiny_model_dir, reward_funcs=reference_or_wrong, args=config, train_dataset=rows)
    state = trainer.train()
    assert state["global_step"] == 2
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert records and all(record["rewards/reference_or_wrong/mean"] == 0.5 for record in records)
    assert all(record["frac_zero_std_groups"] == 0.0 for record in records)  # every group is [1, 0, 1, 0]
    assert len(list(pids.iterdir())) == 1, "scored by one process: the RewardActor's"
    assert int(next(pids.iterdir()).name) != os.getpid()
    # The RewardActor was killed with executions in flight (groups scored past the last step): their sandboxes died
    # with it (--die-with-parent), their directories are swept by the next execution on this machine once the
    # actor's process is gone (ray.kill returns before the process has exited on a loaded machine).
    reward_pid = int(next(pids.iterdir()).name)
    deadline = time.monotonic() + 60
    while Path(f"/proc/{reward_pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    sandbox_module._last_sweep[0] = -math.inf
    assert Sandbox().run("print(1)").stdout == "1\n"
    assert set(Path(tempfile.gettempdir()).glob("rlasync-sandbox-*")) <= sandbox_dirs_before
    # nor is any of its sandboxes' processes left: bwrap's child of an execution cut short during its set-up waits
    # for its dead parent forever unless that execution killed it
    its_folders = os.fsencode(f"-{reward_pid}-")
    left = [
        pid
        for pid, args in sandbox_module._processes_naming(b"rlasync-sandbox-")
        if any(its_folders in a for a in args)
    ]
    assert left == []
