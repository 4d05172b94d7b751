"""The `rlasync` command line.

    rlasync train RUN.yaml [--set key=value ...] [--resume [CHECKPOINT]]   train (local Ray cluster, or RAY_ADDRESS)
    rlasync check-model MODEL_PATH      is this architecture supported by tree packing? (exit 0 = yes)
    rlasync config show [CONFIG.yaml] [--set key=value ...]   print the resolved config as JSON
    rlasync models prepare smollm2-135m-instruct              convert a shipped model to a cached HF folder

Each subcommand imports its heavy dependencies only when it runs.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import Any


def _check_model(argv: Sequence[str]) -> int:
    from rlasync.model.check import main

    return main(list(argv))


def _config(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="rlasync config", description="Resolve and print a config.")
    parser.add_argument("action", choices=["show"])
    parser.add_argument("path", nargs="?", help="YAML config file (optional)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args(argv)
    from rlasync.config import load_config
    from rlasync.config.load import read_yaml
    from rlasync.config.run import RUN_KEYS, load_run

    try:
        if args.path is not None and any(key in (read_yaml(args.path) or {}) for key in RUN_KEYS):
            run = load_run(args.path, args.overrides)  # a run file: config plus model, dataset, reward_funcs
            resolved = {**run.config.to_dict(), "model": run.model, "dataset": run.dataset,
                        "reward_funcs": run.reward_funcs, "trainer": run.trainer}  # fmt: skip
            if run.teacher_model is not None:
                resolved["teacher_model"] = run.teacher_model
        else:
            resolved = load_config(args.path, args.overrides).to_dict()
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(resolved, indent=2, sort_keys=True))
    return 0


def _models(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="rlasync models", description="Model aliases (e.g. smollm2-135m-instruct).")
    parser.add_argument("action", choices=["prepare", "list"])
    parser.add_argument("name", nargs="?", help="alias to prepare")
    parser.add_argument("--force", action="store_true", help="convert again even if cached")
    args = parser.parse_args(argv)
    from rlasync.model.registry import ALIASES, cache_dir, prepare_model

    if args.action == "list":
        for alias, spec in ALIASES.items():
            print(f"{alias}  (GGUF from pip package {spec.pip_name}; cache {cache_dir() / 'models' / alias})")
        return 0
    if not args.name:
        parser.error("prepare needs an alias, e.g. `rlasync models prepare smollm2-135m-instruct`")
    try:
        print(prepare_model(args.name, force=args.force))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def _train(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="rlasync train",
        description="Train with async GRPO (or, with `trainer: distillation`, on-policy distillation) from a run file "
        "(config fields + model, dataset, reward_funcs / teacher_model).",
    )
    parser.add_argument("path", help="run file, e.g. configs/quickstart.yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument(
        "--resume", nargs="?", const=True, default=None, metavar="CHECKPOINT",
        help="resume from a checkpoint folder (default: the latest checkpoint-* in output_dir)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    import logging

    from rlasync.config.run import load_run
    from rlasync.data import build_dataset

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        run = load_run(args.path, args.overrides)
        dataset = build_dataset(run.dataset)
        trainer: Any
        if run.trainer == "distillation":
            from rlasync.trainers import AsyncDistillationTrainer

            trainer = AsyncDistillationTrainer(
                model=run.model, args=run.config, train_dataset=dataset, teacher_model=run.teacher_model
            )
        else:
            reward_funcs = run.build_reward_funcs()
            from rlasync.trainers import AsyncGRPOTrainer

            trainer = AsyncGRPOTrainer(
                model=run.model, reward_funcs=reward_funcs, args=run.config, train_dataset=dataset
            )
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        state = trainer.train(resume_from_checkpoint=args.resume)
    except (RuntimeError, ValueError, TimeoutError) as exc:  # a failed actor, a stalled collective, a bad input
        logging.getLogger("rlasync").debug("train failed", exc_info=True)
        print(f"error: training failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    print(json.dumps({"output_dir": run.config.output_dir, **state}))
    return 0


COMMANDS = {
    "train": (_train, "train from a run file: `rlasync train configs/quickstart.yaml --set max_steps=2`"),
    "check-model": (_check_model, "compare tree-packed and unpacked log-probs of a model; exit non-zero on mismatch"),
    "config": (_config, "resolve a YAML config with --set overrides and print it"),
    "models": (_models, "prepare a model alias (`rlasync models prepare smollm2-135m-instruct`) or list them"),
}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: rlasync COMMAND [ARGS...]\n\ncommands:")
        for name, (_, help_text) in COMMANDS.items():
            print(f"  {name:<14}{help_text}")
        return 0 if argv else 2
    if argv[0] == "--version":
        from rlasync import __version__

        print(__version__)
        return 0
    command = COMMANDS.get(argv[0])
    if command is None:
        print(f"rlasync: unknown command {argv[0]!r}; run `rlasync --help`", file=sys.stderr)
        return 2
    return command[0](argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
