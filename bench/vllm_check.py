"""vLLM 0.25 behind rlasync's engine interface, checked on one GPU: correctness, weight sync, throughput, `vllm serve`.

Random Qwen3-0.6B-shaped weights (hidden 1024, 28 layers, 16 heads, 8 KV heads, head dim 128, intermediate 3072,
vocab 151936, tied embeddings; the embedding scaled so next-token distributions are peaked like a trained model's)
are saved with a locally built tokenizer to a temporary HF folder; no network. Phases (each one's failure is
recorded in the JSON and the next one runs; the JSON is rewritten after every phase):

  correctness   VLLMEngine (in-process AsyncLLM, processed log-probs) vs the learner's recomputation
                (`rlasync.model.sequence_logprobs`, tree-packed, and a plain HF forward; bf16 and fp32 learners):
                `sampling/sampling_logp_difference/mean` at zero staleness; with top-k/top-p (vs the filtered
                distribution, and vs the full-vocabulary one the trainer uses without sampling masks); top-N;
                teacher-forced `score`
  weight_sync   perturbed weights loaded while paused: CUDA IPC via collective_rpc (same GPU, timed with
                pause/resume), CPU tensors inline, and rlasync's gloo weight group received inside the vLLM worker;
                then greedy tokens vs HF greedy on the perturbed model. vLLM's own NCCL path needs a second GPU
                (learner and engine on distinct GPUs): run only when two are visible
  throughput    256 prompts x 256 tokens, 256 new tokens, EOS ignored: per-request seeds (as training sends them)
                without and with logprobs=8, and without seeds (bench/engine_throughput.py's shape)
  server        `vllm serve` (dev mode, processed log-probs, rlasync's worker extension) as a subprocess: raw
                responses recorded to OUT/fixtures/ (tests/unit/engine/fixtures/vllm/ format), VLLMServerEngine's
                startup check, generate/score vs HF, /metrics, pause/resume, weight sync through /collective_rpc
  torch_engine  the built-in TorchEngine on the same throughput shape (same GPU, after vLLM has exited)

On the GPU machine, with the vLLM kit carried (`carry: [".vllmkit"]`, a git-ignored folder of vLLM 0.25's wheels):

    bash .vllmkit/unpack.sh && export PYTHONPATH=/tmp/vsite:$PWD:$PYTHONPATH VLLM_USE_FLASHINFER_SAMPLER=0 \\
        VLLM_NO_USAGE_STATS=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 && python3 bench/vllm_check.py --out $OUT

writes $OUT/vllm_h200.json, $OUT/fixtures/*, $OUT/server.log. On CPU, without vLLM (arguments, the model folder,
the HF-side helpers on a tiny model):

    python bench/vllm_check.py --smoke --out /tmp/vllm_check_smoke
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import gc
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import urllib.error
import urllib.request
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


# ---- the HF side: reference log-probs and greedy decoding ----------------------------------------------------------


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
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.started = time.perf_counter()
        self.result: dict[str, Any] = {
            "what": "vLLM 0.25 behind rlasync's engine interface (issue 5): correctness, weight sync, throughput, "
            "vllm serve, on one GPU",
            "command": " ".join([sys.executable, *sys.argv]),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "settings": {k: v for k, v in vars(args).items()},
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
        if self.args.skip_phases and name in self.args.skip_phases.split(","):
            self.result["phases"][name] = {"skipped": "--skip-phases"}
            return None
        started = time.perf_counter()
        print(f"[vllm_check] {name} ... (t={self.elapsed():.0f} s)", flush=True)
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
            print(f"[vllm_check] {name} failed: {type(exc).__name__}: {exc}", flush=True)
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
    return options


async def generate_all(
    engine: Any, prompts: list[list[int]], params: list[SamplingParams], timeout_s: float = 180.0
) -> list[Any]:
    """All requests at once; a stall is a TimeoutError, not a hung run."""
    return await asyncio.wait_for(asyncio.gather(*(engine.generate(p, s) for p, s in zip(prompts, params))), timeout_s)


async def phase_correctness(ctx: dict[str, Any]) -> dict[str, Any]:
    args, engine = ctx["args"], ctx["engine"]
    vocab = ctx["model"]["vocab_size"]
    n, plen, new = args.check_prompts, 64, 64
    prompts = random_prompts(n, plen, vocab, seed=1)
    result: dict[str, Any] = {"prompts": n, "prompt_len": plen, "new_tokens": new, "engine_startup_s": ctx["startup_s"]}
    # T = 1, no filtering: the sampled tokens' processed log-probs vs the learner's recomputation
    params = [SamplingParams(max_tokens=new, temperature=1.0, ignore_eos=True, seed=1000 + i) for i in range(n)]
    turns = await generate_all(engine, prompts, params)
    outputs = [t.output_ids for t in turns]
    engine_lp = [t.output_log_probs for t in turns]
    bf16 = ctx["hf_bf16"]
    refs: dict[str, Any] = {}
    for label, model, packing in (
        ("learner_tree_bf16", "learner_bf16", "tree"),
        ("learner_tree_fp32", "learner_fp32", "tree"),
        ("plain_hf_bf16", "hf_bf16", "none"),
        ("plain_hf_fp32", "hf_fp32", "none"),
    ):
        try:
            model = ctx[model] if isinstance(ctx[model], torch.nn.Module) else ctx[model]()
            refs[label] = diff_stats(engine_lp, learner_logprobs(model, prompts, outputs, 1.0, packing))
        except Exception as exc:  # noqa: BLE001
            refs[label] = {"error": f"{type(exc).__name__}: {exc}"}
    result["temperature_1"] = refs
    result["finish_reasons"] = sorted({t.finish_reason for t in turns})
    # T = 0.8, top-k 20, top-p 0.95: vs the filtered distribution (exact target) and the full one (no-mask fallback)
    params = [
        SamplingParams(
            max_tokens=new, temperature=0.8, top_k=20, top_p=0.95, ignore_eos=True, seed=2000 + i, num_logprobs=8
        )
        for i in range(n)
    ]
    turns = await generate_all(engine, prompts, params)
    outputs = [t.output_ids for t in turns]
    ref = reference_logprobs(bf16, prompts, outputs, 0.8, top_k=20, top_p=0.95, top_n=8)
    engine_lp = [t.output_log_probs for t in turns]
    overlap = []
    for turn, top_ids in zip(turns, ref["top_ids"]):
        for entry, want in zip(turn.output_sampler_logprobs, top_ids.tolist()):
            finite = [t for t, v in entry.items() if v > -1e4]
            overlap.append(len(set(finite) & set(want[: len(finite)])) / max(len(finite), 1))
    result["filtered_t0.8_k20_p0.95"] = {
        "vs_filtered_reference_bf16": diff_stats(engine_lp, ref["processed"]),
        "vs_full_vocabulary_bf16 (the no-mask fallback's target)": diff_stats(engine_lp, ref["full"]),
        "top8_overlap_with_reference": statistics.mean(overlap) if overlap else None,
        "top8_entries_per_position": statistics.mean(len(e) for t in turns for e in t.output_sampler_logprobs),
        "sampling_mask": "None (vLLM 0.25 has no sampling masks)",
    }
    # teacher-forced scoring (prompt_logprobs, raw, T = 1)
    seqs = [p + o for p, o in zip(prompts[:8], outputs[:8])]
    scores = await asyncio.gather(*(engine.score(s, plen, 5) for s in seqs))
    ref = reference_logprobs(bf16, prompts[:8], outputs[:8], 1.0, top_n=5)
    agree = [
        sum(a == b for a, b in zip(row, want.tolist())) / 5
        for sc, top in zip(scores, ref["top_ids"])
        for row, want in zip(sc.topk_ids, top)
    ]
    result["score_top5"] = {
        "vs_plain_hf_bf16": diff_stats([s.token_logprobs for s in scores], ref["full"]),
        "top5_id_agreement": statistics.mean(agree) if agree else None,
    }
    stats = engine.stats()
    result["stats_after"] = {
        "kv_capacity_tokens": stats.kv_capacity_tokens,
        "max_model_len": stats.max_model_len,
        "num_preemptions": stats.num_preemptions,
        "kv_cache_usage_frac": stats.kv_cache_usage_frac,
    }
    main = refs.get("learner_tree_bf16", {})
    ctx["run"].result["summary"]["sampling/sampling_logp_difference/mean (bf16 learner, tree-packed)"] = main.get(
        "mean"
    )
    ctx["run"].result["summary"]["sampling/sampling_logp_difference/mean (fp32 learner)"] = refs.get(
        "learner_tree_fp32", {}
    ).get("mean")
    return result


async def phase_weight_sync(ctx: dict[str, Any]) -> dict[str, Any]:
    args, engine, run = ctx["args"], ctx["engine"], ctx["run"]
    model = ctx["hf_bf16"]
    vocab = ctx["model"]["vocab_size"]
    result: dict[str, Any] = {
        "note": "one GPU: learner tensors reach the vLLM worker by CUDA IPC through collective_rpc "
        "(no copy over a wire); NCCL broadcast needs the learner on a second GPU"
    }
    prompts = random_prompts(16, 32, vocab, seed=3)
    greedy = [SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True) for _ in prompts]
    before = [t.output_ids for t in await generate_all(engine, prompts, greedy)]
    old_tokens, old_gaps = hf_greedy(model, prompts, 32)
    result["greedy_before_update_vs_hf_original"] = compare_greedy(before, old_tokens, old_gaps)
    perturb(model, args.perturb, seed=7)
    ctx["perturbed"] = True
    named = [(name, p.detach()) for name, p in model.named_parameters()]
    result["tensors"] = len(named)
    result["bytes"] = sum(t.numel() * t.element_size() for _, t in named)
    # 1. CUDA IPC, timed with pause and resume
    rounds = []
    for _ in range(args.sync_rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        await engine.pause()
        t1 = time.perf_counter()
        loaded = await engine.load_weights(named)
        t2 = time.perf_counter()
        await engine.resume()
        t3 = time.perf_counter()
        rounds.append(
            {
                "pause_ms": (t1 - t0) * 1e3,
                "load_ms": (t2 - t1) * 1e3,
                "resume_ms": (t3 - t2) * 1e3,
                "total_ms": (t3 - t0) * 1e3,
                "num_tensors": loaded["num_tensors"],
            }
        )
    result["cuda_ipc_rounds"] = rounds
    total = statistics.median(r["total_ms"] for r in rounds)
    result["cuda_ipc_median_total_ms"] = total
    run.result["summary"]["weight_sync_ms (0.6B, pause+load+resume, CUDA IPC, one GPU, median)"] = total
    # 1b. persistent buckets, as an IPC sync in GRPO sends them (same weights): the call's round trip split from
    # the worker's own time, with the engine idle and with it generating
    result["flat_ipc"] = await flat_ipc_sync(engine, named, vocab, args.sync_rounds)
    run.result["summary"]["flat IPC sync ms (pause+load+resume, median; worker's own part)"] = {
        label: [part["median_total_ms"], part["median_worker_ms"]]
        for label, part in result["flat_ipc"].items()
        if isinstance(part, dict) and "median_total_ms" in part
    }
    # the engine's weights now are the perturbed model's
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    fingerprint = await engine.weight_fingerprint(names)
    params = dict(model.named_parameters())
    result["fingerprint_abs_diff"] = {
        n: abs(fingerprint.get(n, float("nan")) - params[n].double().sum().item()) for n in names
    }
    after = [t.output_ids for t in await generate_all(engine, prompts, greedy)]
    new_tokens, new_gaps = hf_greedy(model, prompts, 32)
    result["greedy_after_update_vs_hf_perturbed"] = compare_greedy(after, new_tokens, new_gaps)
    result["greedy_after_update_vs_hf_original (should differ)"] = compare_greedy(after, old_tokens, old_gaps)
    run.result["summary"]["greedy_after_sync_exact_match_frac"] = result["greedy_after_update_vs_hf_perturbed"][
        "exact_match_frac"
    ]
    sample = [SamplingParams(max_tokens=32, temperature=1.0, ignore_eos=True, seed=5000 + i) for i in range(16)]
    turns = await generate_all(engine, prompts, sample)
    ref = learner_logprobs(model, prompts, [t.output_ids for t in turns], 1.0, "none")
    result["logp_difference_after_update_vs_perturbed_bf16"] = diff_stats([t.output_log_probs for t in turns], ref)
    # 2. CPU tensors inline (msgpack bytes through collective_rpc)
    cpu = [(name, t.cpu()) for name, t in named]
    await engine.pause()
    t0 = time.perf_counter()
    loaded = await engine.load_weights(cpu)
    result["cpu_inline_load_ms"] = (time.perf_counter() - t0) * 1e3
    await engine.resume()
    del cpu
    # 3. rlasync's gloo weight group, received inside the vLLM worker (the GenerationActor's receive path)
    result["gloo_group"] = await gloo_group_sync(engine, model, args.collective_timeout_s)
    # 4. vLLM's own NCCL weight transfer (learner on another GPU)
    if torch.cuda.device_count() >= 2 and ctx.get("nccl_backend"):
        result["vllm_nccl"] = await vllm_nccl_sync(engine, model)
    else:
        result["vllm_nccl"] = {"skipped": "needs two GPUs (NCCL cannot put two ranks on one GPU)"}
    return result


async def flat_ipc_sync(
    engine: Any,
    named: list[tuple[str, torch.Tensor]],
    vocab: int,
    rounds: int,
    *,
    device: str = "cuda",
    requests: int = 256,
    new_tokens: int = 192,
) -> dict[str, Any]:
    """Weight syncs from persistent CUDA buckets (`SharedWeights`, what the learner's IPC transport fills): per
    round the pause, the load (one `load_flat_ipc` collective_rpc: the first records the copies, later ones replay
    them) and the resume, with the worker's own part of the load (mapping, queueing the copies, waiting for them);
    also a no-op `collective_rpc`, the round trip alone. Rounds with the engine idle, then with `requests` requests
    generating, then (a VLLMEngine) generating again with vLLM's own `pause_generation` instead of `engine.pause`."""
    from rlasync.weights.ipc import MappedWeights, SharedWeights
    from rlasync.weights.plan import ManifestEntry

    manifest = [ManifestEntry(n, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for n, t in named]
    shared = SharedWeights.allocate(manifest, device, 1 << 30)
    shared.fill(named, manifest)
    shared.synchronize()
    mapped = MappedWeights(shared.key, shared.handles())
    out: dict[str, Any] = {"buckets": len(shared.buffers)}
    trips = []
    for _ in range(7):
        t0 = time.perf_counter()
        await engine.weight_fingerprint([])
        trips.append((time.perf_counter() - t0) * 1e3)
    out["noop_rpc_ms"] = trips
    prompts = random_prompts(requests, 64, vocab, seed=11)
    try:
        labels = ["idle", "generating"]
        if hasattr(getattr(engine, "_llm", None), "pause_generation"):
            labels.append("generating_pause_generation")  # vLLM's own pause (it sleeps 20 ms after), for the A/B

        async def pause(label: str) -> None:
            if label == "generating_pause_generation":
                await engine._llm.pause_generation(mode="keep", clear_cache=engine.clear_cache_on_pause)
                engine._paused = True
            else:
                await engine.pause()

        for label in labels:
            busy = []
            if label.startswith("generating"):
                params = [
                    SamplingParams(max_tokens=new_tokens, temperature=1.0, ignore_eos=True, seed=i)
                    for i in range(requests)
                ]
                busy = [asyncio.ensure_future(engine.generate(p, sp)) for p, sp in zip(prompts, params)]
                await asyncio.sleep(1.0)
            rows = []
            for _ in range(rounds + 1):
                t0 = time.perf_counter()
                await pause(label)
                t1 = time.perf_counter()
                loaded = await engine.load_weights(mapped)
                t2 = time.perf_counter()
                await engine.resume()
                t3 = time.perf_counter()
                rows.append(
                    {
                        "how": loaded.get("how"),
                        "not_replayed": loaded.get("not_replayed"),
                        "pause_ms": (t1 - t0) * 1e3,
                        "load_ms": (t2 - t1) * 1e3,
                        "resume_ms": (t3 - t2) * 1e3,
                        "total_ms": (t3 - t0) * 1e3,
                        "worker_ms": float(loaded.get("engine_s", float("nan"))) * 1e3,
                        **{
                            k.replace("_s", "_ms"): float(loaded[k]) * 1e3
                            for k in ("map_s", "queue_s", "gpu_wait_s")
                            if k in loaded
                        },
                    }
                )
                if busy:
                    await asyncio.sleep(0.3)  # let the engine run a few steps between syncs
            done = await asyncio.wait_for(asyncio.gather(*busy, return_exceptions=True), 180.0)
            later = [r for r in rows if r["how"] != "recorded"] or rows
            out[label] = {
                "rounds": rows,
                "median_total_ms": statistics.median(r["total_ms"] for r in later),
                "median_load_ms": statistics.median(r["load_ms"] for r in later),
                "median_worker_ms": statistics.median(r["worker_ms"] for r in later),
                "median_pause_ms": statistics.median(r["pause_ms"] for r in later),
                "request_errors": sum(isinstance(d, BaseException) for d in done),
            }
    finally:
        shared.release()
    return out


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


async def vllm_nccl_sync(engine: Any, model: Any) -> dict[str, Any]:
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

    from rlasync.weights.broadcast import free_port
    from rlasync.weights.plan import build_manifest

    manifest = build_manifest(model)
    port = free_port()
    on_gpu1 = [(n, p.detach().to("cuda:1")) for n, p in model.named_parameters()]
    box: dict[str, Any] = {}

    def trainer_init() -> None:
        torch.cuda.set_device(1)
        box["group"] = NCCLWeightTransferEngine.trainer_init(
            {"master_address": "127.0.0.1", "master_port": port, "world_size": 2}
        )

    await asyncio.gather(asyncio.to_thread(trainer_init), engine.init_weight_transfer("127.0.0.1", port, 1, 2))

    def send() -> None:
        torch.cuda.set_device(1)
        NCCLWeightTransferEngine.trainer_send_weights(iter(on_gpu1), {"group": box["group"], "packed": True})
        torch.cuda.synchronize(1)

    rounds = []
    for _ in range(3):
        t0 = time.perf_counter()
        seconds, _ = await asyncio.gather(engine.update_weights_nccl(manifest, packed=True), asyncio.to_thread(send))
        rounds.append((time.perf_counter() - t0) * 1e3)
    return {"rounds_ms (pause+transfer+load+resume)": rounds, "median_ms": statistics.median(rounds)}


async def warm_up(engine, prompts) -> None:
    """Short seeded runs with and without 8 log-probs, at two batch sizes, before anything is timed: the engine's
    compiled pieces (the TorchEngine's sampler compiles once per variant, then once more for a dynamic batch size)
    are built here, as vLLM's are at its start-up."""
    for logprobs in (0, 8):
        for count in (32, 7):
            params = [
                SamplingParams(max_tokens=16, ignore_eos=True, seed=i, num_logprobs=logprobs) for i in range(count)
            ]
            await generate_all(engine, prompts[:count], params)


async def phase_throughput(ctx: dict[str, Any]) -> dict[str, Any]:
    args, engine = ctx["args"], ctx["engine"]
    vocab = ctx["model"]["vocab_size"]
    n, plen, new = args.concurrency, args.prompt_len, args.new_tokens
    prompts = random_prompts(n, plen, vocab, seed=11)
    await warm_up(engine, prompts)
    result: dict[str, Any] = {"requests": n, "prompt_len": plen, "new_tokens": new}
    for label, logprobs, seeds in (("seeded", 0, True), ("seeded_logprobs8", 8, True), ("unseeded", 0, False)):
        engine.use_request_seeds = seeds
        params = [
            SamplingParams(
                max_tokens=new, temperature=1.0, ignore_eos=True, num_logprobs=logprobs, seed=i if seeds else None
            )
            for i in range(n)
        ]
        before = engine.stats().num_preemptions
        t0 = time.perf_counter()
        turns = await generate_all(engine, prompts, params)
        elapsed = time.perf_counter() - t0
        generated = sum(len(t.output_ids) for t in turns)
        result[label] = {
            "seconds": elapsed,
            "new_tokens": generated,
            "new_tokens_per_s": generated / elapsed,
            "preemptions": engine.stats().num_preemptions - before,
        }
    engine.use_request_seeds = True
    ctx["run"].result["summary"]["vllm_new_tokens_per_s (256x256, seeded / +logprobs8 / unseeded)"] = [
        round(result[k]["new_tokens_per_s"]) for k in ("seeded", "seeded_logprobs8", "unseeded")
    ]
    return result


# ---- vllm serve ------------------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def http(method: str, url: str, body: Any = None, timeout: float = 60.0) -> tuple[int, str]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def record(fixtures: Path, name: str, method: str, url: str, body: Any = None) -> tuple[int, Any]:
    status, text = http(method, url, body)
    try:
        response: Any = json.loads(text)
    except ValueError:
        response = text
    (fixtures / f"{name}.json").write_text(
        json.dumps({"request": body, "status": status, "response": response}, indent=1) + "\n"
    )
    return status, response


async def phase_server(ctx: dict[str, Any]) -> dict[str, Any]:
    from rlasync.engine.vllm_server import VLLMServerEngine

    args, run = ctx["args"], ctx["run"]
    model_dir, vocab = ctx["model"]["path"], ctx["model"]["vocab_size"]
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "PYTHONPATH": f"{REPO}:{os.environ.get('PYTHONPATH', '')}"}
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.cli.main",
        "serve",
        model_dir,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        "qwen3-0.6b-shape",
        "--dtype",
        "bfloat16",
        "--max-model-len",
        str(args.max_model_len),
        "--gpu-memory-utilization",
        str(args.server_gpu_memory),
        "--logprobs-mode",
        "processed_logprobs",
        "--max-logprobs",
        "20",
        "--seed",
        "0",
        "--worker-extension-cls",
        "rlasync.engine.vllm_worker.WorkerExtension",
    ]
    if args.server_mode == "eager":
        command.append("--enforce-eager")
    result: dict[str, Any] = {"command": " ".join(command), "env": "VLLM_SERVER_DEV_MODE=1"}
    log = open(run.out / "server.log", "w")  # noqa: SIM115 - closed in finally
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    fixtures = run.out / "fixtures"
    fixtures.mkdir(exist_ok=True)
    try:
        t0 = time.perf_counter()
        engine = await asyncio.to_thread(
            VLLMServerEngine,
            base,
            "qwen3-0.6b-shape",
            startup_timeout_s=args.server_start_timeout_s,
            metrics_interval_s=0,
            request_timeout_s=120,
            control_timeout_s=120,
        )
        result["startup_s"] = time.perf_counter() - t0
        info = engine.info
        result["startup_check"] = {
            k: getattr(info, k)
            for k in (
                "version",
                "model_id",
                "max_model_len",
                "dev_mode",
                "logprobs_mode",
                "logprobs_mode_source",
                "max_logprobs",
                "dtype",
                "worker_extension_cls",
                "weight_transfer_backend",
                "kv_capacity_tokens",
                "warnings",
            )
        }
        # raw wire format, recorded for the CPU tests' fixtures
        model_id = info.model_id
        record(fixtures, "models", "GET", f"{base}/v1/models")
        record(fixtures, "version", "GET", f"{base}/version")
        record(fixtures, "server_info", "GET", f"{base}/server_info?config_format=json")
        prompt = random_prompts(1, 4, vocab, seed=21)[0]
        record(
            fixtures,
            "completions_logprobs",
            "POST",
            f"{base}/v1/completions",
            {
                "model": model_id,
                "prompt": prompt[:3],
                "max_tokens": 4,
                "temperature": 1.0,
                "top_p": 1.0,
                "top_k": 0,
                "repetition_penalty": 1.0,
                "n": 1,
                "seed": 1234,
                "stop_token_ids": [],
                "ignore_eos": True,
                "logprobs": 2,
                "return_token_ids": True,
                "return_tokens_as_token_ids": True,
                "skip_special_tokens": False,
                "stream": False,
            },
        )
        record(
            fixtures,
            "completions_prompt_logprobs",
            "POST",
            f"{base}/v1/completions",
            {
                "model": model_id,
                "prompt": prompt,
                "max_tokens": 1,
                "temperature": 1.0,
                "prompt_logprobs": 2,
                "seed": 0,
                "return_tokens_as_token_ids": True,
                "skip_special_tokens": False,
                "stream": False,
            },
        )
        long_prompt = random_prompts(1, args.max_model_len - 10, vocab, seed=22)[0]
        record(
            fixtures,
            "error_400",
            "POST",
            f"{base}/v1/completions",
            {"model": model_id, "prompt": long_prompt, "max_tokens": 30},
        )
        record(fixtures, "is_paused", "GET", f"{base}/is_paused")
        record(fixtures, "get_world_size", "GET", f"{base}/get_world_size")
        record(
            fixtures,
            "collective_rpc_fingerprint",
            "POST",
            f"{base}/collective_rpc",
            {"method": "weight_fingerprint", "args": [["model.norm.weight"]]},
        )
        # the client: generate / score vs HF (original weights: the server loaded the folder)
        hf = ctx["hf_original"]
        prompts = random_prompts(16, 64, vocab, seed=23)
        params = [
            SamplingParams(max_tokens=32, temperature=1.0, ignore_eos=True, seed=300 + i, num_logprobs=8)
            for i in range(16)
        ]
        turns = await generate_all(engine, prompts, params)
        ref = learner_logprobs(hf, prompts, [t.output_ids for t in turns], 1.0, "none")
        result["logp_difference_vs_hf_bf16"] = diff_stats([t.output_log_probs for t in turns], ref)
        run.result["summary"]["server sampling_logp_difference/mean (bf16)"] = result["logp_difference_vs_hf_bf16"][
            "mean"
        ]
        scores = await asyncio.gather(*(engine.score(p + t.output_ids, 64, 5) for p, t in zip(prompts[:4], turns)))
        ref = reference_logprobs(hf, prompts[:4], [t.output_ids for t in turns[:4]], 1.0)
        result["score_vs_hf_bf16"] = diff_stats([s.token_logprobs for s in scores], ref["full"])
        (fixtures / "metrics.txt").write_text(http("GET", f"{base}/metrics")[1])
        stats = await engine.refresh_stats()
        result["stats"] = {
            "kv_capacity_tokens": stats.kv_capacity_tokens,
            "num_preemptions": stats.num_preemptions,
            "num_running": stats.num_running,
            "kv_cache_usage_frac": stats.kv_cache_usage_frac,
        }
        t0 = time.perf_counter()
        await engine.pause()
        record(fixtures, "is_paused_while_paused", "GET", f"{base}/is_paused")
        await engine.resume()
        result["pause_resume_ms"] = (time.perf_counter() - t0) * 1e3
        # weight sync through /collective_rpc: the server's worker joins rlasync's gloo group
        model = ctx["hf_bf16"]  # perturbed by the weight-sync phase (if it ran)
        result["gloo_group"] = await gloo_group_sync(engine, model, args.collective_timeout_s)
        greedy = [SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True) for _ in range(16)]
        got = [t.output_ids for t in await generate_all(engine, prompts[:16], greedy)]
        want, gaps = hf_greedy(model, prompts[:16], 32)
        result["greedy_after_sync_vs_hf"] = compare_greedy(got, want, gaps)
        result["greedy_after_sync_vs_hf"]["hf_model"] = "perturbed" if ctx.get("perturbed") else "original"
        await engine.close()
        return result
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(10)
        log.close()


