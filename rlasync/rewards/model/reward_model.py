"""`RewardModel`: a sequence-classification reward model as a reward function, scored where the reward functions run.

    reward_funcs="path/to/rm"                                   # a local folder (or a hub id already in the cache)
    reward_funcs=AutoModelForSequenceClassification.from_pretrained(...)   # a loaded model (tokenizer from its path)
    reward_funcs=RewardModel("path/to/rm", batch_size=64, name="helpfulness", template=my_render)

The trainer turns a string or a loaded model into a `RewardModel` (`as_reward_model`). The object travels to the
process that scores (a RewardActor, `cluster.num_reward_actors` ≥ 1, which the trainer starts when a reward model is
given) as its source (a folder path, or a loaded model's config + state dict + tokenizer: never through the policy
weight sync) and loads the model there once, lazily, on its first group, on `device` ("auto": the actor's GPU when
`cluster.reward_num_gpus` > 0, else the CPU) in `dtype` ("auto": bf16 on a GPU, fp32 on the CPU).

It follows the reward calling convention: called once per group with `prompts` and `completions`, it returns one
float per completion. Groups that reach one process within `max_wait_s` of each other, from any rollout actor, are
scored in one batch (`RequestBatcher`), split into forwards of at most `batch_size` texts sorted by length
(`RewardModelScorer`). Metrics (drained by the calling convention into the group's reward table, logged under the
reward's name): `rewards/<name>/batch_size` (texts per batch), `rewards/<name>/batch_requests` (groups merged in a
batch), `rewards/<name>/batch_sources_max` (distinct rollout actors merged in a batch, the window's max) and
`rewards/<name>/scored_per_s` (texts scored per second of forward).
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from rlasync.rewards.calling import ProcessLocal
from rlasync.rewards.model.batcher import BatchRecord, RequestBatcher

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")
CLASSIFIER_SUFFIX = "ForSequenceClassification"


class RewardModel(ProcessLocal):
    """A sequence-classification reward model (see the module docstring).

    model:       a local folder (or a hub id found in the local Hugging Face cache: nothing is downloaded at run
                 time), or a loaded `PreTrainedModel` with a classification head
    tokenizer:   the reward model's tokenizer (a loaded one or a path); None: the model folder's (a loaded model's
                 `name_or_path`)
    name:        the reward's column and metric name (`rewards/<name>/mean`); default: the folder's basename
    device:      "auto" (the process's GPU if it has one, else the CPU), "cpu" or "cuda" / "cuda:N"
    dtype:       "auto" (bfloat16 on a GPU, float32 on the CPU), "float32", "bfloat16" or "float16"
    batch_size:  texts per forward (a batch of merged groups is split into forwards of this many)
    max_wait_s:  how long a group waits for others to join its batch
    template:    how a sample becomes the scored text: None (the tokenizer's chat template for conversational
                 prompts, else plain text), a Jinja chat template string, or `template(prompt, completion) -> str`
    label_index: which logit is the reward: None (label 0 of a one-label head, else the last label) or an index
    max_length:  truncate texts to this many tokens (None: the tokenizer's model_max_length)
    """

    def __init__(
        self,
        model: str | os.PathLike[str] | Any,
        *,
        tokenizer: Any = None,
        name: str | None = None,
        device: str = "auto",
        dtype: str = "auto",
        batch_size: int = 32,
        max_wait_s: float = 0.01,
        template: str | Callable[[Any, Any], str] | None = None,
        label_index: int | None = None,
        max_length: int | None = None,
    ) -> None:
        if isinstance(model, str | os.PathLike):
            self.source: Any = reward_model_folder(model)
            default_name = Path(self.source).name
            tokenizer = str(tokenizer) if isinstance(tokenizer, os.PathLike) else tokenizer
        elif _is_pretrained_model(model):
            self.source, default_name, tokenizer = _loaded_model_payload(model, tokenizer)
        else:
            raise ValueError(
                f"RewardModel: model={model!r} is neither a path nor a loaded transformers model; pass a folder of "
                "a *ForSequenceClassification reward model, or the loaded model"
            )
        self.tokenizer = tokenizer if tokenizer is not None else (self.source if isinstance(self.source, str) else None)
        if name is not None and (not isinstance(name, str) or not name):
            raise ValueError(f"RewardModel: name={name!r} must be a non-empty string (the reward's metric name)")
        self.__name__ = name or default_name.replace("/", "_") or "reward_model"
        if device not in DEVICES and not str(device).startswith("cuda:"):
            raise ValueError(f"RewardModel: device={device!r} must be one of {list(DEVICES)} or 'cuda:N'")
        if dtype not in DTYPES:
            raise ValueError(f"RewardModel: dtype={dtype!r} must be one of {list(DTYPES)}")
        self.device, self.dtype = device, dtype
        self.batch_size = _positive_int("batch_size", batch_size)
        if isinstance(max_wait_s, bool) or not isinstance(max_wait_s, int | float) or not 0 <= max_wait_s <= 10:
            raise ValueError(f"RewardModel: max_wait_s={max_wait_s!r} must be seconds in [0, 10] (e.g. 0.01)")
        self.max_wait_s = float(max_wait_s)
        if template is not None and not (isinstance(template, str) or callable(template)):
            raise ValueError(
                f"RewardModel: template={template!r} must be a Jinja chat template string or a function "
                "template(prompt, completion) -> str"
            )
        self.template = template
        if label_index is not None and (isinstance(label_index, bool) or not isinstance(label_index, int)):
            raise ValueError(f"RewardModel: label_index={label_index!r} must be an int (or None)")
        self.label_index = label_index
        self.max_length = None if max_length is None else _positive_int("max_length", max_length)
        self._reset_process_state()

    # ---- travelling: the loaded model, its batcher and its metrics stay in their process ----------------------

    _process_state = ("_scorer", "_loading", "_batcher", "_metrics")

    def _reset_process_state(self) -> None:
        self._scorer: Any = None
        self._loading: asyncio.Lock | None = None
        self._batcher: RequestBatcher | None = None
        self._metrics: list[tuple[str, Any]] = []

    def __repr__(self) -> str:
        where = self.source if isinstance(self.source, str) else "a loaded model" if self.source else "no weights"
        return f"RewardModel({where!r}, name={self.__name__!r})"

    # ---- the reward function ----------------------------------------------------------------------------------

    async def __call__(self, *, prompts: Sequence[Any], completions: Sequence[Any], **kwargs: Any) -> list[float]:
        """One reward per completion (the chosen logit); raises `RewardModelError` when its batch fails."""
        if len(prompts) != len(completions):
            raise ValueError(f"{len(prompts)} prompts for {len(completions)} completions; pass one prompt each")
        if self._batcher is None:
            self._batcher = RequestBatcher(
                self._score_batch,
                name=self.__name__,
                max_wait_s=self.max_wait_s,
                max_items=self.batch_size,
                on_batch=self._record,
            )
        if self._scorer is None:
            if self._loading is None:
                self._loading = asyncio.Lock()
            async with self._loading:
                if self._scorer is None:
                    self._scorer = await asyncio.to_thread(self.load)
        return await self._batcher.submit(list(zip(prompts, completions, strict=True)))

    def prepare(self) -> None:
        """Import what scoring needs (torch, transformers' auto classes) in this process now, without loading the
        model. The RewardActor calls it when it starts: a first import of transformers in one thread racing another
        thread's (a sync reward function's) fails with a partially initialised module."""
        from transformers.models.auto import configuration_auto, modeling_auto, tokenization_auto  # noqa: F401

        from rlasync.rewards.model import loading  # noqa: F401 - imports torch and the scorer

    def without_weights(self) -> RewardModel:
        """A copy that names this reward model but carries no loaded model's weights (for the rollout actors, which
        hand the groups to the RewardActor pool and never score themselves); a folder source is kept."""
        copy = RewardModel.__new__(RewardModel)
        copy.__setstate__(self.__getstate__())
        if not isinstance(copy.source, str):
            copy.source = None
        return copy

    def load(self) -> Any:
        """The `RewardModelScorer` of this reward model in this process (loads it; `__call__` does so once)."""
        from rlasync.rewards.model.loading import load_scorer

        if self.source is None:
            raise RuntimeError(
                f"reward model '{self.__name__}': this copy carries no weights (made by without_weights() for a "
                "rollout actor); it is scored in the RewardActor pool (cluster.num_reward_actors >= 1)"
            )
        return load_scorer(self)

    def _score_batch(self, samples: list[tuple[Any, Any]]) -> list[float]:
        return self._scorer.score(samples)

    def _record(self, batch: BatchRecord) -> None:
        prefix = f"rewards/{self.__name__}"
        self._metrics += [
            (f"{prefix}/batch_size", float(batch.items)),
            (f"{prefix}/batch_requests", float(batch.requests)),
            (f"{prefix}/batch_sources_max", float(batch.sources)),
            (f"{prefix}/scored_per_s", (float(batch.items), max(batch.seconds, 1e-9))),
        ]

    def drain_metrics(self) -> list[tuple[str, Any]]:
        """The metric items recorded since the last call (see the module docstring)."""
        items, self._metrics = self._metrics, []
        return items


# ---- what `reward_funcs` accepts ---------------------------------------------------------------------------------


def as_reward_model(value: Any) -> RewardModel | None:
    """A `RewardModel` for a string / path / loaded classification model given in `reward_funcs`; the value itself
    when it already is one; None for anything else (a function). A string that is no reward model raises."""
    if isinstance(value, RewardModel):
        return value
    if isinstance(value, str | os.PathLike) or _is_pretrained_model(value):
        return RewardModel(value)
    return None


def reward_model_folder(model: str | os.PathLike[str]) -> str:
    """The local folder of a reward model given by path or hub id, checked to be a sequence classifier.

    A hub id is looked up in the local Hugging Face cache only (no download at run time); anything else is a
    `ValueError` saying how to get the folder.
    """
    text = os.fspath(model)
    folder = Path(text).expanduser()
    if not folder.exists():
        cached = _cached_snapshot(text)
        if cached is None:
            raise ValueError(
                f"reward_funcs={text!r}: no such folder, and not a reward model in the local Hugging Face cache. "
                "rlasync does not download models at run time: fetch it first (`hf download "
                f"{text} --local-dir DIR`, or `AutoModelForSequenceClassification.from_pretrained('{text}')` once) and "
                "pass the folder; or serve it and pass rlasync.rewards.RemoteReward(url); or pass a function"
            )
        folder = Path(cached)
    config_file = folder / "config.json"
    if not folder.is_dir() or not config_file.is_file():
        raise ValueError(
            f"reward_funcs={text!r}: not a model folder (no config.json in it); pass the folder of a "
            "*ForSequenceClassification reward model saved with save_pretrained"
        )
    try:
        config = json.loads(config_file.read_text())
    except ValueError as exc:
        raise ValueError(f"reward_funcs={text!r}: {config_file} is not valid JSON ({exc})") from None
    architectures = config.get("architectures") or []
    if not any(str(a).endswith(CLASSIFIER_SUFFIX) for a in architectures) and "num_labels" not in config:
        raise ValueError(
            f"reward_funcs={text!r}: the model's architectures {architectures} are not a sequence classifier; a "
            f"reward model is a *{CLASSIFIER_SUFFIX} (a language model is a policy, not a reward: pass a function "
            "that uses it, or a classifier folder)"
        )
    return str(folder)


def _cached_snapshot(repo_id: str) -> str | None:
    if repo_id.count("/") != 1 or repo_id.startswith((".", "/", "~")):
        return None
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(repo_id, local_files_only=True)
    except Exception:
        return None


def _is_pretrained_model(value: Any) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return isinstance(value, PreTrainedModel)


def _loaded_model_payload(model: Any, tokenizer: Any) -> tuple[dict[str, Any], str, Any]:
    """(the source that travels: class name, config, state dict on the CPU), the default name, the tokenizer."""
    architectures = [type(model).__name__, *(getattr(model.config, "architectures", None) or [])]
    if not any(a.endswith(CLASSIFIER_SUFFIX) for a in architectures):
        raise ValueError(
            f"reward_funcs: a loaded {type(model).__name__} is not a sequence-classification reward model; load it "
            f"with AutoModelForSequenceClassification (a *{CLASSIFIER_SUFFIX}), or pass a function"
        )
    name_or_path = str(getattr(model, "name_or_path", "") or getattr(model.config, "name_or_path", "") or "")
    if tokenizer is None:
        if not name_or_path or not Path(name_or_path).expanduser().is_dir():
            raise ValueError(
                f"reward_funcs: the loaded {type(model).__name__} has no local folder to read its tokenizer from "
                f"(name_or_path={name_or_path!r}); pass RewardModel(model, tokenizer=its_tokenizer)"
            )
        tokenizer = name_or_path
    payload = {
        "class_name": type(model).__name__,
        "config": model.config.to_dict(),
        "state_dict": {key: value.detach().to("cpu").clone() for key, value in model.state_dict().items()},
    }
    return payload, Path(name_or_path).name if name_or_path else "reward_model", tokenizer


def _positive_int(field: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"RewardModel: {field}={value!r} must be a positive integer")
    return value
