"""Tree packing vs padding-free packing vs padded batches: fwd+bwd trained tokens/s on one GPU.

The model has the Qwen3-0.6B shape (hidden 1024, 28 layers, 16 heads, 8 KV heads, head dim 128, intermediate
3072, vocab 151936, tied embeddings) with random bf16 weights. Samples are GRPO groups: one random prompt shared by
`--group` random completions. The same samples are trained three ways, in one run:

  tree          rows of `--row-tokens` unique tokens, shared prompts forwarded once (rlasync.packing, seed planner)
  padding_free  the same planner with nothing shared (each sample its own chain in the row)
  padded        [B, prompt + completion] batches, B = row_tokens // (prompt + completion), a causal mask
  tree_varlen   (when asked for in --modes) the tree rows on the varlen tree attention (FlashAttention varlen over
                root-path segments), next to --attention's backend (default flex on CUDA) in the same call
  tree_probs    (when asked for) the tree rows with the LM head keeping probabilities (keep_as="probs"), and
  tree_logits   with it keeping logits (kernels.head_keep="logits"): the head's A/B in one process
  tree_aligned  (with --block-align N) the same tree rows with their segment starts put on multiples of N by
                invisible padding (rlasync.packing.align_blocks; bench/block_layout.py counts the blocks), next to
                tree in the same call: `tree_aligned_over_tree`, the FlexAttention blocks of both, the padding

Every mode uses the same model code (tree attention, chunked LM head on trained positions only), gradient
checkpointing on, and a loss that touches every trained token. Reported: trained (completion) tokens/s,
forwarded tokens/s, MFU (model FLOPs: 6 x matmul params per token for the layers, 6 x hidden x vocab per
trained token for the head, attention 12 x head_dim x heads x attended pairs; peak 989 TFLOP/s dense bf16),
and the max |Δ| between the modes' per-token log-probs.

`--compile default` prepares the model as the learner does with the default config (`torch_compile` unset: compiled
layers on CUDA, eager on the CPU; rlasync.model.compilation). `--default-vs-compiled` also times the tree mode on a
second copy of the same weights prepared that way, in the same call, next to the explicitly compiled model
(`--compile layers`): per shape `tree_default_config` and `default_over_compiled` (default / compiled trained
tokens/s), at the top `default_over_compiled` (the smallest over the shapes) and `default_config_compile`.

    python bench/tree_packing.py --out bench/results/tree_packing_h200.json   (results: bench/results/)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the bench helpers (trl_tree_anchor, tree_profile)

from learner_shapes import (  # noqa: E402
    PEAK_BF16_FLOPS,
    Shape,
    flops_of,
    make_samples,
    model_config,
    parse_shapes,
    plan_rows,
)

from rlasync.config import KernelSettings  # noqa: E402
from rlasync.model import (  # noqa: E402
    chunked_token_scores,
    packed_row_to_tensors,
    packed_token_scores,
    prepare_for_training,
)
from rlasync.model.block_mask import tree_block_sparsity  # noqa: E402
from rlasync.packing import align_blocks, pack  # noqa: E402

MODES = ("tree", "tree_varlen", "tree_probs", "tree_logits", "tree_aligned", "padding_free", "padded")


@dataclass
class PaddedBatch:
    """A plain [B, L] right-padded batch: what a trainer without packing forwards."""

    samples: list
    input_ids: torch.Tensor  # [B, L]
    attention_mask: torch.Tensor  # [B, L]
    hidden_index: torch.Tensor  # [M] flat index b * L + (p - 1) of the state predicting each trained target
    target_ids: torch.Tensor  # [M]
    advantages: torch.Tensor  # [M]
    sample_index: np.ndarray  # [M]
    num_tokens: int  # B * L forwarded slots, padding included
    load: int  # attended pairs
    trained: int
    num_samples: int
    num_raw_tokens: int


def padded_batches(samples, row_tokens: int, device) -> list[PaddedBatch]:
    per_batch = max(1, row_tokens // max(len(s) for s in samples))
    batches = []
    for start in range(0, len(samples), per_batch):
        chunk = samples[start : start + per_batch]
        length = max(len(s) for s in chunk)
        ids = np.zeros((len(chunk), length), np.int64)
        mask = np.zeros((len(chunk), length), np.int64)
        index, targets, advantages, owner = [], [], [], []
        for b, sample in enumerate(chunk):
            ids[b, : len(sample)] = sample.input_ids
            mask[b, : len(sample)] = 1
            for p in np.flatnonzero(sample.completion_mask[1:]) + 1:
                index.append(b * length + p - 1)
                targets.append(sample.input_ids[p])
                advantages.append(sample.advantage)
                owner.append(b)
        batches.append(
            PaddedBatch(
                chunk,
                torch.as_tensor(ids, device=device),
                torch.as_tensor(mask, device=device),
                torch.as_tensor(index, device=device),
                torch.as_tensor(np.array(targets), device=device),
                torch.as_tensor(advantages, dtype=torch.float32, device=device),
                np.array(owner),
                ids.size,
                len(chunk) * length * (length + 1) // 2,
                len(targets),
                len(chunk),
                sum(len(s) for s in chunk),
            )
        )
    return batches


def padded_scores(model, batch: PaddedBatch, temperature: float = 1.0):
    hidden = model.get_decoder()(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False)
    flat = hidden.last_hidden_state.reshape(-1, hidden.last_hidden_state.shape[-1]).index_select(0, batch.hidden_index)
    head = model.get_output_embeddings()
    return chunked_token_scores(flat, head.weight, batch.target_ids, temperature=temperature)


def _sync(device) -> None:
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def gpu_state(device) -> dict | None:
    """SM clock (MHz) and power draw (W) through NVML where torch can read them: the context of a timing (leases of
    the same GPU kind have differed by ~15% on this bench)."""
    if not str(device).startswith("cuda"):
        return None
    state = {}
    for key, read in (("sm_clock_mhz", torch.cuda.clock_rate), ("power_w", torch.cuda.power_draw)):
        try:
            value = read(torch.device(device))
        except Exception:  # no NVML (pynvml) here: the timing stands without its context
            continue
        state[key] = value / 1000 if key == "power_w" else value  # power_draw reports milliwatts
    return state or None


class TreeMode:
    """Packed rows (tree or padding-free) scored by rlasync's tree forward."""

    def __init__(
        self,
        rows,
        device,
        block_size: int | None = None,
        backend: str = "auto",
        head_keep: str | None = None,
        kernels: KernelSettings | None = None,
        align: dict | None = None,
    ):
        self.rows = rows
        kernels = KernelSettings.of(kernels)  # the learner's `kernels.*` settings (--kernel)
        if head_keep is not None:  # the LM head's kept chunks ("logits" / "probs"); None: the kernels' own
            kernels = dataclasses.replace(kernels, head_keep=head_keep)
        self.head_keep = kernels.head_keep
        self.packed = [pack(r) for r in rows]
        if align:  # segment starts on block boundaries (`align_blocks` keyword arguments)
            self.packed = [align_blocks(p, **align) for p in self.packed]
        self.padding_per_row = float(np.mean([p.num_tokens - r.num_tokens for p, r in zip(self.packed, rows)]))
        started = time.perf_counter()  # varlen: the segment plan, made on the host as the learner does per row
        self.tensors = [packed_row_to_tensors(p, device, segments=backend == "varlen") for p in self.packed]
        self.to_device_ms = 1e3 * (time.perf_counter() - started) / max(1, len(rows))
        self.kwargs = {"block_size": block_size} if block_size else {}  # the BlockMask's blocks (default 128)
        self.kwargs["backend"] = backend
        self.kwargs["kernels"] = kernels  # handed to the tree and the head as the learner does

    def __len__(self) -> int:
        return len(self.rows)

    def block_counts(self, block_size: int) -> dict[str, float]:
        """Per row, the FlexAttention mask blocks (full attention) of the rows as forwarded."""
        totals = {"nonempty": 0, "full": 0, "partial": 0}
        for p in self.packed:
            partial, full = tree_block_sparsity(
                torch.as_tensor(p.subtree_end), torch.as_tensor(p.position_ids), None, block_size
            )
            totals["nonempty"] += int((partial | full).sum())
            totals["full"] += int(full.sum())
            totals["partial"] += int(partial.sum())
        return {key: value / max(1, len(self.packed)) for key, value in totals.items()}

    def scores(self, model, i: int):
        tensors = self.tensors[i]
        return packed_token_scores(model, tensors, **self.kwargs), tensors.advantages

    def per_sample(self, i: int, logprobs: np.ndarray):
        return [(s, logprobs[self.packed[i].sample_index == k]) for k, s in enumerate(self.rows[i].samples)]


