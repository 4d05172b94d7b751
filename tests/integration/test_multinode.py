"""GRPO on a multi-node Ray cluster on one machine (`ray.cluster_utils.Cluster`: a raylet per "node", each with its
own custom resource standing in for a node group), then a node is lost mid-run (its raylet killed, as a crash):

- the generation node (the engine and the rollout actor): Ray re-places both on the replacement node (the only other
  node with `generation_node`), the driver re-opens the weight transport to the restarted engine, the restarted
  rollout actor's leases are released, the run finishes its epoch and every prompt is consumed exactly once;
- the learner node: the run stops naming the learner rank and the lost node, and the checkpoint to resume from; a
  resume on a new learner node finishes the epoch.

`cluster.resources` keeps each role on its nodes (the queue on the head, with the driver: the samples it owns live
there). Marked `standalone_cluster` (it starts its own Ray cluster, not the session's): `.ci/run` runs it alone:

    python -m pytest -q -rP -m standalone_cluster tests/integration/test_multinode.py   (-rP: the timelines)

Each test prints its timeline: which actor ran on which node when, the node changes, the restarts.
"""

import json
import sys
import threading
import time

import pytest

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


def digit_reward(completions, **kwargs):
    return [
        sum(w.isdigit() for w in c[-1]["content"].split()) / max(len(c[-1]["content"].split()), 1) for c in completions
    ]


class Nodes:
    """The Ray cluster of the module: a head (driver + queue), a learner node, a generation node; named nodes and a
    timeline of what happened to them and to the actors on them."""

    def __init__(self) -> None:
        import ray
        from ray.cluster_utils import Cluster

        self.t0 = time.monotonic()
        self.events: list[tuple[float, str]] = []
        self.names: dict[str, str] = {}
        self.cluster = Cluster(
            initialize_head=True,
            head_node_args={"num_cpus": 1, "resources": {"head_node": 1}, "_system_config": FAST_NODE_DEATH},
        )
        self.names[self.cluster.head_node.node_id] = "head"
        self.nodes = {"head": self.cluster.head_node}
        self.add("learner-1", learner_node=1)
        self.add("generation-1", generation_node=1)
        ray.init(address=self.cluster.address, log_to_driver=False)
        self._seen: dict[str, tuple[str, str, int]] = {}
        self._stop = threading.Event()
        self._watch = threading.Thread(target=self._poll, daemon=True)
        self._watch.start()

    def log(self, text: str) -> None:
        self.events.append((time.monotonic() - self.t0, text))

    def add(self, name: str, **resources: float) -> None:
        node = self.cluster.add_node(num_cpus=1, resources=resources)
        self.nodes[name], self.names[node.node_id] = node, name
        self.log(f"node {name} joined ({node.node_id[:8]}, {resources})")

    def remove(self, name: str) -> None:
        self.cluster.remove_node(self.nodes.pop(name), allow_graceful=False)  # the raylet killed: a crash
        self.log(f"node {name} lost (raylet killed)")

    def where(self, class_name: str) -> list[str]:
        """The nodes of the live actors of `class_name`."""
        from ray._private.state import actors

        return [
            self.names.get(row["Address"]["NodeID"], "?")
            for row in actors().values()
            if row["ActorClassName"] == class_name and row["State"] == "ALIVE"
        ]

    def _poll(self) -> None:
        from ray._private.state import actors

        while not self._stop.wait(0.25):
            try:
                table = actors()
            except Exception:  # the GCS restarting or shutting down: the next poll sees it
                continue
            for key, row in table.items():
                node = self.names.get(row["Address"]["NodeID"], "-") if row["State"] == "ALIVE" else "-"
                now = (row["State"], node, row["NumRestarts"])
                if self._seen.get(key) != now:
                    self._seen[key] = now
                    restarts = f", restart {now[2]}" if now[2] else ""
                    self.log(f"{row['ActorClassName']} {key[:6]}: {now[0]} on {node}{restarts}")

    def timeline(self, title: str) -> str:
        lines = [f"{at:7.1f} s  {text}" for at, text in sorted(self.events)]
        self.events.clear()
        return f"\n---- timeline: {title} ----\n" + "\n".join(lines)

    def close(self) -> None:
        import ray

        self._stop.set()
        self._watch.join(timeout=5)
        ray.shutdown()
        self.cluster.shutdown()


