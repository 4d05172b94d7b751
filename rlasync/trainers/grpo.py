"""`AsyncGRPOTrainer`: TRL's constructor, run on Ray actors (DESIGN.md §1).

    trainer = AsyncGRPOTrainer(model="smollm2-135m-instruct", reward_funcs=last_number_reward,
                               args=AsyncGRPOConfig(...), train_dataset=dataset)
    trainer.train()                      # or train(resume_from_checkpoint=True / "out/checkpoint-20")

`train()` connects to Ray (the config's `cluster.ray_address`, else `RAY_ADDRESS`, else an existing
`ray.init()`, else a new local cluster), creates the actors of the `cluster` section, runs the step loop

    take (token target, from the StalenessQueue) -> learners train -> every weight_sync_steps: pause engines,
    broadcast from learner rank 0 (NCCL GPU to GPU, or gloo through the CPU), resume, publish the policy
    version -> log a window -> maybe checkpoint

and removes every actor it made on the way out, also on error. Ray is imported inside functions only.
"""

from __future__ import annotations

import inspect
import logging
import math
import os
import pickle
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from rlasync.config import AsyncGRPOConfig
from rlasync.data import validate_prompt_dataset
from rlasync.rollout.environments import EnvironmentFactory
from rlasync.rollout.loop import AsyncRolloutLoop
from rlasync.rollout.tools import tools_by_name

logger = logging.getLogger(__name__)

TAKE_POLL_S = 5.0
CHECKPOINT_PREFIX = "checkpoint-"
TRAINER_STATE = "trainer_state.json"


