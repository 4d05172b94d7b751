"""End-to-end async GRPO on Ray actors: step time, weight-sync phases, waits and trained tokens/s, async vs sync.

One learner and one generation actor (GPU 0 and GPU 1 when two are visible; both on one GPU with fractional
`num_gpus` with `--share-gpu` or when only one is visible, where the weight sync falls back to gloo through the
CPU), the arithmetic task of `rlasync.data`, a random-weight Qwen3-0.6B-shaped model (hidden 1024, 28 layers, 16
heads, 8 KV heads, head dim 128, intermediate 3072, vocab 151936, tied) saved with a locally built word-level
tokenizer with a chat template (no hub access needed), or `--model smollm2-135m-instruct` / any HF folder.
The reward is the last-number accuracy plus a small hash of the reply, so no group has zero spread and every
step trains (random weights never answer correctly).

The same training runs twice: with `--max-staleness` (async, default 4) and with `max_staleness=0` (synchronous
without waste: each weight version generates its step's samples, then the learner trains on them; nothing is
generated while it trains and nothing is dropped as stale, docs/algorithms.md §2.3.4). Per run the JSON holds the
means over steps after `--warmup` of `perf/step_s`, `perf/weight_sync_s` (+ `_pause_s`, `_transfer_s`,
`_resume_s`), `perf/rollout_wait_s`, `rollout/backpressure_s`, trained tokens/s (Σ `batch/trained_tokens_per_step` /
Σ `perf/step_s`), read from the run's `<output_dir>/metrics.jsonl`, for the step and sync times also the medians and
the per-step values (one slow sync shows there); and the ratio async / sync of trained tokens/s.

The learner's compilation: every run leaves `torch_compile` unset (the default config: compiled layers on CUDA,
eager on CPU) except `async_compiled` (torch_compile=True) and `async_eager` (torch_compile=False), which are the
async run with the flag set; `--runs async,async_compiled` records `default_over_compiled_trained_tok_s`. Each run
reports `compile_s_total` (Σ `perf/compile_s`, the steps that compiled) and `compile_steps`.

    python bench/e2e_grpo.py --out bench/results/e2e_grpo_h200x2.json                 # 2 GPUs, ~5 min
    python bench/e2e_grpo.py --share-gpu --out bench/results/e2e_grpo_h200x1.json     # 1 GPU
    python bench/e2e_grpo.py --device cpu --tiny --steps 2 --out /tmp/e2e_tiny.json   # smoke test, CPU
    python bench/e2e_grpo.py --trainer distill --runs async --out $OUT/e2e_distill.json  # distillation, 2 GPUs
    python bench/e2e_grpo.py --runs async,async_compiled --out $OUT/e2e_default_vs_compiled.json
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SPECIALS = ["<pad>", "<eos>", "<unk>", "<|im_start|>", "<|im_end|>"]
WORDS = [str(d) for d in range(10)] + "What is + - * / ? . , Answer with just the number user assistant system".split()
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|> {{ m['role'] }} {{ m['content'] }} <|im_end|> {% endfor %}"
    "{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)
KEYS = (
    "perf/step_s",
    "perf/weight_sync_s",
    "perf/weight_sync_pause_s",
    "perf/weight_sync_transfer_s",
    "perf/weight_sync_resume_s",
    "perf/weight_sync_dispatch_s",
    "perf/weight_sync_send_s",
    "perf/weight_sync_engine_load_s",
    "perf/generation_loop_lag_max_s",
    "perf/generation_gc_max_s",
    "perf/rollout_wait_s",
    "rollout/backpressure_s",
    "perf/fwd_bwd_s",
    "perf/fwd_s",
    "perf/optimizer_s",
    "perf/fetch_samples_s",
    "perf/pack_s",
    "batch/trained_tokens_per_step",
    "batch/forwarded_tokens_per_step",
    "batch/samples_per_step",
    "sample/staleness_mean",
    "sample/staleness_max",
    "rollout/generated_tokens_per_s",
    "reward",
    "jsd",
    "entropy",
)


def bench_reward(completions: list[Any], answer: list[Any] | None = None, **kwargs: Any) -> list[float]:
    """Last-number accuracy + a hash of the reply in [0, 0.1): every group has a spread, so every step trains."""
    from rlasync.rewards import last_number_reward
    from rlasync.rewards.text import completion_text

    scores = last_number_reward(completions, answer=answer) if answer is not None else [0.0] * len(completions)
    return [
        float(score or 0.0) + (zlib.crc32(completion_text(completion).encode()) % 1000) / 10000.0
        for score, completion in zip(scores, completions)
    ]


def build_tokenizer(vocab_size: int) -> Any:
    """A word-level tokenizer of exactly `vocab_size` ids (task words, digits, filler words) with a chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = SPECIALS + WORDS
    words += [f"w{i}" for i in range(vocab_size - len(words))]
    vocab = {word: i for i, word in enumerate(words[:vocab_size])}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation(), pre_tokenizers.Digits(individual_digits=True)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        eos_token="<eos>",
        unk_token="<unk>",
        chat_template=CHAT_TEMPLATE,
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )


