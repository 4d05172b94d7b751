"""The driver of a training run, pure (no Ray): the step loop over async protocols, checkpoints, and the spec a
trainer builds for `actors.cluster` (which owns every Ray call).

    protocols.py   SampleQueue, LearnerGroup, WeightTransport, Fleet: what the step loop talks to
    step_loop.py   StepLoop: take -> train -> sync -> log -> save, the one hang check, TRL callback events
    checkpoint.py  Checkpointer: checkpoint-N folders (written through .tmp), pruning, the resume point
    spec.py        RunSpec: rollout kind and arguments, learner objective, teachers, queue settings, horizon
    resources.py   check_resources: what the actors ask for against what the Ray cluster has
    signals.py     ShutdownGuard: SIGINT / SIGTERM / SIGHUP -> a final checkpoint within shutdown_grace_s
"""

from rlasync.driver.checkpoint import Checkpointer
from rlasync.driver.protocols import Fleet, LearnerGroup, SampleQueue, Taken, WeightTransport
from rlasync.driver.resources import actor_requests, check_resources
from rlasync.driver.signals import RunInterrupted, ShutdownGuard, ShutdownRequest
from rlasync.driver.spec import (
    LearnerSpec,
    RolloutSpec,
    RunSpec,
    TeacherSpec,
    engine_dtype,
    server_engine_kwargs,
    step_budget,
)
from rlasync.driver.step_loop import StepLoop, StepSettings, check_actor_health
from rlasync.driver.watchdog import NoProgressError, Watchdog, WatchdogSettings

__all__ = [
    "Checkpointer",
    "Fleet",
    "LearnerGroup",
    "LearnerSpec",
    "NoProgressError",
    "RolloutSpec",
    "RunInterrupted",
    "RunSpec",
    "SampleQueue",
    "ShutdownGuard",
    "ShutdownRequest",
    "StepLoop",
    "StepSettings",
    "Taken",
    "TeacherSpec",
    "Watchdog",
    "WatchdogSettings",
    "WeightTransport",
    "actor_requests",
    "check_actor_health",
    "check_resources",
    "engine_dtype",
    "server_engine_kwargs",
    "step_budget",
]
