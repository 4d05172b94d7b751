"""`KernelSettings` (the config's `kernels` section) reach the model code through the `TreeScorer`: the tree
attention backend, FlexAttention's kernel options and the head's keep / compile / dynamic settings are handed to
`build_tree_attention` and `chunked_token_scores`, never read from the environment."""

import pickle

import pytest
import torch

from rlasync.config import AsyncDistillationConfig, AsyncGRPOConfig, KernelSettings, load_config
from rlasync.model import TreeScorer, enable_tree_attention, forward, packed_token_scores

CHOSEN = KernelSettings(
    tree_attention="varlen",
    flex_kernel_options={"BLOCK_M1": 32},
    head_compile=False,
    head_keep="probs",
    head_dynamic="all",
)


@pytest.fixture
def spied(monkeypatch):
    """What the scoring hands the tree builder and the head."""
    seen = {}
    build, head = forward.build_tree_attention, forward.chunked_token_scores

    def build_spy(*args, **kwargs):
        seen["backend"], seen["kernel_options"] = args[2], kwargs.get("kernel_options")
        return build(*args, **kwargs)

    def head_spy(*args, **kwargs):
        seen["head"] = {k: kwargs[k] for k in ("keep_as", "compile_kernels", "dynamic")}
        return head(*args, **kwargs)

    monkeypatch.setattr(forward, "build_tree_attention", build_spy)
    monkeypatch.setattr(forward, "chunked_token_scores", head_spy)
    return seen


def test_a_scorer_hands_its_kernels_to_the_tree_and_the_head(make_model, scenarios, packed_tensors, spied, monkeypatch):
    for name in ("RLASYNC_TREE_ATTENTION", "RLASYNC_HEAD_KEEP", "RLASYNC_HEAD_DYNAMIC", "RLASYNC_HEAD_COMPILE"):
        monkeypatch.setenv(name, "nonsense")  # the variables of old are read no more
    model = enable_tree_attention(make_model("llama"))
    tensors = packed_tensors(*scenarios("grpo"))
    with torch.no_grad():
        chosen = TreeScorer(model, CHOSEN)(tensors)
        assert spied["backend"] == "varlen" and spied["kernel_options"] == {"BLOCK_M1": 32}
        assert spied["head"] == {"keep_as": "probs", "compile_kernels": False, "dynamic": "all"}
        default = packed_token_scores(TreeScorer(model), tensors)
        assert spied["backend"] == "auto" and spied["kernel_options"] is None
        assert spied["head"] == {"keep_as": "logits", "compile_kernels": None, "dynamic": "rows"}
    assert (chosen.logprobs - default.logprobs).abs().max() < 1e-5  # varlen (CPU reference loop) == dense


def test_explicit_arguments_of_packed_token_scores_take_a_scorers_kernels(make_model, scenarios, packed_tensors, spied):
    model = enable_tree_attention(make_model("llama"))
    tensors = packed_tensors(*scenarios("chain"))
    with torch.no_grad():
        packed_token_scores(TreeScorer(model, CHOSEN), tensors, backend="dense")
    assert spied["backend"] == "dense" and spied["head"]["keep_as"] == "probs"  # the backend named, its head kept
    with torch.no_grad():
        packed_token_scores(model, tensors, kernels=CHOSEN)
    assert spied["backend"] == "varlen"


def test_the_kernels_section_is_a_typed_config_field_for_both_trainers():
    config = load_config(None, ["kernels.tree_attention=varlen", "kernels.head_keep=probs", "kernels.head_compile=0"])
    assert config.kernels == KernelSettings(tree_attention="varlen", head_keep="probs", head_compile=False)
    assert AsyncGRPOConfig().kernels == KernelSettings()  # the defaults: today's behaviour
    distill = AsyncDistillationConfig(kernels={"flex_kernel_options": '{"BLOCK_M": 64}'})
    assert distill.kernels.flex_kernel_options == {"BLOCK_M": 64}
    assert pickle.loads(pickle.dumps(CHOSEN)) == CHOSEN
    assert config.to_dict()["kernels"]["tree_attention"] == "varlen"


@pytest.mark.parametrize(
    "override, message",
    [
        ("kernels.tree_attention=flash", "kernels.tree_attention: Input should be 'auto', 'flex', 'varlen' or 'dense'"),
        ("kernels.head_keep=softmax", "kernels.head_keep: Input should be 'logits' or 'probs'"),
        ("kernels.head_dynamic=vocab", "kernels.head_dynamic: Input should be 'rows' or 'all'"),
        ("kernels.treeattention=flex", "did you mean 'kernels.tree_attention'"),
    ],
)
def test_a_bad_value_names_the_field_and_the_allowed_values(override, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        load_config(None, [override])


def test_a_bad_value_given_in_code_names_the_field():
    with pytest.raises(
        ValueError, match="kernels.tree_attention='flash': use one of 'auto', 'flex', 'varlen', 'dense'"
    ):
        AsyncGRPOConfig(kernels={"tree_attention": "flash"})
    with pytest.raises(ValueError, match="kernels.bogus: not a kernel setting; the settings are tree_attention"):
        AsyncGRPOConfig(kernels={"bogus": 1})
    with pytest.raises(ValueError, match="kernels.head_compile='yes': use true or false"):
        KernelSettings(head_compile="yes")
