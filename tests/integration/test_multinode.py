"""GRPO on a multi-node Ray cluster on one machine, and under Ray's real autoscaler with simulated nodes.

Node loss (`ray.cluster_utils.Cluster`: a raylet per "node", each with its own custom resource standing in for a
node group; a node is lost mid-run by killing its raylet, as a crash):

- the generation node (the engine and the rollout actor): Ray re-places both on the replacement node (the only other
  node with `generation_node`), the driver re-opens the weight transport to the restarted engine, the restarted
  rollout actor's leases are released, the run finishes its epoch and every prompt is consumed exactly once;
- the learner node: the run stops naming the learner rank and the lost node, and the checkpoint to resume from; a
  resume on a new learner node finishes the epoch.

The autoscaler (`FakeAutoscalingCluster`: `ray start --head` with the fake multi-node provider, the worker groups of
deploy/raycluster.yaml, the run configured as deploy/rayjob.yaml's entrypoint): the elastic policy asks for a second
engine, the autoscaler adds a generation node for it, it joins the weight transport and serves; removed again, its
node is idle and the autoscaler removes it; every worker node goes once the run ends.

`cluster.resources` keeps each role on its nodes (the queue on the head, with the driver: the samples it owns live
there). Marked `standalone_cluster` (each test starts its own Ray cluster, not the session's): `.ci/run` runs the
file alone (~6 min on 2 loaded cores):

    python -m pytest -q -rP -m standalone_cluster tests/integration/test_multinode.py   (-rP: the timelines)

Each test prints its timeline: which actor ran on which node when, the nodes joining and leaving, the restarts.
"""

import contextlib
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import yaml

from tests.integration.tiny_runs import assert_exactly_once, digit_reward, pickle_by_value, tiny_grpo_config

pytestmark = [pytest.mark.integration, pytest.mark.standalone_cluster]

NUM_ROWS = 16
RESOURCES = {
    "learner": {"learner_node": 1.0},
    "generation": {"generation_node": 0.5},
    "rollout": {"generation_node": 0.5},
    "queue": {"head_node": 1.0},
}
FAST_NODE_DEATH = {  # a lost node is declared dead within ~2 s (Ray's default: ~15-30 s)
    "health_check_period_ms": 500,
    "health_check_failure_threshold": 3,
    "health_check_initial_delay_ms": 0,
}


class Timeline:
    """What happened when, polled from Ray's GCS every 0.25 s: nodes joining and leaving (named by `names`, else by
    the custom resource they offer: "generation#2"), each actor's state and node; plus what a test logs."""

    ACTORS = ("LearnerActor", "GenerationActor", "RolloutActor", "QueueActor", "RewardActor", "TeacherScorer")

    def __init__(self, names: dict[str, str] | None = None, auto_names: bool = True) -> None:
        self.auto_names = auto_names  # False: a node is logged once the test has named it
        self.t0 = time.monotonic()
        self.events: list[tuple[float, str]] = []
        self.names = names if names is not None else {}
        self._actors: dict[str, tuple[str, str, int]] = {}
        self._alive: dict[str, bool] = {}
        self._stop = threading.Event()
        self._watch = threading.Thread(target=self._poll, daemon=True)
        self._watch.start()

    def log(self, text: str) -> None:
        self.events.append((time.monotonic() - self.t0, text))

    def name(self, node: dict) -> str:
        if node["NodeID"] not in self.names:
            offered = [key.removesuffix("_node") for key in sorted(node["Resources"]) if key.endswith("_node")]
            group = offered[0] if offered else "node"
            count = sum(name.startswith(f"{group}#") for name in self.names.values())
            self.names[node["NodeID"]] = f"{group}#{count + 1}"
        return self.names[node["NodeID"]]

    def where(self, class_name: str) -> list[str]:
        """The nodes of the live actors of `class_name`."""
        from ray._private.state import actors

        return [
            self.names.get(row["Address"]["NodeID"], "?")
            for row in actors().values()
            if row["ActorClassName"] == class_name and row["State"] == "ALIVE"
        ]

    def alive_nodes(self) -> list[str]:
        import ray

        return sorted(self.name(node) for node in ray.nodes() if node["Alive"])

    def _poll(self) -> None:
        import ray
        from ray._private.state import actors

        while not self._stop.wait(0.25):
            try:
                nodes, table = ray.nodes(), actors()
            except Exception:  # the GCS restarting or shutting down: the next poll sees it
                continue
            for node in nodes:
                if node["NodeID"] not in self.names and not self.auto_names:
                    continue
                if self._alive.get(node["NodeID"]) != node["Alive"]:
                    known = node["NodeID"] in self._alive or not node["Alive"]
                    self._alive[node["NodeID"]] = node["Alive"]
                    if known or node["NodeID"] not in self.names:
                        state = "is up" if node["Alive"] else "is gone"
                        self.log(f"node {self.name(node)} {state} (Ray: ...{node['NodeID'][-8:]})")
            for key, row in table.items():
                if row["ActorClassName"] not in self.ACTORS:
                    continue
                node = self.names.get(row["Address"]["NodeID"], "-") if row["State"] == "ALIVE" else "-"
                now = (row["State"], node, row["NumRestarts"])
                if self._actors.get(key) != now:
                    self._actors[key] = now
                    restarts = f", restart {now[2]}" if now[2] else ""
                    self.log(f"{row['ActorClassName']} {key[:6]}: {now[0]} on {node}{restarts}")

    def print(self, title: str) -> None:
        lines = [f"{at:7.1f} s  {text}" for at, text in sorted(self.events)]
        self.events.clear()
        print(f"\n---- timeline: {title} ----\n" + "\n".join(lines))

    def close(self) -> None:
        self._stop.set()
        self._watch.join(timeout=5)


