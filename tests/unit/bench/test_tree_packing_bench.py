"""bench/tree_packing.py's TRL anchor merge, failure reporting, option passthrough and --profile (CPU)."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "bench"))

import tree_packing  # noqa: E402
import trl_tree_anchor  # noqa: E402
from tree_profile import PHASES, profile_tree  # noqa: E402

WHEELS = [REPO / ".trlwheel" / "trl-1.16.0-py3-none-any.whl", Path("/work/main/.trlwheel/trl-1.16.0-py3-none-any.whl")]


def ours(tok_s):
    return {"tree": {"trained_tokens_per_s": tok_s, "mfu": 0.1}}


def test_the_anchor_numbers_merge_per_shape_with_speedups_and_the_logprob_agreement():
    results = {"shapes": {"a": ours(300.0), "b": ours(50.0)}}
    anchor = {
        "status": "failed shapes: b",
        "trl": "1.16.0",
        "shapes": {
            "a": {
                "tree": {"trained_tokens_per_s": 100.0, "mfu": 0.04},
                "padding_free": {"trained_tokens_per_s": 60.0, "mfu": 0.05},
                "tree_logprobs": {"0": [-1.0, -2.0], "3": [-0.5]},
            },
            "b": {"error": "RuntimeError: out of memory"},
        },
    }
    trl_tree_anchor.merge_anchor(results, anchor, "a", {0: np.array([-1.0, -2.25]), 1: np.array([0.0])})
    trl_tree_anchor.merge_anchor(results, anchor, "b", {})
    a, b = results["shapes"]["a"], results["shapes"]["b"]
    assert a["speedup_vs_trl"] == pytest.approx(3.0) and a["speedup_vs_trl_padding_free"] == pytest.approx(5.0)
    assert a["trl"]["trained_tokens_per_s"] == 100.0 and a["trl"]["mfu"] == 0.04
    assert a["logprob_max_abs_diff_vs_trl"] == pytest.approx(0.25) and a["logprob_samples_compared_vs_trl"] == 1
    assert b["speedup_vs_trl"] is None and "out of memory" in b["trl"]["error"]
    assert results["speedup_vs_trl"] == {"a": pytest.approx(3.0), "b": None}
    assert results["trl"]["status"] == "failed shapes: b" and "shapes" not in results["trl"]


def test_an_anchor_that_never_ran_leaves_our_numbers_and_says_why():
    results = {"shapes": {"a": ours(300.0)}}
    trl_tree_anchor.merge_anchor(results, {"status": "failed", "stage": "install", "error": "pip exited 1"}, "a", {})
    assert results["shapes"]["a"]["tree"]["trained_tokens_per_s"] == 300.0
    assert results["shapes"]["a"]["speedup_vs_trl"] is None
    assert results["shapes"]["a"]["trl"]["error"] == "pip exited 1"


def test_a_wheel_that_does_not_install_is_reported_not_raised(tmp_path):
    bogus = tmp_path / "trl-1.16.0-py3-none-any.whl"
    bogus.write_text("not a zip")
    args = tree_packing.build_parser().parse_args(["--tiny", "--device", "cpu", "--shapes", "8x4x2@32"])
    anchor = trl_tree_anchor.run_anchor(str(bogus), args, timeout_s=60)
    assert anchor["status"] == "failed" and anchor["stage"] == "install"
    assert anchor["log_tail"]  # pip's own message comes back


def options(*argv):
    return tree_packing.training_options(tree_packing.build_parser().parse_args(list(argv)))


def test_checkpointing_flags_and_prepare_kwargs_reach_prepare_for_training():
    assert options() == {"gradient_checkpointing": True, "compile": "layers"}
    assert options("--no-grad-ckpt", "--compile", "none")["gradient_checkpointing"] is False
    assert options("--grad-ckpt", "none")["gradient_checkpointing"] is False
    assert options("--prepare-kwargs", '{"use_reentrant": true}')["use_reentrant"] is True
    with pytest.raises(SystemExit, match="contradicts"):
        options("--no-grad-ckpt", "--grad-ckpt", "all")
    with pytest.raises(SystemExit, match=r"takes no \['bogus'\]"):
        options("--prepare-kwargs", '{"bogus": 1}')
    with pytest.raises(SystemExit, match="JSON object"):
        options("--prepare-kwargs", "[1]")
    with pytest.raises(SystemExit, match="--shapes"):
        tree_packing.parse_shapes("8x4@32")


def test_grad_ckpt_auto_asks_for_the_learners_plan_by_memory():
    auto = options("--grad-ckpt", "auto")
    assert auto["gradient_checkpointing"] is True and auto["checkpoint_layers"] == "auto"
    assert "checkpoint_layers" not in options("--grad-ckpt", "all")


def test_segment_reference_attention_is_bottom_right_causal_with_gqa():
    """segments_varlen (the anchor's CPU kernel) against a dense masked attention over one path of 3 + 2 tokens."""
    torch.manual_seed(0)
    q, k, v = torch.randn(5, 4, 8), torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    kv_index = torch.tensor([0, 1, 2, 0, 1, 2, 3, 4])  # segment 1 sees segment 0 (its path) and itself
    cu_k = torch.tensor([0, 3, 8], dtype=torch.int32)
    got = trl_tree_anchor.segments_varlen(q, k[kv_index], v[kv_index], cu, cu_k, 3, 5)
    visible = torch.ones(5, 5, dtype=torch.bool).tril()  # the row is one chain: plain causal over 5 tokens
    kk, vv = (x.repeat_interleave(2, 1).transpose(0, 1) for x in (k, v))
    want = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), kk, vv, attn_mask=visible)
    torch.testing.assert_close(got, want.transpose(0, 1))