class AsyncGRPOTrainer:
    """Asynchronous GRPO (TRL's `AsyncGRPOTrainer` API). Subclass and set `loop_cls` to customise rollouts."""

    loop_cls: type[AsyncRolloutLoop] = AsyncRolloutLoop

    def __init__(
        self,
        model: Any,
        reward_funcs: Callable[..., Any] | Sequence[Callable[..., Any]] | None = None,
        args: AsyncGRPOConfig | None = None,
        train_dataset: Any = None,
        processing_class: Any = None,
        callbacks: Sequence[Any] | None = None,
        loop_cls: type[AsyncRolloutLoop] | None = None,
        tools: Sequence[Callable[..., Any]] | None = None,
        environment_factory: EnvironmentFactory | Mapping[str, EnvironmentFactory] | None = None,
    ) -> None:
        self.args = args if args is not None else AsyncGRPOConfig()
        if loop_cls is not None:
            self.loop_cls = loop_cls
        self.tools = _checked_tools(tools)
        self.environment_factory = _checked_environment_factory(environment_factory)
        if train_dataset is None:
            train_dataset = self._placeholder_dataset(environment_factory)
        validate_prompt_dataset(train_dataset)
        self.train_dataset = train_dataset
        if reward_funcs is None:
            reward_funcs = []
        self.reward_funcs = [reward_funcs] if callable(reward_funcs) else list(reward_funcs)
        if (
            not self.reward_funcs
            and not getattr(self.loop_cls, "provides_rollout_rewards", False)
            and not _may_own_reward(environment_factory)
        ):
            raise ValueError(
                "No reward source: pass reward_funcs (e.g. rlasync.rewards.last_number_reward), an "
                "environment_factory whose class defines get_reward, or a loop_cls whose generate_one sets "
                "Rollout.reward and provides_rollout_rewards = True"
            )
        for func in self.reward_funcs:
            if not callable(func):
                raise ValueError(f"reward_funcs: {func!r} is not callable (pass functions, not their names)")
        self.model = self._model_path(model)
        self.processing_class = processing_class
        self.callbacks = list(callbacks or [])
        self.state: dict[str, Any] = {"global_step": 0, "policy_version": 0}
        self.actor_ids: list[str] = []

    # ---- public -------------------------------------------------------------------------------------------------

    def train(self, resume_from_checkpoint: str | bool | None = None) -> dict[str, Any]:
        """Run until `max_steps` (or the epochs' prompts are consumed); returns the final state."""
        import ray

        resume_dir = self._resume_dir(resume_from_checkpoint)
        started_ray = self._connect(ray)
        self._handles: list[Any] = []
        self._rollouts: list[Any] = []
        try:
            check_resources(self._actor_requests(), ray.cluster_resources(), autoscaling=not started_ray)
            return self._train(ray, resume_dir)
        finally:
            self._shutdown(ray)
            if started_ray:
                ray.shutdown()

    # ---- setup --------------------------------------------------------------------------------------------------

    def _placeholder_dataset(self, environment_factory: Any) -> list[dict[str, Any]]:
        """Without a dataset, a single environment supplies the prompts (SPEC §3.4): B x GA rows with an empty
        user message, to which each rollout's `reset()` observation is appended."""
        if environment_factory is None:
            raise ValueError(
                "`train_dataset` is required: pass a dataset with a 'prompt' column (or, to let an environment "
                "write the prompts, a single environment_factory and max_steps > 0)"
            )
        if isinstance(environment_factory, Mapping):
            raise ValueError(
                "a dict environment_factory (several environments) requires a `train_dataset` whose "
                "'environment' column routes each row to one of them"
            )
        if self.args.max_steps <= 0:
            raise ValueError(
                f"max_steps={self.args.max_steps}: without a train_dataset the environment yields an endless "
                "stream of prompts, so set max_steps > 0"
            )
        num_rows = self.args.per_device_train_batch_size * self.args.gradient_accumulation_steps
        return [{"prompt": [{"role": "user", "content": ""}]} for _ in range(num_rows)]

    def _model_path(self, model: Any) -> str:
        if isinstance(model, str | os.PathLike):
            return str(model)
        if hasattr(model, "save_pretrained"):  # an instantiated model: the actors load it from a folder
            path = Path(self.args.output_dir) / "initial_model"
            model.save_pretrained(path)
            return str(path)
        raise ValueError(f"model must be a hub id, a local path, an alias or a PreTrainedModel, got {type(model)}")

    def _resume_dir(self, resume: str | bool | None) -> str | None:
        if not resume:
            return None
        if resume is True:
            checkpoints = sorted(
                Path(self.args.output_dir).glob(f"{CHECKPOINT_PREFIX}*"),
                key=lambda p: int(p.name.removeprefix(CHECKPOINT_PREFIX)),
            )
            if not checkpoints:
                raise ValueError(f"resume_from_checkpoint=True but {self.args.output_dir} holds no checkpoint-*")
            return str(checkpoints[-1])
        if not Path(resume).is_dir():
            raise ValueError(f"resume_from_checkpoint={resume!r} is not a directory")
        return str(resume)

    def _connect(self, ray: Any) -> bool:
        """Join the configured / existing cluster; start a local one if there is none. True if we started it."""
        if ray.is_initialized():
            return False
        address = self.args.cluster.ray_address or os.environ.get("RAY_ADDRESS")
        if address:
            ray.init(address=address, log_to_driver=True)
            return False
        ray.init(include_dashboard=False, log_to_driver=True)
        return True

    def _actor_requests(self) -> dict[str, tuple[int, float, float]]:
        """Per actor role: (count, CPUs each, GPUs each), as `_train` will spawn them."""
        c = self.args.cluster
        return {
            "generation": (c.num_generation_actors, c.generation_num_cpus, c.generation_num_gpus),
            "learner": (c.num_learners, c.learner_num_cpus, c.learner_num_gpus),
            "rollout": (c.num_rollout_actors, c.rollout_num_cpus, 0.0),
            "reward": (c.num_reward_actors, c.reward_num_cpus, 0.0),
            "queue": (1, c.queue_num_cpus, 0.0),
        }

    def _spawn(self, actor_cls: Any, name: str | None = None, **options: Any) -> Any:
        handle_options = {k: v for k, v in options.items() if k in ("num_cpus", "num_gpus")}
        init = {k: v for k, v in options.items() if k not in ("num_cpus", "num_gpus")}
        if name is not None:
            handle_options["name"] = name
        handle = actor_cls.options(**handle_options).remote(**init)
        self._handles.append(handle)
        self.actor_ids.append(handle._actor_id.hex())
        return handle

    def _train(self, ray: Any, resume_dir: str | None) -> dict[str, Any]:
        from actors.reward import RewardActor
        from actors.rollout import RolloutActor

        args, cluster = self.args, self.args.cluster
        timeout = cluster.collective_timeout_s
        model, tokenizer, resume_state, start_step, version = self._starting_point(resume_dir)

        # generation first (the token budget defaults to the engine's max_model_len)
        gens = self._spawn_engines(model)
        budget, tokens_per_step, samples_per_step = self._step_budget(ray, gens)
        learners = self._spawn_learners(ray, model, budget, resume_dir)
        sync, version = self._connect_weights(ray, learners, gens, "rlasync-staleness-queue", tokens_per_step,
                                              resume_state, version)  # fmt: skip
        queue = sync.queue

        rewards = [
            self._spawn(RewardActor, reward_funcs=self.reward_funcs, num_cpus=cluster.reward_num_cpus)
            for _ in range(cluster.num_reward_actors)
        ]
        dataset_ref = ray.put(self.train_dataset)
        self._rollouts = [
            self._spawn(RolloutActor, index=i, config=args, tokenizer=tokenizer, dataset=dataset_ref,
                        reward_funcs=self.reward_funcs, queue=queue, engines=gens, loop_cls=self.loop_cls,
                        seed=args.seed, reward_actors=rewards, num_cpus=cluster.rollout_num_cpus,
                        tools=self.tools, environment_factory=self.environment_factory)
            for i in range(cluster.num_rollout_actors)
        ]  # fmt: skip
        ray.get([rollout.start.remote() for rollout in self._rollouts], timeout=timeout + 600)

        return self._step_loop(ray, queue, learners, sync, tokenizer, start_step=start_step, version=version,
                               tokens_per_step=tokens_per_step, samples_per_step=samples_per_step, timeout=timeout,
                               horizon=args.max_steps if args.max_steps > 0 else None)  # fmt: skip

    def _starting_point(self, resume_dir: str | None) -> tuple[str, Any, Any, int, int]:
        """(model path, tokenizer, rollout state or None, first step, policy version) of a fresh or resumed run."""
        from rlasync.model.registry import resolve_model
        from rlasync.pipeline import read_rollout_state

        model = resume_dir or resolve_model(self.model)  # an alias is converted once, here, not in every actor
        tokenizer = self.processing_class if self.processing_class is not None else self._tokenizer_path(model)
        resume_state = read_rollout_state(resume_dir) if resume_dir else None
        start_step = _read_step(resume_dir) if resume_dir else 0
        version = resume_state.model_version if resume_state else 0
        return model, tokenizer, resume_state, start_step, version

    def _spawn_engines(self, model: str) -> list[Any]:
        """The GenerationActors of the policy (they receive the weight syncs)."""
        from actors.generation import GenerationActor

        args, cluster = self.args, self.args.cluster
        server_url = cluster.vllm_server_url
        if cluster.engine == "vllm_server" and server_url is None:
            server_url = args.vllm_server_base_url  # TRL's field
        return [
            self._spawn(GenerationActor, model=model, dtype=engine_dtype(args), engine_kwargs=cluster.engine_kwargs,
                        engine=cluster.engine, vllm_server_url=server_url, num_cpus=cluster.generation_num_cpus,
                        num_gpus=cluster.generation_num_gpus)
            for _ in range(cluster.num_generation_actors)
        ]  # fmt: skip

    def _step_budget(self, ray: Any, gens: list[Any]) -> tuple[int, int, int | None]:
        """(tokens per packed row, tokens per step, samples per step or None): the row budget defaults to the
        engine's max_model_len; a budget <= 0 means a fixed count of samples per step."""
        from rlasync.pipeline import initial_tokens_per_step

        args, cluster = self.args, self.args.cluster
        budget = args.token_budget
        if budget is None:
            budget = ray.get(gens[0].max_model_len.remote(), timeout=cluster.collective_timeout_s)
        if budget > 0:
            return budget, initial_tokens_per_step(budget, cluster.num_learners, args.gradient_accumulation_steps), None
        samples_per_step = args.samples_per_step(cluster.num_learners)
        return budget, samples_per_step * 256, samples_per_step  # a first guess; finish_step corrects it

    def _spawn_learners(self, ray: Any, model: str, budget: int, resume_dir: str | None, **options: Any) -> list[Any]:
        """The learner ranks, set up (process group, model, optimizer; resumed from `resume_dir`)."""
        from actors.learner import LearnerActor

        args, cluster = self.args, self.args.cluster
        timeout, num_learners = cluster.collective_timeout_s, cluster.num_learners
        learners = [
            self._spawn(LearnerActor, rank=rank, world_size=num_learners, model=model, args=args,
                        token_budget=budget, num_cpus=cluster.learner_num_cpus, num_gpus=cluster.learner_num_gpus,
                        **options)
            for rank in range(num_learners)
        ]  # fmt: skip
        master = ray.get(learners[0].address.remote(), timeout=timeout) if num_learners > 1 else None
        ray.get([learner.setup.remote(master, timeout, resume_dir) for learner in learners], timeout=timeout + 600)
        return learners

    def _connect_weights(self, ray: Any, learners: list[Any], gens: list[Any], queue_name: str, tokens_per_step: int,
                         resume_state: Any, version: int) -> tuple[_WeightSync, int]:  # fmt: skip
        """The weight-sync group (learner rank 0 + every engine; NCCL when each holds its own GPU, else gloo), the
        staleness queue, and the cold sync: returns the sync (its `.queue` is the queue) and the served version."""
        from actors.staleness_queue import QueueActor
        from rlasync.weights.broadcast import choose_backend

        args, cluster = self.args, self.args.cluster
        timeout = cluster.collective_timeout_s
        host, port = ray.get(learners[0].address.remote(), timeout=timeout)
        world = 1 + len(gens)
        infos = ray.get([learners[0].device_info.remote()] + [gen.device_info.remote() for gen in gens], timeout=timeout)
        backend, why_not_nccl = choose_backend(infos[0], infos[1:], cluster.weight_sync_backend)
        if why_not_nccl:
            _warn_once(f"weight sync: {why_not_nccl}")
        bucket_bytes = max(1, int(cluster.weight_sync_bucket_mb * (1 << 20)))
        ray.get(
            [learners[0].join_weight_group.remote(host, port, world, timeout, backend, bucket_bytes)]
            + [
                gen.join_weight_group.remote(host, port, i + 1, world, timeout, backend, bucket_bytes)
                for i, gen in enumerate(gens)
            ],
            timeout=timeout + 30,
        )
        logger.info("weight-sync group: %d engines over %s", len(gens), backend)
        manifest = ray.get(learners[0].manifest.remote(), timeout=timeout)

        num_epochs = None if args.max_steps > 0 else args.num_train_epochs  # epochs over distinct prompts
        queue = self._spawn(
            QueueActor, name=f"{queue_name}-{uuid.uuid4().hex[:8]}", num_rows=len(self.train_dataset),
            num_epochs=num_epochs, max_staleness=args.max_staleness, tokens_per_step=tokens_per_step,
            resume=resume_state.to_dict() if resume_state else None, num_cpus=cluster.queue_num_cpus,
        )  # fmt: skip
        staging = int(cluster.weight_sync_staging_mb * (1 << 20))
        sync = _WeightSync(ray, learners, gens, queue, manifest, timeout, staging, backend)
        version = sync(version)  # cold sync: the first served policy is version + 1
        self.state["policy_version"] = version
        return sync, version

    def _step_loop(self, ray: Any, queue: Any, learners: list[Any], sync: Any, tokenizer: Any, *, start_step: int,
                   version: int, tokens_per_step: int | None, samples_per_step: int | None, timeout: float,
                   horizon: int | None) -> dict[str, Any]:  # fmt: skip
        """take → learn → maybe sync → log → maybe checkpoint, until `horizon` steps (None: until the prompt stream
        ends); the final window is logged and, at `max_steps`, a last checkpoint saved."""
        from rlasync.metrics import MetricSink
        from rlasync.metrics.sinks import build_sinks

        args = self.args
        sinks = build_sinks(args.output_dir, args.report_to, max_steps=args.max_steps, run_name=args.run_name,
                            config=args.to_dict())  # fmt: skip
        window = MetricSink()
        step = start_step
        last_step_end: float | None = None
        try:
            while horizon is None or step < horizon:
                refs, wait_s, take_items, tokens = self._take(ray, queue, tokens_per_step, samples_per_step)
                if not refs:
                    logger.info("the prompt stream is exhausted after %d steps", step)
                    break
                window.update(take_items)
                window.add("perf/rollout_wait_s", wait_s)
                self._event("on_step_begin")
                items = ray.get([learner.train_step.remote(refs) for learner in learners], timeout=timeout + 3600)
                window.update(items[0])
                ray.get(queue.finish_step.remote(tokens), timeout=timeout)
                step += 1
                if step % args.weight_sync_steps == 0:
                    version = sync(version)
                    window.update(sync.timings)
                self.state.update(global_step=step, policy_version=version)
                self._event("on_step_end")
                for rollout in self._rollouts:
                    window.update(ray.get(rollout.drain_metrics.remote(), timeout=timeout))
                now = time.perf_counter()
                if last_step_end is not None:
                    window.add("perf/step_s", now - last_step_end)
                last_step_end = now
                window.add("policy_version", float(version))
                if step % args.logging_steps == 0:
                    self._log(sinks, step, window.reduce())
                if step % args.save_steps == 0:
                    self._event("on_save", checkpoint=self._save(ray, learners, queue, step, tokenizer))
            if len(window):
                self._log(sinks, step, window.reduce())
            if args.max_steps > 0 and step >= args.max_steps and step % args.save_steps != 0:
                self._event("on_save", checkpoint=self._save(ray, learners, queue, step, tokenizer))
            self.state["queue"] = ray.get(queue.state.remote(), timeout=timeout)  # epoch accounting, for callers
            self._event("on_train_end")
        finally:
            for sink in sinks:
                sink.close()
        return dict(self.state)

    def _tokenizer_path(self, model: str) -> str:
        from rlasync.model.registry import resolve_model

        return resolve_model(model)

    # ---- the step loop's parts ----------------------------------------------------------------------------------

    def _take(
        self, ray: Any, queue: Any, tokens_per_step: int, samples_per_step: int | None
    ) -> tuple[list[Any], float, list[tuple[str, Any]], int]:
        """Fresh samples for one step: up to the token target (or the sample count); checks rollout health while
        waiting. Returns (refs, seconds spent waiting on the queue for them, take metrics, raw tokens)."""
        refs: list[Any] = []
        tokens, waited = 0, 0.0
        items: list[tuple[str, Any]] = []
        while (tokens < tokens_per_step) if samples_per_step is None else (len(refs) < samples_per_step):
            target = tokens_per_step - tokens if samples_per_step is None else 1
            started = time.perf_counter()
            result = ray.get(queue.wait_take.remote(max(target, 1), TAKE_POLL_S), timeout=TAKE_POLL_S + 60)
            waited += time.perf_counter() - started  # blocked until a fresh sample came (or the poll timed out)
            items += list(result.metrics.items())
            if result.entries:
                refs += [entry.payload for entry in result.entries]
                tokens += result.num_tokens
                continue
            self._check_rollouts(ray)
            state = ray.get(queue.state.remote(), timeout=60)
            if state["done"] and state["queue_size"] == 0 and state["inflight_groups"] == 0:
                break
        return refs, waited, items, tokens

    def _check_rollouts(self, ray: Any) -> None:
        timeout = self.args.rollout_worker_timeout
        for index, rollout in enumerate(self._rollouts):
            health = ray.get(rollout.health.remote(), timeout=60)
            if health["error"]:
                raise RuntimeError(f"rollout actor {index} failed: {health['error']}")
            if health["running"] and health["heartbeat_age_s"] > timeout:
                raise RuntimeError(
                    f"rollout actor {index}: no heartbeat for {health['heartbeat_age_s']:.0f} s "
                    f"(> rollout_worker_timeout={timeout}): the rollout loop is hung"
                )

    def _log(self, sinks: list[Any], step: int, record: dict[str, Any]) -> None:
        record = {k: v for k, v in record.items() if v is not None and not (isinstance(v, float) and math.isnan(v))}
        for sink in sinks:
            sink.write(step, record)
        self._event("on_log", logs=record)

    def _event(self, name: str, **kwargs: Any) -> None:
        """Call `name` (TRL's TrainerCallback events: on_step_begin, on_step_end, on_log, on_save, on_train_end)
        on every callback that defines it, as `callback.name(args, state, control, **kwargs)`."""
        for callback in self.callbacks:
            method = getattr(callback, name, None)
            if method is not None:
                method(self.args, self.state, None, **kwargs)

    def _save(self, ray: Any, learners: list[Any], queue: Any, step: int, tokenizer: Any) -> str:
        import json

        from rlasync.pipeline import RolloutState, write_rollout_state

        path = Path(self.args.output_dir) / f"{CHECKPOINT_PREFIX}{step}"
        path.mkdir(parents=True, exist_ok=True)
        state = RolloutState.from_dict(ray.get(queue.rollout_state.remote(), timeout=60))
        write_rollout_state(path, state)  # before the model, as TRL does
        # every rank takes part in gathering the full state (FSDP2); rank 0 writes it
        ray.get(
            [learner.save.remote(str(path), tokenizer) for learner in learners],
            timeout=self.args.cluster.collective_timeout_s + 600,
        )
        (path / TRAINER_STATE).write_text(json.dumps({"global_step": step, **self.state}) + "\n")
        self._prune_checkpoints()
        logger.info("saved %s", path)
        return str(path)

    def _prune_checkpoints(self) -> None:
        import shutil

        limit = self.args.save_total_limit
        if not limit:
            return
        checkpoints = sorted(
            Path(self.args.output_dir).glob(f"{CHECKPOINT_PREFIX}*"),
            key=lambda p: int(p.name.removeprefix(CHECKPOINT_PREFIX)),
        )
        for old in checkpoints[:-limit]:
            shutil.rmtree(old, ignore_errors=True)

    def _shutdown(self, ray: Any) -> None:
        """Stop the rollout loops politely (bounded), then kill every actor this trainer made."""
        try:
            ray.get([rollout.stop.remote() for rollout in self._rollouts], timeout=20)
        except Exception as exc:  # dead or hung actors are killed below anyway
            logger.warning("stopping the rollout actors: %s", exc)
        for handle in self._handles:
            try:
                ray.kill(handle, no_restart=True)
            except Exception as exc:
                logger.warning("ray.kill: %s", exc)
        self._handles, self._rollouts = [], []
        _wait_until_dead(ray, self.actor_ids)