class PaddedMode:
    def __init__(self, batches):
        self.rows = batches

    def __len__(self) -> int:
        return len(self.rows)

    def scores(self, model, i: int):
        return padded_scores(model, self.rows[i]), self.rows[i].advantages

    def per_sample(self, i: int, logprobs: np.ndarray):
        batch = self.rows[i]
        return [(s, logprobs[batch.sample_index == k]) for k, s in enumerate(batch.samples)]


def run_mode(model, mode, config, steps: int, warmup: int, device):
    def step(i: int) -> None:
        scores, adv = mode.scores(model, i % len(mode))
        loss = -(scores.logprobs * adv).sum() / max(1, adv.numel())
        loss.backward()

    for i in range(warmup):
        step(i)
    _sync(device)
    n = max(steps, len(mode))
    print(f"timing {n} rows", flush=True)  # a profiler attached from outside starts here (bench/device_runs.sh)
    start = time.perf_counter()
    for i in range(n):
        step(i)
        if i == n // 2:
            state = gpu_state(device)  # mid-run, the GPU busy
    _sync(device)
    elapsed = time.perf_counter() - start
    used = [mode.rows[i % len(mode)] for i in range(n)]
    trained = sum(_trained(r) for r in used)
    rows = mode.rows
    return {
        "rows_timed": n,
        "seconds": elapsed,
        "trained_tokens_per_s": trained / elapsed,
        "forwarded_tokens_per_s": sum(r.num_tokens for r in used) / elapsed,
        "mfu": sum(flops_of(r, config) for r in used) / elapsed / PEAK_BF16_FLOPS,
        "samples_per_row": float(np.mean([r.num_samples for r in rows])),
        "tokens_per_row": float(np.mean([r.num_tokens for r in rows])),
        "packing_ratio": float(sum(r.num_raw_tokens for r in rows) / sum(r.num_tokens for r in rows)),
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if str(device).startswith("cuda") else None,
        "rows_tokens": sorted({int(r.num_tokens) for r in rows}),
        "gpu_mid_run": state,
    }


