"""The trainers' argument checks that run before any actor starts: tools, environments, picklability, the
distillation teacher's vocabulary. Each error names the argument and the fix."""

from __future__ import annotations

import inspect
import pickle
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from rlasync.rollout.tools import tools_by_name


def _refuse_trl_workers(rollout_worker: Any, weight_transfer: Any) -> None:
    """TRL's `rollout_worker` / `weight_transfer` hooks (objects run in TRL's accelerate process) have no place in
    rlasync, whose rollouts and weight syncs are Ray actors: accepted at TRL's default (None), refused otherwise."""
    for name, value, fix in (
        (
            "rollout_worker",
            rollout_worker,
            "pass loop_cls= (a subclass of the rollout loop, docs/algorithms.md) to customise rollouts",
        ),
        (
            "weight_transfer",
            weight_transfer,
            "choose the weight transport with `cluster.weight_sync_backend` in the config",
        ),
    ):
        if value is not None:
            raise ValueError(
                f"{name}={type(value).__name__}(...) is not supported: rlasync runs its rollouts and weight syncs "
                f"as Ray actors; leave {name}=None (TRL's default) and {fix}"
            )


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


def check_same_vocabulary(student: str, teacher: str, teacher_id: str) -> None:
    """Raise `ValueError` unless the teacher's tokenizer maps every token to the same id as the student's (docs/algorithms.md §9.4:
    the teacher's candidate ids index the student's vocabulary; a different one trains on wrong tokens, silently)."""
    from transformers import AutoTokenizer

    student_vocab = AutoTokenizer.from_pretrained(student).get_vocab()
    teacher_vocab = AutoTokenizer.from_pretrained(teacher).get_vocab()
    if student_vocab != teacher_vocab:
        differing = sum(1 for token, index in teacher_vocab.items() if student_vocab.get(token) != index)
        raise ValueError(
            f"teacher_model[{teacher_id!r}] ({teacher}) has a different vocabulary from the student ({len(teacher_vocab)} "
            f"vs {len(student_vocab)} tokens, {differing} teacher tokens with another id): the teacher's candidate "
            "ids index the student's vocabulary, so distillation would train on wrong tokens; use a teacher that "
            "shares the student's tokenizer"
        )
