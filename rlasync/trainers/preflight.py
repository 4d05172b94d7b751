"""Checks a trainer runs before its one launch call into `actors/` (docs/design.md §4: errors that name the field and
the fix), so that what is known up front fails in seconds instead of after Ray and every actor started:

    model / teacher_model   an alias (known?), a local folder (exists? config.json? a tokenizer?), or a hub id
                            (in the local cache, or the hub reachable: offline is said plainly); a local teacher
                            shares the student's vocabulary (`check_same_vocabulary`)
    model weights           a local model folder holds its weights (not only config.json)
    engine_kwargs           integer settings are positive integers; the built-in engine knows every key and its
                            kv_cache_tokens holds one request of max_model_len
    max_completion_length   below max_model_len (refused), and not capped for the checked prompts (warned)
    output_dir              named (not empty), created, a probe file written and removed; room for a checkpoint
                            (refused) and for two (warned): rlasync.trainers.disk
    report_to               every sink known and importable (`rlasync.metrics.sinks.check_report_to`)
    prompts                 the first rows render with the chat template within the engine's max_model_len
                            (`cluster.engine_kwargs.max_model_len`, else the model's max_position_embeddings)
    token_budget            one sample (the longest checked prompt + max_completion_length) fits one packed row
    teacher_id              with several teachers, every row's `teacher_id` names one of them (`check_teacher_ids`)

Each failure is a `ValueError` naming the field and the fix. Nothing here imports ray; transformers is imported
only to load the tokenizer.
"""

from __future__ import annotations

import concurrent.futures
import difflib
import json
import logging
import os
import socket
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from rlasync.config.vocab import EngineKind
from rlasync.data.prompts import NUM_ROWS_CHECKED, PROMPT_COLUMN, leased_row_problem, render_prompt
from rlasync.data.streaming import first_rows
from rlasync.driver.checkpoint import missing_weights
from rlasync.driver.run_lock import check_output_dir_named
from rlasync.metrics.sinks import check_report_to
from rlasync.model.registry import ALIASES, is_alias, resolve_model
from rlasync.trainers.checks import check_same_vocabulary
from rlasync.trainers.disk import check_disk

if TYPE_CHECKING:
    from rlasync.config.base import ClusterConfig, TrainerConfig

logger = logging.getLogger(__name__)

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "spiece.model")
POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
HUB_PROBE_TIMEOUT_S = 3.0


# ---- the model ------------------------------------------------------------------------------------------------------


def check_model_source(name: Any, field: str = "model", need_tokenizer: bool = True) -> str:
    """The path or hub id `from_pretrained` will load for `name` (an alias is prepared: its cached folder);
    `ValueError` naming `field` when it cannot be a model: an unknown alias, a missing folder, a folder without
    config.json or tokenizer, a hub id neither cached nor reachable."""
    text = str(name)
    if is_alias(text):
        try:
            path = resolve_model(text)
        except ValueError as exc:
            raise ValueError(f"{field}={text!r}: {exc}") from None
        return _check_folder(Path(path), text, field, need_tokenizer)
    path = Path(text).expanduser()
    if path.exists():
        return _check_folder(path, text, field, need_tokenizer)
    if _looks_like_path(text):
        raise ValueError(
            f"{field}={text!r}: the local folder {path} does not exist; give an existing model folder (with "
            f"config.json), a hub id (org/name) or an alias ({', '.join(sorted(ALIASES))})"
        )
    return _check_hub_id(text, field)


def _looks_like_path(text: str) -> bool:
    return text.startswith(("/", ".", "~")) or text.endswith("/") or text.count("/") > 1 or "\\" in text