def _trained(row) -> int:
    return int(row.trained)


def per_sample_logprobs(model, mode, num_rows: int) -> dict[int, np.ndarray]:
    """Per sample (keyed by object id), the trained tokens' log-probs in position order."""
    out: dict[int, np.ndarray] = {}
    for i in range(min(num_rows, len(mode))):  # grad mode on, as when timed: no_grad would recompile
        scores, _ = mode.scores(model, i)
        for sample, lps in mode.per_sample(i, scores.logprobs.detach().float().cpu().numpy()):
            out[id(sample)] = lps
    return out


def fp32_reference_logprobs(reference, samples, keys: set[int], device) -> dict[int, np.ndarray]:
    """The trained tokens' log-probs of each sample in `keys`, from a plain fp32 forward of the sample alone."""
    out: dict[int, np.ndarray] = {}
    reference.to(device)
    with torch.no_grad():
        for sample in samples:
            if id(sample) not in keys:
                continue
            ids = torch.as_tensor(np.asarray(sample.input_ids), device=device).long()[None]
            logits = reference(input_ids=ids, use_cache=False).logits[0, :-1].float()
            lps = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
            trained = torch.as_tensor(np.asarray(sample.completion_mask)[1:] == 1, device=device)
            out[id(sample)] = lps[trained].cpu().numpy()
    reference.to("cpu")
    return out


