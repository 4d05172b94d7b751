"""Tree attention on CUDA: compiled FlexAttention (BlockMask from subtree_end) equals the dense SDPA path.

Run through the device tool: `pytest -m gpu tests/gpu/test_model_gpu.py`.
"""

import copy

import numpy as np
import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2}


def tiny_model(family: str, dtype: torch.dtype, seed: int = 0):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    from rlasync.model import enable_tree_attention

    shape = dict(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        initializer_range=0.1,
    )
    if family == "llama":
        config = LlamaConfig(**shape)
    elif family == "qwen3":
        config = Qwen3Config(**shape, head_dim=32)
    else:  # a sliding window on layer 0, small enough to matter inside the samples
        config = Qwen3Config(
            **shape,
            head_dim=32,
            use_sliding_window=True,
            sliding_window=24,
            layer_types=["sliding_attention", "full_attention"],
        )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=dtype).cuda().eval()
    return model, enable_tree_attention(copy.deepcopy(model))


def random_row(seed: int, vocab: int = 256):
    """GRPO groups, a multi-turn chain and unrelated samples: a few hundred tokens, several 128-token blocks."""
    rng = np.random.default_rng(seed)
    seqs, prompts = [], []
    for _ in range(3):
        prompt = rng.integers(0, vocab, int(rng.integers(30, 90))).tolist()
        for _ in range(4):
            seqs.append(prompt + rng.integers(0, vocab, int(rng.integers(5, 70))).tolist())
            prompts.append(len(prompt))
    turn = rng.integers(0, vocab, 50).tolist()
    for _ in range(3):
        context = turn + rng.integers(0, vocab, 10).tolist()
        turn = context + rng.integers(0, vocab, 40).tolist()
        seqs.append(turn), prompts.append(len(context))
    for _ in range(2):
        seqs.append(rng.integers(0, vocab, 77).tolist()), prompts.append(13)
    return seqs, prompts


def packed(seqs, prompts, segments=False):
    from rlasync.model import packed_row_to_tensors
    from rlasync.packing import TreeRow, pack
    from rlasync.records import RolloutSample

    row = TreeRow()
    for seq, prompt in zip(seqs, prompts):
        row.add(RolloutSample(seq, [0] * prompt + [1] * (len(seq) - prompt), [0.0] * len(seq), 0.0, group_id=0))
    return packed_row_to_tensors(pack(row), "cuda", segments=segments)


def scores_and_grads(model, row, backend):
    from rlasync.model import packed_token_scores

    model.zero_grad(set_to_none=True)
    scores = packed_token_scores(model, row, backend=backend)
    weights = torch.randn(scores.logprobs.shape, generator=torch.Generator().manual_seed(0)).cuda()
    (weights * scores.logprobs).sum().div(scores.logprobs.numel()).backward()
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    return scores.logprobs.detach().float(), grads


