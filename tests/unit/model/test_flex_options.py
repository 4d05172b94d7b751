"""$RLASYNC_FLEX_KERNEL_OPTIONS: FlexAttention's kernel options for tuning on a GPU, parsed once, passed through."""

import pytest
import torch

from rlasync.model import attention


@pytest.fixture(autouse=True)
def fresh_cache():
    attention.flex_kernel_options.cache_clear()
    yield
    attention.flex_kernel_options.cache_clear()


def test_unset_passes_no_kernel_options_and_a_json_object_is_passed_through(monkeypatch):
    seen = []

    def fake_flex(query, key, value, **kwargs):
        seen.append(kwargs)
        return query

    import torch.nn.attention.flex_attention as flex

    monkeypatch.setattr(flex, "flex_attention", fake_flex)
    q = torch.zeros(1, 2, 4, 8)
    monkeypatch.delenv(attention.FLEX_KERNEL_OPTIONS_ENV, raising=False)
    attention._flex_attention(q, q, q, None, None, None, compile=False)
    assert "kernel_options" not in seen[-1]
    attention.flex_kernel_options.cache_clear()
    monkeypatch.setenv(attention.FLEX_KERNEL_OPTIONS_ENV, '{"BLOCK_M1": 32, "BLOCK_N1": 64}')
    attention._flex_attention(q, q, q, None, None, None, compile=False)
    assert seen[-1]["kernel_options"] == {"BLOCK_M1": 32, "BLOCK_N1": 64}


@pytest.mark.parametrize("text", ["{not json", "[1, 2]", '"BLOCK_M"'])
def test_a_bad_value_names_the_variable(monkeypatch, text):
    monkeypatch.setenv(attention.FLEX_KERNEL_OPTIONS_ENV, text)
    with pytest.raises(ValueError, match="RLASYNC_FLEX_KERNEL_OPTIONS"):
        attention.flex_kernel_options()