async def phase_torch_engine(ctx: dict[str, Any]) -> dict[str, Any]:
    from rlasync.engine import TorchEngine

    args = ctx["args"]
    vocab = ctx["model"]["vocab_size"]
    t0 = time.perf_counter()
    engine = TorchEngine(
        ctx["model"]["path"],
        dtype="bfloat16",
        max_model_len=args.max_model_len,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_seqs=256,
    )
    result: dict[str, Any] = {"startup_s": time.perf_counter() - t0}
    n, plen, new = args.concurrency, args.prompt_len, args.new_tokens
    prompts = random_prompts(n, plen, vocab, seed=11)
    try:
        await warm_up(engine, prompts)
        for label, logprobs in (("seeded", 0), ("seeded_logprobs8", 8)):
            params = [
                SamplingParams(max_tokens=new, temperature=1.0, ignore_eos=True, num_logprobs=logprobs, seed=i)
                for i in range(n)
            ]
            t1 = time.perf_counter()
            turns = await generate_all(engine, prompts, params)
            elapsed = time.perf_counter() - t1
            generated = sum(len(t.output_ids) for t in turns)
            result[label] = {"seconds": elapsed, "new_tokens": generated, "new_tokens_per_s": generated / elapsed}
    finally:
        await engine.close()
    ctx["run"].result["summary"]["torch_engine_new_tokens_per_s (256x256, seeded / +logprobs8)"] = [
        round(result[k]["new_tokens_per_s"]) for k in ("seeded", "seeded_logprobs8") if k in result
    ]
    return result


