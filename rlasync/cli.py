"""The `rlasync` command line.

    rlasync train RUN.yaml [--set key=value ...] [--resume [CHECKPOINT]] [--overwrite_output_dir] [--verbose] [--json]
                                                            train (local Ray cluster, or RAY_ADDRESS); a progress
                                                            bar, then a summary; one run per output_dir
    rlasync train RUN.yaml --dry-run [--gpu-memory-gib G]   no Ray, no actors: placement, memory, fit (exit 1: no fit)
    rlasync plot RUN_DIR [--out FILE.png]                   the diagnostic panels of a run's metrics.jsonl
    rlasync check-model MODEL_PATH      is this architecture supported by tree packing? (exit 0 = yes)
    rlasync config show [CONFIG.yaml] [--set key=value ...]   print the resolved config as JSON
    rlasync models prepare smollm2-135m-instruct              convert a shipped model to a cached HF folder

Each subcommand imports its heavy dependencies only when it runs. An error is one line, `error: <what> (<where>)`
(the traceback with `--verbose`); exit codes: 2 bad input (known before any actor starts), 1 a failed run,
128 + the signal number when SIGINT (130), SIGTERM (143) or SIGHUP (129) stopped the run (after a final checkpoint,
whose path is printed; a second signal exits at once).
"""

from __future__ import annotations

import argparse
import json
import re
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
    from rlasync.runfile import RUN_KEYS, load_run

    try:
        if args.path is not None and any(key in (read_yaml(args.path) or {}) for key in RUN_KEYS):
            run = load_run(args.path, args.overrides)  # a run file: config plus model, dataset, reward_funcs
            resolved = {
                **run.config.to_dict(),
                "model": run.model,
                "dataset": run.dataset,
                "reward_funcs": run.reward_funcs,
                "trainer": run.trainer,
            }
            if run.teacher_model is not None:
                resolved["teacher_model"] = run.teacher_model
        else:
            resolved = load_config(args.path, args.overrides).to_dict()
    except Exception as exc:
        return _fail(exc, 2, verbose=False)
    print(json.dumps(resolved, indent=2, sort_keys=True))
    return 0


def _models(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="rlasync models", description="Model aliases (e.g. smollm2-135m-instruct).")
    parser.add_argument("action", choices=["prepare", "list"])
    parser.add_argument("name", nargs="?", help="alias to prepare")
    parser.add_argument("--force", action="store_true", help="convert again even if cached")
    args = parser.parse_args(argv)
    from rlasync.envs import cache_dir
    from rlasync.model.registry import ALIASES, prepare_model

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


def _plot(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="rlasync plot", description="Draw a run's diagnostic panels into a PNG.")
    parser.add_argument("run_dir", help="a run's output_dir (or its metrics.jsonl)")
    parser.add_argument(
        "--out", default=None, metavar="FILE.png", help="where the PNG goes (default RUN_DIR/metrics.png)"
    )
    parser.add_argument("--title", default=None, help="the figure's title (default: the run folder and its steps)")
    args = parser.parse_args(argv)
    from rlasync.plot import plot_run

    try:
        path, notes = plot_run(args.run_dir, args.out, title=args.title)
    except (ValueError, OSError) as exc:
        return _fail(exc, 2, verbose=False)
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    print(path)
    return 0


def _train(argv: Sequence[str]) -> int:
    """`rlasync train`; SIGTERM / SIGHUP before the run's own handlers exit 128 + signal, as SIGINT does (the
    previous handlers are restored on the way out)."""
    from rlasync.driver.signals import interrupt_early

    restore = interrupt_early()
    try:
        return _train_command(argv)
    finally:
        restore()