class Nodes(Timeline):
    """A `ray.cluster_utils.Cluster`: a head (driver + queue), a learner node, a generation node, each named; nodes
    are added and lost (`add`, `remove`) as the tests say, with the timeline of `Timeline`."""

    def __init__(self) -> None:
        import ray
        from ray.cluster_utils import Cluster

        self.cluster = Cluster(
            initialize_head=True,
            head_node_args={"num_cpus": 1, "resources": {"head_node": 1}, "_system_config": FAST_NODE_DEATH},
        )
        super().__init__({self.cluster.head_node.node_id: "head"}, auto_names=False)
        self.nodes = {"head": self.cluster.head_node}
        self.add("learner-1", learner_node=1)
        self.add("generation-1", generation_node=1)
        ray.init(address=self.cluster.address, log_to_driver=False)

    def add(self, name: str, **resources: float) -> None:
        node = self.cluster.add_node(num_cpus=1, resources=resources)
        self.nodes[name], self.names[node.node_id] = node, name
        self.log(f"node {name} joined ({node.node_id[:8]}, {resources})")

    def remove(self, name: str) -> None:
        self.cluster.remove_node(self.nodes.pop(name), allow_graceful=False)  # the raylet killed: a crash
        self.log(f"node {name} lost (raylet killed)")

    def close(self) -> None:
        import ray

        super().close()
        ray.shutdown()
        self.cluster.shutdown()


@pytest.fixture(scope="class")
def nodes():
    nodes = Nodes()
    pickle_by_value(sys.modules[__name__])
    yield nodes
    nodes.close()


class AtStep:
    """Calls `action` once at the end of step `step` (in the driver, between two steps) and logs the step."""

    def __init__(self, nodes, step, action):
        self.nodes, self.step, self.action, self.done_at = nodes, step, action, None

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step and self.done_at is None:
            self.nodes.log(f"step {state.global_step} done")
            self.action()
            self.done_at = state.global_step


class StepLog:
    def __init__(self, nodes):
        self.nodes = nodes

    def on_step_end(self, args, state, control, **kwargs):
        self.nodes.log(f"trained step {state.global_step}")


def grpo(tiny_model_dir, tmp_path, rows=NUM_ROWS, cluster=None, **changes):
    from rlasync import AsyncGRPOTrainer
    from rlasync.data import arithmetic_dataset

    args = tiny_grpo_config(
        tmp_path,
        **{"max_steps": -1, "num_train_epochs": 1.0, "token_budget": 64, **changes},
        cluster={"resources": RESOURCES, **(cluster or {})},
    )
    return AsyncGRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=digit_reward,
        args=args,
        train_dataset=arithmetic_dataset(rows, seed=0),
    )