def free_gpu() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


async def main_gpu(run: Run) -> None:
    args = run.args
    ctx: dict[str, Any] = {"args": args, "run": run}
    workdir = Path(tempfile.mkdtemp(prefix="vllm_check_"))
    ctx["model"] = await run.phase(
        "model", build_model_dir, workdir / "qwen3-0.6b-shape", False, 0, "cuda", args.embed_scale
    )
    if ctx["model"] is None:
        return
    path = Path(ctx["model"]["path"])
    ctx["hf_bf16"] = load_hf(path, torch.bfloat16, "cuda")  # the learner's model: perturbed by weight_sync
    ctx["hf_original"] = load_hf(path, torch.bfloat16, "cuda")
    ctx["hf_fp32"] = load_hf(path, torch.float32, "cuda")

    def learner(dtype: str) -> Any:
        key = f"_learner_{dtype}"
        if key not in ctx:
            ctx[key] = load_learner(path, dtype, "cuda")
        return ctx[key]

    ctx["learner_bf16"] = lambda: learner("bfloat16")
    ctx["learner_fp32"] = lambda: learner("float32")

    async def start_engine() -> dict[str, Any]:
        from rlasync.engine.vllm_engine import VLLMEngine

        options = engine_options(args)
        ctx["nccl_backend"] = torch.cuda.device_count() >= 2
        if ctx["nccl_backend"]:
            options["weight_transfer_backend"] = "nccl"
        t0 = time.perf_counter()
        ctx["engine"] = VLLMEngine(str(path), **options)
        ctx["startup_s"] = time.perf_counter() - t0
        engine = ctx["engine"]
        return {
            "startup_s": ctx["startup_s"],
            "vllm": engine.vllm_version,
            "options": options,
            "max_model_len": engine.max_model_len,
            "kv_capacity_tokens": engine.stats().kv_capacity_tokens,
        }

    await run.phase("engine_start", start_engine)
    if "engine" in ctx:
        await run.phase("correctness", phase_correctness, ctx)
        for key in ("hf_fp32", "_learner_bfloat16", "_learner_float32"):
            ctx.pop(key, None)
        free_gpu()
        await run.phase("weight_sync", phase_weight_sync, ctx)
        await run.phase("throughput", phase_throughput, ctx)
        await ctx["engine"].close()
        del ctx["engine"]
        free_gpu()
        await asyncio.sleep(2)
    if not args.skip_server:
        await run.phase("server", phase_server, ctx)
    del ctx["hf_bf16"], ctx["hf_original"]
    free_gpu()
    if not args.skip_torch_engine:
        await run.phase("torch_engine", phase_torch_engine, ctx)


