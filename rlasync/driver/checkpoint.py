"""`Checkpointer`: where a run's checkpoints go and which one a run resumes from.

    <output_dir>/checkpoint-<step>/      rollout_state.json (first, as TRL), the learners' files (model, tokenizer,
                                         optimizer), trainer_state.json (last: it marks the checkpoint complete)

A checkpoint is written under `checkpoint-<step>.tmp` and renamed once complete, so a run killed while saving
leaves no `checkpoint-<step>` that looks finished; `resume_from_checkpoint=True` takes the newest one that holds
`trainer_state.json` and logs the incomplete ones it skipped. `save_total_limit` keeps the newest complete ones.
Pure Python: the queue and the learners are the step loop's async protocols.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

from rlasync.driver.protocols import LearnerGroup, SampleQueue
from rlasync.pipeline import RolloutState, read_rollout_state, write_rollout_state

logger = logging.getLogger(__name__)

CHECKPOINT_PREFIX = "checkpoint-"
TRAINER_STATE = "trainer_state.json"
TMP_SUFFIX = ".tmp"


def checkpoint_step(path: Path) -> int | None:
    """The step of a `checkpoint-<step>` folder name, else None (a `.tmp` folder, another name)."""
    suffix = path.name.removeprefix(CHECKPOINT_PREFIX)
    if not path.name.startswith(CHECKPOINT_PREFIX) or not suffix.isdigit():
        return None
    return int(suffix)


def is_complete(path: Path) -> bool:
    """Whether a checkpoint folder was finished (its trainer_state.json is written last)."""
    return (path / TRAINER_STATE).is_file()


def read_step(checkpoint_dir: str | Path) -> int:
    """The global step a checkpoint was saved at: trainer_state.json, else the folder's name, else 0."""
    path = Path(checkpoint_dir) / TRAINER_STATE
    if path.is_file():
        return int(json.loads(path.read_text())["global_step"])
    step = checkpoint_step(Path(checkpoint_dir))
    return step if step is not None else 0


class Checkpointer:
    """Saves `checkpoint-<step>` folders under `output_dir`, prunes to `save_total_limit`, finds the resume point."""

    def __init__(self, output_dir: str | Path, save_total_limit: int | None = None) -> None:
        self.output_dir = Path(output_dir)
        self.save_total_limit = save_total_limit

    # ---- finding checkpoints ------------------------------------------------------------------------------------

    def checkpoints(self) -> list[Path]:
        """Every `checkpoint-<step>` folder (complete or not), oldest step first."""
        found = [(checkpoint_step(p), p) for p in self.output_dir.glob(f"{CHECKPOINT_PREFIX}*") if p.is_dir()]
        return [p for step, p in sorted((s, p) for s, p in found if s is not None)]

    def complete_checkpoints(self) -> list[Path]:
        return [p for p in self.checkpoints() if is_complete(p)]

    def resume_dir(self, resume: str | bool | None) -> str | None:
        """The folder `train(resume_from_checkpoint=...)` resumes from: None (a fresh run), the newest complete
        checkpoint for True, or the given folder."""
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
            logger.info("resuming from %s", complete[0])
            return str(complete[0])
        if not Path(resume).is_dir():
            raise ValueError(f"resume_from_checkpoint={resume!r} is not a directory")
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

    async def save(self, step: int, state: dict[str, Any], queue: SampleQueue, learners: LearnerGroup,
                   tokenizer: Any) -> str:  # fmt: skip
        """Write checkpoint-<step> (through a `.tmp` folder renamed when complete); returns its path."""
        final = self.path(step)
        tmp = final.with_name(final.name + TMP_SUFFIX)
        shutil.rmtree(tmp, ignore_errors=True)  # a leftover of a save that was killed
        tmp.mkdir(parents=True)
        write_rollout_state(tmp, RolloutState.from_dict(await queue.rollout_state()))  # before the model, as TRL does
        # every rank takes part in gathering the full state (FSDP2); rank 0 writes it
        await learners.save(str(tmp), tokenizer)
        (tmp / TRAINER_STATE).write_text(json.dumps({**_plain(state), "global_step": step}) + "\n")
        if final.exists():  # an older checkpoint of the same step (a run restarted from an earlier one)
            shutil.rmtree(final)
        tmp.rename(final)
        self.prune()
        logger.info("saved %s", final)
        return str(final)

    def prune(self) -> None:
        """Keep the newest `save_total_limit` complete checkpoints (incomplete ones are never counted or kept)."""
        limit = self.save_total_limit
        if not limit:
            return
        for old in self.complete_checkpoints()[:-limit]:
            shutil.rmtree(old, ignore_errors=True)


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


__all__ = ["CHECKPOINT_PREFIX", "TRAINER_STATE", "Checkpointer", "checkpoint_step", "is_complete", "read_step"]
