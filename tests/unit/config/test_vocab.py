"""One vocabulary per concept (rlasync.config.vocab): engine kinds, weight transports, trackers and LoRA syncs are
spelled once, each with its capability table, checked once by the config with an error naming the field and the
allowed values; code asks a member's traits instead of testing its name."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import yaml

from rlasync.config import AsyncDistillationConfig, AsyncGRPOConfig, ClusterConfig
from rlasync.config.vocab import (
    ENGINE_TRAITS,
    REPORT_TO,
    TRACKER_TRAITS,
    TRANSPORT_TRAITS,
    EngineKind,
    LoraMode,
    LoraSync,
    Tracker,
    WeightTransport,
    parse_engine,
    parse_report_to,
    parse_weight_sync_backend,
)

REPO = Path(__file__).resolve().parents[3]
VOCAB = REPO / "rlasync" / "config" / "vocab.py"
VOCABULARIES = {
    "engine kind": {k.value for k in EngineKind},
    "weight transport": {t.value for t in WeightTransport},
    "tracker": {t.value for t in Tracker},
}
OTHER_VOCABULARIES = {
    # files that speak another vocabulary spelled like a weight transport: torch.distributed's process-group
    # backends ("nccl", "gloo"), and the weight payload's item encodings ("raw", "b64", "ipc")
    "rlasync/weights/broadcast.py": {"weight transport"},
    "rlasync/engine/vllm_worker.py": {"weight transport"},
}


def _docstrings(tree: ast.AST) -> set[int]:
    return {
        id(node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
    }


def _named_in(node: ast.AST, words: set[str]) -> list[str]:
    """The vocabulary words a comparison operand, container literal or dict key spells as a string constant."""
    if isinstance(node, ast.Constant) and node.value in words:
        return [node.value]
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return [e.value for e in node.elts if isinstance(e, ast.Constant) and e.value in words]
    return []


def spelled_outside(repo: Path = REPO, roots: tuple[str, ...] = ("rlasync", "actors")) -> list[str]:
    """Every place outside rlasync/config/vocab.py that tests or lists a vocabulary word: a comparison with it
    (`== "vllm_server"`, `in ("torch", "vllm")`), a container of two or more of one vocabulary's words, a dict key,
    or the word "vllm_server" anywhere but a docstring."""
    found = []
    for root in roots:
        for path in sorted((repo / root).rglob("*.py")):
            if path == VOCAB:
                continue
            rel = path.relative_to(repo).as_posix()
            tree = ast.parse(path.read_text(), filename=rel)
            docstrings = _docstrings(tree)
            found += [
                f"{rel}:{node.lineno}: engine kind {node.value!r}"
                for node in ast.walk(tree)
                if isinstance(node, ast.Constant)
                and node.value == EngineKind.VLLM_SERVER.value
                and id(node) not in docstrings
            ]
            for vocabulary, words in VOCABULARIES.items():
                if vocabulary in OTHER_VOCABULARIES.get(rel, ()):
                    continue
                for node in ast.walk(tree):
                    hits: list[str] = []
                    if isinstance(node, ast.Compare):
                        for operand in (node.left, *node.comparators):
                            hits += _named_in(operand, words)
                    elif isinstance(node, ast.Tuple | ast.List | ast.Set) and len(_named_in(node, words)) >= 2:
                        hits += _named_in(node, words)
                    elif isinstance(node, ast.Dict):
                        hits += [w for key in node.keys if key is not None for w in _named_in(key, words)]
                    found += [f"{rel}:{node.lineno}: {vocabulary} {hit!r}" for hit in dict.fromkeys(hits)]
    return sorted(set(found))


def test_each_vocabulary_is_spelled_only_in_its_defining_module():
    assert spelled_outside() == []


def test_the_scan_finds_a_kind_string_test(tmp_path):
    """The scan is not vacuous: the tests it exists to catch are found."""
    sample = tmp_path / "rlasync" / "sample.py"
    sample.parent.mkdir()
    sample.write_text(
        'def f(cluster, plan, names):\n    if cluster.engine == "vllm_server":\n        return 1\n'
        '    if plan.kind != "ipc":\n        return 2\n    LOCAL = ("torch", "vllm")\n'
        '    return "wandb" in names\n'
    )
    assert spelled_outside(tmp_path, ("rlasync",)) == [
        "rlasync/sample.py:2: engine kind 'vllm_server'",
        "rlasync/sample.py:4: weight transport 'ipc'",
        "rlasync/sample.py:6: engine kind 'torch'",
        "rlasync/sample.py:6: engine kind 'vllm'",
        "rlasync/sample.py:7: tracker 'wandb'",
    ]


# ---- the capability tables ----------------------------------------------------------------------------------------


def test_every_member_has_its_traits():
    assert set(ENGINE_TRAITS) == set(EngineKind) and set(TRANSPORT_TRAITS) == set(WeightTransport)
    assert set(TRACKER_TRAITS) == set(Tracker)
    assert all(kind.traits is ENGINE_TRAITS[kind] for kind in EngineKind)


def test_engine_traits_say_how_the_kinds_differ():
    torch, vllm, server = (kind.traits for kind in (EngineKind.TORCH, EngineKind.VLLM, EngineKind.VLLM_SERVER))
    assert [t.remote for t in (torch, vllm, server)] == [False, False, True]
    assert [t.needs_url for t in (torch, vllm, server)] == [False, False, True]
    assert [t.lora for t in (torch, vllm, server)] == [LoraMode.MERGED, LoraMode.RUNTIME, LoraMode.RUNTIME]
    assert [t.vllm_in_process for t in (torch, vllm, server)] == [False, True, False]


def test_transport_traits_say_how_the_kinds_differ():
    nccl, gloo, ipc = (kind.traits for kind in (WeightTransport.NCCL, WeightTransport.GLOO, WeightTransport.IPC))
    assert (nccl.process_group, gloo.process_group, ipc.process_group) == ("nccl", "gloo", None)
    assert (nccl.device, gloo.device, ipc.device) == ("cuda", "cpu", "sender")
    assert (nccl.same_device, gloo.same_device, ipc.same_device) == (False, False, True)
    assert (nccl.stages, gloo.stages, ipc.stages) == (True, True, False)


def test_each_dispatch_table_covers_its_vocabulary():
    from rlasync.engine.factory import BUILDERS
    from rlasync.weights.transport import SENDERS, IpcSender

    assert set(BUILDERS) == set(EngineKind)
    assert set(SENDERS) == set(WeightTransport)
    assert all((SENDERS[k] is IpcSender) == (k.traits.process_group is None) for k in WeightTransport)


def test_the_engine_kwargs_of_a_lora_run_follow_the_engine_traits():
    from types import SimpleNamespace

    from rlasync.weights.adapter import lora_engine_kwargs

    peft = SimpleNamespace(r=12, rank_pattern={})
    got = {kind: lora_engine_kwargs(peft, kind, max_loras=3, lora_dir="/a") for kind in EngineKind}
    assert got[EngineKind.TORCH] == {}  # merges the adapter itself
    assert got[EngineKind.VLLM_SERVER] == {"lora_dir": "/a", "max_loras": 3}
    assert got[EngineKind.VLLM] == {"lora_dir": "/a", "max_loras": 3, "enable_lora": True, "max_lora_rank": 16}


def test_make_engine_asks_the_traits_for_the_url():
    from rlasync.engine.factory import make_engine

    with pytest.raises(ValueError, match=r"cluster.vllm_server_url is set but cluster.engine='torch'.*'vllm_server'"):
        make_engine("torch", "m", base_url="http://x:8000")
    with pytest.raises(ValueError, match=r"cluster.engine='vllm_server' needs cluster.vllm_server_url"):
        make_engine("vllm_server", "m")
    with pytest.raises(ValueError, match=r"cluster.engine='tgi': must be one of 'torch', 'vllm' or 'vllm_server'"):
        make_engine("tgi", "m")


def test_the_transport_choice_returns_members_and_asks_the_traits():
    from rlasync.weights.transport import TransportPlan, choose_kind

    cpu = {"node": "n", "device": "cpu", "gpu": None}
    gpus = [{"node": "n", "device": "cuda", "gpu": i} for i in range(3)]
    assert choose_kind(gpus[0], gpus[1:]) == (WeightTransport.NCCL, None)
    assert choose_kind(gpus[0], [gpus[0], gpus[0]])[0] is WeightTransport.IPC
    assert choose_kind(cpu, [cpu], "ipc")[0] is WeightTransport.IPC
    assert choose_kind(cpu, [cpu], "gloo")[0] is WeightTransport.GLOO
    with pytest.raises(ValueError, match=r"weight_sync_backend='ipc' needs every engine on learner rank 0's node"):
        choose_kind(gpus[0], gpus[1:], "ipc")
    with pytest.raises(ValueError, match=r"weight_sync_backend='mpi': choose one of 'auto', 'nccl', 'gloo' or 'ipc'"):
        choose_kind(cpu, [cpu], "mpi")
    plan = TransportPlan(kind="ipc", host="h", port=1, world_size=2, timeout_s=1.0)  # a plain string is coerced
    assert plan.kind is WeightTransport.IPC and plan.kind.traits.process_group is None
    with pytest.raises(ValueError):
        TransportPlan(kind="mpi", host="h", port=1, world_size=2, timeout_s=1.0)


# ---- the one check, in the typed config ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"cluster": {"engine": "tgi"}}, r"cluster.engine='tgi': must be one of 'torch', 'vllm' or 'vllm_server'"),
        (
            {"cluster": {"weight_sync_backend": "mpi"}},
            r"cluster.weight_sync_backend='mpi': choose one of 'auto', 'nccl', 'gloo' or 'ipc'",
        ),
        ({"cluster": {"lora_sync": "delta"}}, r"cluster.lora_sync='delta': use 'adapter' .* or 'merged'"),
        (
            {"report_to": ["wandb", "comet_ml"]},
            r"report_to=\['wandb', 'comet_ml'\]: unsupported sink\(s\) \['comet_ml'\]",
        ),
        (
            {"cluster": {"engine": "vllm_server"}},
            r"cluster.vllm_server_url is required with cluster.engine='vllm_server'",
        ),
        (
            {"cluster": {"engine": "vllm", "vllm_server_url": "http://x:8000"}},
            r"cluster.vllm_server_url is set but cluster.engine='vllm': set cluster.engine='vllm_server'",
        ),
    ],
)
@pytest.mark.parametrize("config_class", [AsyncGRPOConfig, AsyncDistillationConfig])
def test_a_bad_choice_is_refused_naming_the_field_and_the_allowed_values(config_class, changes, message):
    with pytest.raises(ValueError, match=message):
        config_class(**changes)


def test_the_config_holds_members_and_dumps_plain_strings():
    config = AsyncGRPOConfig(
        report_to=["wandb", "none"],
        cluster=ClusterConfig(engine="vllm", weight_sync_backend="ipc", lora_sync="merged"),
    )
    cluster = config.cluster
    assert cluster.engine is EngineKind.VLLM and cluster.engine == "vllm" and cluster.engine.traits.vllm_in_process
    assert cluster.weight_sync_backend is WeightTransport.IPC and cluster.lora_sync is LoraSync.MERGED
    assert config.report_to == [Tracker.WANDB] and AsyncGRPOConfig().cluster.weight_sync_backend == "auto"
    plain = config.to_dict()
    assert type(plain["cluster"]["engine"]) is str and type(plain["report_to"][0]) is str
    assert yaml.safe_load(yaml.safe_dump(plain))["cluster"]["engine"] == "vllm"


def test_parse_functions_accept_members_and_their_strings():
    assert parse_engine(EngineKind.VLLM_SERVER) is parse_engine("vllm_server") is EngineKind.VLLM_SERVER
    assert parse_weight_sync_backend("auto") == "auto" and parse_weight_sync_backend("nccl") is WeightTransport.NCCL
    assert parse_report_to(None) == parse_report_to("") == parse_report_to("none") == []
    assert parse_report_to(["mlflow", "all", "mlflow"]) == [Tracker.MLFLOW, "all"]
    assert set(REPORT_TO) == {*Tracker, "all", "none"}
