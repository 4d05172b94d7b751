"""rlasync.model.compilation: `torch_compile` resolved per device ("auto" = compiled on CUDA only; explicit values as
TRL; a backend or mode turns it on), inductor's cache folder under RLASYNC_CACHE unless the user chose one, and the
compile timer that `perf/compile_s` reads."""

import os

import pytest
import torch

from rlasync.model.compilation import compile_seconds, resolve_torch_compile, use_compile_cache


@pytest.mark.parametrize(
    ("value", "cuda", "backend", "mode", "expected"),
    [
        (None, True, None, None, True),  # auto on CUDA: compiled
        (None, False, None, None, False),  # auto on the CPU: eager
        (True, False, None, None, True),  # explicit True compiles on the CPU too (TRL's meaning)
        (True, True, None, None, True),
        (False, True, None, None, False),  # explicit False never compiles
        (False, False, None, None, False),
        (None, False, "aot_eager", None, True),  # a backend asks for compilation (transformers' rule)
        (None, False, None, "max-autotune", True),  # so does a mode
    ],
)
def test_torch_compile_resolves_per_device(value, cuda, backend, mode, expected):
    assert resolve_torch_compile(value, cuda=cuda, backend=backend, mode=mode) is expected


def test_a_torch_compile_that_is_not_a_boolean_is_refused_by_name():
    with pytest.raises(ValueError, match="torch_compile='fast': use true .compile., false .eager. or leave it unset"):
        resolve_torch_compile("fast", cuda=True)


@pytest.fixture
def clean_env(tmp_path, monkeypatch):
    monkeypatch.setenv("RLASYNC_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    return tmp_path


def test_the_cache_goes_under_rlasync_cache_unless_the_user_chose_one(clean_env, monkeypatch):
    chosen = use_compile_cache()
    assert chosen == clean_env / "cache" / "inductor" and chosen.is_dir()
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(chosen)
    from torch._inductor.runtime.cache_dir_utils import cache_dir, triton_cache_dir

    assert cache_dir() == str(chosen)  # what inductor itself now uses
    if "TRITON_CACHE_DIR" not in os.environ:
        assert triton_cache_dir(0).startswith(str(chosen))  # Triton's kernels follow inductor's folder

    mine = clean_env / "mine"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(mine))
    assert use_compile_cache() == mine and os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(mine)  # kept
    assert not mine.exists()  # not even created: the user's folder is the user's business


def test_torchs_own_temporary_default_counts_as_unset(clean_env, monkeypatch):
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())  # what inductor writes on its first use
    assert use_compile_cache() == clean_env / "cache" / "inductor"


def test_the_local_graph_caches_are_turned_on_unless_the_user_set_them(clean_env, monkeypatch):
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    monkeypatch.setattr(inductor_config, "fx_graph_cache", False)
    monkeypatch.setattr(functorch_config, "enable_autograd_cache", False)
    monkeypatch.setenv("TORCHINDUCTOR_AUTOGRAD_CACHE", "0")  # the user's choice stands
    use_compile_cache()
    assert inductor_config.fx_graph_cache is True and functorch_config.enable_autograd_cache is False


def test_compile_seconds_counts_a_compile_and_nothing_else():
    torch._dynamo.reset()
    function = torch.compile(lambda x: torch.sin(x) * 2, backend="aot_eager")
    before = compile_seconds()
    x = torch.randn(4, requires_grad=True)
    function(x).sum().backward()
    compiled = compile_seconds()
    assert compiled > before
    function(x).sum().backward()  # cached graph: no compile
    torch.sin(x)
    assert compile_seconds() == compiled
    torch._dynamo.reset()


def test_compiled_layers_serve_every_row_length_with_one_graph(make_model):
    """The learner's regional compile is dynamic from the first call: rows of a new length reuse the graph (Dynamo's
    default compiles the first length statically and again at the second: what the frame count shows without it)."""
    from torch._dynamo.testing import CompileCounter

    from rlasync.model.checkpointing import decoder_layers
    from rlasync.model.loading import compile_decoder_layers, uncompile_decoder_layers

    def frames(compile_layers) -> int:
        torch._dynamo.reset()
        model, counter = make_model("llama"), CompileCounter()
        compile_layers(model, counter)
        with torch.no_grad():
            for length in (10, 14, 22):  # none a size of the model (Dynamo gives equal sizes one symbol)
                model(torch.arange(length)[None], use_cache=False)
        uncompile_decoder_layers(model)
        return counter.frame_count

    assert frames(lambda model, counter: compile_decoder_layers(model, backend=counter)) == 1

    def dynamos_default(model, counter):
        for layer in decoder_layers(model):
            layer.compile(backend=counter)

    assert frames(dynamos_default) == 2  # the reference: a second, dynamic graph at the second length
    torch._dynamo.reset()


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_modes_that_replay_cuda_graphs_keep_static_row_shapes(make_model, monkeypatch, mode):
    from rlasync.model.loading import compile_decoder_layers

    model, seen = make_model("llama"), []
    monkeypatch.setattr(torch.nn.Module, "compile", lambda self, **kwargs: seen.append(kwargs))
    compile_decoder_layers(model, mode=mode)
    assert seen == [{"mode": mode}] * 2
    compile_decoder_layers(model, mode="default")
    assert seen[2:] == [{"mode": "default", "dynamic": True}] * 2