def _check_folder(path: Path, name: str, field: str, need_tokenizer: bool) -> str:
    where = f"{field}={name!r}" + ("" if str(path) == name else f" ({path})")
    if not path.is_dir():
        raise ValueError(f"{where} is a file, not a model folder: give the folder that holds config.json")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ValueError(
            f"{where} holds no config.json, so it is not a Hugging Face model folder: save the model with "
            "`model.save_pretrained(folder)` (and its tokenizer with `tokenizer.save_pretrained(folder)`)"
        )
    try:
        json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"{where}: {config_file} cannot be read ({type(exc).__name__}: {exc}); save the model again"
        ) from None
    if need_tokenizer and not any((path / file).is_file() for file in TOKENIZER_FILES):
        raise ValueError(
            f"{where} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}): save it there with "
            "`tokenizer.save_pretrained(folder)`, or pass processing_class=tokenizer"
        )
    missing = missing_weights(path)
    if missing is not None:
        raise ValueError(
            f"{where} holds config.json but {missing.removeprefix('no model weights: ')}: save the whole model there "
            "with `model.save_pretrained(folder)`, or finish copying it"
        )
    return str(path)


def _check_hub_id(name: str, field: str) -> str:
    from huggingface_hub import constants, try_to_load_from_cache
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    aliases = ", ".join(sorted(ALIASES))
    close = difflib.get_close_matches(name.lower(), list(ALIASES), n=1, cutoff=0.6)
    if "/" not in name and close:  # a typo of an alias, not a legacy hub id
        raise ValueError(
            f"{field}={name!r}: unknown model alias {name!r} (did you mean {close[0]!r}?): known aliases are "
            f"{aliases}; or pass a hub id (org/name) or a local folder"
        )
    try:
        validate_repo_id(name)
    except HFValidationError:
        raise ValueError(
            f"{field}={name!r} is neither a local folder (none exists there), a known alias ({aliases}), nor a "
            "valid hub id (org/name)"
        ) from None
    if isinstance(try_to_load_from_cache(name, "config.json"), str):
        return name  # cached: loads offline
    unknown = (
        f"unknown model alias {name!r}: known aliases are {aliases}; or pass a hub id (org/name) or a local folder"
    )
    if constants.HF_HUB_OFFLINE:
        offline = "HF_HUB_OFFLINE is set: download it first (`huggingface-cli download ...`)"
    elif not _hub_reachable(constants.ENDPOINT):
        offline = f"{constants.ENDPOINT} cannot be reached (offline?): download it where the hub is reachable"
    else:
        offline = None
    if offline is not None:
        missing = f"the hub id {name!r} is not in the local Hugging Face cache and {offline}, or pass a local folder"
        raise ValueError(f"{field}={name!r}: {unknown if '/' not in name else missing}")
    try:
        from huggingface_hub import file_exists

        found = file_exists(name, "config.json")
    except Exception as exc:  # gated, unauthorised, network trouble: say what the hub said
        raise ValueError(f"{field}={name!r}: the hub refused {name!r} ({type(exc).__name__}: {exc})") from None
    if not found:
        raise ValueError(
            f"{field}={name!r}: "
            + (unknown if "/" not in name else f"no model {name!r} on the hub (no config.json there): check the id")
        )
    return name


def _hub_reachable(endpoint: str, timeout_s: float = HUB_PROBE_TIMEOUT_S) -> bool:
    """Whether a TCP connection to the hub opens within `timeout_s` (name resolution included)."""
    url = urlparse(endpoint)
    host, port = url.hostname or "huggingface.co", url.port or (443 if url.scheme == "https" else 80)

    def connect() -> bool:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True

    pool = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    try:
        return pool.submit(connect).result(timeout=timeout_s)
    except Exception:
        return False
    finally:
        pool.shutdown(wait=False)


def model_config(source: str) -> dict[str, Any]:
    """The model's config.json as a dict ({} when it is not at hand)."""
    path = Path(source) / "config.json"
    if not path.is_file():
        from huggingface_hub import try_to_load_from_cache

        cached = try_to_load_from_cache(source, "config.json")
        if not isinstance(cached, str):
            return {}
        path = Path(cached)
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


INT_ENGINE_KWARGS = ("max_model_len", "kv_cache_tokens", "max_num_seqs", "max_num_batched_tokens", "block_size")


