"""What the vLLM checks share: a random Qwen3-0.6B-shaped model folder, the HF-side references, the run's JSON.

Random Qwen3-0.6B-shaped weights (hidden 1024, 28 layers, 16 heads, 8 KV heads, head dim 128, intermediate 3072,
vocab 151936, tied embeddings; the embedding scaled so next-token distributions are peaked like a trained model's)
are saved with a locally built tokenizer to a temporary HF folder; no network. Each check (bench/vllm_logprobs.py,
bench/vllm_weight_sync.py, bench/vllm_throughput.py, bench/vllm_serve_check.py) runs its phases through `Run`: each
phase's failure is recorded in the JSON and the next one runs; the JSON is rewritten after every phase.

On the GPU machine, with the vLLM kit carried (`carry: [".vllmkit"]`, a git-ignored folder of vLLM 0.25's wheels):

    bash .vllmkit/unpack.sh && export PYTHONPATH=/tmp/vsite:$PWD:$PYTHONPATH VLLM_USE_FLASHINFER_SAMPLER=0 \\
        VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 && python3 bench/vllm_<check>.py --out $OUT
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import gc
import json
import os
import platform
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from rlasync.engine import SamplingParams  # noqa: E402

EOS_ID = 151645
PAD_ID = 151643


# ---- the model folder ----------------------------------------------------------------------------------------------


def qwen3_config(tiny: bool) -> Any:
    from transformers import Qwen3Config

    common = dict(
        tie_word_embeddings=True,
        eos_token_id=EOS_ID if not tiny else 3,
        pad_token_id=PAD_ID if not tiny else 0,
        bos_token_id=None,
        rope_theta=1_000_000.0,
    )
    if tiny:
        return Qwen3Config(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=128,
            vocab_size=512,
            max_position_embeddings=2048,
            **common,
        )
    return Qwen3Config(
        hidden_size=1024,
        num_hidden_layers=28,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=3072,
        vocab_size=151936,
        max_position_embeddings=40960,
        **common,
    )


def build_tokenizer(vocab_size: int, eos_id: int, pad_id: int) -> Any:
    """A WordLevel tokenizer over "t<i>" words (no hub): ids are what the tests send, text is never used."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    specials = {eos_id: "<|im_end|>", pad_id: "<|endoftext|>"}
    for token_id, text in specials.items():
        vocab.pop(f"t{token_id}")
        vocab[text] = token_id
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=specials[pad_id]))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token=specials[eos_id], pad_token=specials[pad_id], unk_token=specials[pad_id]
    )


def build_model_dir(path: Path, tiny: bool, seed: int, device: str, embed_scale: float) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    config = qwen3_config(tiny)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        model.get_input_embeddings().weight.mul_(embed_scale)
    model.save_pretrained(path)
    build_tokenizer(config.vocab_size, config.eos_token_id, config.pad_token_id).save_pretrained(path)
    params = sum(p.numel() for p in model.parameters())
    del model
    return {
        "path": str(path),
        "parameters": params,
        "vocab_size": config.vocab_size,
        "layers": config.num_hidden_layers,
        "hidden": config.hidden_size,
        "embed_scale": embed_scale,
        "dtype": "bfloat16",
    }


def load_hf(path: Path, dtype: torch.dtype, device: str) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").to(device).eval()


def load_learner(path: Path, dtype: str, device: str) -> Any:
    """The learner's model: rlasync's loader, tree attention (what `sequence_logprobs(packing="tree")` needs)."""
    from rlasync.model import load_model

    return load_model(str(path), dtype=dtype, device=device).eval()


def perturb(model: Any, scale: float, seed: int) -> None:
    """Add noise of `scale` x each parameter's std (norm weights, all ones, stay)."""
    generator = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            std = param.float().std().item() if param.numel() > 1 else 0.0
            if std > 0:
                noise = torch.randn(param.shape, generator=generator).to(param.device, param.dtype)
                param.add_(noise * (scale * std))


# ---- references ----------------------------------------------------------------------------------------------------