class TestNodeLoss:
    """One `Nodes` cluster for both (class scope: torn down before the autoscaler's own cluster starts)."""

    def test_the_generation_node_is_lost_its_actors_are_re_placed_and_every_prompt_is_consumed_once(
        self, nodes, tiny_model_dir, tmp_path
    ):
        trainer = grpo(tiny_model_dir, tmp_path)
        placed = {}

        def lose_the_generation_node():
            placed.update({cls: nodes.where(cls) for cls in ("LearnerActor", "GenerationActor", "RolloutActor")})
            placed["QueueActor"] = nodes.where("QueueActor")
            nodes.add("generation-2", generation_node=1)  # the replacement (an autoscaler's new node, a spare)
            nodes.remove("generation-1")

        lose = AtStep(nodes, 2, lose_the_generation_node)
        trainer.callbacks += [StepLog(nodes), lose]
        try:
            state = trainer.train()
        finally:
            nodes.print("generation node lost")

        assert lose.done_at == 2, "the run ended before the node was lost"
        assert placed == {  # each role on its group of nodes (cluster.resources)
            "LearnerActor": ["learner-1"],
            "GenerationActor": ["generation-1"],
            "RolloutActor": ["generation-1"],
            "QueueActor": ["head"],
        }
        assert_exactly_once(state["queue"], NUM_ROWS)
        assert state["global_step"] > 2
        records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
        queued = next(r for r in records if r["step"] == 2)["rollout/queue_size"]
        assert queued > 0, "no sample was queued when the node was lost"  # owned by the queue (head), not the node
        restarts = [r["faults/generation_restarts"] for r in records if "faults/generation_restarts" in r]
        assert restarts and restarts[-1] >= 1, "the driver did not re-sync a restarted engine"
        versions = [r["policy_version"] for r in records]
        assert versions == sorted(versions) and versions[-1] > state["global_step"]  # the re-sync is a policy version
        assert (tmp_path / f"checkpoint-{state['global_step']}" / "trainer_state.json").is_file()

    def test_the_learner_node_is_lost_the_run_stops_naming_it_and_resumes_on_a_new_node(
        self, nodes, tiny_model_dir, tmp_path
    ):
        trainer = grpo(tiny_model_dir, tmp_path, save_steps=2)
        lose = AtStep(nodes, 3, lambda: nodes.remove("learner-1"))
        trainer.callbacks += [StepLog(nodes), lose]
        try:
            with pytest.raises(RuntimeError) as info:
                trainer.train()
            message = str(info.value)
            nodes.log(f"the run stopped: {message[:160]}...")
            nodes.add("learner-2", learner_node=1)
            resumed = grpo(tiny_model_dir, tmp_path, save_steps=2)
            resumed.callbacks.append(StepLog(nodes))
            state = resumed.train(resume_from_checkpoint=True)
            learner_nodes = {text for _, text in nodes.events if "LearnerActor" in text and "ALIVE" in text}
        finally:
            nodes.print("learner node lost, resumed")

        assert lose.done_at == 3
        assert message.startswith("learner rank 0 died (its node "), message
        assert "was lost" in message and "--resume" in message and str(tmp_path / "checkpoint-2") in message, message
        assert any(text.endswith("on learner-2") for text in learner_nodes), learner_nodes
        saved = json.loads((tmp_path / "checkpoint-2" / "rollout_state.json").read_text())
        queue, rest = (
            state["queue"],
            NUM_ROWS - saved["prompt_index"],
        )  # the resumed run: the prompts after checkpoint-2
        outcomes = {k: v for k, v in queue["outcomes"].items() if k != "stale"}
        assert 0 < rest < NUM_ROWS and queue["done"] and queue["first_untrained_index"] == NUM_ROWS
        assert queue["consumed_groups"] == sum(outcomes.values()) == rest, (queue, saved)  # each exactly once
        assert queue["queue_size"] == 0 and queue["inflight_groups"] == 0 and queue["leased_groups"] == 0
        assert state["global_step"] > 3


# ---- the autoscaler: Ray's fake multi-node provider runs the real autoscaler against simulated nodes --------------

REPO = Path(__file__).resolve().parents[2]
IDLE_TIMEOUT_MINUTES = 0.1  # deploy/raycluster.yaml's idleTimeoutSeconds (60 s), scaled down for CI
UPSCALING_SPEED = {"Conservative": 1.0, "Default": 1000.0, "Aggressive": 1000.0}  # KubeRay's upscalingMode


def start_params_resources(params):
    """A KubeRay `rayStartParams.resources` value ('"{\\"x\\": 1}"') as a dict."""
    return json.loads(json.loads(params["resources"])) if "resources" in params else {}