def _train_command(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="rlasync train",
        description="Train with async GRPO (or, with `trainer: distillation`, on-policy distillation) from a run file "
        "(config fields + model, dataset, reward_funcs / teacher_model).",
    )
    parser.add_argument("path", help="run file, e.g. configs/quickstart.yaml")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument(
        "--resume",
        nargs="?",
        const=True,
        default=None,
        metavar="CHECKPOINT",
        help="resume from a checkpoint folder (default: the latest checkpoint-* in output_dir)",
    )
    parser.add_argument(
        "--overwrite_output_dir",
        action="store_true",
        help="start afresh in an output_dir that holds an earlier run's checkpoints (they are removed)",
    )
    parser.add_argument(
        "--verbose",
        action="store_true",
        help="print the traceback of an error, INFO logs and the actors' start-up output",
    )
    parser.add_argument(
        "--json", action="store_true", help="end with the final state (with --dry-run: the plan) as one JSON line"
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="start no Ray and no actor: print each actor's placement, the learner rank's peak memory (measured on "
        "this GPU under a fake process group, else estimated), the engines' KV cache and whether the layout fits its "
        "GPUs; exit 0 if it fits, 1 if not",
    )
    parser.add_argument(
        "--gpu-memory-gib",
        type=float,
        default=None,
        help="with --dry-run: the memory of each GPU (default: this machine's GPU, else an H200's 139.8 GiB)",
    )
    args = parser.parse_args(argv)
    if args.dry_run:
        return _dry_run(args)
    import logging
    import time

    from rlasync.console import quiet_actors, run_summary
    from rlasync.driver.checkpoint import Checkpointer
    from rlasync.driver.run_lock import check_run_folder
    from rlasync.driver.signals import RunInterrupted

    quiet_actors(args.verbose)  # before Ray starts: local workers inherit the environment
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    started = time.monotonic()
    try:  # bad input: everything known before the first actor exists (exit 2)
        overrides = args.overrides + (["overwrite_output_dir=true"] if args.overwrite_output_dir else [])
        run, trainer = _build_trainer(args.path, overrides)
        trainer.preflight()
        resume = args.resume or run.config.resume_from_checkpoint
        check_run_folder(run.config.output_dir, resume, run.config.overwrite_output_dir)
        if resume:  # a bad or corrupt resume point is bad input too; train() gets the folder found here
            args.resume = Checkpointer(run.config.output_dir).resume_dir(resume)
    except RunInterrupted as exc:
        print(f"error: {exc.message()}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        return _fail(exc, 2, args.verbose)
    try:  # a failed run (exit 1)
        state = trainer.train(resume_from_checkpoint=args.resume)
    except RunInterrupted as exc:  # SIGINT / SIGTERM / SIGHUP: a final checkpoint was written (rlasync.driver.signals)
        print(f"error: {exc.message()}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"error: interrupted; resume with --resume (checkpoints in {run.config.output_dir})", file=sys.stderr)
        return 130
    except Exception as exc:
        return _fail(exc, 1, args.verbose, prefix="training failed: ")
    if args.json:
        print(json.dumps({"output_dir": run.config.output_dir, **state}, default=str))
    else:
        print(run_summary(run.config.output_dir, state, time.monotonic() - started))
    return 0


def _dry_run(args: argparse.Namespace) -> int:
    """`rlasync train CONFIG --dry-run` (rlasync.driver.dry_run): 0 fits, 1 does not, 2 bad input."""
    from rlasync.driver.dry_run import dry_run

    try:
        return dry_run(
            args.path, args.overrides, gpu_memory_gib=args.gpu_memory_gib, as_json=args.json, verbose=args.verbose
        )
    except Exception as exc:
        return _fail(exc, 2, args.verbose)


def _build_trainer(path: str, overrides: Sequence[str]) -> tuple[Any, Any]:
    from rlasync.data import build_dataset
    from rlasync.runfile import load_run

    run = load_run(path, overrides)
    dataset = build_dataset(run.dataset)
    return run, run.build_trainer(dataset)


def _fail(exc: BaseException, code: int, verbose: bool, prefix: str = "") -> int:
    """Print `error: <what> (<where>)` (the traceback first with --verbose) and return the exit code."""
    if verbose:
        import traceback

        traceback.print_exception(exc, file=sys.stderr)
    print(f"error: {prefix}{describe_error(exc)}", file=sys.stderr)
    return code


_ERROR_LINE = re.compile(r"^\s*([A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt)\w*)(?:\([\w.]+\))?: (.+)$")
_FRAME = re.compile(r'File "([^"]+)", line (\d+), in (\S+)')


def describe_error(exc: BaseException) -> str:
    """The error as `<what> (<where>)`: a Ray task error reduced to the actor and the user's exception (its message
    and the function that raised it), a dead actor to its class and name, an OS error to its path, a YAML / JSON
    error to its position; a message that embeds a remote traceback to its last error line."""
    kind = type(exc).__name__
    cause = getattr(exc, "cause", None)
    if isinstance(getattr(exc, "traceback_str", None), str) and isinstance(cause, BaseException):  # a RayTaskError
        where = _frame(exc.traceback_str)
        actor = f"in {exc.function_name}" if getattr(exc, "function_name", None) else "in a Ray task"
        return f"{type(cause).__name__}: {_first(_reduce_text(str(cause)))} ({actor}{where})"
    if kind in ("ActorDiedError", "RayActorError", "ActorUnavailableError", "ActorUnschedulableError"):
        text = str(exc)
        fields = dict(re.findall(r"^\s*(class_name|name|pid|ip): (\S+)", text, flags=re.MULTILINE))
        reason = re.search(r"The actor is dead because ([^.]+)", text)
        actor = fields.get("class_name", "an actor") + (f" {fields['name']!r}" if fields.get("name") else "")
        why = reason.group(1) if reason else _first(text)
        return f"{kind}: {actor} died ({why}{', pid ' + fields['pid'] if 'pid' in fields else ''})"
    if isinstance(exc, OSError) and exc.filename is not None:
        return f"{kind}: {exc.strerror or exc} ({exc.filename})"
    if kind == "JSONDecodeError":
        return f"{kind}: {exc} (a JSON file is corrupt; see --verbose for which one was being read)"
    text = _reduce_text(str(exc)) or kind
    if not isinstance(exc, ValueError | RuntimeError | TimeoutError) or text == kind:
        text = f"{kind}: {text}" if text != kind else kind
    inner = exc.__cause__
    if inner is not None and getattr(inner, "traceback_str", None) and type(inner).__name__ not in text:
        text += f" <- {describe_error(inner)}"
    return text


def _reduce_text(text: str) -> str:
    """A message that embeds a (remote) traceback, reduced to its first line's own words and its last error line."""
    text = text.strip()
    if "Traceback (most recent call last)" not in text and "ray::" not in text:
        return text
    head = re.split(r"Ray\w*Error\(|Traceback \(most|ray::", text.split("\n", 1)[0])[0].strip()
    actor = re.search(r"ray::(\w+)(?:\.(\w+))?", text)
    errors = [m for line in text.splitlines() if (m := _ERROR_LINE.match(line))]
    last = f"{errors[-1].group(1)}: {errors[-1].group(2)}" if errors else _first(text)
    where = f"in {actor.group(1)}" if actor else "in a remote task"
    return f"{head} {last} ({where}{_frame(text)})".strip()


def _frame(traceback_text: str) -> str:
    frames = _FRAME.findall(traceback_text)
    if not frames:
        return ""
    path, line, function = frames[-1]
    return f", raised at {function} ({path.rsplit('/', 1)[-1]}:{line})"


def _first(text: str) -> str:
    return text.strip().split("\n", 1)[0]


COMMANDS = {
    "train": (
        _train,
        "train from a run file: `rlasync train configs/quickstart.yaml --set max_steps=2` (`--dry-run`: does it fit?)",
    ),
    "plot": (_plot, "draw a run's diagnostic panels from its metrics.jsonl: `rlasync plot outputs/quickstart`"),
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