def torch_engine_kwargs() -> set[str]:
    """The keyword arguments `TorchEngine.__init__` takes, read from its source (importing it takes seconds)."""
    import ast

    source = Path(__file__).parents[1] / "engine" / "torch_engine.py"
    for node in ast.walk(ast.parse(source.read_text())):
        if isinstance(node, ast.ClassDef) and node.name == "TorchEngine":
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                    args = item.args
                    return {a.arg for a in args.args + args.kwonlyargs} - {"self", "model"}
    return set()


def check_engine_kwargs(cluster: ClusterConfig) -> None:
    """`cluster.engine_kwargs`: integer settings are positive integers (named, not "invalid literal for int()"),
    the built-in engine knows every key, and its KV cache holds one request of max_model_len."""
    kwargs = cluster.engine_kwargs or {}
    for key in INT_ENGINE_KWARGS:
        value = kwargs.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
            raise ValueError(
                f"cluster.engine_kwargs.{key}={value!r}: must be a positive integer (tokens or sequences), e.g. "
                f"--set cluster.engine_kwargs.{key}={2048 if key != 'max_num_seqs' else 32}"
            )
    if cluster.engine != EngineKind.TORCH.value:
        return
    known = torch_engine_kwargs()
    unknown = sorted(set(kwargs) - known - {"dtype"})
    if known and unknown:
        close = difflib.get_close_matches(unknown[0], sorted(known), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(
            f"cluster.engine_kwargs has {', '.join(map(repr, unknown))}, unknown to the built-in engine "
            f"(cluster.engine='torch'){hint}; it takes {', '.join(sorted(known))}"
        )
    cache, limit = kwargs.get("kv_cache_tokens"), kwargs.get("max_model_len")
    if cache is not None and limit is not None and cache < limit:
        raise ValueError(
            f"cluster.engine_kwargs.kv_cache_tokens={cache} is below max_model_len={limit}: one request of "
            f"max_model_len would not fit the KV cache; raise kv_cache_tokens to >= {limit} or lower max_model_len"
        )


def check_completion_fit(config: TrainerConfig, limit: int | None) -> None:
    """`max_completion_length` leaves room for a prompt within the engine's `max_model_len`."""
    if limit is not None and config.max_completion_length >= limit:
        raise ValueError(
            f"max_completion_length={config.max_completion_length} is not below max_model_len={limit} (the engine's "
            "prompt + completion limit): no prompt would fit; lower max_completion_length or raise "
            "cluster.engine_kwargs.max_model_len"
        )


def max_model_len(cluster: ClusterConfig, model_cfg: dict[str, Any]) -> int | None:
    """The engine's prompt + output limit: `cluster.engine_kwargs.max_model_len`, else the model's positions
    (the built-in engine's and vLLM's default); None when unknown (an external server)."""
    kwargs = cluster.engine_kwargs or {}
    if kwargs.get("max_model_len"):
        return int(kwargs["max_model_len"])
    if EngineKind(cluster.engine).traits.remote:  # the server's limit, known once it answers
        return None
    text_cfg = model_cfg.get("text_config") or {}
    for key in POSITION_KEYS:
        value = model_cfg.get(key) or text_cfg.get(key)
        if isinstance(value, int) and value > 0:
            return value
    return None


def load_tokenizer(source: str, field: str = "model") -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source)
    except Exception as exc:
        raise ValueError(
            f"{field}={source!r}: its tokenizer cannot be loaded ({type(exc).__name__}: {exc}); save a tokenizer "
            "there with `tokenizer.save_pretrained(folder)` or pass processing_class=tokenizer"
        ) from None


# ---- the prompts and the token budget ------------------------------------------------------------------------------