def processed_logprobs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """log-softmax of the distribution vLLM samples from: logits / T, then top-k, then top-p (filtered -> -inf)."""
    logits = logits.float() / max(temperature, 1e-6)
    if top_k > 0:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=False)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative <= (1 - top_p)
        drop_sorted[..., -1] = False  # keep at least the top token
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return torch.log_softmax(logits, dim=-1)


@torch.no_grad()
def reference_logprobs(
    model: Any,
    prompts: list[list[int]],
    outputs: list[list[int]],
    temperature: float,
    top_k: int = 0,
    top_p: float = 1.0,
    batch: int = 8,
    top_n: int = 0,
) -> dict[str, Any]:
    """Per sequence: log-probs of the output tokens under the processed distribution (plain HF forward), the
    full-vocabulary log-probs at the same temperature, and the reference top-N ids."""
    device = next(model.parameters()).device
    processed, full, top_ids = [], [], []
    for start in range(0, len(prompts), batch):
        chunk = list(range(start, min(start + batch, len(prompts))))
        lengths = {len(prompts[i]) + len(outputs[i]) for i in chunk}
        for i in chunk if len(lengths) > 1 else [None]:
            members = [i] if i is not None else chunk
            ids = torch.tensor([prompts[m] + outputs[m] for m in members], device=device)
            logits = model(input_ids=ids, use_cache=False).logits
            for row, m in enumerate(members):
                p = len(prompts[m])
                scores = logits[row, p - 1 : -1]
                target = ids[row, p:, None]
                lp = processed_logprobs(scores, temperature, top_k, top_p)
                processed.append(lp.gather(1, target).squeeze(1).cpu())
                full.append(
                    torch.log_softmax(scores.float() / max(temperature, 1e-6), -1).gather(1, target).squeeze(1).cpu()
                )
                if top_n:
                    top_ids.append(torch.topk(lp, top_n, dim=-1).indices.cpu())
    return {"processed": processed, "full": full, "top_ids": top_ids}


@torch.no_grad()
def hf_greedy(model: Any, prompts: list[list[int]], new_tokens: int) -> tuple[list[list[int]], list[list[float]]]:
    """Greedy continuation (argmax every step, EOS not special) with a KV cache; also each step's top-1/top-2
    logit gap (a small gap is a near-tie that bf16 noise may flip)."""
    import inspect

    device = next(model.parameters()).device
    # transformers 5.x renamed past_key_values to cache (forward argument and output field)
    key = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    ids = torch.tensor(prompts, device=device)
    out = model(input_ids=ids, use_cache=True)
    tokens, gaps = [], []
    past = getattr(out, key)
    logits = out.logits[:, -1].float()
    for _ in range(new_tokens):
        top2 = torch.topk(logits, 2, dim=-1)
        gaps.append((top2.values[:, 0] - top2.values[:, 1]).cpu())
        nxt = top2.indices[:, :1]
        tokens.append(nxt.cpu())
        out = model(input_ids=nxt, use_cache=True, **{key: past})
        past, logits = getattr(out, key), out.logits[:, -1].float()
    seqs = torch.cat(tokens, dim=1).tolist()
    gap_rows = torch.stack(gaps, dim=1).tolist()
    return seqs, gap_rows


def compare_greedy(engine_tokens: list[list[int]], hf_tokens: list[list[int]], gaps: list[list[float]]) -> dict:
    first = []
    for got, want, gap in zip(engine_tokens, hf_tokens, gaps):
        diverge = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), None)
        if diverge is None and len(got) != len(want):
            diverge = min(len(got), len(want))
        first.append(
            None
            if diverge is None
            else {"position": diverge, "hf_top2_logit_gap": gap[diverge] if diverge < len(gap) else None}
        )
    return {
        "sequences": len(first),
        "exact_match_frac": sum(f is None for f in first) / max(len(first), 1),
        "mismatches": [f for f in first if f is not None],
        "min_hf_top2_logit_gap": min(min(g) for g in gaps) if gaps else None,
    }


