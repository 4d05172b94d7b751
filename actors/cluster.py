"""`Cluster`: the Ray side of a training run. It owns every Ray call the driver makes.

    launch(spec)  ->  connect to Ray (cluster.ray_address, RAY_ADDRESS, an existing ray.init(), else a local
                      cluster) -> check resources -> create and wire the actors of the RunSpec:
                      engines -> teachers -> learners -> weight group -> queue + cold sync -> rewards -> rollouts
                  ->  run the core's StepLoop over adapters of the actor handles (queue, learner group, weight
                      transport, fleet: rlasync.driver.protocols)
                  ->  remove every actor it made (also on error), and stop Ray if it started it

Every actor construction and actor method call is in a small named function (`spawn_*`, `connect_weights`, the
adapters), so a change of an actor's API touches one place.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import ray

from actors.cluster_elastic import RayPools
from actors.cluster_faults import (
    RestartWatch,
    blame,
    dead_actor_name,
    died_error,
    probe_engines,
    restart_options,
)
from actors.cluster_weights import RayWeightSync, connect_weights
from actors.fanout import (
    Named,
    Timeouts,
    actor_id,
    call_all,
    call_all_async,
    get_all,
    in_thread,
    remote_all,
    wait_until_dead,
)
from actors.loop_host import FROM_QUEUE
from actors.reaper import start_reaper, stop_reaper
from rlasync.config.vocab import EngineKind
from rlasync.driver import (
    RunSpec,
    ShutdownGuard,
    Taken,
    check_actor_health,
    check_resources,
    engine_dtype,
    server_engine_kwargs,
    step_budget,
)
from rlasync.driver.checkpoint import config_changes
from rlasync.driver.resources import check_custom_resources
from rlasync.driver.signals import interrupted_error
from rlasync.driver.spec import model_shares_prefixes, step_plan
from rlasync.driver.watchdog import silent_engines
from rlasync.weights.adapter import lora_engine_kwargs

logger = logging.getLogger(__name__)
# the kinds of actor that rollout actors refer to in their constructor: given Ray names (plus the named queue)
NAMED_KINDS = frozenset({"generation", "reward", "teacher"})


def launch(spec: RunSpec, *, state: dict[str, Any], actor_ids: list[str]) -> dict[str, Any]:
    """Run `spec` on Ray; `state` (the trainer's) is updated as the run goes and returned at the end; `actor_ids`
    (the trainer's) lists every actor created, also when the run fails."""
    changes = config_changes(spec.resume_dir, spec.config.to_dict())
    if changes:  # before Ray starts
        logger.warning("resuming from %s with a changed config: %s", spec.resume_dir, "; ".join(changes))
    guard = ShutdownGuard(spec.config.shutdown_grace_s, spec.config.output_dir)  # entered once Ray is up
    with Cluster(spec, actor_ids, guard) as cluster:
        loop = cluster.build(state)
        loop.stop_request, guard.loop_running = guard.request, True  # a signal now ends with a final checkpoint
        loop.checkpointer.run_config = spec.config.to_dict()  # run_config.json: a later resume names what changed
        try:
            final = asyncio.run(loop.run(spec.start_step, cluster.version))
            if guard.request.requested:  # the signal came as the run ended: its final checkpoint is written
                raise interrupted_error(guard.request, None, spec.config.output_dir)
            return final
        except ray.exceptions.RayActorError as exc:  # the queue, a learner rank, restarts used up: stop-and-resume
            timeouts, answered = cluster.timeouts, cluster.answered_at  # a frozen generation actor is named first
            raise blame(exc, cluster.names, cluster.engines, spec.config.output_dir, timeouts.probe, answered) from exc


async def _get(refs: Any, timeout: float) -> Any:
    """`get_all` off the event loop (the step loop's protocols are async)."""
    return await in_thread(get_all, refs, timeout)


class Cluster:
    """Creates, wires and removes the actors of one run (a context manager: `with Cluster(spec) as cluster`)."""

    def __init__(self, spec: RunSpec, actor_ids: list[str] | None = None, guard: ShutdownGuard | None = None) -> None:
        self.spec, self.config = spec, spec.config
        self.guard = guard  # the signal handlers: installed after ray.init (Ray's C++ SIGTERM handler would abort)
        self.timeouts = Timeouts.from_cluster(spec.config.cluster)  # every deadline of a call to the actors
        self.actor_ids = actor_ids if actor_ids is not None else []
        self.handles: list[Any] = []
        self.names: dict[str, str] = {}  # actor id (hex) -> "learner rank 0", "generation actor 1", ...
        self.rollouts: list[Any] = []
        self.engines: list[Any] = []
        self.dataset_ref: Any = None
        self.ray_names: dict[str, str] = {}  # actor id (hex) -> its Ray name (the actors rollout actors refer to)
        self.token = uuid.uuid4().hex[:8]  # this run's part of those names (runs may share a Ray cluster)
        self.started_ray = False
        self.reaper: Any = None  # the local cluster's processes die with the driver (actors/reaper.py)
        self.version = spec.version
        self.step_splitter: Any = None  # how the driver splits each step over the learner ranks (setup_learners)
        self.engine_count = self.rollout_count = 0  # actors of each pool made so far (they name the next one)
        self.engine_options: dict[str, Any] = {}
        self.rollout_parts: tuple[Any, dict[str, Any], list[Any]] = (None, {}, [])
        self.answered_at: dict[str, float | None] = {}  # engine name -> when it last answered (a frozen one's error)
        self.entered_at = time.perf_counter()
        self.startup_s: dict[str, float] = {}  # the start-up's phases (`build`), logged as perf/startup/*_s

    # ---- connect and remove -------------------------------------------------------------------------------------

    def __enter__(self) -> Cluster:
        self.entered_at = time.perf_counter()
        self.started_ray = connect(self.config.cluster.ray_address)
        self.startup_s["ray"] = time.perf_counter() - self.entered_at
        if self.started_ray:
            self.reaper = start_reaper(ray.get_runtime_context().get_session_name())
        if self.guard is not None:
            self.guard.__enter__()
        try:
            nodes = [node.get("Resources", {}) for node in ray.nodes() if node.get("Alive")]
            check_resources(self.spec.requests, ray.cluster_resources(), autoscaling=not self.started_ray, nodes=nodes)
            counts = {role: count for role, (count, *_) in self.spec.requests.items()}
            counts["teacher"] = len(self.spec.teachers or {})
            check_custom_resources(self.config.cluster.resources or {}, counts, nodes, not self.started_ray)
        except BaseException:
            self._disconnect()
            if self.guard is not None:
                self.guard.uninstall()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            self.remove()
        finally:
            self._disconnect()
            if self.guard is not None:  # after the teardown: a signal during it ends the process within the grace
                self.guard.uninstall()

    def _disconnect(self) -> None:
        if self.started_ray:
            ray.shutdown()
            self.started_ray = False
            stop_reaper(self.reaper)  # it kills what the session left behind (its agents) and exits
            self.reaper = None

    def remove(self) -> None:
        """Stop the rollout loops politely (bounded), then kill every actor this run made and wait (bounded) until
        each is gone: a ping on a killed actor fails once Ray reports it dead."""
        try:
            call_all(self.rollouts, "stop", timeout=self.timeouts.stop)
        except Exception as exc:  # dead or hung actors are killed below anyway
            logger.warning("stopping the rollout actors: %s", exc)
        handles, self.handles, self.rollouts = self.handles, [], []
        for handle in handles:
            try:
                ray.kill(handle, no_restart=True)
            except Exception as exc:
                logger.warning("ray.kill: %s", exc)
        wait_until_dead(handles, self.timeouts.death, names=self.names)

    # ---- wiring -------------------------------------------------------------------------------------------------

    def build(self, state: dict[str, Any]) -> Any:
        """Create every actor of the spec in dependency order, run the cold sync, start the rollouts; returns the
        StepLoop over adapters of the handles."""
        spec, cluster = self.spec, self.config.cluster
        mark = time.perf_counter()

        def phase(name: str) -> None:  # the time since the last phase ended
            nonlocal mark
            now = time.perf_counter()
            self.startup_s[name], mark = now - mark, now

        engines = self.engines = self.spawn_engines()  # first: the token budget defaults to the engine's max_model_len
        teachers = self.spawn_teachers()
        max_model_len = None if self.config.token_budget is not None else self.max_model_len(engines)
        share = model_shares_prefixes(spec.model, bool(getattr(self.config, "trust_remote_code", False)))
        group = spec.algorithm.group_size(self.config) if share else 1
        budget, tokens_per_step, samples_per_step = step_budget(self.config, cluster.num_learners, max_model_len, group)
        plan = step_plan(self.config, spec.algorithm, cluster.num_learners, budget, share)
        learners, settings = self.create_learners(budget)  # before the CPU actors: their processes start first
        queue = self.spawn_queue(tokens_per_step, samples_per_step, plan)
        rewards = self.spawn_rewards()
        # made now, started after the cold sync: their constructors run while the learners and engines start
        self.rollouts = self.spawn_rollouts(queue, engines, teachers, rewards)
        self.setup_learners(learners, settings)  # the engines are built meanwhile (their actors started at once)
        phase("learners")
        connect_weights(learners, engines, cluster)  # waits for the engines
        phase("engines")
        weights = RayWeightSync(
            learners,
            engines,
            queue,
            self.timeouts,
            cluster=cluster,
            names=self.names,
            output_dir=self.config.output_dir,
            hang_s=spec.hang_timeout_s,
            answered_at=self.answered_at,
        )
        self.version, _ = weights.sync_now(self.version)  # cold sync: the first served policy is version + 1
        phase("cold_sync")
        state["policy_version"] = self.version
        self.start_rollouts(self.rollouts)
        phase("rollouts")
        self.startup_s["total"] = time.perf_counter() - self.entered_at
        state["startup_s"] = dict(self.startup_s)  # the step loop logs them with its first step (and drops them)
        fleet = RayFleet(
            self.rollouts,
            spec.algorithm.rollout_name,
            spec.hang_setting,
            self.timeouts,
            engines=engines,
            names=self.names,
            output_dir=self.config.output_dir,
            heal=weights.heal,
            answered_at=self.answered_at,
            watches=[
                RestartWatch(kind, handles, self.names, self.timeouts.build)
                for kind, handles in (("reward", rewards), ("teacher", list(teachers.values())))
                if handles
            ],
        )
        return spec.step_loop(
            queue=RayQueue(queue, self.timeouts),
            learners=RayLearners(learners, self.timeouts, self.step_splitter),
            weights=weights,
            fleet=fleet,
            tokens_per_step=tokens_per_step,
            samples_per_step=samples_per_step,
            state=state,
            pools=RayPools(self, weights, fleet, queue, state),
            evaluate=self.evaluation(),
            composed=plan is not None,
        )

    def evaluation(self) -> Any:
        """The evaluation over the rollout actors (`spec.eval_dataset`; actors/evaluation.py), or None."""
        if self.spec.eval_dataset is None:
            return None
        from actors.evaluation import RayEvaluation

        generations = getattr(self.config, "num_generations_eval", None) or self.spec.algorithm.group_size(self.config)
        return RayEvaluation(lambda: self.rollouts, self.spec.eval_dataset, generations, self.timeouts.train_step)

    def spawn(self, actor_cls: Any, label: str, kind: str, name: str | None = None, **options: Any) -> Any:
        """One actor: `num_cpus` / `num_gpus` (and `name`) are Ray options, the rest its constructor's keywords;
        `label` names it in errors ("learner rank 0"), `kind` decides whether Ray restarts it (actors/cluster_faults.py)
        and which custom resources it asks for (`cluster.resources[kind]`)."""
        handle_options = {k: v for k, v in options.items() if k in ("num_cpus", "num_gpus")}
        init = {k: v for k, v in options.items() if k not in ("num_cpus", "num_gpus")}
        if name is None and kind in NAMED_KINDS:  # rollout actors' constructors refer to them by name (Named)
            name = f"rlasync-{self.token}-" + re.sub(r"[^A-Za-z0-9_.-]+", "-", label).strip("-")
        if name is not None:
            handle_options["name"] = name
        custom = self.config.cluster.role_resources(kind)  # cluster.resources: the nodes this role may run on
        if custom:
            handle_options["resources"] = custom
        handle = actor_cls.options(**handle_options, **restart_options(kind)).remote(**init)
        self.handles.append(handle)
        self.actor_ids.append(actor_id(handle))
        self.names[actor_id(handle)] = label
        if name is not None:
            self.ray_names[actor_id(handle)] = name
        return handle

    def named(self, handle: Any) -> Named:
        """`handle` by its Ray name, for a restartable actor's constructor (`actors.fanout.Named`)."""
        return Named(self.ray_names[actor_id(handle)])

    def spawn_engines(self) -> list[Any]:
        """The GenerationActors of the policy (they receive the weight syncs)."""
        config, cluster = self.config, self.config.cluster
        traits = EngineKind(cluster.engine).traits
        server_url = cluster.vllm_server_url
        if traits.needs_url and server_url is None:
            server_url = config.vllm_server_base_url  # TRL's field
        engine_kwargs = cluster.engine_kwargs
        if traits.remote:
            engine_kwargs = server_engine_kwargs(config, engine_kwargs)
        if self.spec.learner.peft_config is not None and cluster.lora_sync == "adapter":  # runtime adapters
            engine_kwargs = {
                **lora_engine_kwargs(
                    self.spec.learner.peft_config,
                    cluster.engine,
                    max_loras=cluster.max_loras,
                    lora_dir=cluster.lora_dir or f"{config.output_dir}/lora_adapters",
                ),
                **(engine_kwargs or {}),
            }
        sampling = self.spec.algorithm.sampling
        self.engine_options = dict(
            model=self.spec.model,
            dtype=engine_dtype(config),
            engine_kwargs=engine_kwargs,
            warm_sampling=None if sampling is None else [sampling(config)],
            engine=cluster.engine,
            vllm_server_url=server_url,
            num_cpus=cluster.generation_num_cpus,
            num_gpus=cluster.generation_num_gpus,
            loop_stall_s=cluster.generation_stall_s,
            switch_interval_s=cluster.gil_switch_interval_s,
        )
        return [self.spawn_engine() for _ in range(cluster.num_generation_actors)]

    def spawn_engine(self) -> Any:
        """One more GenerationActor (numbered on: "generation actor 2"); `spawn_engines` ran first."""
        from actors.generation import GenerationActor

        index, self.engine_count = self.engine_count, self.engine_count + 1
        return self.spawn(GenerationActor, f"generation actor {index}", "generation", **self.engine_options)

    def max_model_len(self, engines: Sequence[Any]) -> int:
        return ray.get(engines[0].max_model_len.remote(), timeout=self.timeouts.call)

    def spawn_teachers(self) -> dict[str, Any]:
        """One TeacherScorer per teacher of the spec (distillation; scoring only, they never receive weights),
        waited for until built (or failed)."""
        if not self.spec.teachers:
            return {}
        from actors.teacher import TeacherScorer

        cluster = self.config.cluster
        teachers = {
            teacher_id: self.spawn(
                TeacherScorer,
                f"teacher {teacher_id!r}",
                "teacher",
                teacher_id=teacher_id,
                model=t.model,
                engine=t.engine,
                base_url=t.base_url,
                engine_kwargs=cluster.engine_kwargs if t.is_local else server_engine_kwargs(self.config, None),
                num_cpus=cluster.teacher_num_cpus,
                num_gpus=cluster.generation_num_gpus if t.is_local else 0.0,
            )
            for teacher_id, t in self.spec.teachers.items()
        }
        call_all(list(teachers.values()), "stats", timeout=self.timeouts.build)
        return teachers

    def create_learners(self, budget: int) -> tuple[list[Any], Any]:
        """The learner ranks' actors, not set up yet (their processes start meanwhile: `setup_learners` follows),
        and the settings they were given."""
        from actors.learner import LearnerActor

        spec, cluster = self.spec, self.config.cluster
        num_learners = cluster.num_learners
        settings = spec.algorithm.learner_settings(  # the algorithm's objective class and loss settings
            self.config,
            token_budget=budget,
            max_steps=spec.learner.max_steps,
            teacher_ids=spec.learner.teacher_ids,
            peft_config=spec.learner.peft_config,
            optimizer_overrides=spec.learner.optimizer_overrides,
        )
        learners = [
            self.spawn(
                LearnerActor,
                f"learner rank {rank}",
                "learner",
                rank=rank,
                world_size=num_learners,
                model=spec.model,
                settings=settings,
                num_cpus=cluster.learner_num_cpus,
                num_gpus=cluster.learner_num_gpus,
            )
            for rank in range(num_learners)
        ]
        return learners, settings

    def setup_learners(self, learners: list[Any], settings: Any) -> list[Any]:
        """Set up the ranks `create_learners` made (process group, model, optimizer; resumed from the spec's
        checkpoint) and wait for them."""
        from rlasync.learner.sharing import StepSplitter

        cluster = self.config.cluster
        timeout, num_learners = cluster.collective_timeout_s, cluster.num_learners
        master = ray.get(learners[0].address.remote(), timeout=timeout) if num_learners > 1 else None
        infos = call_all(learners, "setup", master, timeout, self.spec.resume_dir, timeout=self.timeouts.build)
        self.step_splitter = StepSplitter.for_learners(settings, num_learners, infos[0].get("share_prefixes", True))
        return learners

    def spawn_queue(self, tokens_per_step: int, samples_per_step: int | None = None, plan: Any = None) -> Any:
        """The named StalenessQueue actor (resumed at the checkpoint's prompt position); `plan`: the `StepPlan` it
        composes the steps with."""
        from actors.staleness_queue import QueueActor

        spec = self.spec
        return self.spawn(
            QueueActor,
            "the queue actor (StalenessQueue)",
            "queue",
            name=f"{spec.queue_name}-{uuid.uuid4().hex[:8]}",
            settings=spec.queue.with_tokens_per_step(tokens_per_step, samples_per_step, plan),
            resume=spec.resume_state.to_dict() if spec.resume_state else None,
            num_cpus=self.config.cluster.queue_num_cpus,
        )

    def spawn_rewards(self) -> list[Any]:
        """The RewardActor pool (an algorithm that scores through one, with `cluster.num_reward_actors` > 0)."""
        if not self.spec.algorithm.reward_actors:
            return []
        from actors.reward import RewardActor

        cluster = self.config.cluster
        return [
            self.spawn(
                RewardActor,
                f"reward actor {i}",
                "reward",
                reward_funcs=self.spec.rollout.reward_funcs,
                num_cpus=cluster.reward_num_cpus,
                num_gpus=cluster.reward_num_gpus,
            )
            for i in range(cluster.num_reward_actors)
        ]

    def spawn_rollouts(self, queue: Any, engines: list[Any], teachers: dict[str, Any], rewards: list[Any]) -> list[Any]:
        """The rollout actors of the spec's kind, made but not started (`start_rollouts`, after the cold sync: their
        constructors, imports and tokenizers run while the learners and engines start)."""
        cluster = self.config.cluster
        # kept by the Cluster and held by the queue actor, where the rollout actors (restarted or added later too)
        # fetch it: an object ref among their constructor's arguments would make Ray log an error at every start
        self.dataset_ref = ray.put(self.spec.train_dataset)
        ray.get(queue.hold_dataset.remote([self.dataset_ref]), timeout=self.timeouts.build)
        self.rollout_parts = (queue, teachers, rewards)
        return [self.spawn_rollout(engines) for _ in range(cluster.num_rollout_actors)]

    def start_rollouts(self, rollouts: list[Any]) -> list[Any]:
        """Start the rollout loops (waits for the actors' constructors)."""
        call_all(rollouts, "start", timeout=self.timeouts.build)
        return rollouts

    def spawn_rollout(self, engines: list[Any]) -> Any:
        """One more RolloutActor over `engines` (not started; numbered on, so its owner name at the queue is new),
        wired as the algorithm says (group size, engine keyword, reward actors, teachers, sink);
        `spawn_rollouts` ran first."""
        from actors.rollout import RolloutActor

        spec, config, cluster = self.spec, self.config, self.config.cluster
        algorithm, (queue, teachers, rewards) = spec.algorithm, self.rollout_parts
        i, self.rollout_count = self.rollout_count, self.rollout_count + 1
        return self.spawn(
            RolloutActor,
            f"{algorithm.rollout_name} {i}",
            "rollout",
            index=i,
            actor_name=algorithm.rollout_name,
            config=config,
            tokenizer=spec.tokenizer,
            dataset=FROM_QUEUE,
            queue=self.named(queue),  # by name, not handle (Named)
            engines=[self.named(engine) for engine in engines],
            loop_cls=spec.rollout.loop_cls,
            loop_kwargs=spec.rollout.loop_kwargs,
            group_size=algorithm.group_size(config),
            engine_arg=algorithm.engine_arg,
            sink=algorithm.sink,
            reward_actors=[self.named(r) for r in rewards] if algorithm.reward_actors else None,
            teachers={k: self.named(t) for k, t in teachers.items()} if algorithm.teachers else None,
            seed=config.seed,
            num_cpus=cluster.rollout_num_cpus,
        )


def connect(address: str | None) -> bool:
    """Join the configured / existing cluster; start a local one if there is none. True if this call started it.

    Ray's own rule for an unset address: `RAY_ADDRESS`, else the cluster the last `ray start` on this machine left
    running (joined, with a log line saying how to start one for this run instead: `ray_address: local`), else a new
    local cluster; "local" always starts one. Only a cluster started here is shut down (and reaped) by this run,
    and only a joined one may grow by its autoscaler."""
    if ray.is_initialized():
        return False
    address = address or os.environ.get("RAY_ADDRESS") or None
    if address is None:
        running = started_by_ray_start()
        if running is not None:
            logger.info(
                "joining the Ray cluster that `ray start` left running at %s (cluster.ray_address: local starts a "
                "cluster of this run's own instead)",
                running,
            )
            address = running
    if address is not None and address != "local":
        ray.init(address=address, log_to_driver=True)
        return False
    ray.init(address="local", include_dashboard=False, log_to_driver=True)
    return True


def started_by_ray_start() -> str | None:
    """The address of the cluster `ray.init()` without an address would join (the last `ray start` on this machine,
    still running), or None when it would start one. Ray's own lookup, which has no public name: read here only."""
    try:
        from ray._private.services import canonicalize_bootstrap_address

        return canonicalize_bootstrap_address(None)
    except (ImportError, ConnectionError, ValueError) as exc:  # no such lookup in this Ray, or a stale address file
        logger.debug("no running `ray start` cluster found: %s", exc)
        return None


# ---- the core's protocols over actor handles ----------------------------------------------------------------------


class RayQueue:
    """`SampleQueue` over the QueueActor."""

    def __init__(self, handle: Any, timeouts: Timeouts) -> None:
        self.handle, self.timeouts = handle, timeouts

    async def take(self, token_target: int, timeout_s: float) -> Taken:
        result = await _get(
            self.handle.wait_take.remote(token_target, timeout_s), timeout_s + self.timeouts.take_margin
        )
        entries = list(result.entries)  # the payload refs with what the step's split plans with (RayLearners)
        return Taken(entries, result.num_tokens, list(result.metrics.items()), step_full=result.step_full)

    async def finish_step(self, tokens: int, unplanned: int = 0) -> None:
        await _get(self.handle.finish_step.remote(tokens, unplanned), self.timeouts.call)

    async def set_policy_version(self, version: int) -> None:
        await _get(self.handle.set_policy_version.remote(version), self.timeouts.call)

    async def state(self) -> dict[str, Any]:
        return await _get(self.handle.state.remote(), self.timeouts.health)

    async def rollout_state(self) -> dict[str, Any]:
        return await _get(self.handle.rollout_state.remote(), self.timeouts.health)


class RayLearners:
    """`LearnerGroup` over the LearnerActor ranks. The step's `refs` are the queue's entries (`RayQueue.take`):
    `splitter` (a `rlasync.learner.sharing.StepSplitter`) plans the step's rows once, here, and each rank is sent
    only the refs of its own rows' samples with its share (docs/design.md §6.2); without a splitter, or for entries
    without token ids, every rank is sent the whole step and splits it itself."""

    def __init__(self, handles: list[Any], timeouts: Timeouts, splitter: Any = None) -> None:
        self.handles, self.timeouts, self.splitter = handles, timeouts, splitter

    async def train_step(self, refs: Sequence[Any]) -> list[tuple[str, Any]]:
        entries = list(refs)
        parts = await asyncio.to_thread(self.splitter.split, entries) if self.splitter is not None else None
        if parts is None:
            payloads = [getattr(entry, "payload", entry) for entry in entries]
            items = await call_all_async(self.handles, "train_step", payloads, timeout=self.timeouts.train_step)
        else:
            items = await call_all_async(self.handles, "train_step", each=parts, timeout=self.timeouts.train_step)
        return items[0]

    async def save(self, directory: str, tokenizer: Any) -> None:
        await call_all_async(self.handles, "save", directory, tokenizer, timeout=self.timeouts.save)


class RayFleet:
    """`Fleet` over the rollout actors; `name` opens their errors ("rollout actor 0 failed: ..."). Before each
    health check and metric drain a generation actor Ray restarted is brought back (`heal`: the weight transport
    re-opened, the current policy sent), and every rollout actor is asked to `ensure_running` (a rollout actor Ray
    restarted releases its predecessor's leases and starts its loop: actors/restart.py). A failure that is another actor's
    death is reported as that actor's ("generation actor 0 died (seen by rollout actor 0: ...)"); a hung rollout
    loop first probes the generation actors, so a frozen one is named instead of the loop waiting for it."""

    def __init__(
        self,
        handles: list[Any],
        name: str,
        setting: str,
        timeouts: Timeouts,
        *,
        engines: Sequence[Any] = (),
        names: dict[str, str] | None = None,
        output_dir: str = ".",
        heal: Callable[[], Awaitable[Any]] | None = None,
        answered_at: dict[str, float | None] | None = None,
        watches: Sequence[Any] = (),
    ) -> None:
        self.handles, self.name, self.setting, self.timeouts = handles, name, setting, timeouts
        self.engines, self.names, self.output_dir = list(engines), names or {}, output_dir
        self.heal = heal  # brings back generation actors Ray restarted (RayWeightSync.heal)
        self.restarts = 0
        self.answered_at = answered_at if answered_at is not None else {}  # engine name -> its last answer (wall)
        self.watches = list(watches)  # RestartWatch: reward actors and teachers Ray restarted, reported

    async def _call(self, index: int, ref: Any, timeout: float) -> Any:
        try:
            return await _get(ref, timeout)
        except ray.exceptions.RayActorError as exc:  # restarts used up (or not restartable): stop with its name
            raise died_error(f"{self.name} {index}", exc, self.output_dir) from exc

    async def ensure_running(self) -> None:
        if self.heal is not None:
            await self.heal()
        refs = remote_all(self.handles, "ensure_running")  # all asked at once: one round trip
        for index, (rollout, ref) in enumerate(zip(self.handles, refs)):  # (at every step, to busy actors)
            released = await self._call(index, ref, self.timeouts.restart)
            if released is not None:  # Ray restarted it with its first engines: give it the current ones
                await self._call(index, rollout.set_engines.remote(self.engines, self.labels()), self.timeouts.call)
                self.restarts += 1
                logger.warning(
                    "%s %d was restarted after it died: %d of its leases released and generated again",
                    self.name,
                    index,
                    released,
                )

    def labels(self) -> list[str]:
        """The engines' names ("generation actor 2"), as the rollout actors' channels call them."""
        return [self.names.get(actor_id(engine), "generation actor") for engine in self.engines]

    async def check_health(self, stale_after_s: float) -> list[tuple[str, dict[str, Any]]]:
        await self.ensure_running()
        healths = []
        for index, rollout in enumerate(self.handles):
            name = f"{self.name} {index}"
            health = await self._call(index, rollout.health.remote(), self.timeouts.health)
            self._note_answers(health)
            try:
                check_actor_health(name, health, stale_after_s, self.setting)
            except RuntimeError as exc:
                dead = dead_actor_name(health.get("error") or "", self.names)
                if dead is not None:
                    raise died_error(dead, health["error"], self.output_dir, seen_by=name) from exc
                await self._probe(name)
                raise
            healths.append((name, health))
        silent = silent_engines(healths, stale_after_s)
        if silent:  # requests wait on an engine that answered nothing for the hang bound: frozen ones are named
            await self._probe(f"{', '.join(n for n, _ in healths)} (waiting on {', '.join(silent)})")
        return healths

    async def _probe(self, seen_by: str) -> None:
        await in_thread(
            probe_engines, self.engines, self.names, seen_by, self.output_dir, self.timeouts.probe, self.answered_at
        )

    def _note_answers(self, health: dict[str, Any]) -> None:
        """Keep, per engine, the newest time any rollout actor had an answer from it (for the frozen engine's error)."""
        now = time.time()
        for entry in health.get("engines") or ():
            name, age = entry["name"], entry.get("answered_age_s")
            at = None if age is None else now - float(age)
            known = self.answered_at.get(name)
            self.answered_at[name] = known if at is None or (known is not None and known > at) else at

    async def drain_metrics(self) -> list[tuple[str, Any]]:
        draining = remote_all(self.handles, "drain_metrics")  # asked with the restart check: one round trip
        await self.ensure_running()
        drained = await _get(draining, self.timeouts.call)
        restarts = [item for watch in self.watches for item in watch.check()]
        if self.restarts:  # rollout actors Ray restarted, counted by ensure_running
            restarts.append(("faults/rollout_restarts", float(self.restarts)))
        return [item for items in drained for item in items] + restarts

    async def drain_completions(self) -> list[Any]:
        """`log_completions`: every rollout actor's sample of the window's completions."""
        drained = await call_all_async(self.handles, "drain_completions", timeout=self.timeouts.call)
        return [row for rows in drained for row in rows]

    async def stop(self) -> None:
        await call_all_async(self.handles, "stop", timeout=self.timeouts.stop)