def prompt_lengths(
    tokenizer: Any,
    dataset: Any,
    config: TrainerConfig,
    tools: Sequence[Any] | None = None,
    num_rows: int = NUM_ROWS_CHECKED,
) -> list[int]:
    """Rendered token counts of the first `num_rows` prompts (chat template, generation prompt appended)."""
    if getattr(tokenizer, "chat_template", True) is None:
        raise ValueError(
            f"the tokenizer ({getattr(tokenizer, 'name_or_path', type(tokenizer).__name__)}) has no chat template, "
            "but prompts are rendered with it: use an instruct model, or pass processing_class=tokenizer with "
            "tokenizer.chat_template set"
        )
    lengths = []
    for row_index, row in enumerate(first_rows(dataset, num_rows)):  # a streaming dataset: its first rows
        if leased_row_problem(row, row_index) is not None:
            continue  # not a prompt: dropped (or, strict_dataset, refused) when leased
        prompt = row[PROMPT_COLUMN]
        try:
            try:
                ids = render_prompt(tokenizer, prompt, config.chat_template_kwargs, tools)
            except Exception:
                if not tools:
                    raise
                ids = render_prompt(tokenizer, prompt, config.chat_template_kwargs)  # a tool's schema is the loop's
        except Exception as exc:
            raise ValueError(
                f"row {row_index}: the prompt cannot be rendered with the chat template ({type(exc).__name__}: {exc});"
                " fix the row, or the template / chat_template_kwargs"
            ) from None
        lengths.append(len(ids))
    return lengths


def check_prompt_fit(config: TrainerConfig, lengths: Sequence[int], limit: int | None) -> None:
    """Every checked prompt too long for the engine is an error, some too long a warning (those rows fail and are
    counted); then one sample of the longest prompt that fits must fit `token_budget`."""
    if not lengths:
        return
    if limit is not None:
        too_long = [i for i, n in enumerate(lengths) if n >= limit]
        if len(too_long) == len(lengths):
            raise ValueError(
                f"every one of the first {len(lengths)} prompts is longer than max_model_len={limit} (the shortest "
                f"renders to {min(lengths)} tokens): raise cluster.engine_kwargs.max_model_len (e.g. "
                f"{min(lengths) + config.max_completion_length}) or shorten the prompts"
            )
        if too_long:
            logger.warning(
                "rows %s of the first %d render longer than max_model_len=%d: the engine rejects them "
                "(each is dropped and counted as failed)",
                too_long,
                len(lengths),
                limit,
            )
        lengths = [n for n in lengths if n < limit]
    if limit is not None and lengths and max(lengths) + config.max_completion_length > limit:
        logger.warning(
            "max_completion_length=%d: with the longest of the first %d prompts (%d tokens) a completion is capped "
            "at %d tokens by max_model_len=%d (raise cluster.engine_kwargs.max_model_len to %d to allow it)",
            config.max_completion_length,
            len(lengths),
            max(lengths),
            limit - max(lengths),
            limit,
            max(lengths) + config.max_completion_length,
        )
    budget = config.token_budget
    if budget is None or budget <= 0:
        return
    longest = max(lengths)
    need = longest + config.max_completion_length
    if limit is not None:
        need = min(need, limit)
    if budget < need:
        raise ValueError(
            f"token_budget={budget} is smaller than one sample: the longest of the first {len(lengths)} prompts "
            f"renders to {longest} tokens, plus max_completion_length={config.max_completion_length}, needs {need}; "
            f"set token_budget >= {need} (or lower max_completion_length), or token_budget <= 0 for a fixed count "
            "of samples per step"
        )


# ---- output_dir and report_to ---------------------------------------------------------------------------------------


def check_output_dir(output_dir: str | os.PathLike) -> None:
    """Create `output_dir` and write and remove a probe file in it; `ValueError` naming it when that fails (or when
    it is empty: the run would land in the current directory)."""
    check_output_dir_named(output_dir)
    path = Path(output_dir)
    probe = path / f".rlasync-write-probe-{os.getpid()}"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe.write_text("probe\n")
        probe.unlink()
    except OSError as exc:
        raise ValueError(
            f"output_dir={str(output_dir)!r} is not writable ({type(exc).__name__}: {exc.strerror or exc}): "
            "choose a folder you can write, e.g. --set output_dir=runs/my_run"
        ) from None