def _wait_until_dead(ray: Any, actor_ids: list[str], timeout_s: float = 30.0) -> None:
    """Return once the GCS reports every actor DEAD (ray.kill is asynchronous), or warn after `timeout_s`."""
    try:
        from ray._private.state import actors
    except ImportError:
        return
    deadline = time.monotonic() + timeout_s
    while True:
        table = actors()
        left = [i for i in actor_ids if table.get(i, {}).get("State", "DEAD") != "DEAD"]
        if not left:
            return
        if time.monotonic() > deadline:
            logger.warning("%d actors still alive %.0f s after ray.kill: %s", len(left), timeout_s, left)
            return
        time.sleep(0.2)


def check_resources(requests: Mapping[str, tuple[int, float, float]], available: Mapping[str, float],
                    autoscaling: bool) -> None:  # fmt: skip
    """Compare what the actors ask for with what the Ray cluster has. On a local cluster this process started (it
    cannot grow) a shortfall is a `ValueError` naming the `cluster.*` fields to lower; on an existing cluster (it may
    autoscale) a warning: otherwise actors would wait for resources that never come."""
    need = {
        "CPU": sum(count * cpus for count, cpus, _ in requests.values()),
        "GPU": sum(count * gpus for count, _, gpus in requests.values()),
    }
    short = {kind: (need[kind], float(available.get(kind, 0.0))) for kind in need if need[kind] > available.get(kind, 0.0) + 1e-9}
    if not short:
        return
    field = {"CPU": "num_cpus", "GPU": "num_gpus"}
    parts = []
    for kind, (wanted, have) in short.items():
        roles = ", ".join(
            f"{count} {role} x {each[0 if kind == 'CPU' else 1]:g} (cluster.{role}_{field[kind]})"
            for role, (count, *each) in requests.items()
            if count and each[0 if kind == "CPU" else 1]
        )
        parts.append(f"{wanted:g} {kind}s but the Ray cluster has {have:g} ({roles})")
    message = "the actors ask for " + "; ".join(parts) + ": lower those fields or the actor counts"
    if autoscaling:
        logger.warning("%s, unless the cluster scales up", message)
    else:
        raise ValueError(message)