def tiny_tree_mode():
    from transformers import AutoModelForCausalLM, Qwen3Config

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        tie_word_embeddings=True,
    )
    model = tree_packing.prepare_for_training(AutoModelForCausalLM.from_config(config), compile=False)
    shape = tree_packing.Shape(12, 6, 3, 64)
    samples = tree_packing.make_samples(shape, 2, config.vocab_size, 0)
    return model, tree_packing.TreeMode(tree_packing.plan_rows(samples, shape.row_tokens, share=True), "cpu")


def test_profile_writes_a_table_and_a_phase_split_and_leaves_no_gradients(tmp_path):
    model, mode = tiny_tree_mode()
    summary = profile_tree(model, mode, None, "tiny", str(tmp_path), 2, "cpu")
    assert "error" not in summary, summary
    report = json.loads((tmp_path / "tree_tiny.json").read_text())
    assert set(report["split"]["phases"]) == set(PHASES)
    assert all(phase["wall_ms"] > 0 for phase in report["split"]["phases"].values())
    shares = [v for v in report["split"]["shares"].values() if v is not None]
    assert sum(shares) == pytest.approx(1.0)
    names = [row["name"] for row in report["plain"]["top"]]
    assert "aten::mm" in names and report["plain"]["launches_per_row"] > 0
    assert "decoder_backward" in (tmp_path / "tree_tiny.txt").read_text()
    assert all(p.grad is None for p in model.parameters())


def test_the_split_profile_step_computes_the_plain_steps_gradients(tmp_path, monkeypatch):
    """The hooks re-root the decoder's output for the head: the gradients must be those of one ordinary step."""
    import tree_profile

    model, mode = tiny_tree_mode()
    scores, adv = mode.scores(model, 0)
    tree_profile._loss(scores, adv).backward()
    plain = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    monkeypatch.setattr(model, "zero_grad", lambda set_to_none=True: None)  # keep the split step's gradients
    tree_profile._split(model, mode, torch.device("cpu"))
    for want, p in zip(plain, model.parameters()):
        torch.testing.assert_close(p.grad, want, atol=1e-6, rtol=1e-5)