def model_config(tiny: bool) -> Any:
    from transformers import Qwen3Config

    ids = dict(eos_token_id=SPECIALS.index("<eos>"), pad_token_id=SPECIALS.index("<pad>"), bos_token_id=None)
    if tiny:
        return Qwen3Config(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=128,
            vocab_size=512,
            tie_word_embeddings=True,
            max_position_embeddings=1024,
            **ids,
        )
    return Qwen3Config(
        hidden_size=1024,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=3072,
        vocab_size=151936,
        tie_word_embeddings=True,
        max_position_embeddings=40960,
        rope_theta=1_000_000.0,
        **ids,
    )


def build_random_model(folder: Path, tiny: bool, dtype: str, device: str, seed: int = 0) -> str:
    """Random weights of the Qwen3-0.6B shape (or a tiny one) + the word-level tokenizer, saved as an HF folder."""
    import torch
    from transformers import AutoModelForCausalLM

    config = model_config(tiny)
    torch.manual_seed(seed)
    with torch.device(device):  # initialising 0.6B parameters is much faster on the GPU
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    model.generation_config.eos_token_id = config.eos_token_id
    model.save_pretrained(folder)
    build_tokenizer(config.vocab_size).save_pretrained(folder)
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return str(folder)


def hardware(device: str) -> dict[str, Any]:
    import torch
    import transformers

    info: dict[str, Any] = {
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    try:
        import ray  # noqa: TID251 - a driver script, as actors.cluster

        info["ray"] = ray.__version__
    except ImportError:
        pass
    if device == "cuda":
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        info["cuda"] = torch.version.cuda
    return info


def kernel_overrides(pairs: list[str]) -> dict[str, Any]:
    """`--kernel KEY=VALUE` flags as the config's `kernels` section (values parsed as YAML, as `--set` does)."""
    from rlasync.config.load import parse_override

    return dict(parse_override(pair) for pair in pairs)


RUN_COMPILE: dict[str, bool | None] = {"async": None, "sync": None, "async_compiled": True, "async_eager": False}
"""Each run's `torch_compile`: None leaves the field unset (the default config)."""


def make_config(
    args: argparse.Namespace, output_dir: Path, max_staleness: int, placement: str, torch_compile: bool | None = None
) -> Any:
    from rlasync.config import AsyncGRPOConfig

    gpu = args.device == "cuda"
    compile_flag = {} if torch_compile is None else {"torch_compile": torch_compile}
    learner_gpus, generation_gpus = {"two_gpus": (1.0, 1.0), "shared_gpu": (0.5, 0.5), "cpu": (0.0, 0.0)}[placement]
    return AsyncGRPOConfig(
        output_dir=str(output_dir),
        max_steps=args.steps,
        logging_steps=1,
        save_steps=10**9,
        seed=0,
        num_generations=args.num_generations,
        max_completion_length=args.max_completion_length,
        temperature=1.0,
        learning_rate=1e-6,
        token_budget=args.token_budget,
        gradient_accumulation_steps=1,
        max_staleness=max_staleness,
        weight_sync_steps=1,
        gradient_checkpointing=gpu,
        dtype=args.learner_dtype,
        report_to="none",
        kernels=kernel_overrides(args.kernel),
        **compile_flag,
        cluster={
            "num_rollout_actors": 1,
            "num_generation_actors": 1,
            "num_learners": 1,
            "rollout_num_cpus": 1.0 if gpu else 0.25,
            "generation_num_cpus": 1.0 if gpu else 0.5,
            "learner_num_cpus": 1.0 if gpu else 0.5,
            "learner_num_gpus": learner_gpus,
            "generation_num_gpus": generation_gpus,
            "collective_timeout_s": 600.0,
            "engine": args.engine,
            "engine_kwargs": engine_kwargs(args),
            "weight_sync_backend": args.weight_sync_backend,
        },
    )


def make_distill_config(
    args: argparse.Namespace, output_dir: Path, max_staleness: int, placement: str, torch_compile: bool | None = None
) -> Any:
    """The same run as `make_config`, as on-policy distillation (`--trainer distill`): forward KL to the teacher's
    top-8 plus the tail bucket, one sample per prompt, the teacher hosted by a TeacherScorer actor."""
    from rlasync.config import AsyncDistillationConfig

    grpo = make_config(args, output_dir, max_staleness, placement, torch_compile)
    shared = {
        name: getattr(grpo, name)
        for name in (
            "output_dir",
            "max_steps",
            "logging_steps",
            "save_steps",
            "seed",
            "max_completion_length",
            "temperature",
            "learning_rate",
            "token_budget",
            "gradient_accumulation_steps",
            "max_staleness",
            "weight_sync_steps",
            "gradient_checkpointing",
            "dtype",
            "report_to",
            "torch_compile",
        )
    }
    cluster = {**grpo.to_dict()["cluster"]}
    if placement == "two_gpus":  # the student's engine and the teacher share the second GPU
        cluster["generation_num_gpus"] = 0.5
    elif placement == "shared_gpu":  # learner, student engine and teacher on one GPU: their shares must add up to 1
        cluster["learner_num_gpus"], cluster["generation_num_gpus"] = 0.4, 0.3
    return AsyncDistillationConfig(**shared, cluster=cluster, teacher_top_k=8, beta=0.0)


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    if args.engine == "vllm":  # in-process AsyncLLM: decode-only CUDA graphs, no torch.compile (starts in ~20 s)
        return {
            "max_model_len": args.max_model_len,
            "max_num_seqs": args.max_num_seqs or 256,
            "gpu_memory_utilization": args.vllm_gpu_memory_utilization,
            "compilation_config": {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"},
        }
    return {
        "max_model_len": args.max_model_len,
        "kv_cache_tokens": args.kv_cache_tokens,
        "max_num_seqs": args.max_num_seqs,
        **json.loads(args.engine_kwargs or "{}"),
    }


class _BackendLog(logging.Handler):
    """Captures the driver's 'weight-sync group: ... over <backend>' line and its gloo-fallback warning."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "weight-sync group" in message or "weight sync:" in message:
            self.lines.append(message)


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarize(metrics_path: Path, warmup: int) -> dict[str, Any]:
    records = [json.loads(line) for line in metrics_path.read_text().splitlines() if line.strip()]
    measured = [r for r in records if r["step"] > warmup]
    means: dict[str, float | None] = {}
    for key in KEYS:
        values = [r[key] for r in measured if r.get(key) is not None]
        means[key] = sum(values) / len(values) if values else None
    timed = [r for r in measured if r.get("perf/step_s") and r.get("batch/trained_tokens_per_step") is not None]
    seconds = sum(r["perf/step_s"] for r in timed)
    trained = sum(r["batch/trained_tokens_per_step"] for r in timed)
    dropped = [r.get("sample/dropped_stale_count", r.get("sample/dropped_stale_total")) for r in records]
    compiled = [r for r in records if r.get("perf/compile_s") is not None]  # logged only where a step compiled
    per_step = (
        "perf/step_s",
        "perf/weight_sync_s",
        "perf/weight_sync_pause_s",
        "perf/weight_sync_transfer_s",
        "perf/weight_sync_engine_load_s",
        "perf/weight_sync_dispatch_s",
        "perf/generation_loop_lag_max_s",
        "perf/generation_gc_max_s",
        "perf/rollout_wait_s",
    )
    return {
        "steps_logged": len(records),
        "steps_measured": [r["step"] for r in timed],
        "means": means,
        "medians": {key: _median([r[key] for r in measured if r.get(key) is not None]) for key in per_step},
        "per_step": {key: [r.get(key) for r in measured] for key in per_step},  # one slow sync shows here
        "trained_tok_s": trained / seconds if seconds > 0 else None,
        "dropped_stale_samples": sum(d for d in dropped if d is not None),
        "compile_s_total": sum(r["perf/compile_s"] for r in compiled),
        "compile_steps": [r["step"] for r in compiled],
    }


def run_training(
    args: argparse.Namespace, model_dir: str, name: str, max_staleness: int, placement: str, work: Path, warmup: int
) -> dict[str, Any]:
    from rlasync import AsyncGRPOTrainer
    from rlasync.data import arithmetic_dataset

    output_dir = work / name
    shutil.rmtree(output_dir, ignore_errors=True)
    distill = args.trainer == "distill"
    config = (make_distill_config if distill else make_config)(
        args, output_dir, max_staleness, placement, RUN_COMPILE[name]
    )
    handler = _BackendLog()
    driver_log = logging.getLogger("actors")
    driver_log.setLevel(logging.INFO)
    driver_log.addHandler(handler)
    started = time.perf_counter()
    try:
        if distill:
            from rlasync import AsyncDistillationTrainer

            trainer = AsyncDistillationTrainer(
                model=model_dir,
                args=config,
                train_dataset=arithmetic_dataset(20000, seed=0),
                teacher_model=args.teacher_dir,
            )
        else:
            peft = None
            if args.lora_rank:
                from peft import LoraConfig

                peft = LoraConfig(r=args.lora_rank, lora_alpha=2 * args.lora_rank, target_modules="all-linear")
            trainer = AsyncGRPOTrainer(
                model=model_dir,
                reward_funcs=bench_reward,
                args=config,
                train_dataset=arithmetic_dataset(20000, seed=0),
                peft_config=peft,
            )
        state = trainer.train()
    finally:
        driver_log.removeHandler(handler)
    result = {
        "max_staleness": max_staleness,
        "torch_compile": "unset (auto)" if RUN_COMPILE[name] is None else RUN_COMPILE[name],
        "wall_s": time.perf_counter() - started,
        "global_step": state["global_step"],
        "weight_sync_log": handler.lines,
        **summarize(output_dir / "metrics.jsonl", warmup),
    }
    if not args.keep_outputs:
        shutil.rmtree(output_dir, ignore_errors=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a tiny random Qwen3 (smoke test)")
    parser.add_argument(
        "--model",
        default="random-qwen3-0.6b",
        help="random-qwen3-0.6b (built here), smollm2-135m-instruct, or an HF folder",
    )
    parser.add_argument("--share-gpu", action="store_true", help="learner and engine on one GPU (0.5 each)")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the means")
    parser.add_argument("--max-staleness", type=int, default=4, help="the async run's max_staleness")
    parser.add_argument(
        "--runs",
        default="async,sync",
        help="which runs, in order: async, sync (the default config), async_compiled (torch_compile=True), "
        "async_eager (torch_compile=False)",
    )
    parser.add_argument("--num-generations", type=int, default=None)
    parser.add_argument("--max-completion-length", type=int, default=None)
    parser.add_argument("--token-budget", type=int, default=None, help="raw tokens per step")
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--kv-cache-tokens", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--engine", choices=["torch", "vllm"], default="torch", help="the generation engine")
    parser.add_argument(
        "--engine-kwargs",
        default=None,
        help="torch engine: JSON of extra TorchEngine arguments, e.g. '{\"compiled_sampler\": false}'",
    )
    parser.add_argument(
        "--trainer",
        choices=["grpo", "distill"],
        default="grpo",
        help="distill: on-policy distillation from a second random model (a TeacherScorer actor on "
        "the engine's GPU) instead of GRPO",
    )
    parser.add_argument(
        "--weight-sync-backend",
        choices=["auto", "nccl", "gloo", "ipc"],
        default="auto",
        help="ipc: learner and engine share one GPU (with --share-gpu)",
    )
    parser.add_argument(
        "--learner-dtype",
        default="auto",
        help="the config's dtype: auto = float32 master weights with bf16 compute on GPU (bf16=True), "
        "engines in bf16; bfloat16 = pure bf16 training",
    )
    parser.add_argument(
        "--vllm-gpu-memory-utilization",
        type=float,
        default=0.5,
        help="vLLM's share of its GPU (lower it with --share-gpu)",
    )
    parser.add_argument("--dtype", default=None, help="dtype of the random checkpoint (default bfloat16 on GPU)")
    parser.add_argument("--lora-rank", type=int, default=0, help="train LoRA adapters of this rank (all-linear; peft)")
    parser.add_argument("--keep-outputs", action="store_true", help="keep each run's output_dir (metrics.jsonl)")
    parser.add_argument("--workdir", default=None)
    parser.add_argument(
        "--kernel",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a learner kernel setting (the config's kernels.KEY), e.g. --kernel tree_attention=varlen",
    )
    parser.add_argument("--out", default=None, help="JSON result path")
    args = parser.parse_args()

    import torch

    gpu = args.device == "cuda"
    if gpu and not torch.cuda.is_available():
        parser.error("--device cuda but no CUDA GPU is visible (use --device cpu --tiny for a smoke test)")
    defaults = {
        "num_generations": 8 if gpu else 4,
        "max_completion_length": (128 if not args.tiny else 32) if gpu else 12,
        "token_budget": 8192 if gpu else 384,
        "kv_cache_tokens": 65536 if gpu else 4096,
        "max_num_seqs": 256 if gpu else 32,
        "dtype": "bfloat16" if gpu else "float32",
    }
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if gpu:
        placement = "two_gpus" if torch.cuda.device_count() >= 2 and not args.share_gpu else "shared_gpu"
        if placement == "shared_gpu" and not args.share_gpu:
            print("only one GPU is visible: learner and engine share it (--share-gpu)", flush=True)
    else:
        placement = "cpu"
    warmup = max(0, min(args.warmup, args.steps - 1))
    runs = [name.strip() for name in args.runs.split(",") if name.strip()]
    staleness = {"async": args.max_staleness, "sync": 0}
    staleness.update(async_compiled=args.max_staleness, async_eager=args.max_staleness)
    if not runs or any(name not in staleness for name in runs):
        parser.error(f"--runs {args.runs!r}: a comma-separated list of {', '.join(staleness)}")

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="rlasync_e2e_"))
    work.mkdir(parents=True, exist_ok=True)
    if args.model == "random-qwen3-0.6b":
        started = time.perf_counter()
        model_dir = build_random_model(work / "model", args.tiny, args.dtype, "cuda" if gpu else "cpu")
        print(f"built the random model in {time.perf_counter() - started:.1f} s: {model_dir}", flush=True)
        if args.trainer == "distill":
            args.teacher_dir = build_random_model(
                work / "teacher", args.tiny, args.dtype, "cuda" if gpu else "cpu", seed=1
            )
    else:
        from rlasync.model.registry import resolve_model

        model_dir = resolve_model(args.model)
        args.teacher_dir = model_dir  # --trainer distill: the model distils itself (a smoke run)

    import ray  # noqa: TID251 - a driver script, as actors.cluster

    ray.init(include_dashboard=False, log_to_driver=True)
    results: dict[str, Any] = {
        "benchmark": "e2e_grpo",
        "date": time.strftime("%Y-%m-%d"),
        "command": "python " + " ".join([sys.argv[0], *sys.argv[1:]]),
        "hardware": hardware(args.device),
        "placement": placement,
        "model": args.model + (" (tiny)" if args.tiny else ""),
        "warmup_steps_skipped": warmup,
        "settings": {k: v for k, v in vars(args).items() if k not in ("out", "workdir")},
        "runs": {},
    }
    try:
        for name in runs:
            print(f"--- run {name} (max_staleness={staleness[name]}, {args.steps} steps)", flush=True)
            result = run_training(args, model_dir, name, staleness[name], placement, work, warmup)
            results["runs"][name] = result
            print(json.dumps({name: result}, indent=1), flush=True)
        results["config"] = make_config(args, work / "run", args.max_staleness, placement).to_dict()
    finally:
        ray.shutdown()
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    tok_s = {name: run.get("trained_tok_s") for name, run in results["runs"].items()}
    if tok_s.get("async") and tok_s.get("sync"):
        results["async_over_sync_trained_tok_s"] = tok_s["async"] / tok_s["sync"]
    if tok_s.get("async") and tok_s.get("async_compiled"):  # the default config against the explicit flag
        results["default_over_compiled_trained_tok_s"] = tok_s["async"] / tok_s["async_compiled"]
    text = json.dumps(results, indent=2)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