def engine_dtype(args: Any) -> str | None:
    """The engines' dtype: their default (bf16 on a GPU, float32 on the CPU) when the trainer is float32 under bf16
    mixed precision or "auto"; else the trainer's (e.g. pure bf16 training samples from bf16 engines)."""
    if args.dtype == "auto" or (args.dtype == "float32" and args.bf16):
        return None
    return args.dtype


class _WeightSync:
    """Every learner rank gathers, rank 0 broadcasts; each engine receives while still generating, pauses (its step
    in flight finishes meanwhile), loads, resumes (`GenerationActor.sync_weights`); then version + 1 is published.
    `timings` holds the last sync's phases (SPEC §6.1 names): `perf/weight_sync_s` (total, including the version
    bump), and over the engines the slowest `perf/weight_sync_pause_s` (until paused, overlapping the transfer),
    `perf/weight_sync_transfer_s` (paused until loaded: what of the transfer did not overlap, and the copies) and
    `perf/weight_sync_resume_s`; also `perf/weight_sync_dispatch_s` (until the slowest engine's call started) and
    `perf/weight_sync_send_s` (rank 0's broadcast, waiting for the receivers included), and
    `perf/generation_loop_lag_max_s` (the worst event-loop lag of a GenerationActor since the previous sync)."""

    def __init__(self, ray: Any, learners: list[Any], engines: list[Any], queue: Any, manifest: list[Any],
                 timeout: float, staging_bytes: int = 0, backend: str = "gloo"):  # fmt: skip
        self.ray, self.learners, self.engines, self.queue = ray, learners, engines, queue
        self.manifest, self.timeout, self.staging_bytes, self.backend = manifest, timeout, staging_bytes, backend
        self.timings: dict[str, float] = {}

    def __call__(self, version: int) -> int:
        ray = self.ray
        started, started_at = time.perf_counter(), time.time()
        sent: list[float] = []
        if self.backend == "ipc":  # rank 0 shares buckets on its device; the engines copy from them; then release
            handles = ray.get([learner.share_weights.remote() for learner in self.learners], timeout=self.timeout)[0]
            try:
                phases = ray.get(
                    [engine.sync_weights.remote(self.manifest, 0, handles) for engine in self.engines],
                    timeout=self.timeout + 60,
                )
            finally:
                ray.get(self.learners[0].release_weights.remote(), timeout=self.timeout)
        else:
            results = ray.get(
                [learner.send_weights.remote() for learner in self.learners]
                + [engine.sync_weights.remote(self.manifest, self.staging_bytes) for engine in self.engines],
                timeout=self.timeout + 60,
            )
            sent, phases = results[: len(self.learners)], results[len(self.learners) :]
        ray.get(self.queue.set_policy_version.remote(version + 1), timeout=self.timeout)
        self.timings = {
            "perf/weight_sync_s": time.perf_counter() - started,
            "perf/weight_sync_pause_s": max(p["pause_s"] for p in phases),
            "perf/weight_sync_transfer_s": max(p["load_s"] for p in phases),
            "perf/weight_sync_resume_s": max(p["resume_s"] for p in phases),
            # how long the slowest engine's call waited to start (a busy actor), and the learners' send
            "perf/weight_sync_dispatch_s": max(max(p.get("started_at", started_at) - started_at, 0.0) for p in phases),
            "perf/generation_loop_lag_max_s": max(p.get("loop_lag_max_s", 0.0) for p in phases),
        }
        if sent:
            self.timings["perf/weight_sync_send_s"] = max(sent)
        return version + 1


