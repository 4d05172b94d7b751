"""deploy/: the RayJob and the RayCluster validate strictly (an unknown field is an error, as with
`kubectl apply --validate=strict`) against KubeRay's RayJob CRD schema kept in deploy/schema/ (its
`spec.rayClusterSpec` is the RayCluster spec type), and they are manifests that run: the image is the one
deploy/Dockerfile builds (no pip at pod start), output_dir is on the shared volume mounted by the driver's pod and
the learner's, token auth is on, and no placeholder is left."""

import copy
import json
import lzma
import re
import shlex
from pathlib import Path

import pytest
import yaml

jsonschema = pytest.importorskip("jsonschema")

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


def strict(schema):
    """The CRD's structural schema as a JSON Schema that refuses unknown fields: every object node with
    `properties` and no `additionalProperties` / `x-kubernetes-preserve-unknown-fields` gets
    `additionalProperties: false`."""
    schema = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            if (
                node.get("type") == "object"
                and "properties" in node
                and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")
            ):
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


@pytest.fixture(scope="module")
def rayjob_schema():
    text = lzma.decompress((DEPLOY / "schema" / "kuberay_rayjobs_crd.yaml.xz").read_bytes())
    crd = yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # 1.4 MB: the C loader when built
    assert crd["spec"]["names"]["kind"] == "RayJob"
    (v1,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1"]
    return strict(v1["schema"]["openAPIV3Schema"])


def load(name):
    return yaml.safe_load((DEPLOY / name).read_text())


def errors(schema, document):
    validator = jsonschema.Draft202012Validator(schema)
    return sorted(f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(document))


def test_the_rayjob_validates_strictly(rayjob_schema):
    job = load("rayjob.yaml")
    assert job["apiVersion"] == "ray.io/v1" and job["kind"] == "RayJob"
    assert errors(rayjob_schema, job) == []


def test_the_raycluster_validates_as_the_rayjobs_cluster_spec(rayjob_schema):
    cluster = load("raycluster.yaml")
    assert cluster["apiVersion"] == "ray.io/v1" and cluster["kind"] == "RayCluster"
    spec_schema = rayjob_schema["properties"]["spec"]["properties"]["rayClusterSpec"]
    assert errors(spec_schema, cluster["spec"]) == []
    assert cluster["spec"] == load("rayjob.yaml")["spec"]["rayClusterSpec"]  # one cluster shape, two ways to run it


def test_the_strict_check_catches_a_misspelt_field(rayjob_schema):
    job = load("rayjob.yaml")
    job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["maxReplica"] = 4
    job["spec"]["shutdownAfterJobFinish"] = True
    found = errors(rayjob_schema, job)
    assert any("maxReplica" in e for e in found) and any("shutdownAfterJobFinish'" in e for e in found), found


def test_the_manifests_run_as_written():
    spec = load("raycluster.yaml")["spec"]
    groups = {g["groupName"]: g for g in spec["workerGroupSpecs"]}
    assert set(groups) == {"learner", "generation", "rollout"} and spec["enableInTreeAutoscaling"] is True
    assert all(g["minReplicas"] == g["replicas"] == 0 < g["maxReplicas"] for g in groups.values())
    gpus = {
        n: g["template"]["spec"]["containers"][0]["resources"]["limits"].get("nvidia.com/gpu", 0)
        for n, g in groups.items()
    }
    assert (
        gpus == {"learner": 1, "generation": 1, "rollout": 0} and groups["rollout"]["rayStartParams"]["num-gpus"] == "0"
    )
    assert spec["authOptions"] == {"mode": "token"}
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    base = re.search(r"ARG RAY_IMAGE=rayproject/ray:(\d+\.\d+\.\d+)-py311-gpu", dockerfile)
    assert base and base.group(1) == spec["rayVersion"]
    pvc = load("pvc.yaml")
    assert pvc["kind"] == "PersistentVolumeClaim" and pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    pods = {"head": spec["headGroupSpec"]["template"]["spec"], **{n: g["template"]["spec"] for n, g in groups.items()}}
    for name, pod in pods.items():
        claims = {
            v["name"]: v["persistentVolumeClaim"]["claimName"] for v in pod["volumes"] if "persistentVolumeClaim" in v
        }
        (container,) = pod["containers"]
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        assert claims == {"outputs": pvc["metadata"]["name"]} and mounts["outputs"] == "/outputs", name
        assert container["image"] == "rlasync:0.1.0", name  # the deploy/Dockerfile build, no pip at start
    job = load("rayjob.yaml")["spec"]
    assert "runtimeEnvYAML" not in job and "--set output_dir=/outputs/" in job["entrypoint"]
    config = re.search(r"rlasync train /home/ray/rlasync/(\S+)", job["entrypoint"]).group(1)
    assert (DEPLOY.parent / config).is_file() and "COPY --chown=ray:users configs ./configs" in dockerfile
    for name in ("rayjob.yaml", "raycluster.yaml", "pvc.yaml", "Dockerfile"):
        assert not re.search(r"YOUR_|CHANGEME|TODO|<[A-Z_]+>", (DEPLOY / name).read_text()), name


def test_every_pod_gives_the_driver_its_shutdown_grace():
    """SIGTERM on pod deletion: the driver needs `shutdown_grace_s` for its final checkpoint before the SIGKILL."""
    from rlasync.config import AsyncGRPOConfig

    spec = load("raycluster.yaml")["spec"]
    pods = [spec["headGroupSpec"]["template"]["spec"]] + [g["template"]["spec"] for g in spec["workerGroupSpecs"]]
    grace = AsyncGRPOConfig().shutdown_grace_s
    assert all(pod["terminationGracePeriodSeconds"] >= grace + 5 for pod in pods)


def offered(params):
    """A KubeRay `rayStartParams.resources` value ('"{\\"x\\": 1}"': a JSON string in quotes) as a dict."""
    return json.loads(json.loads(params["resources"])) if "resources" in params else {}


def test_each_role_of_the_job_lands_on_its_own_group_and_the_elastic_pool_fits_it():
    """rayjob.yaml's run (its config with the entrypoint's `--set`s: `cluster.resources`, `cluster.elastic`) against
    the groups it runs on: each role asks for a custom resource exactly one group (or the head) offers, an actor's
    amount fits a pod, and the pools at their largest fit the groups' maxReplicas. tests/integration/test_multinode.py
    runs these groups (read from raycluster.yaml) and this `cluster.resources` under Ray's autoscaler."""
    from rlasync.runfile import load_run

    job = load("rayjob.yaml")["spec"]
    words = shlex.split(job["entrypoint"])
    path = DEPLOY.parent / words[words.index("train") + 1].removeprefix("/home/ray/rlasync/")
    run = load_run(path, [word for flag, word in zip(words, words[1:], strict=False) if flag == "--set"])
    cluster, spec = run.config.cluster, job["rayClusterSpec"]
    groups = {g["groupName"]: g for g in spec["workerGroupSpecs"]}
    resources = {"head": offered(spec["headGroupSpec"]["rayStartParams"])}
    resources.update({name: offered(g["rayStartParams"]) for name, g in groups.items()})
    names = [name for held in resources.values() for name in held]
    assert len(names) == len(set(names)) == len(resources), resources  # one resource of its own per group
    biggest = {
        "learner": cluster.num_learners,
        "generation": cluster.pool_bounds("generation")[1],
        "rollout": cluster.pool_bounds("rollout")[1],
        "queue": 1,
    }
    home = {"learner": "learner", "generation": "generation", "rollout": "rollout", "queue": "head"}
    for role, group in home.items():
        wanted = cluster.role_resources(role)
        assert wanted and {g for g, held in resources.items() if set(wanted) & set(held)} == {group}, (role, wanted)
        per_pod = min(resources[group][name] // amount for name, amount in wanted.items())
        assert per_pod >= 1, (role, wanted, resources[group])
        pods = groups[group]["maxReplicas"] if group in groups else 1
        assert biggest[role] <= pods * per_pod, (role, biggest[role], pods, per_pod)
    assert cluster.elastic and cluster.pool_bounds("generation")[1] > cluster.num_generation_actors
    for group in groups.values():
        assert 0 <= group["minReplicas"] <= group["maxReplicas"], group["groupName"]
    options = spec["autoscalerOptions"]
    assert options["upscalingMode"] in ("Default", "Conservative", "Aggressive")
    assert 0 < options["idleTimeoutSeconds"] <= 600  # idle pods go; a GPU pod's start is minutes, so not at once
    gpus = {
        n: g["template"]["spec"]["containers"][0]["resources"]["limits"].get("nvidia.com/gpu", 0)
        for n, g in groups.items()
    }
    assert cluster.learner_num_gpus <= gpus["learner"] and cluster.generation_num_gpus <= gpus["generation"]