def manifest_cluster():
    """deploy/raycluster.yaml as the fake provider's cluster: the head's custom resources, one node type per worker
    group (its custom resources, min/max replicas; 1 CPU a node, no GPU), the upscaling speed of its mode."""
    spec = yaml.safe_load((REPO / "deploy" / "raycluster.yaml").read_text())["spec"]
    types = {
        group["groupName"]: {
            "resources": {"CPU": 1, **start_params_resources(group["rayStartParams"])},
            "node_config": {},
            "min_workers": group["minReplicas"],
            "max_workers": group["maxReplicas"],
        }
        for group in spec["workerGroupSpecs"]
    }
    head = start_params_resources(spec["headGroupSpec"]["rayStartParams"])
    return head, types, UPSCALING_SPEED[spec["autoscalerOptions"]["upscalingMode"]]


def rayjob_cluster_overrides():
    """The `--set cluster.*=...` of deploy/rayjob.yaml's entrypoint, as a `cluster` dict."""
    from rlasync.config.load import parse_override

    words = shlex.split(yaml.safe_load((REPO / "deploy" / "rayjob.yaml").read_text())["spec"]["entrypoint"])
    overrides = [parse_override(word) for flag, word in zip(words, words[1:], strict=False) if flag == "--set"]
    return {key.removeprefix("cluster."): value for key, value in overrides if key.startswith("cluster.")}


class FakeAutoscalingCluster:
    """`ray start --head --autoscaling-config` with Ray's fake multi-node provider (what
    `ray.cluster_utils.AutoscalingCluster` does, without its `ray stop --force`, which ends every Ray process on the
    machine): its own temp dir and ports; `shutdown` ends the processes whose command line names that temp dir, and
    their children (the head's raylet, GCS, autoscaler and the worker nodes it started)."""

    def __init__(self, head_resources, node_types, upscaling_speed):
        import ray

        self.temp_dir = tempfile.mkdtemp(prefix="rlx", dir="/tmp")  # short: Ray's socket paths have a length limit
        ip, port = ray._private.services.get_node_ip_address(), free_port()
        self.address = f"{ip}:{port}"
        config = {
            "cluster_name": "fake_multinode",
            "max_workers": sum(t["max_workers"] for t in node_types.values()),
            "provider": {
                "type": "fake_multinode",
                "use_node_id_as_ip": True,
                "disable_node_updaters": True,
                "disable_launch_config_check": True,
                "gcs_address": self.address,
            },
            "available_node_types": {
                **node_types,
                "ray.head.default": {"resources": {"CPU": 1, **head_resources}, "node_config": {}, "max_workers": 0},
            },
            "head_node_type": "ray.head.default",
            "upscaling_speed": upscaling_speed,
            "idle_timeout_minutes": IDLE_TIMEOUT_MINUTES,
            **{key: {} for key in ("auth", "docker", "file_mounts")},
            **{
                key: []
                for key in (
                    "initialization_commands",
                    "setup_commands",
                    "head_setup_commands",
                    "worker_setup_commands",
                    "head_start_ray_commands",
                    "worker_start_ray_commands",
                    "cluster_synced_files",
                    "rsync_exclude",
                    "rsync_filter",
                )
            },
            "file_mounts_sync_continuously": False,
        }
        path = Path(self.temp_dir) / "autoscaling.json"
        path.write_text(json.dumps(config))
        env = {**os.environ, "AUTOSCALER_UPDATE_INTERVAL_S": "1", "RAY_FAKE_CLUSTER": "1", "RAY_AUTH_MODE": "disabled"}
        env.pop("RAY_ADDRESS", None)
        started = subprocess.run(
            [
                str(Path(sys.executable).with_name("ray")),
                "start",
                "--head",
                f"--port={port}",
                f"--temp-dir={self.temp_dir}",
                "--num-cpus=1",
                f"--resources={json.dumps(head_resources)}",
                f"--autoscaling-config={path}",
                "--include-dashboard=false",
                f"--dashboard-agent-listen-port={free_port()}",
                f"--ray-client-server-port={free_port()}",
                f"--system-config={json.dumps(FAST_NODE_DEATH)}",
            ],
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
        )
        if started.returncode != 0:
            self.shutdown()
            raise RuntimeError(f"ray start failed: {started.stderr[-3000:]}")

    def shutdown(self):
        """SIGKILL, by pid, every process of this cluster: those whose command line names its temp dir (the head's
        GCS, raylet, autoscaler; the worker nodes' raylets) and their descendants (workers, agents)."""
        procs = {}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                    parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                except (OSError, ValueError, IndexError):
                    continue
                procs[int(entry.name)] = (parent, cmdline)
        mine = {pid for pid, (_, cmdline) in procs.items() if self.temp_dir in cmdline and pid != os.getpid()}
        grew = True
        while grew:
            children = {pid for pid, (parent, _) in procs.items() if parent in mine} - mine - {os.getpid()}
            mine |= children
            grew = bool(children)
        for pid in sorted(mine):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def autoscaling():
    import ray

    if ray.is_initialized():  # the module's Cluster (the tests above)
        pytest.skip("run alone: another Ray cluster is connected")
    head, types, speed = manifest_cluster()
    cluster = FakeAutoscalingCluster(head, types, speed)
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        timeline = Timeline()
        yield cluster, timeline
    finally:
        with contextlib.suppress(Exception):
            timeline.close()
        ray.shutdown()
        cluster.shutdown()


