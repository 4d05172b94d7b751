"""vLLM's sampled-token log-probs against the learner's recomputation, on one GPU (vLLM 0.25, in-process AsyncLLM).

VLLMEngine (processed log-probs) vs `rlasync.model.sequence_logprobs` (tree-packed, bf16 and fp32 learners) and a
plain HF forward: `sampling/sampling_logp_difference/mean` at zero staleness; with top-k/top-p (vs the filtered
distribution, and vs the full-vocabulary one the trainer uses without sampling masks); top-N; teacher-forced `score`.
The model folder and the run: bench/vllm_common.py.

    python3 bench/vllm_logprobs.py --out $OUT                           # GPU, vLLM kit on PYTHONPATH
    python bench/vllm_logprobs.py --smoke --out /tmp/vllm_logprobs      # CPU, no vLLM: the HF-side helpers
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vllm_common import (  # noqa: E402
    Run,
    build_model,
    build_model_dir,
    common_parser,
    compare_greedy,
    diff_stats,
    free_gpu,
    generate_all,
    hf_greedy,
    learner_logprobs,
    load_hf,
    load_learner,
    perturb,
    random_prompts,
    reference_logprobs,
    run_check,
    start_vllm,
)

from rlasync.engine import SamplingParams  # noqa: E402

WHAT = "vLLM 0.25 behind rlasync's engine interface: sampled-token log-probs vs the learner's recomputation, one GPU"


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


async def main_gpu(run: Run) -> None:
    ctx: dict[str, Any] = {"args": run.args, "run": run}
    ctx["model"] = await build_model(run)
    if ctx["model"] is None:
        return
    path = Path(ctx["model"]["path"])
    ctx["hf_bf16"] = load_hf(path, torch.bfloat16, "cuda")
    ctx["hf_fp32"] = load_hf(path, torch.float32, "cuda")

    def learner(dtype: str) -> Any:
        key = f"_learner_{dtype}"
        if key not in ctx:
            ctx[key] = load_learner(path, dtype, "cuda")
        return ctx[key]

    ctx["learner_bf16"] = lambda: learner("bfloat16")
    ctx["learner_fp32"] = lambda: learner("float32")
    if await start_vllm(run, ctx):
        try:
            await run.phase("correctness", phase_correctness, ctx)
        finally:
            await ctx["engine"].close()
    free_gpu()


async def main_smoke(run: Run) -> None:
    """CPU, no vLLM: the model folder, the HF-side helpers and the phase bookkeeping on a tiny model."""
    workdir = Path(tempfile.mkdtemp(prefix="vllm_logprobs_smoke_"))
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


def build_parser() -> argparse.ArgumentParser:
    parser = common_parser(__doc__.splitlines()[0], "vllm_logprobs.json")
    parser.add_argument("--check-prompts", type=int, default=64)
    parser.add_argument("--smoke", action="store_true", help="CPU: no vLLM, a tiny model, the HF-side helpers only")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return run_check(args, "vllm_logprobs", WHAT, main_smoke if args.smoke else main_gpu)


if __name__ == "__main__":
    sys.exit(main())