_WARNED: set[str] = set()


def _warn_once(message: str) -> None:
    """Log `message` as a warning the first time this process sees it."""
    if message not in _WARNED:
        _WARNED.add(message)
        logger.warning(message)


def _read_step(checkpoint_dir: str) -> int:
    import json

    path = Path(checkpoint_dir) / TRAINER_STATE
    if path.is_file():
        return int(json.loads(path.read_text())["global_step"])
    name = Path(checkpoint_dir).name
    return int(name.removeprefix(CHECKPOINT_PREFIX)) if name.startswith(CHECKPOINT_PREFIX) else 0


def _checked_tools(tools: Sequence[Callable[..., Any]] | None) -> list[Callable[..., Any]] | None:
    """`tools` as a list, checked before any actor starts: callables, uniquely named, and picklable (they travel
    to the rollout actors like the reward functions)."""
    if tools is None:
        return None
    if callable(tools) or isinstance(tools, str | bytes):
        raise ValueError("tools must be a list of functions, e.g. tools=[get_weather]")
    tools = list(tools)
    for tool in tools:
        if not callable(tool):
            raise ValueError(f"tools: {tool!r} is not callable (pass functions, not their names)")
        _check_picklable(tool, "tools")
    tools_by_name(tools)
    return tools or None


def _checked_environment_factory(factory: Any) -> Any:
    """The factory (or dict of factories), checked: callables that pickle; a class factory must define `reset`."""
    if factory is None:
        return None
    items = factory.items() if isinstance(factory, Mapping) else [(None, factory)]
    for key, item in items:
        where = "environment_factory" if key is None else f"environment_factory[{key!r}]"
        if not callable(item):
            raise ValueError(f"{where}: {item!r} is not callable; pass a zero-argument factory such as the class")
        if inspect.isclass(item) and not callable(getattr(item, "reset", None)):
            raise ValueError(f"{where}: environment {item.__name__} has no reset method; define reset(self, **row)")
        _check_picklable(item, where)
    return dict(factory) if isinstance(factory, Mapping) else factory


def _may_own_reward(factory: Any) -> bool:
    """Whether an environment may define `get_reward` (a non-class factory is only known once called: the
    rollout loop checks it again when it probes the environments)."""
    if factory is None:
        return False
    items = factory.values() if isinstance(factory, Mapping) else [factory]
    return any(not inspect.isclass(item) or callable(getattr(item, "get_reward", None)) for item in items)


def _check_picklable(obj: Any, field_name: str) -> None:
    """Raise `ValueError` naming `field_name` unless `obj` can travel to a Ray actor (pickle, or cloudpickle when
    installed: Ray's serializer, which also takes lambdas and closures)."""
    try:
        pickle.dumps(obj)
        return
    except Exception as exc:
        error: Exception = exc
    try:
        import cloudpickle
    except ImportError:
        pass
    else:
        try:
            cloudpickle.dumps(obj)
            return
        except Exception as exc:
            error = exc
    raise ValueError(
        f"{field_name}: {obj!r} cannot be pickled ({type(error).__name__}: {error}), but it must travel to the "
        "rollout actors like the reward functions: define it at module level in an importable module, and keep "
        "locks, sockets and open files out of what it references"
    )