@pytest.mark.slow
def test_trl_runs_in_the_same_call_on_the_same_samples_and_model(tmp_path):
    """End to end on CPU (~1 min): the anchor installs TRL's wheel, times its tree and padding-free rows, and its
    tree log-probs equal ours (same weights, same samples, float32)."""
    wheel = next((w for w in WHEELS if w.is_file()), None)
    if wheel is None:
        pytest.skip("no TRL 1.16 wheel in .trlwheel/")
    out = tmp_path / "tp.json"
    cmd = [
        sys.executable,
        str(REPO / "bench" / "tree_packing.py"),
        "--tiny",
        "--device",
        "cpu",
        "--compile",
        "none",
        "--shapes",
        "12x6x4@96",
        "--groups",
        "2",
        "--steps",
        "1",
        "--warmup",
        "0",
        "--modes",
        "tree,padding_free",
        "--trl-wheel",
        str(wheel),
        "--profile",
        str(tmp_path / "prof"),
        "--out",
        str(out),
    ]
    subprocess.run(cmd, check=True, cwd=REPO, capture_output=True, timeout=600)
    results = json.loads(out.read_text())
    shape = results["shapes"]["p12_c6_g4_row96"]
    assert results["trl"]["status"] == "ok" and results["trl"]["trl"] == "1.16.0"
    assert shape["trl"]["padding_free"]["packing_ratio"] == pytest.approx(1.0)
    assert shape["trl"]["tree"]["packing_ratio"] == pytest.approx(shape["tree"]["packing_ratio"])
    assert shape["speedup_vs_trl"] == pytest.approx(
        shape["tree"]["trained_tokens_per_s"] / shape["trl"]["trained_tokens_per_s"]
    )
    assert shape["logprob_samples_compared_vs_trl"] >= 2 and shape["logprob_max_abs_diff_vs_trl"] < 1e-4
    assert (tmp_path / "prof" / "tree_p12_c6_g4_row96.txt").is_file()


def test_tree_varlen_runs_next_to_the_flex_tree_and_agrees_with_it(tmp_path):
    """The A/B mode of the varlen tree attention on CPU (its reference loop): timed, planned on the host, and its
    log-probs equal the tree mode's and the padding-free mode's (float32)."""
    out = tmp_path / "tp.json"
    tree_packing.main(
        [
            "--tiny",
            "--device",
            "cpu",
            "--compile",
            "none",
            "--shapes",
            "12x6x4@96",
            "--groups",
            "2",
            "--steps",
            "1",
            "--warmup",
            "0",
            "--modes",
            "tree,tree_varlen,padding_free",
            "--out",
            str(out),
        ]
    )
    results = json.loads(out.read_text())
    shape = results["shapes"]["p12_c6_g4_row96"]
    assert shape["tree_varlen"]["trained_tokens_per_s"] > 0 and shape["tree_varlen"]["row_to_device_ms"] > 0
    assert shape["tree_varlen_over_tree"] == pytest.approx(
        shape["tree_varlen"]["trained_tokens_per_s"] / shape["tree"]["trained_tokens_per_s"]
    )
    assert max(shape["tree_varlen_logprob_max_abs_diff"].values()) < 1e-4
    assert set(shape["tree_varlen_logprob_max_abs_diff"]) == {"tree", "padding_free"}
    assert "tree_varlen" in results["mfu"]["p12_c6_g4_row96"]


def test_block_align_times_the_aligned_rows_next_to_the_tree_and_they_agree(tmp_path):
    """--block-align adds mode tree_aligned in the same call: padded rows, fewer or as many mask blocks on this shape
    (branches of 6 tokens with a shared first completion token), the same log-probs (float32)."""
    out = tmp_path / "tp.json"
    argv = ["--tiny", "--device", "cpu", "--compile", "none", "--shapes", "11x6x4@96", "--groups", "2"]
    argv += ["--steps", "1", "--warmup", "0", "--modes", "tree", "--block-size", "8", "--out", str(out)]
    tree_packing.main([*argv, "--block-align", "8", "--shared-completion-prefix", "1"])
    results = json.loads(out.read_text())
    shape = results["shapes"]["p11_c6_g4_row96"]
    assert results["block_align"] == 8 and results["shared_completion_prefix"] == 1
    tree, aligned = shape["tree"], shape["tree_aligned"]
    assert tree["padding_per_row"] == 0 and aligned["padding_per_row"] > 0
    assert aligned["mask_blocks_per_row"]["partial"] < tree["mask_blocks_per_row"]["partial"]
    assert shape["tree_aligned_over_tree"] == pytest.approx(
        aligned["trained_tokens_per_s"] / tree["trained_tokens_per_s"]
    )
    assert shape["tree_aligned_logprob_max_abs_diff"] < 1e-5
    with pytest.raises(SystemExit, match="needs --block-align"):
        tree_packing.main([*argv[:-4], "--modes", "tree,tree_aligned"])
    with pytest.raises(SystemExit, match="TRL anchor builds its own samples"):
        tree_packing.main([*argv, "--shared-completion-prefix", "1", "--trl-wheel", str(tmp_path / "x.whl")])


