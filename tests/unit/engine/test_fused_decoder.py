"""The engine's fused layers (`triton_layers`, `fused_decoder`) against transformers' eager code: each kernel against
the torch ops it replaces (float32 and bfloat16), and the whole fused decoder against the transformers decoder over
the paged pool (Llama, Qwen2 with its biases, Qwen3 with its q/k norms; a prefill of two requests, then a decode
step reading what the prefill wrote): the same last hidden states and the same keys and values in the pool.

On CPU the kernels run under Triton's interpreter in a subprocess (`triton_check`); on CUDA natively."""

import sys

import pytest
import torch

CONFIGS = {
    "llama": dict(model_type="llama"),
    "qwen2": dict(model_type="qwen2"),
    "qwen3": dict(model_type="qwen3", head_dim=16),
}


def _device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def check_kernels(dtype_name: str = "float32") -> None:
    from rlasync.engine import triton_layers

    dtype = getattr(torch, dtype_name)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    device = _device()
    generator = torch.Generator().manual_seed(3)

    def rand(*shape):
        return torch.randn(*shape, generator=generator).to(device=device, dtype=dtype)

    def eager_rms(x, w, eps):  # transformers' RMSNorm.forward
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return w * h.to(x.dtype)

    x, r, w = rand(7, 96), rand(7, 96), rand(96)
    torch.testing.assert_close(triton_layers.rms_norm(x, w, 1e-6), eager_rms(x, w, 1e-6), **tol)
    y, s = triton_layers.add_rms_norm(x, r, w, 1e-5)
    # the residual add rounds as eager's does (Triton's interpreter truncates float32 to bfloat16 where CUDA rounds
    # to nearest even, so on CPU bfloat16 agrees to an ulp)
    exact = dtype == torch.float32 or device == "cuda"
    torch.testing.assert_close(s, r + x, **(dict(atol=0, rtol=0) if exact else dict(atol=0, rtol=8e-3)))
    torch.testing.assert_close(y, eager_rms(r + x, w, 1e-5), **tol)

    g, u = rand(5, 300), rand(5, 300)
    torch.testing.assert_close(triton_layers.silu_mul(g, u), torch.nn.functional.silu(g) * u, **tol)

    tokens, heads, dim = 6, 3, 16
    src, norm_w = rand(tokens, heads * dim), rand(dim)
    angles = torch.rand(tokens, dim // 2, generator=generator) * 6
    cos = torch.cat([angles.cos(), angles.cos()], -1).to(device=device, dtype=dtype)
    sin = torch.cat([angles.sin(), angles.sin()], -1).to(device=device, dtype=dtype)

    def eager_rope(h):  # transformers' apply_rotary_pos_emb on [N, H, D]
        half = dim // 2
        rotated = torch.cat([-h[..., half:], h[..., :half]], -1)
        return h * cos[:, None] + rotated * sin[:, None]

    heads_view = src.view(tokens, heads, dim)
    torch.testing.assert_close(
        triton_layers.rope_rows(src, heads, dim, cos=cos, sin=sin), eager_rope(heads_view), **tol
    )
    torch.testing.assert_close(
        triton_layers.rope_rows(src, heads, dim, cos=cos, sin=sin, norm_weight=norm_w, eps=1e-6),
        eager_rope(eager_rms(heads_view, norm_w, 1e-6)),
        **tol,
    )
    pool = torch.zeros(20, heads, dim, device=device, dtype=dtype)
    slots = torch.tensor([4, 0, 19, 7, 8, 2], device=device)
    triton_layers.rope_rows(src, heads, dim, out=pool, slots=slots)  # the values' copy: no norm, no rotation
    expected = torch.zeros_like(pool)
    expected[slots] = heads_view
    torch.testing.assert_close(pool, expected, atol=0, rtol=0)


def _tiny(model_type: str, dtype: torch.dtype):
    from transformers import AutoConfig, AutoModelForCausalLM

    extra = {k: v for k, v in CONFIGS[model_type].items() if k != "model_type"}
    config = AutoConfig.for_model(
        model_type, vocab_size=97, hidden_size=64, intermediate_size=112, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6,
        tie_word_embeddings=False, **extra,
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(device=_device(), dtype=dtype).eval()
    with torch.no_grad():  # norms away from 1, so that their weights are checked
        for name, param in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                param.add_(torch.randn_like(param) * 0.3)
    return model


def check_decoder(model_type: str, dtype_name: str = "float32") -> None:
    from rlasync.engine.fused_decoder import FusedDecoder, check_fused, fusable
    from rlasync.engine.paged_attention import ATTENTION_NAME, KVPool, build_metadata, register_paged_attention

    dtype = getattr(torch, dtype_name)
    device = torch.device(_device())
    register_paged_attention()
    model = _tiny(model_type, dtype)
    model.set_attn_implementation(ATTENTION_NAME)
    assert fusable(model) is None
    decoder = model.get_decoder()
    fused = FusedDecoder(decoder)
    config = model.config
    head_dim = fused.head_dim
    pools = [KVPool(config.num_hidden_layers, 12, 4, 2, head_dim, dtype, device) for _ in range(2)]
    no_mask = torch.zeros(1, 1, 0, 0, dtype=torch.bool, device=device)
    block_ids = [[3, 5, 1], [0, 9]]
    generator = torch.Generator().manual_seed(1)
    steps = [([0, 0], [9, 6]), ([9, 6], [1, 1])]  # a prefill of two prompts, then one decode step each
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for starts, lengths in steps:
        ids = torch.randint(0, config.vocab_size, (1, sum(lengths)), generator=generator).to(device)
        outputs = []
        for pool, run in zip(pools, ("eager", "fused")):
            meta = build_metadata(pool, starts, lengths, block_ids, device)
            positions = meta.positions[None]
            with torch.inference_mode():
                if run == "eager":
                    out = decoder(
                        input_ids=ids, position_ids=positions, attention_mask=no_mask, use_cache=False,
                        paged_attention=meta,
                    ).last_hidden_state  # fmt: skip
                else:
                    out = fused(input_ids=ids, position_ids=positions, attention_mask=no_mask, paged_attention=meta)
                    out = out.last_hidden_state
            outputs.append(out[0].float())
        error = float((outputs[1] - outputs[0]).norm() / outputs[0].norm())
        assert error < tol, (model_type, dtype_name, starts, error)
        for layer in range(config.num_hidden_layers):
            for part in (0, 1):  # keys, values
                a, b = pools[0].kv[layer, part].float(), pools[1].kv[layer, part].float()
                assert float((a - b).norm() / a.norm().clamp_min(1e-9)) < tol, (model_type, layer, part)
    # the engine's start-up check agrees (a fresh step over the same pool)
    meta = build_metadata(pools[1], [0], [5], [[7, 8]], device)
    ids = torch.randint(0, config.vocab_size, (1, 5), generator=generator).to(device)
    assert check_fused(fused, meta, ids, no_mask) < tol
    # ... and finds a wrong kernel (a SiLU-and-product off by a factor, in every layer) past its tolerance
    from rlasync.engine import fused_decoder

    right = fused_decoder.triton_layers.silu_mul
    fused_decoder.triton_layers.silu_mul = lambda gate, up: right(gate, up) * 8
    try:
        assert check_fused(fused, meta, ids, no_mask) > 2 * fused_decoder.CHECK_TOLERANCE
    finally:
        fused_decoder.triton_layers.silu_mul = right
    # a call without paged attention is transformers' own forward
    with torch.inference_mode():
        plain = fused(input_ids=ids, use_cache=False).last_hidden_state
        torch.testing.assert_close(plain, decoder(input_ids=ids, use_cache=False).last_hidden_state)


def check_engine(dtype_name: str = "float32") -> None:
    """TorchEngine with `fused_layers=True` against the engine without: the same greedy tokens and log-probs, before
    and after a weight load (the fused layers read the model's own modules, which the load copies into)."""
    import asyncio

    from rlasync.engine import SamplingParams, TorchEngine

    prompts = [[5], [17, 3, 90], list(range(20, 33))]
    params = SamplingParams(max_tokens=6, temperature=0.0, num_logprobs=2)

    async def run(engine, state=None):
        if state is not None:
            await engine.pause()
            await engine.load_weights(state.items())
            await engine.resume()
        records = await asyncio.gather(*(engine.generate(p, params) for p in prompts))
        return [r.output_ids for r in records], [r.output_log_probs for r in records]

    async def main():
        model = _tiny("llama", torch.float32)
        generator = torch.Generator().manual_seed(4)
        state = {
            name: p.detach() + 0.1 * torch.randn(p.shape, generator=generator).to(p.device)
            for name, p in model.named_parameters()
        }
        results = {}
        for fused in (False, True):
            engine = TorchEngine(
                _tiny("llama", torch.float32), device=_device(), max_model_len=64, kv_cache_tokens=512,
                block_size=4 if _device() == "cpu" else None, eos_token_ids=[], fused_layers=fused,
            )  # fmt: skip
            assert engine.runner_info()["fused_layers"] is fused
            results[fused] = (await run(engine), await run(engine, state))
            await engine.close()
        for before_after in (0, 1):
            (ids_plain, lps_plain), (ids_fused, lps_fused) = results[False][before_after], results[True][before_after]
            assert ids_fused == ids_plain, before_after
            for a, b in zip(lps_plain, lps_fused):
                torch.testing.assert_close(torch.tensor(b), torch.tensor(a), atol=1e-4, rtol=1e-4)
        assert results[False][0][0] != results[False][1][0]  # the load changed what the engine generates

    asyncio.run(main())


def check(what: str, dtype_name: str) -> None:
    if what == "kernels":
        check_kernels(dtype_name)
    elif what == "engine":
        check_engine(dtype_name)
    else:
        check_decoder(what, dtype_name)


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_kernels_match_eager_ops(triton_check, dtype_name):
    triton_check(check, __file__, "kernels", dtype_name)


@pytest.mark.parametrize("model_type", sorted(CONFIGS))
def test_fused_decoder_matches_transformers(triton_check, model_type):
    triton_check(check, __file__, model_type, "float32")


def test_fused_decoder_matches_transformers_in_bfloat16(triton_check):
    triton_check(check, __file__, "llama", "bfloat16")


def test_engine_with_fused_layers_generates_as_without(triton_check):
    triton_check(check, __file__, "engine", "float32")


def test_fusable_names_what_it_cannot_fuse():
    pytest.importorskip("triton", reason="Triton is not installed (it ships with CUDA builds of torch)")
    from rlasync.engine.fused_decoder import fusable

    model = _tiny("llama", torch.float32)
    model.config.hidden_act = "gelu"
    assert "hidden_act 'gelu'" in fusable(model)
    model.config.hidden_act = "silu"
    model.config.model_type = "gemma"
    assert "model_type 'gemma'" in fusable(model)
    odd = _tiny("qwen3", torch.float32)
    odd.config.model_type = "qwen3"
    for layer in odd.get_decoder().layers:
        layer.self_attn.head_dim = 12
    assert "head_dim 12" in fusable(odd)


def test_engine_refuses_fused_layers_a_model_cannot_take():
    pytest.importorskip("triton", reason="Triton is not installed (it ships with CUDA builds of torch)")
    from transformers import AutoModelForCausalLM, Qwen3Config

    from rlasync.engine import TorchEngine

    config = Qwen3Config(
        vocab_size=64, hidden_size=48, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=12, max_position_embeddings=64,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(config).eval()
    with pytest.raises(ValueError, match="fused_layers=True: this model cannot take them .*head_dim 12"):
        TorchEngine(model, device="cpu", max_model_len=32, kv_cache_tokens=64, block_size=4, fused_layers=True)
    engine = TorchEngine(model, device="cpu", max_model_len=32, kv_cache_tokens=64, block_size=4)
    assert engine.runner_info()["fused_layers"] is False  # the default on CPU: transformers' layers


@pytest.mark.parametrize("failure", ["disagrees", "raises"])
def test_engine_keeps_transformers_layers_when_the_start_up_check_fails(monkeypatch, caplog, failure):
    pytest.importorskip("triton", reason="Triton is not installed (it ships with CUDA builds of torch)")
    import rlasync.engine.fused_decoder as fused_decoder
    import rlasync.engine.runner as runner_module
    from rlasync.engine import TorchEngine

    def check(fused, meta, input_ids, no_mask):
        assert input_ids.shape[1] == meta.positions.shape[0] > 0
        if failure == "raises":
            raise RuntimeError("no kernel image for this device")
        return 0.5

    monkeypatch.setattr(runner_module, "check_fused", check)
    with caplog.at_level("WARNING", logger="rlasync.engine.runner"):
        engine = TorchEngine(
            _tiny("llama", torch.float32), device="cpu", max_model_len=32, kv_cache_tokens=64, block_size=4,
            fused_layers=True,
        )  # fmt: skip
    assert engine.runner_info()["fused_layers"] is False
    assert not isinstance(engine.runner.decoder, fused_decoder.FusedDecoder)
    expected = "disagree with transformers'" if failure == "disagrees" else "failed their start-up check"
    assert expected in caplog.text


if __name__ == "__main__":  # run by `triton_check` under TRITON_INTERPRET=1
    check(sys.argv[1], sys.argv[2])
