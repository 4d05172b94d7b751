"""Bad input is rejected at once (issue 13): every case below fails with a message naming the field / file / row and
the fix, within BOUND_S seconds, before any actor exists (the launch into actors/ is replaced by a trap). No Ray.

    config layer    load_config / build_config / load_run                 -> ValueError
    preflight       AsyncGRPOTrainer(...).train() before actors.cluster.launch -> ValueError
    the CLI         rlasync.cli.main(["train", ...]) -> exit 2 (bad input) / 1 (failed run) / 130, one `error:` line
    leased rows     rlasync.data.prompts.leased_row_problem (what the rollout actors check for every leased row)
"""

import json
import sys
import time
import types
from pathlib import Path

import pytest
import yaml

from rlasync.cli import describe_error, main
from rlasync.config import AsyncDistillationConfig, AsyncGRPOConfig, load_config
from rlasync.data.prompts import NUM_ROWS_CHECKED, leased_row_problem
from rlasync.rewards import last_number_reward
from rlasync.trainers import AsyncDistillationTrainer, AsyncGRPOTrainer

BOUND_S = 5.0
VOCAB = [str(d) for d in range(10)] + "What is + - * / ? . Answer with just the number user assistant system".split()
ROWS = [{"prompt": [{"role": "user", "content": f"What is {i} + 1 ?"}], "answer": str(i + 1)} for i in range(8)]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    """A random 1-layer Llama (max_position_embeddings=256) with a WordLevel tokenizer and a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    path = tmp_path_factory.mktemp("tiny_model")
    specials = ["<pad>", "<eos>", "<unk>", "<|im_start|>", "<|im_end|>"]
    vocab = {token: i for i, token in enumerate(specials + VOCAB)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    template = (
        "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
        "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
    )
    PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>", chat_template=template
    ).save_pretrained(path)
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
        eos_token_id=1,
        pad_token_id=0,
        bos_token_id=None,
    )
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return str(path)


@pytest.fixture(autouse=True)
def no_launch(monkeypatch):
    """Reaching the launch call means the bad input was not caught up front: fail loudly."""
    calls = []

    def launch(spec, *, state, actor_ids):
        calls.append(spec)
        raise AssertionError("bad input reached actors.cluster.launch")

    monkeypatch.setitem(sys.modules, "actors.cluster", types.SimpleNamespace(launch=launch))
    return calls


def timed(fn, *args, **kwargs):
    start = time.perf_counter()
    try:
        return fn(*args, **kwargs)
    finally:
        elapsed = time.perf_counter() - start
        assert elapsed < BOUND_S, f"took {elapsed:.1f} s (bound {BOUND_S} s)"


def raises_fast(match, fn, *args, **kwargs):
    with pytest.raises(ValueError, match=match):
        timed(fn, *args, **kwargs)


# ---- the config layer -----------------------------------------------------------------------------------------------

CONFIG_CASES = [
    (["learning_rate=-1"], "learning_rate"),
    (["num_generations=1"], "num_generations=1"),
    (["lerning_rate=1e-5"], "did you mean 'learning_rate'"),
    (["max_steps=abc"], "max_steps"),
    (["cluster.num_learner=2"], "cluster.num_learners"),
    (["fp16=true"], "fp16=True is not supported"),
    (["temperature=0"], "temperature=0"),
    (["max_steps=0"], "max_steps=0"),
    (["bf16=true", "fp16=true"], "bf16=True and fp16=True"),
    (["dtype=float8"], "dtype='float8'"),
    (["lr_scheduler_type=cosinus"], "lr_scheduler_type='cosinus'"),
    (["cluster.num_learners=0"], "cluster.num_learners=0"),
    (["cluster.engine=tgi"], "cluster.engine='tgi'"),
    (["cluster.weight_sync_backend=mpi"], "cluster.weight_sync_backend='mpi'"),
    (["cluster.vllm_server_url=http://x:8000"], "set cluster.engine='vllm_server'"),
    (["report_to=comet_ml"], r"report_to=\['comet_ml'\]: unsupported"),
    (["max_staleness=-1"], "max_staleness=-1"),
    (["num_sampler_logprobs=0"], "score_centering=True needs"),
    (["queue_maxsize=8"], "queue_maxsize=8 is not supported"),
    (["min_p=1.5"], r"min_p=1.5: must be in \[0, 1\]"),
    (["max_completion_length=0"], "max_completion_length"),
    (["chat_template_kwargs={not json"], "value of chat_template_kwargs is not valid YAML"),
    (['chat_template_kwargs="{not json"'], "chat_template_kwargs"),
    (["per_device_train_batch_size=1.5"], "per_device_train_batch_size"),
    (["rollout_worker_timeout=0"], "rollout_worker_timeout=0"),
    (["strict_dataset=maybe"], "strict_dataset"),
    # sampling limits (issue 34): each refused before Ray with the smallest (largest) supported value named
    (["temperature=1e-9"], r"temperature=1e-09: GRPO's smallest supported temperature is 0.01"),
    (["temperature=0.005"], r"smallest supported temperature is 0.01"),
    (["top_k=1"], "top_k=1 keeps only the argmax"),
    (["top_p=1e-9"], r"top_p=1e-09: GRPO's smallest supported top_p is 0.01"),
    (["min_p=1.0"], r"min_p=1.0 keeps only the argmax.*min_p < 1"),
    (["repetition_penalty=1e-9"], r"repetition_penalty=1e-09: must be in \[0.01, 100\]"),
    (["repetition_penalty=1e9"], r"repetition_penalty=1000000000.0: must be in \[0.01, 100\]"),
    (["reward_weights=[1, .nan]"], r"reward_weights=\[1.0, nan\]: nan is not a finite number"),
    (["reward_weights=[1, .inf]"], r"reward_weights=\[1.0, inf\]: inf is not a finite number"),
    (["reward_weights=abc"], "reward_weights"),
    (["scale_rewards=batch"], "scale_rewards='batch' is not supported"),
    (["multi_objective_aggregation=normalize_then_sum"], "multi_objective_aggregation='normalize_then_sum'"),
]


@pytest.mark.parametrize("overrides, match", CONFIG_CASES, ids=[c[0][0] for c in CONFIG_CASES])
def test_a_bad_config_value_names_the_field(overrides, match):
    raises_fast(match, load_config, None, overrides)


@pytest.mark.parametrize(
    "overrides, match",
    [
        (["beta=2"], "beta must be in"),
        (['teacher_server_urls={"t": "localhost:1"}'], r"teacher_server_urls\['t'\]"),
        (["teacher_top_k=-1"], "teacher_top_k=-1"),
        (["temperature=1e-9"], r"temperature=1e-09: the smallest supported is 0.0001"),
        (["repetition_penalty=500"], r"repetition_penalty=500.0: must be in \[0.01, 100\]"),
    ],
)
def test_a_bad_distillation_value_names_the_field(overrides, match):
    raises_fast(match, load_config, None, overrides, config_class=AsyncDistillationConfig)


# ---- files: run files, YAML, datasets ------------------------------------------------------------------------------


def run_file(tmp_path, tiny_model, **changes):
    data = {
        "model": tiny_model,
        "dataset": {"name": "arithmetic", "size": 16, "seed": 0},
        "reward_funcs": ["rlasync.rewards:last_number_reward"],
        "output_dir": str(tmp_path / "out"),
        "max_steps": 1,
        "num_generations": 2,
        "max_completion_length": 8,
        "token_budget": 256,
        "cluster": {"engine_kwargs": {"max_model_len": 128}},
    }
    data.update(changes)
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def cli(capsys, *argv):
    code = timed(main, ["train", *argv])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, err
    assert "Traceback" not in err
    return code, errors[0]


FILE_CASES = [
    ("missing config", lambda tmp, m: str(tmp / "nope.yaml"), "nope.yaml' does not exist"),
    ("yaml syntax", lambda tmp, m: _write(tmp / "bad.yaml", "model: x\nmax_steps: [1, 2\n"), r"bad.yaml at line \d+"),
    ("top level list", lambda tmp, m: _write(tmp / "list.yaml", "- 1\n- 2\n"), "top level must be a mapping"),
    ("no model", lambda tmp, m: _run_without(tmp, m, "model"), "`model:` is missing"),
    ("no dataset", lambda tmp, m: _run_without(tmp, m, "dataset"), "`dataset:` is missing"),
    ("dataset name", lambda tmp, m: run_file(tmp, m, dataset={"name": "mnist"}), "dataset.name='mnist'"),
    (
        "dataset file",
        lambda tmp, m: run_file(tmp, m, dataset={"name": "json", "path": str(tmp / "rows.jsonl")}),
        "rows.jsonl'.*no such file",
    ),
    ("dataset path", lambda tmp, m: run_file(tmp, m, dataset={"name": "json"}), "dataset.path is missing"),
    ("reward string", lambda tmp, m: run_file(tmp, m, reward_funcs=["last_number_reward"]), "module:function"),
    ("reward module", lambda tmp, m: run_file(tmp, m, reward_funcs=["no_such_mod:f"]), "cannot import module"),
    ("reward attr", lambda tmp, m: run_file(tmp, m, reward_funcs=["rlasync.rewards:nope"]), "no attribute 'nope'"),
    ("teacher for grpo", lambda tmp, m: run_file(tmp, m, teacher_model="x"), "add `trainer: distillation`"),
    ("trainer kind", lambda tmp, m: run_file(tmp, m, trainer="ppo"), "trainer='ppo'"),
    ("unknown key", lambda tmp, m: run_file(tmp, m, num_generation=4), "did you mean 'num_generations'"),
    ("empty dataset", lambda tmp, m: _jsonl(tmp, m, b""), r"empty.jsonl'?: the dataset is empty \(0 rows\)"),
    ("empty task", lambda tmp, m: run_file(tmp, m, dataset={"name": "arithmetic", "size": 0}), "empty \\(0 rows\\)"),
    (
        "bad byte",
        lambda tmp, m: _jsonl(tmp, m, b'{"prompt": "a"}\n{"prompt": "b\xff"}\n'),
        r"rows.jsonl'?: line 2, column 14: byte 0xff is not UTF-8",
    ),
    (
        "bad json line",
        lambda tmp, m: _jsonl(tmp, m, b'{"prompt": "a"}\n{"prompt": \n'),
        r"rows.jsonl'?: line 2 is not JSON",
    ),
    (
        "duplicate key",
        lambda tmp, m: _write(tmp / "dup.yaml", Path(run_file(tmp, m)).read_text() + "max_steps: 3\n"),
        r"dup.yaml: the key 'max_steps' is written twice \(line \d+ and line \d+\)",
    ),
]


def _jsonl(tmp_path, tiny_model, data):
    name = "empty.jsonl" if not data else "rows.jsonl"
    (tmp_path / name).write_bytes(data)
    return run_file(tmp_path, tiny_model, dataset={"name": "json", "path": str(tmp_path / name)})


def _write(path, text):
    path.write_text(text)
    return str(path)


def _run_without(tmp_path, tiny_model, key):
    path = run_file(tmp_path, tiny_model)
    data = yaml.safe_load(Path(path).read_text())
    del data[key]
    return _write(Path(path), yaml.safe_dump(data))


@pytest.mark.parametrize("name, make, match", FILE_CASES, ids=[c[0] for c in FILE_CASES])
def test_a_bad_run_file_is_one_error_line_and_exit_2(name, make, match, tmp_path, tiny_model, capsys, no_launch):
    code, line = cli(capsys, make(tmp_path, tiny_model))
    assert code == 2 and not no_launch
    assert __import__("re").search(match, line), line


# ---- preflight: known before Ray starts -----------------------------------------------------------------------------


def _no_config(tmp_path, tiny_model):
    folder = tmp_path / "weights_only"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"")
    return {"model": str(folder)}


def _no_tokenizer(tmp_path, tiny_model):
    folder = tmp_path / "no_tok"
    folder.mkdir()
    (folder / "config.json").write_text(Path(tiny_model, "config.json").read_text())
    return {"model": str(folder)}


def _corrupt_config(tmp_path, tiny_model):
    folder = tmp_path / "corrupt"
    folder.mkdir()
    (folder / "config.json").write_text('{"model_type": "lla')
    return {"model": str(folder)}


def _unwritable_output(tmp_path, tiny_model):
    (tmp_path / "a_file").write_text("x")
    return {"output_dir": str(tmp_path / "a_file" / "out")}


def _no_weights(tmp_path, tiny_model):
    """A model folder whose copy stopped before the weights: config.json and the tokenizer only."""
    folder = tmp_path / "no_weights"
    folder.mkdir()
    for file in Path(tiny_model).iterdir():
        if not file.name.endswith(".safetensors"):
            (folder / file.name).write_bytes(file.read_bytes())
    return {"model": str(folder)}


PREFLIGHT_CASES = [
    (
        "alias typo",
        lambda t, m: {"model": "smollm2-135m-instrct"},
        "unknown model alias 'smollm2-135m-instrct'.*did you mean",
    ),
    ("bare name", lambda t, m: {"model": "qwen-tiny"}, "unknown model alias 'qwen-tiny'"),
    ("missing folder", lambda t, m: {"model": str(t / "models" / "mine")}, "does not exist"),
    ("relative folder", lambda t, m: {"model": "./no/such/model"}, "does not exist"),
    ("no config.json", _no_config, "holds no config.json"),
    ("no tokenizer", _no_tokenizer, "holds no tokenizer"),
    ("corrupt config.json", _corrupt_config, r"config.json cannot be read"),
    ("invalid hub id", lambda t, m: {"model": "not a repo!"}, "nor a valid hub id"),
    (
        "uncached hub id",
        lambda t, m: {"model": "rlasync-no-such-org/no-such-model-0"},
        "rlasync-no-such-org/no-such-model-0",
    ),
    ("output_dir", _unwritable_output, "output_dir=.* is not writable"),
    (
        "token budget",
        lambda t, m: {"token_budget": 20, "max_completion_length": 16},
        "token_budget=20 is smaller than one sample",
    ),
    (
        "prompts too long",
        lambda t, m: {"engine_kwargs": {"max_model_len": 8}},
        "every one of the first 8 prompts is longer than max_model_len=8",
    ),
    (
        "positions",
        lambda t, m: {"rows": [{"prompt": [{"role": "user", "content": " ".join(["1"] * 300)}]}]},
        "longer than max_model_len=256",
    ),
    ("no weights", _no_weights, "holds config.json but model.safetensors .* is missing"),
    (
        "max_model_len not a number",
        lambda t, m: {"engine_kwargs": {"max_model_len": "abc"}},
        r"cluster.engine_kwargs.max_model_len='abc': must be a positive integer",
    ),
    (
        "unknown engine kwarg",
        lambda t, m: {"engine_kwargs": {"max_model_length": 128}},
        r"'max_model_length', unknown to the built-in engine .*did you mean 'max_model_len'",
    ),
    (
        "kv cache below max_model_len",
        lambda t, m: {"engine_kwargs": {"max_model_len": 128, "kv_cache_tokens": 64}},
        "kv_cache_tokens=64 is below max_model_len=128",
    ),
    (
        "completion above max_model_len",
        lambda t, m: {"max_completion_length": 200, "token_budget": None},
        "max_completion_length=200 is not below max_model_len=128",
    ),
]


def _grpo(tiny_model, tmp_path, model=None, rows=None, engine_kwargs=None, **config):
    engine_kwargs = {"max_model_len": 128} if engine_kwargs is None else engine_kwargs
    args = AsyncGRPOConfig(
        **{
            "output_dir": str(tmp_path / "out"),
            "max_steps": 1,
            "num_generations": 2,
            "max_completion_length": 8,
            "token_budget": 256,
            "cluster": {"engine_kwargs": engine_kwargs},
            **config,
        }
    )
    if engine_kwargs == {}:
        args.cluster.engine_kwargs = None
    return AsyncGRPOTrainer(
        model=model or tiny_model, reward_funcs=last_number_reward, args=args, train_dataset=rows or ROWS
    )


def test_reward_weights_of_another_length_than_reward_funcs_are_refused_at_construction(tmp_path, tiny_model):
    raises_fast(
        r"reward_weights has 2 weight\(s\) \[1.0, 0.5\] for 1 reward function\(s\): give one weight per entry",
        _grpo,
        tiny_model,
        tmp_path,
        reward_weights=[1.0, 0.5],
    )


@pytest.mark.parametrize("name, make, match", PREFLIGHT_CASES, ids=[c[0] for c in PREFLIGHT_CASES])
def test_preflight_rejects_before_any_actor(name, make, match, tmp_path, tiny_model, no_launch):
    changes = make(tmp_path, tiny_model)
    if name == "positions":
        changes["engine_kwargs"] = {}  # no engine limit: the model's max_position_embeddings (256) applies
    trainer = _grpo(tiny_model, tmp_path, **changes)
    raises_fast(match, trainer.train)
    assert not no_launch


def test_preflight_names_a_missing_teacher(tmp_path, tiny_model, no_launch):
    args = AsyncDistillationConfig(
        output_dir=str(tmp_path / "out"),
        max_steps=1,
        max_completion_length=8,
        token_budget=256,
        cluster={"engine_kwargs": {"max_model_len": 128}},
    )
    trainer = AsyncDistillationTrainer(
        model=tiny_model, args=args, train_dataset=ROWS, teacher_model=str(tmp_path / "teacher")
    )
    raises_fast(r"teacher_model\['default'\]=.*does not exist", trainer.train)
    assert not no_launch


def test_preflight_names_a_tokenizer_without_chat_template(tmp_path, tiny_model, no_launch):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    tokenizer.chat_template = None
    trainer = _grpo(tiny_model, tmp_path)
    trainer.processing_class = tokenizer
    raises_fast("has no chat template", trainer.train)


def test_preflight_names_an_uninstalled_sink(tmp_path, tiny_model, monkeypatch):
    import rlasync.metrics.sinks as sinks

    monkeypatch.setattr(sinks, "_importable", lambda module: module != "tensorboard")
    raises_fast(
        "report_to includes 'tensorboard' but tensorboard is not installed",
        _grpo(tiny_model, tmp_path, report_to="tensorboard").train,
    )


def test_preflight_refuses_an_eval_prompt_longer_than_the_engine(tmp_path, tiny_model, no_launch):
    long = [{"prompt": [{"role": "user", "content": " ".join(["1"] * 200)}], "answer": "1"}]
    trainer = _grpo(tiny_model, tmp_path)
    trainer.eval_dataset = ROWS[:2] + long  # as AsyncGRPOTrainer(..., eval_dataset=...) keeps it
    raises_fast(r"eval_dataset rows \[2\] render to \d+ tokens or more.*max_model_len=128", trainer.train)
    assert not no_launch


def test_preflight_passes_a_good_run_and_warns_of_some_long_prompts(tmp_path, tiny_model, no_launch, caplog):
    rows = ROWS + [{"prompt": [{"role": "user", "content": " ".join(["1"] * 200)}], "answer": "1"}]
    trainer = _grpo(tiny_model, tmp_path, rows=rows)
    with pytest.raises(AssertionError, match="reached actors.cluster.launch"):  # every check passed
        timed(trainer.train)
    assert len(no_launch) == 1
    assert "rows [8] of the first 9 render longer than max_model_len=128" in caplog.text


# ---- the dataset: up front (first rows) and lazily (every leased row) ------------------------------------------------

DATASET_CASES = [
    ("no prompt column", [{"question": "q"}], "no 'prompt' column"),
    ("empty dataset", [], "the dataset is empty"),
    ("plain string", ROWS[:3] + [{"prompt": "What is 1 + 1?"}], "row 3: the prompt is a plain string"),
    ("empty messages", ROWS[:2] + [{"prompt": []}], "row 2: the prompt is an empty list"),
    ("bad role", [{"prompt": [{"role": "robot", "content": "hi"}]}], "role 'robot'"),
    ("no content", [{"prompt": [{"role": "user"}]}], "has no 'content' key"),
]


@pytest.mark.parametrize("name, rows, match", DATASET_CASES, ids=[c[0] for c in DATASET_CASES])
def test_a_bad_dataset_names_the_row(name, rows, match, tmp_path, tiny_model):
    raises_fast(
        match,
        AsyncGRPOTrainer,
        model=tiny_model,
        reward_funcs=last_number_reward,
        args=AsyncGRPOConfig(output_dir=str(tmp_path), max_steps=1),
        train_dataset=rows,
    )


def test_a_bad_row_past_the_checked_ones_is_accepted_up_front_and_caught_when_leased(tmp_path, tiny_model):
    rows = [dict(ROWS[0]) for _ in range(NUM_ROWS_CHECKED + 4)]
    rows[NUM_ROWS_CHECKED + 2] = {"prompt": "What is 1 + 1?", "answer": "2"}
    AsyncGRPOTrainer(
        model=tiny_model,
        reward_funcs=last_number_reward,
        args=AsyncGRPOConfig(output_dir=str(tmp_path)),
        train_dataset=rows,
    )
    bad = NUM_ROWS_CHECKED + 2
    assert f"row {bad}: the prompt is a plain string" in leased_row_problem(rows[bad], bad)
    assert leased_row_problem(rows[0], 0) is None


@pytest.mark.parametrize(
    "row, match",
    [
        ({"answer": 1}, "row 7 has no 'prompt' column"),
        ({"prompt": []}, "row 7: the prompt is an empty list"),
        ({"prompt": None}, "row 7: the prompt is a NoneType"),
        ("text", "row 7 is a str, not a dict"),
    ],
)
def test_leased_row_problem_names_the_row(row, match):
    assert match in leased_row_problem(row, 7)


def test_strict_dataset_is_a_config_field_off_by_default():
    assert AsyncGRPOConfig().strict_dataset is False and AsyncDistillationConfig(strict_dataset=True).strict_dataset


# ---- the CLI: one line per error, exit codes, --verbose, reduced remote errors ------------------------------------


def test_cli_preflight_error_is_exit_2_and_verbose_adds_the_traceback(tmp_path, tiny_model, capsys):
    path = run_file(tmp_path, tiny_model, model="smollm2-135m-instrct")
    code, line = cli(capsys, path)
    assert code == 2 and "unknown model alias 'smollm2-135m-instrct'" in line
    assert timed(main, ["train", path, "--verbose"]) == 2
    assert "Traceback (most recent call last)" in capsys.readouterr().err


def test_cli_token_budget_from_set_is_caught_up_front(tmp_path, tiny_model, capsys, no_launch):
    code, line = cli(capsys, run_file(tmp_path, tiny_model), "--set", "token_budget=12")
    assert code == 2 and "token_budget=12 is smaller than one sample" in line and not no_launch


def test_cli_a_failed_run_is_exit_1_and_keyboard_interrupt_exit_130(tmp_path, tiny_model, capsys, monkeypatch):
    def died(spec, *, state, actor_ids):
        raise RuntimeError("learner rank 0 failed: boom")

    monkeypatch.setitem(sys.modules, "actors.cluster", types.SimpleNamespace(launch=died))
    path = run_file(tmp_path, tiny_model)
    code, line = cli(capsys, path)
    assert code == 1 and line == "error: training failed: learner rank 0 failed: boom"

    def interrupted(spec, *, state, actor_ids):
        raise KeyboardInterrupt

    monkeypatch.setitem(sys.modules, "actors.cluster", types.SimpleNamespace(launch=interrupted))
    code, line = cli(capsys, path)
    assert code == 130 and "interrupted; resume with --resume" in line


def test_cli_a_signal_is_exit_128_plus_the_signal_naming_the_final_checkpoint(
    tmp_path, tiny_model, capsys, monkeypatch
):
    from rlasync.driver.signals import RunInterrupted

    def terminated(spec, *, state, actor_ids):
        raise RunInterrupted(15, str(tmp_path / "out" / "checkpoint-3"))

    monkeypatch.setitem(sys.modules, "actors.cluster", types.SimpleNamespace(launch=terminated))
    code, line = cli(capsys, run_file(tmp_path, tiny_model))
    assert code == 143 and "interrupted by SIGTERM: final checkpoint" in line and "checkpoint-3" in line


def test_cli_one_run_per_folder(tmp_path, tiny_model, capsys, no_launch):
    path = run_file(tmp_path, tiny_model)
    code, line = cli(capsys, path, "--set", "output_dir=")
    assert code == 2 and "output_dir='' is empty" in line
    (tmp_path / "out" / "checkpoint-2").mkdir(parents=True)
    code, line = cli(capsys, path)
    assert (
        code == 2 and "holds checkpoints of an earlier run (checkpoint-2)" in line and "--overwrite_output_dir" in line
    )
    assert not no_launch
    code, line = cli(capsys, path, "--overwrite_output_dir")  # accepted: it reaches the launch (the trap: exit 1)
    assert code == 1 and "bad input reached actors.cluster.launch" in line
    assert not (tmp_path / "out" / "checkpoint-2").exists() and not (tmp_path / "out" / ".rlasync.lock").exists()


def test_cli_a_bad_resume_point_is_exit_2(tmp_path, tiny_model, capsys, no_launch):
    path = run_file(tmp_path, tiny_model)
    code, line = cli(capsys, path, "--resume", str(tmp_path / "nowhere"))
    assert code == 2 and "nowhere' is not a directory" in line
    code, line = cli(capsys, path, "--resume")
    assert code == 2 and "holds no complete checkpoint" in line
    checkpoint = tmp_path / "out" / "checkpoint-2"
    checkpoint.mkdir(parents=True)
    (checkpoint / "trainer_state.json").write_text('{"global_step": 2}')  # complete, but no model.safetensors
    code, line = cli(capsys, path, "--resume", str(checkpoint))
    assert code == 2 and "checkpoint-2 is incomplete (no model weights: model.safetensors" in line
    assert not no_launch


def test_a_resume_names_the_changed_config_fields(tmp_path):
    from rlasync.driver.checkpoint import RUN_CONFIG, config_changes

    saved = AsyncGRPOConfig(output_dir=str(tmp_path), num_generations=4, max_steps=10).to_dict()
    (tmp_path / RUN_CONFIG).write_text(json.dumps(saved, default=str))
    resumed = AsyncGRPOConfig(
        output_dir=str(tmp_path / "x"),
        num_generations=8,
        max_steps=20,
        temperature=0.7,
        eval_strategy="steps",  # the evaluation cadence may change on a resume without a word
        eval_steps=5,
    )
    assert config_changes(tmp_path, resumed.to_dict()) == ["num_generations: 4 -> 8", "temperature: 1.0 -> 0.7"]
    assert config_changes(tmp_path / "old_checkpoint_without_it", resumed.to_dict()) == []


def test_preflight_refuses_an_output_dir_without_room_for_a_checkpoint_and_warns_below_two(
    tmp_path, tiny_model, monkeypatch, caplog, no_launch
):
    import shutil

    from rlasync.trainers.disk import checkpoint_bytes, parameter_count

    config = AsyncGRPOConfig(output_dir=str(tmp_path / "out"))
    params = parameter_count(tiny_model)
    need = checkpoint_bytes(config, tiny_model)
    assert params and need == params * (4 + 8) + 10_000_000  # float32 weights + AdamW's two fp32 moments
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr("rlasync.trainers.disk.shutil.disk_usage", lambda path: usage._replace(free=need // 2))
    raises_fast(
        r"output_dir=.*out' has 0.0\d GB free, but one checkpoint needs about 0.0\d GB",
        _grpo(tiny_model, tmp_path).train,
    )
    monkeypatch.setattr("rlasync.trainers.disk.shutil.disk_usage", lambda path: usage._replace(free=need * 3 // 2))
    with caplog.at_level("WARNING"):
        _grpo(tiny_model, tmp_path).preflight()
    assert "room for one checkpoint" in caplog.text and "but not two" in caplog.text


class FakeRayTaskError(Exception):
    """What Ray raises for a remote exception: `cause`, `function_name`, `traceback_str`."""

    def __init__(self, cause, function_name, traceback_str):
        super().__init__(traceback_str)
        self.cause, self.function_name, self.traceback_str = cause, function_name, traceback_str


REMOTE_TB = """ray::RewardActor.score() (pid=4242, ip=10.0.0.1, actor_id=abc)
  File "/site/ray/_private/worker.py", line 900, in main_loop
  File "/work/my_rewards.py", line 12, in strict_reward
    raise ValueError("no answer column")