def diff_stats(a: list[torch.Tensor] | list[list[float]], b: list[torch.Tensor]) -> dict[str, float]:
    x = torch.cat([torch.as_tensor(v, dtype=torch.float64).reshape(-1) for v in a])
    y = torch.cat([torch.as_tensor(v, dtype=torch.float64).reshape(-1) for v in b])
    d = (x - y).abs()
    return {
        "mean": d.mean().item(),
        "max": d.max().item(),
        "p99": torch.quantile(d, 0.99).item(),
        "signed_mean": (x - y).mean().item(),
        "tokens": d.numel(),
        "engine_mean_logprob": x.mean().item(),
    }


def learner_logprobs(model: Any, prompts, outputs, temperature: float, packing: str) -> list[torch.Tensor]:
    from rlasync.model import sequence_logprobs

    with torch.no_grad():
        scores = sequence_logprobs(
            model,
            [p + o for p, o in zip(prompts, outputs)],
            [len(p) for p in prompts],
            packing=packing,
            temperature=temperature,
        )
    return [s.float().cpu() for s in scores]


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    high = min(vocab, 151_000)
    return torch.randint(10, high, (count, length), generator=generator).tolist()


# ---- the run -------------------------------------------------------------------------------------------------------


class Run:
    """One check's JSON: its command, settings and hardware, each phase's result (or error), a summary."""

    def __init__(self, args: argparse.Namespace, name: str, what: str) -> None:
        self.args, self.name = args, name
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.started = time.perf_counter()
        self.result: dict[str, Any] = {
            "what": what,
            "command": " ".join([sys.executable, *sys.argv]),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "settings": dict(vars(args)),
            "hardware": hardware(),
            "phases": {},
            "errors": {},
            "summary": {},
        }

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def save(self) -> None:
        self.result["elapsed_s"] = round(self.elapsed(), 1)
        path = self.out / self.args.json_name
        path.write_text(json.dumps(self.result, indent=1, default=str) + "\n")

    async def phase(self, name: str, func, *args: Any) -> Any:
        if self.elapsed() > self.args.budget_s:
            self.result["phases"][name] = {"skipped": f"time budget ({self.args.budget_s} s) spent"}
            self.save()
            return None
        started = time.perf_counter()
        print(f"[{self.name}] {name} ... (t={self.elapsed():.0f} s)", flush=True)
        try:
            value = await func(*args) if asyncio.iscoroutinefunction(func) else func(*args)
            if isinstance(value, dict):
                value.setdefault("phase_s", round(time.perf_counter() - started, 2))
            self.result["phases"][name] = value
            return value
        except BaseException as exc:  # noqa: BLE001 - every phase records its failure and the run goes on
            if isinstance(exc, KeyboardInterrupt):
                raise
            self.result["errors"][name] = "".join(traceback.format_exception(exc))[-6000:]
            print(f"[{self.name}] {name} failed: {type(exc).__name__}: {exc}", flush=True)
            return None
        finally:
            self.save()


