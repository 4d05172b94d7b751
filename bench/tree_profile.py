"""Where the time of a tree-packed fwd+bwd goes: bench/tree_packing.py --profile DIR (torch.profiler).

Per shape, two profiled passes over the tree mode's rows (no optimizer step, as in the timing):

  plain   `steps` rows as timed: the kernel table (top kernels by device time, launches per row) and the GPU busy
          fraction = union of kernel / memcpy / memset intervals over wall time
  split   one row cut into phases at the decoder's boundaries, synchronised at each: block mask (everything before
          the decoder), decoder forward, head forward + loss, head backward, decoder backward (checkpoint recompute
          included); the decoder's output is detached and re-attached by hooks, so the work is the same
          (attention = kernels named like attention, within the decoder phases)

Written to DIR/tree_<shape>.txt and DIR/tree_<shape>.json. On CPU (smoke runs) the table is of operators by self
CPU time and the phases have wall times only.
"""

from __future__ import annotations

import json
import re
import tempfile
import time
import traceback
from collections import defaultdict
from pathlib import Path

import torch

ATTENTION = re.compile(r"flash|flex|attention|fmha|sdpa|triton_tem_fused", re.IGNORECASE)
PHASES = ("mask", "decoder_forward", "head_forward", "head_backward", "decoder_backward")
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def profile_tree(model, mode, config, shape_name: str, out_dir: str, steps: int, device) -> dict:
    """Profile `mode`'s rows (a TreeMode of bench/tree_packing.py); returns the summary, or `{"error": ...}`."""
    try:
        return _profile(model, mode, shape_name, Path(out_dir), max(1, steps), torch.device(device))
    except Exception as exc:  # a profile that fails is reported in the results, the benchmark goes on
        model.zero_grad(set_to_none=True)
        return {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-2000:]}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _loss(scores, advantages) -> torch.Tensor:
    return -(scores.logprobs * advantages).sum() / max(1, advantages.numel())


def _trace_events(prof) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def _union_us(spans: list[tuple[float, float]]) -> float:
    busy, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            busy += b - max(a, end)
            end = b
    return busy


def _profiler(device: torch.device):
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    return profile(activities=activities)


def _plain(model, mode, steps: int, device: torch.device) -> dict:
    _sync(device)
    with _profiler(device) as prof:
        start = time.perf_counter()
        for i in range(steps):
            scores, adv = mode.scores(model, i % len(mode))
            _loss(scores, adv).backward()
        _sync(device)
        wall = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    table: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    if device.type == "cuda":
        events = [e for e in _trace_events(prof) if e.get("cat") in DEVICE_CATEGORIES]
        for e in events:
            entry = table[e["name"]]
            entry[0] += float(e.get("dur", 0.0))
            entry[1] += 1
        busy_s = _union_us([(float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0))) for e in events]) / 1e6
        launches = sum(1 for e in events if e.get("cat") == "kernel")
        unit = "device time of kernels, memcpy and memset"
    else:
        for e in prof.key_averages():
            table[e.key] = [float(e.self_cpu_time_total), int(e.count)]
        busy_s, launches, unit = (
            None,
            sum(int(c) for _, c in table.values()),
            "self CPU time of operators (CPU run; launches = operator calls)",
        )
    total_us = sum(t for t, _ in table.values()) or 1.0
    top = sorted(table.items(), key=lambda kv: -kv[1][0])[:40]
    return {
        "rows_profiled": steps,
        "wall_s": wall,
        "table_unit": unit,
        "device_busy_s": busy_s,
        "gpu_busy_fraction": None if busy_s is None else busy_s / wall,
        "launches_per_row": launches / steps,
        "attention_share_by_name": sum(t for n, (t, _) in table.items() if ATTENTION.search(n)) / total_us,
        "top": [
            {"name": n, "total_ms": t / 1e3, "share": t / total_us, "count_per_row": c / steps} for n, (t, c) in top
        ],
    }


