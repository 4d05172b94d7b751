"""`Checkpointer`: where a run's checkpoints go and which one a run resumes from.

    <output_dir>/checkpoint-<step>/      rollout_state.json (first, as TRL), the learners' files (model, tokenizer,
                                         optimizer), run_config.json (the config: a resume names what changed),
                                         trainer_state.json (last: it marks the checkpoint complete)

A checkpoint is written under `checkpoint-<step>.tmp` and renamed once complete, so a run killed while saving
leaves no `checkpoint-<step>` that looks finished (a save that fails removes its `.tmp` folder; a full disk is
`CheckpointSaveError` naming the folder, the space and the newest intact checkpoint); `resume_from_checkpoint=True` takes the newest one that holds
`trainer_state.json` and logs the incomplete ones it skipped. `save_total_limit` keeps the newest complete ones. A checkpoint with an unreadable file (truncated safetensors,
`optimizer.pt`, a JSON file) is reported naming the file (`verify_checkpoint`, headers only), and skipped by
`resume_from_checkpoint=True`; so is a complete one whose model weights are missing (`missing_weights`).
Pure Python: the queue and the learners are the step loop's async protocols.
"""

from __future__ import annotations

import json
import logging
import shutil
import struct
import zipfile
from pathlib import Path
from typing import Any

from rlasync.driver.protocols import LearnerGroup, SampleQueue
from rlasync.pipeline import RolloutState, read_rollout_state, write_rollout_state

logger = logging.getLogger(__name__)

CHECKPOINT_PREFIX = "checkpoint-"
TRAINER_STATE = "trainer_state.json"
TMP_SUFFIX = ".tmp"
RUN_CONFIG = "run_config.json"
"""The run's config as `TrainerConfig.to_dict()` wrote it, in each checkpoint: a resume compares it to its own."""
RESUME_FREE = frozenset(
    {
        "output_dir",
        "resume_from_checkpoint",
        "overwrite_output_dir",
        "max_steps",
        "num_train_epochs",
        "logging_steps",
        "logging_first_step",
        "save_steps",
        "save_strategy",
        "save_total_limit",
        "report_to",
        "run_name",
        "project",
        "disable_tqdm",
        "log_level",
        "log_completions",
        "num_completions_to_print",
        "eval_strategy",
        "eval_steps",
        "num_generations_eval",
        "shutdown_grace_s",
        "watchdog_timeout_s",
        "watchdog_action",
        "push_to_hub",
        "hub_model_id",
        "cluster",
    }
)
"""Fields a resumed run may change without a word: the horizon, the cadences, the sinks, the actor layout."""


def checkpoint_step(path: Path) -> int | None:
    """The step of a `checkpoint-<step>` folder name, else None (a `.tmp` folder, another name)."""
    suffix = path.name.removeprefix(CHECKPOINT_PREFIX)
    if not path.name.startswith(CHECKPOINT_PREFIX) or not suffix.isdigit():
        return None
    return int(suffix)


def is_complete(path: Path) -> bool:
    """Whether a checkpoint folder was finished (its trainer_state.json is written last)."""
    return (path / TRAINER_STATE).is_file()


class CorruptCheckpointError(ValueError):
    """A checkpoint file that cannot be read (truncated, not JSON, ...); the message names the file."""


def read_json(path: Path) -> Any:
    """A checkpoint's JSON file, or `CorruptCheckpointError` naming it."""
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CorruptCheckpointError(
            f"{path} is corrupt ({type(exc).__name__}: {exc}): the checkpoint {path.parent} cannot be resumed; resume "
            "from an earlier checkpoint-* (--resume <dir>) or delete this one"
        ) from exc