@pytest.mark.parametrize("backend", ["flex", "varlen"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_sliding"])
def test_tree_backends_equal_dense_sdpa_path(family, dtype, backend):
    """Compiled FlexAttention, and the FlashAttention varlen kernel over root-path segments (bf16; fp32 takes its
    reference loop) with the plan made on the host as the learner does (first row) and from the row on the device."""
    _, model = tiny_model(family, dtype)
    for seed in range(2):  # two rows of different lengths: the compiled kernel handles a new N
        row = packed(*random_row(seed), segments=backend == "varlen" and seed == 0)
        assert row.num_tokens > 3 * 128  # several 128-token blocks (and, almost surely, a partial last one)
        dense, dense_grads = scores_and_grads(model, row, "dense")
        tree, tree_grads = scores_and_grads(model, row, backend)
        tolerance = TOLERANCE[dtype]
        assert (dense - tree).abs().max().item() <= tolerance
        for name in dense_grads:
            scale = max(1.0, dense_grads[name].abs().max().item())
            assert (dense_grads[name] - tree_grads[name]).abs().max().item() <= tolerance * scale, name


@pytest.mark.parametrize("window", [None, 40])
def test_the_varlen_kernel_aligns_each_segment_to_the_end_of_its_keys(window):
    """One attention call at the real head shape (16 query heads over 8 KV heads, head_dim 128) against SDPA in
    fp32 under the dense tree mask: values and the gradients of q, k and v."""
    from rlasync.model.segment_attention import segment_attention, segment_plan
    from rlasync.model.tree_mask import dense_tree_mask

    row = packed(*random_row(3))
    n, gen = row.num_tokens, torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (
        torch.randn(1, h, n, 128, device="cuda", generator=gen, dtype=torch.bfloat16).requires_grad_()
        for h in (16, 8, 8)
    )
    plan = segment_plan(row.subtree_end.cpu(), row.position_ids.cpu()).to("cuda")
    out = segment_attention(q, k, v, plan, None, window)
    mask = dense_tree_mask(row.subtree_end, row.position_ids, window)
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    expected = torch.nn.functional.scaled_dot_product_attention(q32, k32, v32, attn_mask=mask, enable_gqa=True)
    expected = expected.transpose(1, 2)
    assert (out.float() - expected).abs().max().item() <= 2e-2
    weights = torch.randn(out.shape, device="cuda", generator=gen)
    grads = torch.autograd.grad((out.float() * weights).sum(), (q, k, v))
    expected_grads = torch.autograd.grad((expected * weights).sum(), (q32, k32, v32))
    for got, want in zip(grads, expected_grads):
        assert (got.float() - want).abs().max().item() <= 5e-2 * max(1.0, want.abs().max().item())


@pytest.mark.parametrize("family", ["qwen3", "qwen3_sliding"])
def test_tree_packed_on_cuda_equals_unpacked_forward_in_float32(family):
    from rlasync.model import sequence_logprobs

    reference_model, tree_model = tiny_model(family, torch.float32)
    seqs, prompts = random_row(7)
    reference = torch.cat(sequence_logprobs(reference_model, seqs, prompts, packing="none"))
    tree = torch.cat(sequence_logprobs(tree_model, seqs, prompts, packing="tree"))  # auto: flex on CUDA
    assert (reference - tree).abs().max().item() <= 1e-4


def test_check_model_cli_passes_on_cuda(tmp_path, capsys):
    from rlasync.model.check import main

    model, _ = tiny_model("qwen3", torch.float32)
    model.save_pretrained(tmp_path / "m")
    code = main([str(tmp_path / "m"), "--device", "cuda", "--tolerance", "1e-4"])
    output = capsys.readouterr().out
    assert code == 0, output
    assert output.strip().splitlines()[-1].startswith("max_abs_diff=")


def test_a_scorers_kernel_settings_reach_the_compiled_flex_calls_and_the_head(monkeypatch):
    """`KernelSettings` on CUDA (no environment variable): FlexAttention's kernel options reach every flex call of
    the row, the head keeps probabilities in passes compiled with every size dynamic, and scores and gradients
    equal the default scorer's."""
    from rlasync.config import KernelSettings
    from rlasync.model import TreeScorer, attention, head

    flex_calls, head_passes = [], []
    real_flex, real_fused = attention._flex_attention, head.fused

    def flex_spy(*args, **kwargs):
        flex_calls.append(args[7] if len(args) > 7 else kwargs.get("kernel_options"))
        return real_flex(*args, **kwargs)

    def fused_spy(name, compile_kernels, dynamic="rows"):
        head_passes.append((name, compile_kernels, dynamic))
        return real_fused(name, compile_kernels, dynamic)

    monkeypatch.setattr(attention, "_flex_attention", flex_spy)
    monkeypatch.setattr(head, "fused", fused_spy)
    _, model = tiny_model("qwen3", torch.bfloat16)
    row = packed(*random_row(5))
    chosen = KernelSettings(flex_kernel_options={"WRITE_DQ": False}, head_keep="probs", head_dynamic="all")
    results = []
    for scorer in (TreeScorer(model), TreeScorer(model, chosen)):
        flex_calls.clear(), head_passes.clear()
        model.zero_grad(set_to_none=True)
        logprobs = scorer(row).logprobs
        logprobs.float().mean().backward()
        grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((logprobs.detach().float(), grads, list(flex_calls), set(head_passes)))
    (default, default_grads, default_flex, default_head), (ours, our_grads, our_flex, our_head) = results
    assert default_flex and all(options is None for options in default_flex)
    assert our_flex and all(options == {"WRITE_DQ": False} for options in our_flex)
    assert {dynamic for _, _, dynamic in default_head} == {"rows"}
    assert our_head and all(compiled and dynamic == "all" for _, compiled, dynamic in our_head)
    assert (default - ours).abs().max().item() <= TOLERANCE[torch.bfloat16]
    for name, grad in default_grads.items():
        scale = max(1.0, grad.abs().max().item())
        assert (grad - our_grads[name]).abs().max().item() <= TOLERANCE[torch.bfloat16] * scale, name