def _split(model, mode, device: torch.device) -> dict:
    """One row in phases (module hooks at the decoder; the decoder's output re-rooted as a leaf for the head)."""
    from torch.profiler import record_function

    decoder = model.get_decoder()
    state: dict = {}

    def enter(name: str) -> None:
        _sync(device)
        if "range" in state:
            state["range"].__exit__(None, None, None)
        state["range"] = record_function(f"phase/{name}")
        state["range"].__enter__()

    def pre_hook(module, args, kwargs):
        enter("decoder_forward")

    def post_hook(module, args, kwargs, output):
        hidden = output.last_hidden_state
        state["hidden"], state["leaf"] = hidden, hidden.detach().requires_grad_()
        output.last_hidden_state = state["leaf"]
        enter("head_forward")
        return output

    handles = [
        decoder.register_forward_pre_hook(pre_hook, with_kwargs=True),
        decoder.register_forward_hook(post_hook, with_kwargs=True),
    ]
    try:
        with _profiler(device) as prof:
            enter("mask")
            scores, adv = mode.scores(model, 0)
            loss = _loss(scores, adv)
            enter("head_backward")
            loss.backward()
            enter("decoder_backward")
            state["hidden"].backward(state["leaf"].grad)
            _sync(device)
            state.pop("range").__exit__(None, None, None)
    finally:
        for handle in handles:
            handle.remove()
        model.zero_grad(set_to_none=True)
    events = _trace_events(prof)
    ranges = {
        e["name"][len("phase/") :]: (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0.0)))
        for e in events
        if str(e.get("name", "")).startswith("phase/") and e.get("ph") == "X"
    }
    missing = [p for p in PHASES if p not in ranges]
    if missing:
        raise RuntimeError(f"the profile has no range for phases {missing}")
    kernels = [e for e in events if e.get("cat") in DEVICE_CATEGORIES]
    phases = {}
    for name in PHASES:
        a, b = ranges[name]
        inside = [e for e in kernels if a <= float(e["ts"]) < b]
        phase = {"wall_ms": (b - a) / 1e3}
        if device.type == "cuda":
            phase["kernel_ms"] = sum(float(e.get("dur", 0.0)) for e in inside) / 1e3
            phase["launches"] = sum(1 for e in inside if e.get("cat") == "kernel")
            if name.startswith("decoder"):
                phase["attention_kernel_ms"] = (
                    sum(float(e.get("dur", 0)) for e in inside if ATTENTION.search(e["name"])) / 1e3
                )
        phases[name] = phase
    key = "kernel_ms" if device.type == "cuda" else "wall_ms"
    total = sum(p[key] for p in phases.values()) or 1.0
    attention = sum(p.get("attention_kernel_ms", 0.0) for p in phases.values())
    shares = {
        "mask": phases["mask"][key] / total,
        "decoder_without_attention": (phases["decoder_forward"][key] + phases["decoder_backward"][key] - attention)
        / total,
        "attention": attention / total if device.type == "cuda" else None,
        "head_and_loss": (phases["head_forward"][key] + phases["head_backward"][key]) / total,
        "optimizer": 0.0,  # no optimizer step in the profiled rows
    }
    return {"measure": key, "phases": phases, "shares": shares}


def _text(shape_name: str, plain: dict, split: dict) -> str:
    lines = [f"tree mode, {shape_name}: {plain['rows_profiled']} rows in {plain['wall_s'] * 1e3:.1f} ms"]
    if plain["gpu_busy_fraction"] is not None:
        lines.append(f"GPU busy {plain['gpu_busy_fraction']:.1%} of wall ({plain['device_busy_s'] * 1e3:.1f} ms)")
    lines.append(
        f"launches per row {plain['launches_per_row']:.0f}; attention by name "
        f"{plain['attention_share_by_name']:.1%} of the table"
    )
    if "error" in split:
        lines.append(f"split: failed: {split['error']}")
    else:
        lines.append(f"split of one row ({split['measure']}):")
        for name, phase in split["phases"].items():
            lines.append(
                f"  {name:18s} "
                + " ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in phase.items())
            )
        lines.append("  shares: " + ", ".join(f"{k} {v:.1%}" for k, v in split["shares"].items() if v is not None))
    lines.append(f"top by {plain['table_unit']}:")
    lines.append(f"  {'total ms':>9} {'share':>6} {'per row':>8}  name")
    for row in plain["top"]:
        lines.append(f"  {row['total_ms']:9.2f} {row['share']:6.1%} {row['count_per_row']:8.1f}  {row['name'][:100]}")
    return "\n".join(lines) + "\n"


def _profile(model, mode, shape_name: str, out_dir: Path, steps: int, device: torch.device) -> dict:
    plain = _plain(model, mode, steps, device)
    try:
        split = _split(model, mode, device)
    except Exception as exc:  # the plain table still stands
        split = {"error": f"{type(exc).__name__}: {exc}"}
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = out_dir / f"tree_{shape_name}"
    stem.with_suffix(".json").write_text(json.dumps({"shape": shape_name, "plain": plain, "split": split}, indent=2))
    stem.with_suffix(".txt").write_text(_text(shape_name, plain, split))
    summary = {k: plain[k] for k in ("rows_profiled", "wall_s", "gpu_busy_fraction", "launches_per_row")}
    summary.update(
        split=split.get("shares", split), files=[str(stem.with_suffix(".txt")), str(stem.with_suffix(".json"))]
    )
    return summary
