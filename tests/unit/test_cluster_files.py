"""cluster/: the ``ray up`` YAML against Ray's own cluster-config schema, the KubeRay manifests
against the fields KubeRay's v1 CRDs require, and every file installing raykv the way the README
does (from this repository, extras that exist, Ray at the version pyproject pins); the raykv
configurations they carry load and match what they run."""

from __future__ import annotations

import ast
import importlib.resources
import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import ray
import tomllib
import yaml
from deps import require

from actors.cache.settings import load_settings

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = ROOT / "cluster"
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
EXTRAS = set(PYPROJECT["project"]["optional-dependencies"])

# Required fields of KubeRay's ray.io/v1 CRDs (ray-operator/config/crd/bases/ray.io_rayclusters.yaml
# and ray.io_rayservices.yaml; identical in v1.4.0, v1.5.0 and v1.7.0, and v1.1.0 also requires
# rayStartParams in both group specs, which these manifests give). Pod templates need
# spec.containers (Kubernetes' PodSpec) and each container a name and, to run, an image.
CLUSTER_SPEC_REQUIRED = ["headGroupSpec"]
HEAD_REQUIRED = ["template", "rayStartParams"]
WORKER_REQUIRED = ["groupName", "minReplicas", "maxReplicas", "template", "rayStartParams"]


def _ray_pin() -> str:
    """The Ray version pyproject pins (``ray[serve]>=2.60,<2.61`` -> ``2.60``)."""
    (spec,) = PYPROJECT["project"]["optional-dependencies"]["serve"]
    m = re.fullmatch(r"ray\[serve\]>=(\d+\.\d+),<\d+\.\d+", spec)
    assert m, spec
    return m.group(1)


def _docs(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((CLUSTER / name).read_text()) if d]


def _installs(text: str) -> list[tuple[str, set[str]]]:
    """Every ``pip install -e <path>[extras]`` of raykv in ``text`` (comments aside): (path,
    extras)."""
    code = "\n".join(ln for ln in text.splitlines() if not ln.lstrip().startswith("#"))
    found = re.finditer(r'pip install [^\n]*-e "?([^"\s\[]+)\[([a-z0-9,]+)\]', code)
    return [(m.group(1), set(m.group(2).split(","))) for m in found]


def test_ray_up_yaml_passes_rays_schema_and_installs_raykv_from_the_repository() -> None:
    config = yaml.safe_load((CLUSTER / "raykv-cluster.yaml").read_text())
    schema = json.loads((importlib.resources.files("ray") / "autoscaler" / "ray-schema.json").read_text())
    jsonschema.validate(config, schema)
    types = config["available_node_types"]
    assert config["head_node_type"] in types
    for node in types.values():
        assert node.get("min_workers", 0) <= node.get("max_workers", 0) <= config["max_workers"]
    port = re.search(r"--head --port=(\d+)", " ".join(config["head_start_ray_commands"]))
    assert port and f"$RAY_HEAD_IP:{port.group(1)}" in " ".join(config["worker_start_ray_commands"])
    mounted = {k: v for k, v in config["file_mounts"].items() if v == "."}  # the repository
    (installs,) = [_installs(c) for c in config["setup_commands"] if "pip install" in c]
    assert installs and all(extras <= EXTRAS for _, extras in installs)
    assert [p.replace("$HOME", "~") for p, _ in installs] == list(mounted)
    assert {"serve"} <= installs[0][1] and installs[0][1] & {"ucx", "cu12", "cu13"}


def _check_group_specs(spec: dict[str, Any]) -> None:
    for key in CLUSTER_SPEC_REQUIRED:
        assert key in spec, key
    assert spec["rayVersion"].startswith(_ray_pin() + ".") and ray.__version__.startswith(_ray_pin() + ".")
    groups = [spec["headGroupSpec"], *spec.get("workerGroupSpecs", [])]
    assert all(k in spec["headGroupSpec"] for k in HEAD_REQUIRED)
    for worker in spec.get("workerGroupSpecs", []):
        missing = [k for k in WORKER_REQUIRED if k not in worker]
        assert not missing, (worker.get("groupName"), missing)
        assert worker["minReplicas"] <= worker.get("replicas", worker["minReplicas"]) <= worker["maxReplicas"]
    for group in groups:
        pod = group["template"]["spec"]
        assert pod["containers"], group
        volumes = {v["name"] for v in pod.get("volumes", [])}
        for container in pod["containers"]:
            assert container["name"] and container["image"] == "your-registry/raykv:latest"
            for mount in container.get("volumeMounts", []):
                assert mount["name"] in volumes, mount