def _check_safetensors(path: Path) -> str | None:
    """Why `path` is not a whole safetensors file (header length, JSON header, tensor data past the end), or None."""
    size = path.stat().st_size
    with path.open("rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"{size} bytes: shorter than the 8-byte header length"
        (length,) = struct.unpack("<Q", head)
        if 8 + length > size:
            return f"{size} bytes: the header says {length} bytes of header follow"
        try:
            header = json.loads(f.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            return f"unreadable header ({exc})"
    end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    if 8 + length + end > size:
        return f"truncated: {size} bytes, the tensors need {8 + length + end}"
    return None


def _check_torch_file(path: Path) -> str | None:
    """Why a `torch.save` file (a zip archive) is not whole (its directory at the end is missing), or None."""
    try:
        with zipfile.ZipFile(path):
            return None
    except zipfile.BadZipFile as exc:
        return f"truncated or not a torch.save archive ({exc})"


WEIGHT_INDEXES = (
    "model.safetensors.index.json",
    "pytorch_model.bin.index.json",
    "adapter_model.safetensors.index.json",
)


def missing_weights(path: Path) -> str | None:
    """Why a complete checkpoint (or model folder) has no loadable weights: no `*.safetensors` / `*.bin` file, or
    a shard its index lists is absent; None when they are there."""
    for index_name in WEIGHT_INDEXES:
        index = path / index_name
        if index.is_file():
            weight_map = read_json(index).get("weight_map") or {}
            absent = sorted({shard for shard in weight_map.values() if not (path / shard).is_file()})
            if absent:
                return (
                    f"{index_name} lists {', '.join(absent[:3])}, which {'is' if len(absent) == 1 else 'are'} missing"
                )
    if not any(path.glob("*.safetensors")) and not any(p.name != "training_args.bin" for p in path.glob("*.bin")):
        return "no model weights: model.safetensors (or adapter_model.safetensors, or an index's shards) is missing"
    return None


def verify_checkpoint(checkpoint_dir: str | Path) -> None:
    """Raise `CorruptCheckpointError` naming the first file of the checkpoint that is unreadable: its JSON files,
    the model's safetensors files (header and length) and the optimizer / scheduler archives. Reads headers only,
    so it takes milliseconds, before any actor starts."""
    path = Path(checkpoint_dir)
    for json_file in sorted(path.glob("*.json")):
        read_json(json_file)
    if is_complete(path):
        missing = missing_weights(path)
        if missing is not None:
            raise CorruptCheckpointError(
                f"{path} is incomplete ({missing}): the checkpoint cannot be resumed; resume from an earlier "
                "checkpoint-* (--resume <dir>) or delete this one"
            )
    checks = [(f, _check_safetensors) for f in sorted(path.glob("*.safetensors"))]
    checks += [(f, _check_torch_file) for f in sorted(path.glob("*.pt")) + sorted(path.glob("*.bin"))]
    for file, check in checks:
        why = check(file)
        if why is not None:
            raise CorruptCheckpointError(
                f"{file} is corrupt ({why}): the checkpoint {path} cannot be resumed; resume from an earlier "
                "checkpoint-* (--resume <dir>) or delete this one"
            )


def read_step(checkpoint_dir: str | Path) -> int:
    """The global step a checkpoint was saved at: trainer_state.json, else the folder's name, else 0."""
    path = Path(checkpoint_dir) / TRAINER_STATE
    if path.is_file():
        state = read_json(path)
        if not isinstance(state, dict) or not isinstance(state.get("global_step"), int):
            raise CorruptCheckpointError(
                f"{path} has no integer 'global_step': not a trainer state; resume from an "
                "earlier checkpoint-* or delete this one"
            )
        return state["global_step"]
    step = checkpoint_step(Path(checkpoint_dir))
    return step if step is not None else 0


def resumed_trainer_state(checkpoint_dir: str | Path | None) -> dict[str, Any]:
    """What a resumed run continues from its checkpoint's trainer_state.json: `num_tokens` (forwarded tokens so
    far) and `log_history` (the logged records, as transformers' `TrainerState.log_history`); {} for a fresh run or
    a checkpoint written before these were saved."""
    if checkpoint_dir is None:
        return {}
    path = Path(checkpoint_dir) / TRAINER_STATE
    state = read_json(path) if path.is_file() else {}
    out: dict[str, Any] = {}
    if isinstance(state, dict):
        if isinstance(state.get("num_tokens"), (int, float)) and not isinstance(state["num_tokens"], bool):
            out["num_tokens"] = float(state["num_tokens"])
        history = state.get("log_history")
        if isinstance(history, list) and all(isinstance(record, dict) for record in history):
            out["log_history"] = history
    return out


class Checkpointer:
    """Saves `checkpoint-<step>` folders under `output_dir`, prunes to `save_total_limit`, finds the resume point."""

    def __init__(self, output_dir: str | Path, save_total_limit: int | None = None) -> None:
        self.output_dir = Path(output_dir)
        self.save_total_limit = save_total_limit
        self.run_config: dict[str, Any] | None = None  # written as run_config.json into each checkpoint when set

    # ---- finding checkpoints ------------------------------------------------------------------------------------

    def checkpoints(self) -> list[Path]:
        """Every `checkpoint-<step>` folder (complete or not), oldest step first."""
        found = [(checkpoint_step(p), p) for p in self.output_dir.glob(f"{CHECKPOINT_PREFIX}*") if p.is_dir()]
        return [p for step, p in sorted((s, p) for s, p in found if s is not None)]

    def complete_checkpoints(self) -> list[Path]:
        return [p for p in self.checkpoints() if is_complete(p)]

    def resume_dir(self, resume: str | bool | None) -> str | None:
        """The folder `train(resume_from_checkpoint=...)` resumes from: None (a fresh run), the newest complete and
        readable checkpoint for True (incomplete and corrupt ones are skipped with a warning naming them), or the
        given folder (a corrupt file in it raises `CorruptCheckpointError` naming the file)."""
        if not resume:
            return None
        if resume is True:
            newest_first = list(reversed(self.checkpoints()))
            complete = [p for p in newest_first if is_complete(p)]
            if not complete:
                raise ValueError(f"resume_from_checkpoint=True but {self.output_dir} holds no complete checkpoint-*")
            skipped = [p.name for p in newest_first[: newest_first.index(complete[0])]]
            if skipped:
                logger.warning("resume: skipping incomplete checkpoints (no %s): %s", TRAINER_STATE, ", ".join(skipped))
            corrupt: list[str] = []
            for candidate in complete:
                try:
                    verify_checkpoint(candidate)
                except CorruptCheckpointError as exc:
                    logger.warning("resume: skipping a corrupt checkpoint: %s", exc)
                    corrupt.append(str(exc))
                    continue
                logger.info("resuming from %s", candidate)
                return str(candidate)
            raise CorruptCheckpointError(
                f"resume_from_checkpoint=True: every complete checkpoint in {self.output_dir} "
                f"is corrupt; the newest: {corrupt[0]}"
            )
        if not Path(resume).is_dir():
            raise ValueError(f"resume_from_checkpoint={resume!r} is not a directory")
        verify_checkpoint(resume)
        return str(resume)

    @staticmethod
    def starting_point(resume_dir: str | None) -> tuple[RolloutState | None, int, int]:
        """(rollout state or None, first step, policy version) of a fresh or resumed run."""
        if resume_dir is None:
            return None, 0, 0
        state = read_rollout_state(resume_dir)
        return state, read_step(resume_dir), state.model_version if state else 0

    # ---- saving -------------------------------------------------------------------------------------------------

    def path(self, step: int) -> Path:
        return self.output_dir / f"{CHECKPOINT_PREFIX}{step}"

    async def save(
        self, step: int, state: dict[str, Any], queue: SampleQueue, learners: LearnerGroup, tokenizer: Any
    ) -> str:
        """Write checkpoint-<step> (through a `.tmp` folder renamed when complete); returns its path."""
        final = self.path(step)
        tmp = final.with_name(final.name + TMP_SUFFIX)
        shutil.rmtree(tmp, ignore_errors=True)  # a leftover of a save that was killed
        try:
            tmp.mkdir(parents=True)
            write_rollout_state(tmp, RolloutState.from_dict(await queue.rollout_state()))  # before the model (TRL)
            # every rank takes part in gathering the full state (FSDP2); rank 0 writes it
            await learners.save(str(tmp), tokenizer)
            if self.run_config is not None:
                (tmp / RUN_CONFIG).write_text(json.dumps(self.run_config, default=str, sort_keys=True) + "\n")
            (tmp / TRAINER_STATE).write_text(json.dumps({**_plain(state), "global_step": step}) + "\n")
        except BaseException as exc:
            shutil.rmtree(tmp, ignore_errors=True)  # no partial folder left behind
            if _is_disk_error(exc):
                raise CheckpointSaveError(self._save_failure(step, exc)) from exc
            raise
        if final.exists():  # an older checkpoint of the same step (a run restarted from an earlier one)
            shutil.rmtree(final)
        tmp.rename(final)
        self.prune()
        logger.info("saved %s", final)
        return str(final)

    def _save_failure(self, step: int, exc: BaseException) -> str:
        """The message of a save the disk refused: the folder, the space free and needed, the newest intact one."""
        complete = self.complete_checkpoints()
        newest = complete[-1] if complete else None
        try:
            free = f"{shutil.disk_usage(self.output_dir).free / 1e9:.2f} GB free"
        except OSError:
            free = "free space unknown"
        need = f"about {folder_bytes(newest) / 1e9:.2f} GB needed (the size of {newest.name})" if newest else ""
        where = f"the newest intact checkpoint is {newest} (resume with --resume)" if newest else "no intact checkpoint"
        reason = str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__
        return (
            f"saving checkpoint-{step} into {self.output_dir} failed ({reason}): {free}"
            f"{', ' + need if need else ''}; the partial folder was removed and {where}. Free space there, or "
            "set output_dir to a larger disk"
        )

    def prune(self) -> None:
        """Keep the newest `save_total_limit` complete checkpoints (incomplete ones are never counted or kept)."""
        limit = self.save_total_limit
        if not limit:
            return
        for old in self.complete_checkpoints()[:-limit]:
            shutil.rmtree(old, ignore_errors=True)


class CheckpointSaveError(RuntimeError):
    """A checkpoint the disk could not take (full, quota); the message names the folder, the space and the newest
    intact checkpoint."""


DISK_ERRORS = ("No space left on device", "Disk quota exceeded", "ENOSPC", "EDQUOT", "File too large")


def _is_disk_error(exc: BaseException) -> bool:
    """An out-of-space error, raised here or inside a learner (a Ray task error carries its text)."""
    if isinstance(exc, OSError) and exc.errno in (28, 122, 27):  # ENOSPC, EDQUOT, EFBIG
        return True
    return isinstance(exc, Exception) and any(text in str(exc) for text in DISK_ERRORS)


def folder_bytes(path: Path) -> int:
    """The bytes of the files under `path`."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def config_changes(resume_dir: str | Path | None, config: dict[str, Any]) -> list[str]:
    """The fields of `config` (a `to_dict()`) that differ from the checkpoint's run_config.json, as
    "name: old -> new" (the horizon, cadences, sinks and `cluster` are free to change: `RESUME_FREE`); [] when the
    checkpoint has no run_config.json (written before it was saved)."""
    if resume_dir is None or not (Path(resume_dir) / RUN_CONFIG).is_file():
        return []
    saved = read_json(Path(resume_dir) / RUN_CONFIG)
    if not isinstance(saved, dict):
        return []
    current = json.loads(json.dumps(config, default=str))  # the same JSON round trip as the saved one
    return [
        f"{name}: {saved[name]!r} -> {current[name]!r}"
        for name in sorted(set(saved) & set(current) - RESUME_FREE)
        if saved[name] != current[name]
    ]


def _plain(state: dict[str, Any]) -> dict[str, Any]:
    """The JSON-serialisable part of the trainer state (global_step, policy_version, the queue's counters)."""
    out = {}
    for key, value in state.items():
        try:
            json.dumps(value)
        except TypeError:
            continue
        out[key] = value
    return out


__all__ = [
    "CHECKPOINT_PREFIX",
    "RUN_CONFIG",
    "TRAINER_STATE",
    "CheckpointSaveError",
    "Checkpointer",
    "CorruptCheckpointError",
    "checkpoint_step",
    "config_changes",
    "folder_bytes",
    "resumed_trainer_state",
    "is_complete",
    "missing_weights",
    "read_json",
    "read_step",
    "verify_checkpoint",
]
