"""TRL 1.16's own tree packing, timed like bench/tree_packing.py times ours: the baseline of `--trl-wheel`.

For every shape, the same GRPO samples as bench/tree_packing.py (its `make_samples`, same seed and groups) are
planned by TRL's `TokenBudgetBatcher` placement rule into TRL `TreeRow`s, collated by TRL's
`DataCollatorForRollout`, and trained by TRL's `AsyncGRPOTrainer.compute_loss` + `backward()` on the same model
(bench/tree_packing.py's config and seed, built the way `AsyncGRPOTrainer.__init__` builds it: TRL's tree
attention, TRL's fused LM head with log-probs and entropy, gradient checkpointing on every layer as TRL's default,
bf16 autocast through accelerate on CUDA). Two layouts:

  tree          TRL's TreeRow: each group's prompt forwarded once per row
  padding_free  the same TreeRow with nothing shared: every sample starts its own root, one chain per sample

Timing and MFU follow bench/tree_packing.py's `run_mode` and `flops_of` (rows of the device are timed one
forward+backward at a time, no optimizer step; attended pairs are TRL's own `TreeRow.load`).

TRL fetches its FlashAttention varlen kernel from the Hugging Face Hub, which the GPU machine cannot reach; the
attention call is answered instead by PyTorch's built-in varlen FlashAttention-2 (`--kernel flash`, CUDA, checked
against the per-segment SDPA reference first) or by that reference itself (`--kernel segments`, CPU dry runs).
Without the `datasets` package (TRL imports it at module level only) an import-only stand-in is put on the path.

    PYTHONPATH=<dir with trl installed> python bench/trl_tree_anchor.py --out trl.json --shapes 1088x256x8@4096

`bench/tree_packing.py --trl-wheel trl-1.16.0-py3-none-any.whl` installs the wheel and runs this in a subprocess.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

_DATASETS_STAND_IN = '''"""Import-only stand-in for `datasets` (bench/trl_tree_anchor.py): building anything raises."""
__version__ = "0+import-only"


class _Missing:
    def __init__(self, *args, **kwargs):
        raise ImportError("datasets is not installed: bench/trl_tree_anchor.py only put an import-only stand-in here")


Dataset = IterableDataset = type("Dataset", (_Missing,), {})
DatasetDict = IterableDatasetDict = dict


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return type(name, (_Missing,), {})
'''


def datasets_source() -> str:
    """The real `datasets` if it imports, else an import-only stand-in appended to sys.path."""
    try:
        import datasets

        return f"datasets {datasets.__version__}"
    except ImportError:
        folder = Path(tempfile.mkdtemp(prefix="trl_anchor_datasets_"))
        (folder / "datasets").mkdir()
        (folder / "datasets" / "__init__.py").write_text(_DATASETS_STAND_IN)
        sys.path.append(str(folder))
        return "import-only stand-in (datasets not installed)"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file written after every stage")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--tiny", action="store_true", help="bench/tree_packing.py's --tiny model")
    parser.add_argument("--shapes", default="1088x256x8@4096,544x128x8@8192")
    parser.add_argument("--groups", type=int, default=24)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-grad-ckpt", action="store_true")
    parser.add_argument(
        "--kernel",
        choices=["auto", "flash", "segments"],
        default="auto",
        help="attention for TRL's varlen call: auto = flash on CUDA, segments elsewhere",
    )
    parser.add_argument(
        "--check-samples",
        type=int,
        default=4,
        help="record the tree log-probs of this many samples (compared with ours by tree_packing.py)",
    )
    return parser.parse_args(argv)


# ---------------------------------------------------------------------------------------------- the caller's side
def run_anchor(wheel: str, args, *, timeout_s: float) -> dict:
    """Install `wheel` into a temp dir (pip, no index, no dependencies) and run this script on bench/tree_packing.py's
    `args` (device, shapes, model, seed, groups, steps, checkpointing) in a subprocess. Returns its JSON; any failure
    (install, crash, timeout, no JSON) comes back as `{"status": "failed", "stage": ..., "error": ...}`."""
    import subprocess

    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="trl_anchor_") as tmp:
        site, out, log = Path(tmp) / "site", Path(tmp) / "anchor.json", Path(tmp) / "anchor.log"
        pip = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(site), wheel]
        installed = subprocess.run(pip, capture_output=True, text=True)
        if installed.returncode != 0:
            return {
                "status": "failed",
                "stage": "install",
                "error": f"pip exited {installed.returncode}",
                "log_tail": (installed.stdout + installed.stderr)[-3000:],
            }
        ckpt = getattr(args, "grad_ckpt", None) or ("none" if args.no_grad_ckpt else "all")
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--out",
            str(out),
            "--device",
            args.device,
            "--layers",
            str(args.layers),
            "--shapes",
            args.shapes,
            "--groups",
            str(args.groups),
            "--steps",
            str(args.steps),
            "--warmup",
            str(args.warmup),
            "--seed",
            str(args.seed),
            *(["--tiny"] if args.tiny else []),
            *(["--no-grad-ckpt"] if ckpt == "none" else []),
        ]
        env = dict(
            os.environ, PYTHONPATH=os.pathsep.join([str(site), str(HERE.parent), os.environ.get("PYTHONPATH", "")])
        )
        try:
            with open(log, "w") as sink:
                rc = subprocess.run(cmd, stdout=sink, stderr=subprocess.STDOUT, env=env, timeout=timeout_s).returncode
            stage = None if rc == 0 else "run"
        except subprocess.TimeoutExpired:
            rc, stage = None, "timeout"
        anchor = json.loads(out.read_text()) if out.is_file() else {"status": "failed", "shapes": {}}
        anchor.update(command=" ".join(cmd[1:]), returncode=rc, wall_s=round(time.perf_counter() - started, 1))
        if ckpt == "auto":
            anchor["gradient_checkpointing_note"] = "TRL checkpoints every layer (it has no per-layer choice)"
        if stage is not None:
            anchor.update(stage=stage, log_tail=log.read_text()[-3000:])
            if anchor["status"] == "ok":  # finished measuring, then failed (e.g. at exit): keep its numbers
                anchor["status"] = f"measured, then exited {rc}"
            elif not str(anchor["status"]).startswith(("failed", "error")):
                anchor["status"] = f"failed ({stage}) while: {anchor['status']}"
            if stage == "timeout":
                anchor["error"] = f"no result within --trl-timeout-s {timeout_s:g}"
    return anchor


def merge_anchor(results: dict, anchor: dict, shape_name: str, ours_logprobs: dict) -> None:
    """Put the anchor's run (`results["trl"]`) and its numbers for `shape_name` into bench/tree_packing.py's
    results: `trl` {tree, padding_free, trained_tokens_per_s, mfu}, `speedup_vs_trl` (our tree / TRL's tree) and
    `speedup_vs_trl_padding_free`, and the max |Δ| of the tree log-probs of the samples both recorded."""
    results["trl"] = {k: v for k, v in anchor.items() if k != "shapes"}
    ours = results["shapes"][shape_name]
    theirs = anchor.get("shapes", {}).get(shape_name)
    if theirs is None or "tree" not in theirs:
        why = (theirs or {}).get("error") or anchor.get("error") or f"anchor status: {anchor.get('status')}"
        ours["trl"], ours["speedup_vs_trl"] = {"error": why}, None
        return
    tree = theirs["tree"]
    ours["trl"] = {
        "trained_tokens_per_s": tree["trained_tokens_per_s"],
        "mfu": tree["mfu"],
        "tree": tree,
        "padding_free": theirs.get("padding_free"),
        "error": theirs.get("error"),
    }
    mine = ours.get("tree", {}).get("trained_tokens_per_s")
    ours["speedup_vs_trl"] = mine / tree["trained_tokens_per_s"] if mine else None
    if mine and theirs.get("padding_free"):
        ours["speedup_vs_trl_padding_free"] = mine / theirs["padding_free"]["trained_tokens_per_s"]
    common = sorted(set(ours_logprobs) & {int(k) for k in theirs.get("tree_logprobs", {})})
    if common:
        import numpy as np

        ours["logprob_max_abs_diff_vs_trl"] = max(
            float(np.abs(np.asarray(theirs["tree_logprobs"][str(k)]) - ours_logprobs[k]).max()) for k in common
        )
        ours["logprob_samples_compared_vs_trl"] = len(common)
    results["speedup_vs_trl"] = {name: r.get("speedup_vs_trl") for name, r in results["shapes"].items()}


# ---------------------------------------------------------------------------------------------- attention kernels
def segments_varlen(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    softmax_scale=None,
    causal=True,
    window_size=(-1, -1),
    softcap=0.0,
    **_,
):
    """The Hub kernel's contract, slowly: segment s's queries attend to its K/V path, bottom-right causal, GQA."""
    if not causal or tuple(window_size) != (-1, -1) or softcap:
        raise NotImplementedError("segments_varlen: only causal attention without window or softcap")
    import torch

    groups = q.shape[1] // k.shape[1]
    out = []
    for s in range(cu_seqlens_q.numel() - 1):
        qs = q[int(cu_seqlens_q[s]) : int(cu_seqlens_q[s + 1])].transpose(0, 1)
        ks, vs = (
            x[int(cu_seqlens_k[s]) : int(cu_seqlens_k[s + 1])].repeat_interleave(groups, 1).transpose(0, 1)
            for x in (k, v)
        )
        offset = ks.shape[1] - qs.shape[1]  # the path above the segment: visible to all its queries
        visible = torch.ones(qs.shape[1], ks.shape[1], dtype=torch.bool, device=q.device).tril(offset)
        out.append(
            torch.nn.functional.scaled_dot_product_attention(
                qs, ks, vs, attn_mask=visible, scale=softmax_scale
            ).transpose(0, 1)
        )
    return torch.cat(out)


def flash_varlen(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    softmax_scale=None,
    causal=True,
    window_size=(-1, -1),
    softcap=0.0,
    **_,
):
    """The Hub kernel's contract on PyTorch's varlen FlashAttention-2 (aten op with a backward; CUDA only)."""
    if softcap:
        raise NotImplementedError("flash_varlen: softcap is not supported")
    import torch

    left, right = (None if int(w) < 0 else int(w) for w in window_size)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    out = torch.ops.aten._flash_attention_forward(
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        cu_seqlens_q,
        cu_seqlens_k,
        int(max_seqlen_q),
        int(max_seqlen_k),
        0.0,
        bool(causal),
        False,
        scale=scale,
        window_size_left=left,
        window_size_right=right,
    )
    return out[0]


def check_kernel(kernel, device, TreeRow) -> dict:
    """`kernel` against `segments_varlen` in float32 on one TRL tree row: outputs and q/k/v gradients."""
    import numpy as np
    import torch

    rng = np.random.default_rng(1)
    row, prompt = TreeRow(), rng.integers(0, 500, 40)
    for length in (30, 90, 200, 7):
        ids = np.concatenate([prompt, rng.integers(0, 500, length)])
        row.add(
            {
                "input_ids": ids,
                "completion_mask": (np.arange(len(ids)) >= 40).astype(np.int64),
                "old_log_probs": np.zeros(len(ids), np.float32),
                "advantage": 0.0,
                "group_id": 0,
            }
        )
    p = row.pack()
    n, kv = len(p["input_ids"]), p["tree_kv_index"].to(device)
    cu_q, cu_k = p["tree_cu_seqlens_q"].to(device), p["tree_cu_seqlens_k"].to(device)
    max_q, max_k = p["tree_max_seqlens"].tolist()
    gen = torch.Generator().manual_seed(0)
    base = [torch.randn(n, h, 64, generator=gen).to(device) for h in (8, 4, 4)]
    grad = torch.randn(n, 8, 64, generator=gen).to(device)
    results = []
    for fn, dtype in ((segments_varlen, torch.float32), (kernel, torch.bfloat16 if device.type == "cuda" else None)):
        q, k, v = (x.detach().to(dtype or x.dtype).clone().requires_grad_() for x in base)
        out = fn(q, k.index_select(0, kv), v.index_select(0, kv), cu_q, cu_k, max_q, max_k, causal=True)
        out.backward(grad.to(out.dtype))
        results.append([t.detach().float() for t in (out, q.grad, k.grad, v.grad)])
    errors = [float((a - b).abs().max() / b.abs().max()) for a, b in zip(results[1], results[0])]
    return {"rel_err_out_dq_dk_dv": errors, "passed": max(errors) < 2e-2}


# ---------------------------------------------------------------------------------------------- rows
def trl_samples(samples) -> list[dict]:
    """bench/tree_packing.py's RolloutSamples as the dicts TRL's rollout queue yields."""
    return [
        {
            "input_ids": s.input_ids,
            "completion_mask": s.completion_mask.astype("int64"),
            "old_log_probs": s.sampler_logprobs,
            "advantage": float(s.advantage),
            "group_id": s.group_id,
            "metrics": {},
            "index": i,
        }
        for i, s in enumerate(samples)
    ]


def plan(samples, budget: int, row_cls, Batcher) -> list:
    """TRL's planner loop with one rank (its `_place` rule), keeping the last open row, which TRL's iterator only
    emits when a later sample arrives."""
    batcher = Batcher(samples, 1, budget, defaultdict(list))
    rows, planned = [row_cls()], []
    for sample in samples:
        while (placed := batcher._place(rows, sample)) is None:
            planned.append(rows)
            rows = [row_cls()]
        placed.add(sample)
    return planned + ([rows] if rows[0].samples else [])


def unshared_row_class(TreeRow):
    class UnsharedRow(TreeRow):
        """TRL's TreeRow where each sample is walked from an empty root set, so it shares nothing: one chain per
        sample under a root key of its own (TRL's padding-free case; fits, load and pack stay TRL's)."""

        def add(self, sample) -> None:
            shared_roots, self.roots = self.roots, {}
            super().add(sample)
            ((_, root),) = self.roots.items()
            shared_roots[("sample", len(self.samples))] = root
            self.roots = shared_roots

    return UnsharedRow


def row_stats(row) -> SimpleNamespace:
    """What `flops_of` reads, off a TRL TreeRow: unique tokens, trained tokens, attended pairs (`TreeRow.load`)."""
    return SimpleNamespace(num_tokens=len(row.tokens), trained=row.trained, load=row.load)


# ---------------------------------------------------------------------------------------------- the loss step
class _SingleProcess:
    num_processes = 1

    @staticmethod
    def reduce(tensor, reduction="sum"):
        return tensor

    @staticmethod
    def gather(tensor):
        return tensor


def trainer_view(micro_batches: int) -> SimpleNamespace:
    """What `AsyncGRPOTrainer.compute_loss` reads and writes on `self` (AsyncGRPOConfig defaults)."""
    return SimpleNamespace(
        epsilon_low=0.2,
        epsilon_high=0.2,
        aux_loss_enabled=False,
        accelerator=_SingleProcess(),
        current_gradient_accumulation_steps=micro_batches,
        _metrics={"train": defaultdict(list)},
        _step_forward_tokens=0.0,
        _step_trained_tokens=0.0,
        _step_seq_len_weighted=0.0,
        _step_samples=0.0,
        _step_forward_s=0.0,
    )


def build_model(config, args, trl_packing, add_fused_lm_head):
    import torch
    from transformers import AutoModelForCausalLM

    trl_packing.register_tree_attention()  # as AsyncGRPOTrainer.__init__
    torch.manual_seed(args.seed)  # the same weights as bench/tree_packing.py's model
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=trl_packing.TREE_ATTENTION)
    model = model.to(args.device)
    add_fused_lm_head(model, temperature=1.0, outputs=("log_probs", "entropy"))
    if not args.no_grad_ckpt:  # TRL's default gradient_checkpointing=True, every layer
        enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
        enable()
    model.train()
    precision = "float32, no autocast (CPU)"
    if args.device == "cuda":  # TRL's bf16=True: accelerate wraps the forward in bf16 autocast
        from accelerate import Accelerator

        model = Accelerator(mixed_precision="bf16").prepare_model(model)
        precision = "bf16 weights, accelerate prepare_model(mixed_precision='bf16')"
    return model, precision


def time_layout(model, batches, rows, config, args, compute_loss, flops_of, sync) -> dict:
    view = trainer_view(len(batches))

    def step(i: int) -> None:
        compute_loss(view, model, batches[i % len(batches)]).backward()

    for i in range(args.warmup):
        step(i)
    sync()
    n = max(args.steps, len(batches))
    start = time.perf_counter()
    for i in range(n):
        step(i)
    sync()
    elapsed = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    from learner_shapes import PEAK_BF16_FLOPS

    stats = [row_stats(rows[i % len(rows)]) for i in range(n)]
    return {
        "rows_timed": n,
        "seconds": elapsed,
        "trained_tokens_per_s": sum(s.trained for s in stats) / elapsed,
        "forwarded_tokens_per_s": sum(s.num_tokens for s in stats) / elapsed,
        "mfu": sum(flops_of(s, config) for s in stats) / elapsed / PEAK_BF16_FLOPS,
        "samples_per_row": sum(len(r.samples) for r in rows) / len(rows),
        "tokens_per_row": sum(len(r.tokens) for r in rows) / len(rows),
        "packing_ratio": sum(len(s["input_ids"]) for r in rows for s in r.samples) / sum(len(r.tokens) for r in rows),
    }


def tree_logprobs(model, batches, rows, compute_loss, count: int) -> dict[int, list[float]]:
    """Completion log-probs of the first `count` samples (by index), read off the forward compute_loss makes."""
    import torch

    seen: dict = {}
    hook = model.register_forward_hook(lambda module, inputs, output: seen.__setitem__("out", output))
    out: dict[int, list[float]] = {}
    try:
        with torch.no_grad():
            for batch, row in zip(batches, rows):
                compute_loss(trainer_view(1), model, batch)
                selected = batch["token_index"] >= 0
                lps = seen["out"].log_probs.flatten()[batch["token_index"][selected]].float().cpu()
                segment = batch["segment_id"][selected].cpu()
                for k, sample in enumerate(row.samples):
                    if sample["index"] < count:
                        out[sample["index"]] = lps[segment == k].tolist()
    finally:
        hook.remove()
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    result: dict = {
        "anchor": "TRL AsyncGRPOTrainer.compute_loss + backward",
        "argv": sys.argv[1:],
        "status": "starting",
        "shapes": {},
    }

    def write(status: str | None = None) -> None:
        if status:
            result["status"] = status
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))

    try:
        return run(args, result, write)
    except Exception as exc:  # reported in the JSON, which bench/tree_packing.py merges; the exit code says it too
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()[-3000:]
        write("error")
        print(result["traceback"], file=sys.stderr, flush=True)
        return 1


def run(args, result: dict, write) -> int:
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    result["datasets"] = datasets_source()
    write("importing trl")
    import torch
    import transformers
    import trl
    from learner_shapes import flops_of, make_samples, model_config, parse_shapes
    from trl.experimental.async_grpo import packing as trl_packing
    from trl.experimental.async_grpo.async_grpo_trainer import (
        AsyncGRPOTrainer,
        DataCollatorForRollout,
        TokenBudgetBatcher,
    )
    from trl.trainer.utils import add_fused_lm_head

    device = torch.device(args.device)
    kernel_name = args.kernel if args.kernel != "auto" else ("flash" if device.type == "cuda" else "segments")
    kernel = {"flash": flash_varlen, "segments": segments_varlen}[kernel_name]
    result.update(
        trl=trl.__version__,
        torch=torch.__version__,
        transformers=transformers.__version__,
        python=platform.python_version(),
        attention_kernel=kernel_name,
    )
    result["kernel_check"] = check_kernel(kernel, device, trl_packing.TreeRow)
    if not result["kernel_check"]["passed"]:
        write("kernel check failed: the timings would not be of a correct attention")
        return 1
    trl_packing._flash_attn = lambda: SimpleNamespace(flash_attn_varlen_func=kernel)  # in place of the Hub kernel

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    config = model_config(args.layers, args.tiny)
    model, result["precision"] = build_model(config, args, trl_packing, add_fused_lm_head)
    result["gradient_checkpointing"] = not args.no_grad_ckpt
    compute_loss = AsyncGRPOTrainer.compute_loss
    layouts = {"tree": trl_packing.TreeRow, "padding_free": unshared_row_class(trl_packing.TreeRow)}
    for shape in parse_shapes(args.shapes):
        entry: dict = {"shape": shape.__dict__}
        result["shapes"][shape.name] = entry
        try:
            samples = trl_samples(make_samples(shape, args.groups, config.vocab_size, args.seed))
            for name, row_cls in layouts.items():
                rows = [r[0] for r in plan(samples, shape.row_tokens, row_cls, TokenBudgetBatcher)]
                collate = DataCollatorForRollout(pad_token_id=0, num_processes=1, token_budget=shape.row_tokens)
                batches = [
                    {k: v.to(device) if torch.is_tensor(v) else v for k, v in collate([[r]]).items()} for r in rows
                ]
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                entry[name] = time_layout(model, batches, rows, config, args, compute_loss, flops_of, sync)
                if device.type == "cuda":
                    entry[name]["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
                if name == "tree" and args.check_samples:
                    entry["tree_logprobs"] = tree_logprobs(model, batches, rows, compute_loss, args.check_samples)
                print(shape.name, "trl", name, json.dumps(entry[name]), flush=True)
                write(f"running {shape.name}")
        except Exception as exc:  # one shape's failure is reported with it; the others still run
            entry["error"] = f"{type(exc).__name__}: {exc}"
            entry["traceback"] = traceback.format_exc()[-3000:]
            print(entry["traceback"], file=sys.stderr, flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    failed = [name for name, entry in result["shapes"].items() if "error" in entry]
    write("ok" if not failed else f"failed shapes: {', '.join(failed)}")
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