def test_the_autoscaler_adds_a_generation_node_for_the_elastic_policy_and_removes_idle_nodes(
    autoscaling, tiny_model_dir, tmp_path
):
    """The worker groups of deploy/raycluster.yaml under the real autoscaler, the run configured as deploy/rayjob.yaml
    configures it (`cluster.resources`, `cluster.elastic`): the learner waits on rollouts (max_staleness 0), so at
    the policy's first decision (step 6) it asks for a second engine; the engine is pending until the autoscaler adds
    a generation node, then joins the weight transport and serves. At step 10 the pool shrinks again
    (`trainer.resize`: on CPU the learner always waits, so the policy itself would not): the engine is drained and
    removed, and its node, idle, is removed by the autoscaler; so is every worker node once the run ends."""
    _, timeline = autoscaling
    cluster = {
        **rayjob_cluster_overrides(),  # resources per role, elastic: true
        "max_generation_actors": 2,  # rayjob.yaml's 4, bounded for a 2-core machine
        "elastic_interval_steps": 6,  # decides at step 6 (grow), then quiet until step 13, then at 18 (past the end)
        "engine_kwargs": {"max_num_seqs": 16, "kv_cache_tokens": 2048, "max_model_len": 128},
        "collective_timeout_s": 120.0,  # a new engine waits for its node (seconds here, minutes for a GPU pod)
    }
    assert cluster["elastic"] is True and set(cluster["resources"]) >= {"learner", "generation", "rollout", "queue"}
    # 2 x NUM_ROWS prompts: the run must outlast the shrink at step 10 (a step takes a row's budget with a shared
    # prompt counted once, ~8 steps per 16 prompts here)
    trainer = grpo(tiny_model_dir, tmp_path, rows=2 * NUM_ROWS, max_staleness=0, cluster=cluster)
    up_at_step = {}

    def record(args, state, control, **kwargs):
        up_at_step[state.global_step] = timeline.alive_nodes()

    shrink = AtStep(timeline, 10, lambda: trainer.resize(generation=1))
    trainer.callbacks += [StepLog(timeline), type("Nodes", (), {"on_step_end": staticmethod(record)})(), shrink]
    try:
        state = trainer.train()
        timeline.log("the run ended: its actors are gone")
        deadline = time.monotonic() + 120
        while timeline.alive_nodes() != ["head#1"] and time.monotonic() < deadline:
            time.sleep(1)
        left = timeline.alive_nodes()
        timeline.log(f"nodes up: {left}")
    finally:
        timeline.print("autoscaler")

    assert_exactly_once(state["queue"], rows=2 * NUM_ROWS)
    assert shrink.done_at == 10 and state["global_step"] > 10
    events = trainer.run_state["elastic_events"]
    assert [event["action"] for event in events] == ["add_engine", "remove_engine"], events
    added, removed = events
    assert added["actor"] == removed["actor"] == "generation actor 1" and added["step"] == 6
    assert removed["requests"] > 0, "the engine on the autoscaled node served no request"
    assert removed["weights_version"] == removed["policy_version"] > added["policy_version"] > 0  # kept in sync
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    sizes = [r["elastic/generation_actors"] for r in records]
    assert sizes[:5] == [1.0] * 5 and sizes[5:9] == [2.0] * 4 and set(sizes[10:]) == {1.0}, sizes  # steps 6-9: 2
    first, grown = up_at_step[min(up_at_step)], up_at_step[9]

    # nodes by group (their numbers count launches: Ray's autoscaler may launch a second node for a pending actor
    # while the first still starts, and remove it idle, so the grown node can be "generation#3")
    def groups(nodes: list[str]) -> list[str]:
        return sorted(node.split("#")[0] for node in nodes)

    assert set(groups(first)) == {"generation", "head", "learner", "rollout"}, first  # a node per group
    assert groups(grown) == ["generation", "generation", "head", "learner", "rollout"], grown
    assert left == ["head#1"], "idle worker nodes were not removed"