def hardware() -> dict[str, Any]:
    info: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "host": socket.gethostname(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(
            gpu=props.name,
            gpu_count=torch.cuda.device_count(),
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            cuda=torch.version.cuda,
            capability=f"{props.major}.{props.minor}",
        )
    try:
        import vllm

        info["vllm"] = vllm.__version__
    except Exception as exc:  # noqa: BLE001
        info["vllm"] = f"not importable: {type(exc).__name__}: {exc}"
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except Exception:  # noqa: BLE001
        pass
    return info


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    options: dict[str, Any] = {
        "dtype": "bfloat16",
        "max_model_len": args.max_model_len,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "max_num_seqs": 256,
        "seed": 0,
        "rpc_timeout_s": args.collective_timeout_s,
        "control_timeout_s": 60.0,
    }
    if args.engine_mode == "eager":
        options["enforce_eager"] = True
    elif args.engine_mode == "graphs":
        options["compilation_config"] = {"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY"}
    options.update(json.loads(getattr(args, "vllm_engine_args", None) or "{}"))  # a check's extra AsyncEngineArgs
    return options


async def generate_all(
    engine: Any, prompts: list[list[int]], params: list[SamplingParams], timeout_s: float = 180.0
) -> list[Any]:
    """All requests at once; a stall is a TimeoutError, not a hung run."""
    return await asyncio.wait_for(asyncio.gather(*(engine.generate(p, s) for p, s in zip(prompts, params))), timeout_s)


def free_gpu() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


async def build_model(run: Run) -> dict[str, Any] | None:
    """The "model" phase: the random Qwen3-0.6B-shaped folder on the GPU's host; None if it failed."""
    workdir = Path(tempfile.mkdtemp(prefix=f"{run.name}_"))
    return await run.phase(
        "model", build_model_dir, workdir / "qwen3-0.6b-shape", False, 0, "cuda", run.args.embed_scale
    )


async def start_vllm(run: Run, ctx: dict[str, Any]) -> bool:
    """The "engine_start" phase: an in-process VLLMEngine on the model folder in `ctx["engine"]` (with vLLM's NCCL
    weight transfer when two GPUs are visible); False if it failed."""

    async def start() -> dict[str, Any]:
        from rlasync.engine.vllm_engine import VLLMEngine

        options = engine_options(run.args)
        ctx["nccl_backend"] = torch.cuda.device_count() >= 2
        if ctx["nccl_backend"]:
            options["weight_transfer_backend"] = "nccl"
        t0 = time.perf_counter()
        ctx["engine"] = engine = VLLMEngine(str(ctx["model"]["path"]), **options)
        ctx["startup_s"] = time.perf_counter() - t0
        return {
            "startup_s": ctx["startup_s"],
            "vllm": engine.vllm_version,
            "options": options,
            "max_model_len": engine.max_model_len,
            "kv_capacity_tokens": engine.stats().kv_capacity_tokens,
        }

    await run.phase("engine_start", start)
    return "engine" in ctx


async def gloo_group_sync(engine: Any, model: Any, timeout_s: float) -> dict[str, Any]:
    import inspect

    from rlasync.weights.broadcast import WeightGroup, free_port
    from rlasync.weights.plan import build_manifest, stream_parameters

    manifest = build_manifest(model)
    port = free_port()
    box: dict[str, Any] = {}

    def open_sender() -> None:
        box["group"] = WeightGroup.open("127.0.0.1", port, 0, 2, timeout_s)

    t0 = time.perf_counter()
    await asyncio.gather(asyncio.to_thread(open_sender), engine.join_weight_group("127.0.0.1", port, 1, 2, timeout_s))
    joined = time.perf_counter() - t0
    group = box["group"]

    def send() -> None:
        stream = stream_parameters(model)
        if "manifest" in inspect.signature(group.send).parameters:
            group.send(stream, manifest)
        else:
            group.send(stream)

    t1 = time.perf_counter()
    received, _ = await asyncio.gather(engine.receive_weights(manifest), asyncio.to_thread(send))
    total = time.perf_counter() - t1
    group.close()
    return {"join_s": joined, "pause_receive_load_resume_s": total, "worker_side": received, "tensors": len(manifest)}


def common_parser(description: str, json_name: str) -> argparse.ArgumentParser:
    """The options every vLLM check takes (output, time budget, the in-process engine's settings)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", required=True, help="output folder: the JSON and what the check records")
    parser.add_argument("--json-name", default=json_name)
    parser.add_argument("--budget-s", type=float, default=420.0, help="skip the phases that would start later")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3, help="in-process engine (a learner fits)")
    parser.add_argument(
        "--engine-mode",
        choices=["graphs", "eager", "default"],
        default="graphs",
        help="graphs: no torch.compile, full CUDA graphs for decodes (fast start); default: vLLM's",
    )
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--embed-scale", type=float, default=5.0)
    parser.add_argument("--collective-timeout-s", type=float, default=120.0)
    return parser


def run_check(args: argparse.Namespace, name: str, what: str, body: Callable[[Run], Awaitable[None]]) -> int:
    """Run `body` (its phases) into OUT/json_name, saved after every phase and at the end; print the summary."""
    run = Run(args, name, what)
    run.save()
    try:
        asyncio.run(body(run))
    finally:
        run.save()
        print(json.dumps(run.result["summary"], indent=1), flush=True)
        print(
            f"[{name}] wrote {run.out / args.json_name} ({len(run.result['errors'])} phase errors) "
            f"in {run.elapsed():.0f} s",
            flush=True,
        )
    return 0