def bench_shape(model, config, shape: Shape, args, reference=None) -> dict:
    samples = make_samples(shape, args.groups, config.vocab_size, args.seed, args.shared_completion_prefix)
    align = {"block_size": args.block_align, "at": args.block_align_at} if args.block_align else None

    def tree_mode(share: bool, backend: str, head_keep: str | None = None, align: dict | None = None):
        rows = plan_rows(samples, shape.row_tokens, share=share)
        return TreeMode(rows, args.device, args.block_size, backend, head_keep, kernel_settings(args.kernel), align)

    builders = {
        "tree": lambda: tree_mode(True, args.attention),
        "tree_varlen": lambda: tree_mode(True, "varlen"),  # the varlen backend next to --attention's, same call
        "tree_probs": lambda: tree_mode(True, args.attention, "probs"),  # the head keeping probabilities, same call
        "tree_logits": lambda: tree_mode(True, args.attention, "logits"),
        "tree_aligned": lambda: tree_mode(True, args.attention, align=align),  # the A/B of --block-align, same call
        "padding_free": lambda: tree_mode(False, args.attention),
        "padded": lambda: PaddedMode(padded_batches(samples, shape.row_tokens, args.device)),
    }
    modes = {name: builders[name]() for name in args.modes.split(",")}
    results: dict = {"shape": shape.__dict__, "num_samples": len(samples)}
    logprobs = {}
    for name, mode in modes.items():
        if str(args.device).startswith("cuda"):
            torch.cuda.reset_peak_memory_stats()
        results[name] = run_mode(model, mode, config, args.steps, args.warmup, args.device)
        if isinstance(mode, TreeMode):
            results[name]["row_to_device_ms"] = mode.to_device_ms
            if name in ("tree", "tree_aligned"):
                results[name]["padding_per_row"] = mode.padding_per_row
                results[name]["mask_blocks_per_row"] = mode.block_counts(args.block_size or 128)
        model.zero_grad(set_to_none=True)
        logprobs[name] = per_sample_logprobs(model, mode, args.check_rows)
        print(name, json.dumps(results[name]), flush=True)
    if "tree" in logprobs:  # by sample index, for the TRL anchor's cross-check (popped before the JSON is written)
        results["_tree_logprobs"] = {
            i: logprobs["tree"][id(s)] for i, s in enumerate(samples) if id(s) in logprobs["tree"]
        }
    if args.profile and "tree" in modes:
        from tree_profile import profile_tree

        results["profile"] = profile_tree(
            model, modes["tree"], config, shape.name, args.profile, args.profile_steps, args.device
        )
    if "tree" in modes and "tree_aligned" in modes:
        aligned = logprobs["tree_aligned"]
        results["tree_aligned_over_tree"] = (
            results["tree_aligned"]["trained_tokens_per_s"] / results["tree"]["trained_tokens_per_s"]
        )
        results["tree_aligned_logprob_max_abs_diff"] = max(
            (float(np.abs(aligned[k] - lps).max()) for k, lps in logprobs["tree"].items() if k in aligned), default=None
        )
    others = [name for name in ("padding_free", "padded") if name in modes]
    if "tree" not in modes or not others:
        return results
    common = set(logprobs["tree"]).intersection(*(set(logprobs[name]) for name in others))
    results["logprob_max_abs_diff"] = {
        other: max(float(np.abs(logprobs["tree"][k] - logprobs[other][k]).max()) for k in common) for other in others
    }
    results["logprob_samples_compared"] = len(common)
    if reference is not None:  # each mode's rounding error against fp32: does the tree add any beyond bf16's?
        exact = fp32_reference_logprobs(reference, samples, common, args.device)
        results["logprob_vs_fp32"] = {}
        for name in ("tree", *others):
            errors = np.concatenate([np.abs(logprobs[name][k] - exact[k]) for k in common])
            results["logprob_vs_fp32"][name] = {"max_abs": float(errors.max()), "mean_abs": float(errors.mean())}
    tree = results["tree"]["trained_tokens_per_s"]
    for other in others:
        results[f"speedup_vs_{other}"] = tree / results[other]["trained_tokens_per_s"]
    if "tree_varlen" in modes:
        varlen = logprobs["tree_varlen"]
        results["tree_varlen_logprob_max_abs_diff"] = {
            other: max(float(np.abs(varlen[k] - logprobs[other][k]).max()) for k in common if k in varlen)
            for other in ("tree", *others)
        }
        results["tree_varlen_over_tree"] = results["tree_varlen"]["trained_tokens_per_s"] / tree
    return results