def test_the_fp32_reference_scores_each_trained_token_from_its_prefix_alone():
    """fp32_reference_logprobs against the obvious loop: one forward per trained token over the tokens before it."""
    model, mode = tiny_tree_mode()
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_config(model.config).eval()
    samples = mode.rows[0].samples[:2]
    got = tree_packing.fp32_reference_logprobs(reference, samples, {id(s) for s in samples[:1]}, "cpu")
    assert list(got) == [id(samples[0])]  # only the samples asked for
    ids, mask = torch.as_tensor(samples[0].input_ids).long(), samples[0].completion_mask
    with torch.no_grad():
        want = [
            torch.log_softmax(reference(input_ids=ids[None, :t]).logits[0, -1], -1)[ids[t]].item()
            for t in range(1, len(ids))
            if mask[t] == 1
        ]
    assert len(want) == int(mask.sum())
    np.testing.assert_allclose(got[id(samples[0])], want, atol=1e-5)


def test_fp32_reference_reports_every_modes_error_and_fp32_modes_have_none(tmp_path):
    out = tmp_path / "tp.json"
    tree_packing.main(
        [
            "--tiny",
            "--device",
            "cpu",
            "--compile",
            "none",
            "--shapes",
            "12x6x4@96",
            "--groups",
            "2",
            "--steps",
            "1",
            "--warmup",
            "0",
            "--modes",
            "tree,padding_free,padded",
            "--fp32-reference",
            "--out",
            str(out),
        ]
    )
    shape = json.loads(out.read_text())["shapes"]["p12_c6_g4_row96"]
    assert set(shape["logprob_vs_fp32"]) == {"tree", "padding_free", "padded"}
    for error in shape["logprob_vs_fp32"].values():
        assert 0 <= error["mean_abs"] <= error["max_abs"] < 1e-4


def test_the_default_configs_compilation_is_the_learners():
    assert tree_packing.default_config_compile("cuda") == "layers"  # torch_compile unset: compiled on CUDA
    assert tree_packing.default_config_compile("cpu") == "none"
    args = tree_packing.build_parser().parse_args(["--compile", "default", "--device", "cpu"])
    assert tree_packing.training_options(args)["compile"] is False


def test_default_vs_compiled_times_the_default_config_next_to_the_compiled_model(tmp_path):
    """On the CPU the default config is eager; the compiled side uses the aot_eager backend (a real Dynamo compile,
    fast): both timed on the same samples, the ratio recorded per shape and at the top, the log-probs equal."""
    out = tmp_path / "tp.json"
    argv = ["--tiny", "--device", "cpu", "--shapes", "12x6x4@96", "--groups", "2", "--steps", "1", "--warmup", "0"]
    with pytest.raises(SystemExit, match="--default-vs-compiled compares the tree mode against --compile layers"):
        tree_packing.main([*argv, "--compile", "none", "--default-vs-compiled"])
    tree_packing.main(
        [
            *argv,
            "--modes",
            "tree",
            "--default-vs-compiled",
            "--prepare-kwargs",
            '{"compile_backend": "aot_eager"}',
            "--out",
            str(out),
        ]
    )
    results = json.loads(out.read_text())
    shape = results["shapes"]["p12_c6_g4_row96"]
    assert results["default_config_compile"] == "none" and shape["tree_default_config"]["trained_tokens_per_s"] > 0
    first = shape["tree_default_config"]["trained_tokens_per_s"] / shape["tree"]["trained_tokens_per_s"]
    rounds = shape["default_over_compiled_rounds"]
    assert len(rounds) == 3 and rounds[0] == pytest.approx(first)  # --ab-rounds 3 (the default), alternating
    assert all(r > 0 for r in rounds)
    assert shape["default_over_compiled"] == pytest.approx(sorted(rounds)[1])  # the median
    assert results["default_over_compiled"] == shape["default_over_compiled"]
    assert shape["default_config_logprob_max_abs_diff"] < 1e-4