async def main_smoke(run: Run) -> None:
    """CPU, no vLLM: the model folder, the HF-side helpers and the phase bookkeeping on a tiny model."""
    workdir = Path(tempfile.mkdtemp(prefix="vllm_check_smoke_"))
    model_info = await run.phase("model", build_model_dir, workdir / "tiny", True, 0, "cpu", 5.0)

    def helpers() -> dict[str, Any]:
        from transformers import AutoTokenizer

        path = Path(model_info["path"])
        tokenizer = AutoTokenizer.from_pretrained(path)
        bf16, fp32 = load_hf(path, torch.bfloat16, "cpu"), load_hf(path, torch.float32, "cpu")
        prompts = random_prompts(4, 8, model_info["vocab_size"], seed=1)
        outputs, gaps = hf_greedy(fp32, prompts, 6)
        again, _ = hf_greedy(fp32, prompts, 6)
        greedy = compare_greedy(outputs, again, gaps)
        assert greedy["exact_match_frac"] == 1.0, greedy
        ref = reference_logprobs(fp32, prompts, outputs, 1.0, top_n=3)
        plain = learner_logprobs(fp32, prompts, outputs, 1.0, "none")
        same = diff_stats(ref["full"], plain)
        assert same["max"] < 1e-4, same
        filtered = reference_logprobs(fp32, prompts, outputs, 0.7, top_k=5, top_p=0.9)
        assert all(torch.isfinite(t).all() for t in filtered["processed"])  # greedy tokens survive any filter
        tree = learner_logprobs(load_learner(path, "float32", "cpu"), prompts, outputs, 1.0, "tree")
        perturb(bf16, 0.5, seed=7)
        return {
            "tokenizer_vocab": len(tokenizer),
            "eos": tokenizer.eos_token_id,
            "plain_vs_reference": same,
            "tree_vs_plain": diff_stats(tree, plain),
            "filtered_mean_logprob": torch.cat(filtered["processed"]).mean().item(),
            "greedy": greedy,
        }

    await run.phase("helpers", helpers)

    async def vllm_missing() -> dict[str, Any]:
        from rlasync.engine.vllm_engine import VLLMEngine

        VLLMEngine(model_info["path"])  # raises ImportError here (no vllm on CPU machines)
        return {}

    await run.phase("engine_start", vllm_missing)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output folder: the JSON, fixtures/, server.log")
    parser.add_argument("--json-name", default="vllm_h200.json")
    parser.add_argument("--smoke", action="store_true", help="CPU: no vLLM, a tiny model, the helpers only")
    parser.add_argument("--budget-s", type=float, default=420.0, help="skip the phases that would start later")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.3, help="in-process engine (a learner fits)")
    parser.add_argument("--server-gpu-memory", type=float, default=0.25)
    parser.add_argument(
        "--engine-mode",
        choices=["graphs", "eager", "default"],
        default="graphs",
        help="graphs: no torch.compile, full CUDA graphs for decodes (fast start); default: vLLM's",
    )
    parser.add_argument("--server-mode", choices=["eager", "default"], default="eager")
    parser.add_argument("--max-model-len", type=int, default=1024)
    parser.add_argument("--check-prompts", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--sync-rounds", type=int, default=5)
    parser.add_argument("--perturb", type=float, default=0.5, help="noise, in units of each parameter's std")
    parser.add_argument("--embed-scale", type=float, default=5.0)
    parser.add_argument("--collective-timeout-s", type=float, default=120.0)
    parser.add_argument("--server-start-timeout-s", type=float, default=240.0)
    parser.add_argument("--skip-server", action="store_true")
    parser.add_argument(
        "--skip-phases", default="", help="comma-separated phases not to run (e.g. correctness,weight_sync)"
    )
    parser.add_argument("--skip-torch-engine", action="store_true")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    run = Run(args)
    run.save()
    try:
        asyncio.run(main_smoke(run) if args.smoke else main_gpu(run))
    finally:
        run.save()
        print(json.dumps(run.result["summary"], indent=1), flush=True)
        print(
            f"[vllm_check] wrote {run.out / args.json_name} ({len(run.result['errors'])} phase errors) "
            f"in {run.elapsed():.0f} s",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