def default_config_compile(device: str) -> str:
    """The learner's compilation of the decoder layers with a default `AsyncGRPOConfig` (`torch_compile` unset) on
    `device`: "layers" or "none"."""
    from rlasync.config import AsyncGRPOConfig
    from rlasync.model.compilation import resolve_torch_compile

    unset = {f.name: f.default for f in dataclasses.fields(AsyncGRPOConfig)}["torch_compile"]
    return "layers" if resolve_torch_compile(unset, cuda=str(device).startswith("cuda")) else "none"


def training_options(args) -> dict:
    """`prepare_for_training` keyword arguments from --grad-ckpt / --no-grad-ckpt / --compile / --prepare-kwargs."""
    import inspect

    if args.no_grad_ckpt and args.grad_ckpt not in (None, "none"):
        raise SystemExit(f"--no-grad-ckpt contradicts --grad-ckpt {args.grad_ckpt}: give one of them")
    ckpt = args.grad_ckpt or ("none" if args.no_grad_ckpt else "all")
    accepted = set(inspect.signature(prepare_for_training).parameters) - {"model"}
    chosen = default_config_compile(args.device) if args.compile == "default" else args.compile
    options: dict = {"gradient_checkpointing": ckpt != "none", "compile": False if chosen == "none" else chosen}
    if ckpt == "auto":  # the learner's plan by memory (rlasync.model.checkpointing), made once the model is built
        options["checkpoint_layers"] = "auto"
    try:
        extra = json.loads(args.prepare_kwargs)
    except json.JSONDecodeError as exc:
        raise SystemExit(
            f"--prepare-kwargs: not JSON ({exc}); e.g. --prepare-kwargs '{{\"use_reentrant\": true}}'"
        ) from None
    if not isinstance(extra, dict):
        raise SystemExit(f"--prepare-kwargs: expected a JSON object of prepare_for_training arguments, got {extra!r}")
    unknown = sorted(set(extra) - accepted)
    if unknown:
        raise SystemExit(f"--prepare-kwargs: prepare_for_training takes no {unknown}; it takes {sorted(accepted)}")
    options.update(extra)
    return options


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--groups", type=int, default=24, help="GRPO groups per shape")
    parser.add_argument("--steps", type=int, default=12, help="timed rows per mode (at least all rows once)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--check-rows", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--compile",
        choices=["none", "layers", "decoder", "default"],
        default="layers",
        help="default: what the learner does with torch_compile unset (layers on CUDA, none on the CPU)",
    )
    parser.add_argument(
        "--default-vs-compiled",
        action="store_true",
        help="also time the tree mode with the default config's compilation on a copy of the model, same call "
        "(needs --compile layers): default_over_compiled",
    )
    parser.add_argument(
        "--ab-rounds",
        type=int,
        default=3,
        help="--default-vs-compiled: time the two models this many times, alternating which goes first; the "
        "median ratio is default_over_compiled",
    )
    parser.add_argument("--no-grad-ckpt", action="store_true", help="same as --grad-ckpt none")
    parser.add_argument(
        "--grad-ckpt",
        choices=["all", "none", "auto"],
        default=None,
        help="activation checkpointing: every layer (default), none, or per layer by memory "
        "(the learner's plan by memory: rlasync.model.checkpointing)",
    )
    parser.add_argument(
        "--prepare-kwargs",
        default="{}",
        help="JSON object of extra prepare_for_training arguments (they override the flags above)",
    )
    parser.add_argument("--shapes", default="1088x256x8@4096,544x128x8@8192,2048x512x8@6144")
    parser.add_argument(
        "--modes", default="tree,padding_free,padded", help="comma-separated subset to time (also tree_varlen)"
    )
    parser.add_argument("--out", default=None)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer, 4k-vocab model: a CPU smoke test")
    parser.add_argument(
        "--trl-wheel",
        default=None,
        help="TRL's wheel (trl-1.16.0-py3-none-any.whl): install it into a temp dir and time TRL's "
        "own tree packing on the same shapes first (bench/trl_tree_anchor.py)",
    )
    parser.add_argument("--trl-timeout-s", type=float, default=420.0, help="the TRL anchor's wall-clock limit")
    parser.add_argument(
        "--profile",
        default=None,
        metavar="DIR",
        help="torch.profiler over a few tree-mode rows per shape: kernel table and split into DIR",
    )
    parser.add_argument(
        "--block-size",
        type=int,
        default=None,
        help="tokens per FlexAttention mask block (default: the learner's, 128; see bench/flex_tiles.py)",
    )
    parser.add_argument(
        "--static-shapes",
        action="store_true",
        help="compile each row length as its own static graph instead of one dynamic-length graph",
    )
    parser.add_argument(
        "--fp32-reference",
        action="store_true",
        help="also score the compared samples with an fp32 copy of the model, one sample at a time "
        "(plain forward), and report each mode's max and mean |delta| against it",
    )
    parser.add_argument("--profile-steps", type=int, default=3, help="tree-mode rows profiled per shape")
    parser.add_argument(
        "--block-align",
        type=int,
        default=0,
        metavar="N",
        help="also time mode tree_aligned: the tree rows with segment starts on multiples of N tokens by invisible "
        "padding (rlasync.packing.align_blocks), next to tree in the same call (0: off)",
    )
    parser.add_argument(
        "--block-align-at",
        choices=["segments", "roots"],
        default="segments",
        help="which starts --block-align aligns: every segment (branches and groups) or only the groups' roots",
    )
    parser.add_argument(
        "--shared-completion-prefix",
        type=int,
        default=0,
        metavar="K",
        help="a group's completions open with the same K tokens, so branches are completion - K + 1 tokens "
        "(1: branches of exactly the completion length, the block-aligned best case; bench/block_layout.py)",
    )
    parser.add_argument(
        "--attention",
        choices=["auto", "flex", "varlen", "dense"],
        default="auto",
        help="tree attention backend of the tree and padding_free modes (auto: flex on CUDA; "
        "mode tree_varlen always runs varlen)",
    )
    parser.add_argument(
        "--kernel",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a learner kernel setting for the tree modes (the config's kernels.KEY, rlasync.config.kernels), e.g. "
        "--kernel head_keep=probs --kernel 'flex_kernel_options={\"USE_TMA\": true}' --kernel head_dynamic=all",
    )
    return parser


def compare_default_config(
    results: dict, model, default_model, config, shape: Shape, args, compiled_logprobs: dict
) -> None:
    """The tree mode on the default config's model (same weights, same samples) next to the compiled one's:
    `tree_default_config`, `default_over_compiled` per shape and (smallest over shapes) at the top.

    With `--ab-rounds N` > 1 the two are timed N times in alternating order (round 0: the main bench's compiled
    timing, then the default; odd rounds the default first, even rounds the compiled first): `default_over_compiled`
    is the median of the rounds' ratios (`default_over_compiled_rounds`), since one pair measured back to back also
    carries the order and the clock's drift (0.88 for two identically compiled models on an H200, 12 rows each, 2026-12-05)."""
    only_tree = argparse.Namespace(**{**vars(args), "modes": "tree", "profile": None})
    entry = results["shapes"][shape.name]
    compiled_tps = [entry["tree"]["trained_tokens_per_s"]]
    default_tps: list[float] = []

    def time_tree(bench_model, tps: list[float]) -> dict:
        """The tree mode on `bench_model` once: its trained tokens/s into `tps`; the measurement (log-probs apart)."""
        measured = bench_shape(bench_model, config, shape, only_tree)
        logprobs = measured.pop("_tree_logprobs", {})
        bench_model.zero_grad(set_to_none=True)
        tps.append(measured["tree"]["trained_tokens_per_s"])
        return {"tree": measured["tree"], "logprobs": logprobs}

    first = time_tree(default_model, default_tps)  # round 0: after the compiled model's timing of the main bench
    entry["tree_default_config"] = first["tree"]
    default_logprobs = first["logprobs"]
    for round_index in range(1, max(1, args.ab_rounds)):
        pair = [(default_model, default_tps), (model, compiled_tps)]  # odd rounds: the default model first
        for bench_model, tps in pair if round_index % 2 == 1 else pair[::-1]:
            time_tree(bench_model, tps)
    ratios = [d / c for d, c in zip(default_tps, compiled_tps, strict=True)]
    entry["default_over_compiled_rounds"] = ratios
    entry["default_over_compiled"] = float(np.median(ratios))
    common = set(default_logprobs) & set(compiled_logprobs)
    if common:
        entry["default_config_logprob_max_abs_diff"] = max(
            float(np.abs(default_logprobs[k] - compiled_logprobs[k]).max()) for k in common
        )
    results["default_over_compiled"] = min(
        r["default_over_compiled"] for r in results["shapes"].values() if "default_over_compiled" in r
    )
    print(shape.name, "default_over_compiled", entry["default_over_compiled"], flush=True)


def kernel_settings(pairs: list[str]) -> KernelSettings:
    """`--kernel KEY=VALUE` flags as `KernelSettings` (values parsed as YAML, as `--set kernels.KEY=VALUE` is)."""
    from rlasync.config.load import parse_override

    try:
        return KernelSettings.of(dict(parse_override(pair) for pair in pairs))
    except ValueError as exc:
        raise SystemExit(f"--kernel: {exc}") from None


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    shapes = parse_shapes(args.shapes)
    options = training_options(args)
    unknown_modes = set(args.modes.split(",")) - set(MODES)
    if unknown_modes:
        raise SystemExit(f"--modes: unknown {sorted(unknown_modes)}; choose from {', '.join(MODES)}")
    if args.block_align < 0:
        raise SystemExit(f"--block-align: {args.block_align} must be >= 0 (0: off)")
    if args.block_align and "tree_aligned" not in args.modes.split(","):  # the A/B in one call
        args.modes = ",".join(dict.fromkeys([*args.modes.split(","), "tree_aligned"]))
    if "tree_aligned" in args.modes.split(",") and not args.block_align:
        raise SystemExit("--modes tree_aligned needs --block-align N (the block size to align to, e.g. 128)")
    if args.shared_completion_prefix and args.trl_wheel:
        raise SystemExit("--shared-completion-prefix: the TRL anchor builds its own samples without it; drop one")
    if args.default_vs_compiled and (args.compile != "layers" or "tree" not in args.modes.split(",")):
        raise SystemExit(
            f"--default-vs-compiled compares the tree mode against --compile layers: got --compile {args.compile}, "
            f"--modes {args.modes}"
        )
    if args.trl_wheel and not Path(args.trl_wheel).is_file():
        raise SystemExit(
            f"--trl-wheel: no file {args.trl_wheel} (the TRL 1.16 wheel, e.g. .trlwheel/trl-1.16.0-py3-none-any.whl)"
        )
    anchor = None
    if args.trl_wheel:  # first, while the GPU is still free of our model
        from trl_tree_anchor import run_anchor

        anchor = run_anchor(args.trl_wheel, args, timeout_s=args.trl_timeout_s)
        print("trl anchor:", anchor.get("status"), flush=True)

    from transformers import AutoModelForCausalLM

    torch.manual_seed(args.seed)
    torch._dynamo.config.recompile_limit = 64
    if args.static_shapes:  # every row length its own static graph (with the layers compiled dynamic=False below)
        torch._dynamo.config.automatic_dynamic_shapes = False
    config = model_config(args.layers, args.tiny)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=dtype).to(args.device)
    plan = None
    if options.get("checkpoint_layers") == "auto":
        from rlasync.model.checkpointing import plan_for_model

        plan = plan_for_model(
            model, "auto", device=torch.device(args.device), tokens=max(shape.row_tokens for shape in shapes)
        )
        options["checkpoint_layers"] = plan.layers
        print(plan.describe(), flush=True)
    reference = None
    if args.fp32_reference:  # the same weights before any wrapping; kept on the host between shapes
        import copy

        reference = copy.deepcopy(model).to("cpu", torch.float32).eval()
    default_model = None
    if args.default_vs_compiled:  # the same weights, prepared as the learner's default config does
        import copy

        default_model = copy.deepcopy(model)
        default_options = {**options, "compile": {"none": False}.get(default_config_compile(args.device), "layers")}
        default_model = prepare_for_training(default_model, **default_options).train()
    model = prepare_for_training(model, **options)
    if args.static_shapes and options.get("compile") in (True, "layers"):  # the learner compiles them dynamic
        from rlasync.model.checkpointing import decoder_layers

        for layer in decoder_layers(model):
            layer.compile(dynamic=False)
    model.train()

    results = {
        "benchmark": "tree_packing",
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "hardware": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "model_shape": "Qwen3-0.6B (random bf16 weights)",
        "gradient_checkpointing": args.grad_ckpt or ("none" if args.no_grad_ckpt else "all"),
        "static_shapes": args.static_shapes,
        "checkpointed_layers": None if plan is None else len(plan.layers),
        "compile": args.compile,
        "default_config_compile": default_config_compile(args.device),
        "block_size": args.block_size or 128,
        "block_align": args.block_align or None,
        "block_align_at": args.block_align_at if args.block_align else None,
        "shared_completion_prefix": args.shared_completion_prefix,
        "attention": args.attention,
        "prepare_for_training": {k: v for k, v in options.items()},
        "peak_flops_assumed": PEAK_BF16_FLOPS,
        "shapes": {},
    }
    import transformers

    results["transformers"] = transformers.__version__

    def write() -> None:
        if args.out:  # written after every shape, so a run cut short keeps what it measured
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(results, indent=2))

    for shape in shapes:
        measured = bench_shape(model, config, shape, args, reference)
        ours_logprobs = measured.pop("_tree_logprobs", {})
        results["shapes"][shape.name] = measured
        results["speedup_vs_padding_free"] = next(iter(results["shapes"].values())).get("speedup_vs_padding_free")
        results["mfu"] = {name: {m: r[m]["mfu"] for m in MODES if m in r} for name, r in results["shapes"].items()}
        if default_model is not None:
            compare_default_config(results, model, default_model, config, shape, args, ours_logprobs)
        if anchor is not None:
            from trl_tree_anchor import merge_anchor

            merge_anchor(results, anchor, shape.name, ours_logprobs)
        write()
        print(
            shape.name,
            "speedup_vs_padding_free",
            measured.get("speedup_vs_padding_free"),
            "speedup_vs_trl",
            measured.get("speedup_vs_trl"),
            flush=True,
        )
    write()
    print(json.dumps({k: v for k, v in results.items() if k != "shapes"}, indent=2))


if __name__ == "__main__":
    main()