ValueError: no answer column"""


def test_describe_error_reduces_ray_errors_to_the_actor_and_the_users_message():
    line = describe_error(FakeRayTaskError(ValueError("no answer column"), "RewardActor.score", REMOTE_TB))
    assert line == "ValueError: no answer column (in RewardActor.score, raised at strict_reward (my_rewards.py:12))"
    banner = RuntimeError(
        "rollout actor 0 failed: RayTaskError(RewardFunctionError): "
        + REMOTE_TB.replace(
            "ValueError: no answer column", "RewardFunctionError: reward function strict_reward raised ValueError: x"
        )
    )
    text = describe_error(banner)
    assert text.startswith("rollout actor 0 failed: RewardFunctionError: reward function strict_reward raised")
    assert "(in RewardActor" in text and "\n" not in text and "worker.py" not in text


def test_describe_error_names_a_dead_actor_and_a_missing_file():
    died = type("ActorDiedError", (Exception,), {})(
        "The actor died unexpectedly before finishing this task.\n\tclass_name: LearnerActor\n\tactor_id: 12\n"
        "\tpid: 77\n\tname: \n\tThe actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR"
    )
    assert describe_error(died) == "ActorDiedError: LearnerActor died (its worker process has died, pid 77)"
    missing = FileNotFoundError(2, "No such file or directory", "/data/rows.jsonl")
    assert describe_error(missing) == "FileNotFoundError: No such file or directory (/data/rows.jsonl)"
    assert describe_error(json.JSONDecodeError("Expecting value", "x", 0)).startswith("JSONDecodeError: Expecting")


def test_cli_config_show_names_the_yaml_file(tmp_path, capsys):
    bad = tmp_path / "cfg.yaml"
    bad.write_text("learning_rate: [1\n")
    assert timed(main, ["config", "show", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "cfg.yaml at line" in err and "YAML syntax error" in err and "Traceback" not in err


def test_the_config_and_the_sinks_agree_on_report_to(monkeypatch):
    """One vocabulary (rlasync.config.vocab.Tracker): what the config accepts, the sinks open."""
    import rlasync.metrics.sinks as sinks
    from rlasync.config import AsyncGRPOConfig
    from rlasync.config.vocab import Tracker
    from rlasync.metrics.sinks import check_report_to

    monkeypatch.setattr(sinks, "_importable", lambda module: True)
    for tracker in Tracker:
        assert AsyncGRPOConfig(report_to=tracker.value).report_to == [tracker] == check_report_to(tracker.value)
    assert check_report_to("none") == [] and check_report_to(["wandb", "tensorboard"]) == ["wandb", "tensorboard"]
    assert check_report_to("all") == list(Tracker)


def test_models_prepare_names_an_unknown_alias(capsys):
    assert timed(main, ["models", "prepare", "smollm3"]) == 2
    assert "unknown model alias 'smollm3'" in capsys.readouterr().err
