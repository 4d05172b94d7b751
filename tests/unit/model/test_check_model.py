"""`rlasync check-model` passes on supported tiny models and refuses unsupported ones."""

import pytest

from rlasync.model.check import EXIT_MISMATCH, EXIT_OK, EXIT_UNSUPPORTED, main

SMALL = dict(
    vocab_size=128,
    hidden_size=32,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


def _last_value(output: str) -> float:
    last = output.strip().splitlines()[-1]
    assert last.startswith("max_abs_diff="), last
    return float(last.removeprefix("max_abs_diff="))


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_check_model_passes_on_tiny_models(make_model, tmp_path, capsys, family):
    make_model(family).save_pretrained(tmp_path / family)
    code = main([str(tmp_path / family), "--device", "cpu", "--seed", "3", "--max-length", "24"])
    output = capsys.readouterr().out
    assert code == EXIT_OK, output
    assert _last_value(output) <= 1e-5
    assert "packing ratio" in output


def test_check_model_checks_the_backend_it_is_given(make_model, tmp_path, capsys):
    make_model("qwen3_sliding").save_pretrained(tmp_path / "m")
    code = main([str(tmp_path / "m"), "--device", "cpu", "--seed", "2", "--max-length", "24", "--attention", "varlen"])
    output = capsys.readouterr().out
    assert code == EXIT_OK, output
    assert "tree attention varlen" in output and _last_value(output) <= 1e-5


def test_check_model_fails_above_the_tolerance(make_model, tmp_path, capsys):
    make_model("qwen3").save_pretrained(tmp_path / "m")
    code = main([str(tmp_path / "m"), "--device", "cpu", "--tolerance", "0", "--max-length", "24"])
    assert code == EXIT_MISMATCH
    assert _last_value(capsys.readouterr().out) > 0


def test_check_model_refuses_recurrent_layer_types(tmp_path, capsys):
    from transformers import AutoModelForCausalLM, Lfm2Config

    config = Lfm2Config(**SMALL, layer_types=["conv", "full_attention"])
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "lfm2")
    code = main([str(tmp_path / "lfm2"), "--device", "cpu"])
    captured = capsys.readouterr()
    assert code == EXIT_UNSUPPORTED
    assert "layer_types ['conv']" in captured.err
    assert captured.out.strip().splitlines()[-1] == "max_abs_diff=nan"


def test_check_model_refuses_attention_sinks(tmp_path, capsys):
    from transformers import AutoModelForCausalLM, GptOssConfig

    config = GptOssConfig(**SMALL, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=4)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "gpt_oss")
    code = main([str(tmp_path / "gpt_oss"), "--device", "cpu"])
    assert code == EXIT_UNSUPPORTED
    assert "sinks" in capsys.readouterr().err