def _config_map(docs: list[dict[str, Any]], tmp_path: Path) -> Any:
    """The raykv.toml of the manifest's ConfigMap, loaded (a disk path becomes ``tmp_path``:
    the directory exists in the pod, not here)."""
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap"]
    text = cm["data"]["raykv.toml"].replace('"/mnt/raykv"', f'"{tmp_path}"')
    path = tmp_path / "raykv.toml"
    path.write_text(text)
    return load_settings(path, {})


def test_kuberay_raycluster_has_what_the_crd_requires(tmp_path: Path) -> None:
    docs = _docs("kuberay-raycluster.yaml")
    (rc,) = [d for d in docs if d["kind"] == "RayCluster"]
    assert rc["apiVersion"] == "ray.io/v1" and rc["metadata"]["name"]
    _check_group_specs(rc["spec"])
    settings = _config_map(docs, tmp_path)
    assert settings.cache is not None and [t.kind.name for t in settings.cache.tiers] == [
        "GPU",
        "HOST",
        "DISK",
    ]


def test_kuberay_rayservice_runs_the_example_on_a_deployment_raykv_up_starts(tmp_path: Path) -> None:
    docs = _docs("kuberay-rayservice.yaml")
    (rs,) = [d for d in docs if d["kind"] == "RayService"]
    assert rs["apiVersion"] == "ray.io/v1" and "rayClusterConfig" in rs["spec"]
    _check_group_specs(rs["spec"]["rayClusterConfig"])
    (app,) = yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"]
    module, attr = app["import_path"].split(":")
    source = (ROOT / (module.replace(".", "/") + ".py")).read_text()
    (builder,) = [f for f in ast.parse(source).body if isinstance(f, ast.FunctionDef) and f.name == attr]
    assert len(builder.args.args) == 1  # Serve calls an application builder with its args
    head = rs["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    hook = " ".join(head["lifecycle"]["postStart"]["exec"]["command"])
    assert "raykv up --config /etc/raykv/raykv.toml" in hook
    settings = _config_map(docs, tmp_path)
    assert settings.deployment.namespace == app["args"]["namespace"]
    example = require("examples.serve_app", reason="needs torch and transformers")
    assert settings.cache == example.cache_config()
    assert settings.deployment.num_workers == example.TinyLLM.num_replicas


def test_dockerfile_and_requirements_install_raykv_as_the_readme_does() -> None:
    text = (CLUSTER / "Dockerfile").read_text()
    base = re.search(r"^FROM rayproject/ray:(\d+\.\d+)\.\d+-py311-gpu$", text, re.M)
    assert base and base.group(1) == _ray_pin()
    installs = _installs(text)
    assert installs and installs[0][1] <= EXTRAS and {"serve", "cu12"} <= installs[0][1]
    copied = re.search(r"^COPY \S* ?\. (\S+)$", text, re.M)
    assert copied and installs[0][0] == copied.group(1)
    assert f"ENV PYTHONPATH={copied.group(1)}" in text  # examples.* for the RayService
    lines = [ln for ln in (CLUSTER / "requirements.txt").read_text().splitlines() if ln and ln[0] != "#"]
    extras = PYPROJECT["project"]["optional-dependencies"]
    expected = [d for d in PYPROJECT["project"]["dependencies"] if "python_version" not in d]
    assert lines == expected + extras["serve"] + extras["ucx"]


def test_the_gpu_config_file_loads_and_has_the_sizes_its_comment_gives() -> None:
    settings = load_settings(CLUSTER / "raykv-gpu.toml", {})
    assert settings.cache is not None
    layout = settings.cache.layout
    assert layout.page_bytes == 2 << 20 and layout.page_bytes // layout.tokens_per_block == 128 << 10
    assert [t.capacity_bytes for t in settings.cache.tiers] == [16 << 30, 160 << 30, 1 << 40]
