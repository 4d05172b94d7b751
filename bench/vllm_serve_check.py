"""`vllm serve` (dev mode, processed log-probs, rlasync's worker extension) behind VLLMServerEngine, on one GPU.

The server runs as a subprocess on the model folder: raw responses recorded to OUT/fixtures/
(tests/unit/engine/fixtures/vllm/ format), VLLMServerEngine's startup check, generate/score vs HF, /metrics,
pause/resume, then a weight sync of perturbed weights through /collective_rpc (rlasync's gloo group) and greedy tokens
vs HF greedy on the perturbed model. Writes OUT/server.log too. The model folder and the run: bench/vllm_common.py.

    python3 bench/vllm_serve_check.py --out $OUT   # GPU, vLLM kit on PYTHONPATH
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vllm_common import (  # noqa: E402
    REPO,
    Run,
    build_model,
    common_parser,
    compare_greedy,
    diff_stats,
    free_gpu,
    generate_all,
    gloo_group_sync,
    hf_greedy,
    learner_logprobs,
    load_hf,
    perturb,
    random_prompts,
    reference_logprobs,
    run_check,
)

from rlasync.engine import SamplingParams  # noqa: E402

WHAT = "vLLM 0.25's `vllm serve` behind VLLMServerEngine: wire fixtures, generate/score vs HF, pause, weight sync"


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
        model = ctx["hf_bf16"]  # perturbed: the sync changes what the server generates
        result["gloo_group"] = await gloo_group_sync(engine, model, args.collective_timeout_s)
        greedy = [SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True) for _ in range(16)]
        got = [t.output_ids for t in await generate_all(engine, prompts[:16], greedy)]
        want, gaps = hf_greedy(model, prompts[:16], 32)
        result["greedy_after_sync_vs_hf"] = compare_greedy(got, want, gaps)
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


async def main_gpu(run: Run) -> None:
    ctx: dict[str, Any] = {"args": run.args, "run": run}
    ctx["model"] = await build_model(run)
    if ctx["model"] is None:
        return
    path = Path(ctx["model"]["path"])
    ctx["hf_original"] = load_hf(path, torch.bfloat16, "cuda")  # what the server loads from the folder
    ctx["hf_bf16"] = load_hf(path, torch.bfloat16, "cuda")
    perturb(ctx["hf_bf16"], run.args.perturb, seed=7)  # the weights the sync sends
    await run.phase("server", phase_server, ctx)
    free_gpu()


def build_parser() -> argparse.ArgumentParser:
    parser = common_parser(__doc__.splitlines()[0], "vllm_serve_check.json")
    parser.add_argument("--server-gpu-memory", type=float, default=0.25)
    parser.add_argument("--server-mode", choices=["eager", "default"], default="eager")
    parser.add_argument("--server-start-timeout-s", type=float, default=240.0)
    parser.add_argument("--perturb", type=float, default=0.5, help="noise, in units of each parameter's std")
    return parser


def main(argv: list[str] | None = None) -> int:
    return run_check(build_parser().parse_args(argv), "vllm_serve_check", WHAT, main_gpu)


if __name__ == "__main__":
    sys.exit(main())