# ---- the teachers of a multi-teacher distillation ------------------------------------------------------------------


def check_teacher_ids(dataset: Any, teacher_ids: Sequence[str]) -> None:
    """With several teachers (MOPD), every row's `teacher_id` must name one of `teacher_ids`: a sized dataset's
    whole column is read (a `datasets.Dataset` column is one read), a streaming one's first rows. `ValueError`
    naming the unknown values, their first rows and the configured teachers; one teacher scores every row."""
    from rlasync.algorithms.distill.routing import TEACHER_ID_COLUMN
    from rlasync.data.streaming import is_streaming

    if len(teacher_ids) < 2:
        return
    known = set(teacher_ids)
    columns = getattr(dataset, "column_names", None)
    if columns is not None and not is_streaming(dataset) and TEACHER_ID_COLUMN in columns:
        values = list(dataset[TEACHER_ID_COLUMN])
    else:
        rows = first_rows(dataset, NUM_ROWS_CHECKED) if is_streaming(dataset) else list(dataset)
        values = [row.get(TEACHER_ID_COLUMN) if isinstance(row, dict) else None for row in rows]
    unknown: dict[Any, int] = {}
    for row_index, value in enumerate(values):
        if not (isinstance(value, str) and value in known):
            unknown.setdefault(value, row_index)
    if unknown:
        listed = ", ".join(f"{value!r} (row {row})" for value, row in list(unknown.items())[:5])
        raise ValueError(
            f"{TEACHER_ID_COLUMN}: {listed} {'is' if len(unknown) == 1 else 'are'} not among the configured teachers "
            f"{list(teacher_ids)}: with several teachers every row's {TEACHER_ID_COLUMN!r} column names one of them "
            "(fix the rows, or add the teacher to teacher_model / teacher_server_urls)"
        )


# ---- the whole check ------------------------------------------------------------------------------------------------


def run_preflight(trainer: Any) -> None:
    """Every check above for one trainer (its `args`, `model`, `train_dataset`, `processing_class`, `tools`, and a
    distillation trainer's local teachers), in seconds, before any actor exists."""
    config = trainer.args
    check_output_dir(config.output_dir)
    check_report_to(config.report_to)
    check_teacher_ids(trainer.train_dataset, list(getattr(trainer, "teachers", {})))
    check_engine_kwargs(config.cluster)
    given_tokenizer = trainer.given_processing_class
    source = check_model_source(trainer.model_path, "model", need_tokenizer=given_tokenizer is None)
    check_disk(config, source, lora=getattr(trainer, "peft_config", None) is not None)
    for teacher in getattr(trainer, "teachers", {}).values():
        if teacher.model is not None:
            path = check_model_source(teacher.model, f"teacher_model[{teacher.teacher_id!r}]", need_tokenizer=False)
            if given_tokenizer is None:
                check_same_vocabulary(source, path, teacher.teacher_id)
    tokenizer = given_tokenizer if given_tokenizer is not None else load_tokenizer(source)
    lengths = prompt_lengths(tokenizer, trainer.train_dataset, config, getattr(trainer, "tools", None))
    limit = max_model_len(config.cluster, model_config(source))
    check_prompt_fit(config, lengths, limit)
    check_completion_fit(config, limit)
    if getattr(trainer, "eval_dataset", None) is not None:  # the held-out prompts render and fit as well
        from rlasync.trainers.evaluation import check_eval_prompts

        tools, rows = getattr(trainer, "tools", None), len(trainer.eval_dataset)
        check_eval_prompts(prompt_lengths(tokenizer, trainer.eval_dataset, config, tools, num_rows=rows), limit)


__all__ = [
    "check_completion_fit",
    "check_engine_kwargs",
    "check_model_source",
    "check_output_dir",
    "check_prompt_fit",
    "check_teacher_ids",
    "load_tokenizer",
    "max_model_len",
    "model_config",
    "prompt_lengths",
    "run_preflight",
]