@pytest.fixture(scope="module")
def nodes():
    import ray.cloudpickle

    nodes = Nodes()
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
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


def grpo(tiny_model_dir, tmp_path, **changes):
    from rlasync import AsyncGRPOConfig, AsyncGRPOTrainer
    from rlasync.data import arithmetic_dataset

    fields = dict(
        output_dir=str(tmp_path),
        max_steps=-1,
        num_train_epochs=1.0,
        num_generations=4,
        max_completion_length=8,
        token_budget=64,
        learning_rate=1e-2,
        logging_steps=1,
        save_steps=100,
        max_staleness=2,
        gradient_checkpointing=False,
        temperature=1.0,
        top_k=16,
        seed=0,
        cluster={
            "engine_kwargs": {"max_num_seqs": 16, "kv_cache_tokens": 2048, "max_model_len": 128},
            "collective_timeout_s": 60.0,
            "resources": RESOURCES,
        },
    )
    fields.update(changes)
    return AsyncGRPOTrainer(
        model=tiny_model_dir,
        reward_funcs=digit_reward,
        args=AsyncGRPOConfig(**fields),
        train_dataset=arithmetic_dataset(NUM_ROWS, seed=0),
    )


def assert_exactly_once(queue):
    outcomes = {k: v for k, v in queue["outcomes"].items() if k != "stale"}  # stale groups are leased again
    assert queue["done"] and queue["consumed_groups"] == NUM_ROWS and queue["first_untrained_index"] == NUM_ROWS
    assert sum(outcomes.values()) == NUM_ROWS and set(outcomes) <= {"trained", "zero_std", "filtered", "failed"}
    assert queue["queue_size"] == 0 and queue["inflight_groups"] == 0 and queue["leased_groups"] == 0


def test_the_generation_node_is_lost_its_actors_are_re_placed_and_every_prompt_is_consumed_once(
    nodes, tiny_model_dir, tmp_path
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
        print(nodes.timeline("generation node lost"))

    assert lose.done_at == 2, "the run ended before the node was lost"
    assert placed == {  # each role on its group of nodes (cluster.resources)
        "LearnerActor": ["learner-1"],
        "GenerationActor": ["generation-1"],
        "RolloutActor": ["generation-1"],
        "QueueActor": ["head"],
    }
    assert_exactly_once(state["queue"])
    assert state["global_step"] > 2
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    restarts = [r["faults/generation_restarts"] for r in records if "faults/generation_restarts" in r]
    assert restarts and restarts[-1] >= 1, "the driver did not re-sync a restarted engine"
    versions = [r["policy_version"] for r in records]
    assert versions == sorted(versions) and versions[-1] > state["global_step"]  # the re-sync is a policy version
    assert (tmp_path / f"checkpoint-{state['global_step']}" / "trainer_state.json").is_file()


def test_the_learner_node_is_lost_the_run_stops_naming_it_and_resumes_on_a_new_node(nodes, tiny_model_dir, tmp_path):
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
        print(nodes.timeline("learner node lost, resumed"))

    assert lose.done_at == 3
    assert message.startswith("learner rank 0 died (its node "), message
    assert "was lost" in message and "--resume" in message and str(tmp_path / "checkpoint-2") in message, message
    assert any(text.endswith("on learner-2") for text in learner_nodes), learner_nodes
    saved = json.loads((tmp_path / "checkpoint-2" / "rollout_state.json").read_text())
    queue, rest = state["queue"], NUM_ROWS - saved["prompt_index"]  # the resumed run: the prompts after checkpoint-2
    outcomes = {k: v for k, v in queue["outcomes"].items() if k != "stale"}
    assert 0 < rest < NUM_ROWS and queue["done"] and queue["first_untrained_index"] == NUM_ROWS
    assert queue["consumed_groups"] == sum(outcomes.values()) == rest, (queue, saved)  # each exactly once
    assert queue["queue_size"] == 0 and queue["inflight_groups"] == 0 and queue["leased_groups"] == 0
    assert state["global_step"] > 3
