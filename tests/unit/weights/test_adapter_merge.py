"""The built-in engine's grouped adapter merge (one baddbmm per shape group) equals the per-module merge
W = W0 + B' @ A, keeps W0 across syncs (no accumulation) and groups modules of different ranks apart."""

import pytest
import torch

from rlasync.weights.adapter import AdapterMerger


class Layers(torch.nn.Module):
    def __init__(self, dtype):
        super().__init__()
        torch.manual_seed(0)
        shapes = {"q": (12, 8), "k": (4, 8), "v": (4, 8), "o": (8, 12), "up": (16, 8)}
        self.mods = torch.nn.ModuleDict(
            {n: torch.nn.Linear(i, o, bias=False, dtype=dtype) for n, (o, i) in shapes.items()}
        )


def adapter(model, seed, ranks):
    torch.manual_seed(seed)
    out = []
    for name, linear in model.mods.items():
        r = ranks.get(name, 4)
        out.append((f"mods.{name}.lora_A.weight", torch.randn(r, linear.in_features)))
        out.append((f"mods.{name}.lora_B.weight", torch.randn(linear.out_features, r)))
    return out


def reference(w0, stream, dtype):
    """Per module, in float32: W0 + B' @ A, cast once."""
    pairs = dict(stream)
    return {
        n: (w.float() + pairs[f"mods.{n}.lora_B.weight"].float() @ pairs[f"mods.{n}.lora_A.weight"].float()).to(dtype)
        for n, w in w0.items()
    }


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_merge_equals_the_per_module_merge_and_never_accumulates(dtype):
    model = Layers(dtype)
    w0 = {n: m.weight.detach().clone() for n, m in model.mods.items()}
    merger = AdapterMerger()
    ranks = {"o": 2}  # a rank of its own: a group of its own
    for seed in range(3):
        stream = [(n, t.to(dtype)) for n, t in adapter(model, seed, ranks)]
        assert merger.load(model, stream) == 5
        expected = reference(w0, stream, dtype)
        for name, module in model.mods.items():
            if dtype == torch.float32:
                torch.testing.assert_close(module.weight, expected[name], rtol=1e-6, atol=1e-5)
            else:  # one bf16 rounding of a float32 result either way: at most one ulp apart
                torch.testing.assert_close(module.weight.float(), expected[name].float(), rtol=2**-7, atol=1e-2)
    assert len(merger._groups) == 4  # k and v share (4, 8, r=4); q, o (r=2), up alone
    assert all(torch.equal(merger.base[f"mods.{n}"], w) for n, w in w0.items())


def test_a_new_module_joins_its_group_keeping_the_others_w0():
    model = Layers(torch.float32)
    w0 = {n: m.weight.detach().clone() for n, m in model.mods.items()}
    merger = AdapterMerger()
    stream = adapter(model, 0, {})
    merger.load(model, [item for item in stream if ".v." not in item[0]])
    merger.load(model, stream)  # v arrives later: its W0 is kept now, the others' W0 stay the first sync's
    expected = reference(w0, stream, torch.float32)
    for name, module in model.mods.items():
        torch.testing.assert_close(module.weight, expected[name], rtol=1e-6, atol=1e-5)
