"""The Kubernetes manifests of deploy/ (issue 29, item 1): `kubectl kustomize` renders the base
and the distributed overlay, every rendered resource (and the example Secrets) validates
strictly against a current Kubernetes version's schema with kubernetes-validate, and what the
manifests tell Tollgate is what Tollgate reads: every container's arguments parse with the real
CLI, every ConfigMap key is a variable the code reads, every Secret reference names a key the
example Secrets have, and the probes are where the processes answer."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any
from unittest import mock

import click
import kubernetes_validate
import pytest
import yaml

from tollgate_llm.cli import main

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
# The newest Kubernetes release kubernetes-validate has schemas for (1.37 with its 1.37.0), and
# one a managed cluster may still run: the manifests use nothing newer than policy/v1 and
# batch/v1's ttlSecondsAfterFinished.
KUBERNETES_VERSION = "1.33.0"
KUBERNETES_VERSIONS = (KUBERNETES_VERSION, kubernetes_validate.latest_version())
KUSTOMIZATIONS = ("base", "overlays/distributed")


def render(path: str) -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl is needed to render deploy/ (it is on the CI machines)"
    done = subprocess.run(
        [kubectl, "kustomize", str(DEPLOY / path)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


def by_kind(docs: list[dict[str, Any]], kind: str) -> dict[str, dict[str, Any]]:
    return {d["metadata"]["name"]: d for d in docs if d["kind"] == kind}


def containers(docs: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    found = []
    for d in docs:
        if d["kind"] in ("Deployment", "Job"):
            for c in d["spec"]["template"]["spec"]["containers"]:
                found.append((d["metadata"]["name"], c))
    return found


def example_secrets() -> dict[str, dict[str, str]]:
    docs = yaml.safe_load_all((DEPLOY / "secrets.example.yaml").read_text())
    return {d["metadata"]["name"]: d["stringData"] for d in docs if d}


@pytest.fixture(scope="module", params=KUSTOMIZATIONS)
def rendered(request: pytest.FixtureRequest) -> tuple[str, list[dict[str, Any]]]:
    return request.param, render(request.param)


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_rendered_resource_validates_strictly(
    rendered: tuple[str, list[dict[str, Any]]], version: str
) -> None:
    _, docs = rendered
    examples = [d for d in yaml.safe_load_all((DEPLOY / "secrets.example.yaml").read_text()) if d]
    for doc in [*docs, *examples]:
        # Raises ValidationError naming the field; strict: an unknown field is an error too.
        kubernetes_validate.validate(doc, version, strict=True)


def test_the_validator_refuses_what_kubernetes_would() -> None:
    """The check above can fail: a misspelt field and a wrong type are refused."""
    api = by_kind(render("base"), "Deployment")["tollgate-api"]
    misspelt = {**api, "spec": {**api["spec"], "replica": 3}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(misspelt, KUBERNETES_VERSION, strict=True)
    wrong = {**api, "spec": {**api["spec"], "replicas": "three"}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(wrong, KUBERNETES_VERSION, strict=True)


def test_the_distributed_overlay_runs_the_pipeline(
    rendered: tuple[str, list[dict[str, Any]]],
) -> None:
    name, docs = rendered
    deployments = by_kind(docs, "Deployment")
    assert deployments["tollgate-api"]["spec"]["replicas"] >= 2
    assert "tollgate-migrate" in by_kind(docs, "Job")
    assert "tollgate-api" in by_kind(docs, "PodDisruptionBudget")
    config = by_kind(docs, "ConfigMap")["tollgate-config"]["data"]
    if name == "base":
        assert set(deployments) == {"tollgate-api", "tollgate-worker"}
        assert deployments["tollgate-worker"]["spec"]["replicas"] == 1
        assert "TOLLGATE_KAFKA_BOOTSTRAP" not in config
    else:
        assert set(deployments) == {
            "tollgate-api",
            "tollgate-worker",
            "tollgate-relay",
            "tollgate-batch-runner",
        }
        assert deployments["tollgate-worker"]["spec"]["replicas"] >= 2
        assert deployments["tollgate-relay"]["spec"]["strategy"]["type"] == "Recreate"
        assert config["TOLLGATE_KAFKA_BOOTSTRAP"]
        assert "tollgate-worker" in by_kind(docs, "PodDisruptionBudget")
        # The Kafka credentials only where the broker is spoken to.
        for component, wanted in (
            ("tollgate-api", False),
            ("tollgate-worker", True),
            ("tollgate-relay", True),
            ("tollgate-batch-runner", False),
        ):
            env = deployments[component]["spec"]["template"]["spec"]["containers"][0]["env"]
            refs = {e["name"]: e["valueFrom"]["secretKeyRef"]["name"] for e in env}
            has = refs.get("TOLLGATE_KAFKA_SASL_PASSWORD") == "tollgate-kafka"
            assert has == wanted, component  # fmt: skip


def test_every_container_argument_parses_with_the_cli(
    rendered: tuple[str, list[dict[str, Any]]],
) -> None:
    _, docs = rendered
    config = by_kind(docs, "ConfigMap")["tollgate-config"]["data"]
    secrets = example_secrets()
    for owner, container in containers(docs):
        # The container's environment: the ConfigMap, then its own variables (the Secrets'
        # example values), and nothing of this machine's.
        env = dict(config)
        for e in container.get("env", []):
            ref = e.get("valueFrom", {}).get("secretKeyRef")
            env[e["name"]] = secrets[ref["name"]][ref["key"]] if ref else e["value"]
        args = container["args"]
        command = main.get_command(click.Context(main), args[0])
        assert command is not None, f"{owner}: no command {args[0]!r}"
        if isinstance(command, click.Group):
            command, args = command.get_command(click.Context(command), args[1]), args[1:]
            assert command is not None, f"{owner}: {container['args']}"
        # Parses the options (types, choices, unknown flags, required ones the environment
        # gives) without running the command.
        with mock.patch.dict(os.environ, env, clear=True):
            command.make_context(args[0], list(args[1:]))


def test_every_setting_is_one_the_code_reads(
    rendered: tuple[str, list[dict[str, Any]]],
) -> None:
    _, docs = rendered
    from tollgate_llm.api.config import ENV_PREFIX, Settings

    code = "\n".join(
        p.read_text()
        for folder in ("api", "streams", "ledger", "cli")
        for p in (REPO / folder).rglob("*.py")
    )
    # A setting's variable is its field's name (api/config.py), never written out as a string.
    read = set(re.findall(r"TOLLGATE_[A-Z0-9_]+", code))
    read |= {ENV_PREFIX + name.upper() for name in Settings.model_fields}
    config = by_kind(docs, "ConfigMap")["tollgate-config"]["data"]
    names = set(config)
    for _, container in containers(docs):
        names |= {e["name"] for e in container.get("env", [])}
    for name in sorted(names):
        if name.startswith("TOLLGATE_KAFKA_") and name not in read:
            continue  # a librdkafka setting by name (api/config.py, the kafka setting)
        assert name in read, f"{name} is set by deploy/ but read nowhere in the code"


def test_secret_references_name_keys_of_the_example_secrets(
    rendered: tuple[str, list[dict[str, Any]]],
) -> None:
    _, docs = rendered
    examples = example_secrets()
    for owner, container in containers(docs):
        for e in container.get("env", []):
            ref = e.get("valueFrom", {}).get("secretKeyRef")
            if ref:
                assert ref["key"] in examples.get(ref["name"], set()), (owner, ref)
        # The database URL is never in the ConfigMap or a literal.
        plain = {e["name"]: e.get("value") for e in container.get("env", [])}
        assert plain.get("TOLLGATE_DATABASE_URL") is None, owner


def test_probes_and_shutdown(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, docs = rendered
    deployments = by_kind(docs, "Deployment")
    api = deployments["tollgate-api"]["spec"]["template"]["spec"]
    (edge,) = api["containers"]
    assert edge["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert edge["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert "--host=0.0.0.0" in edge["args"]  # else the edge listens on the pod's loopback only
    # The longest stream (4,096 tokens at the 40 ms TPOT target: 164 s) and the preStop pause
    # fit in the grace (deploy/README.md, "Shutdown").
    pause_s = int(edge["lifecycle"]["preStop"]["exec"]["command"][1])
    assert api["terminationGracePeriodSeconds"] >= 4096 * 0.040 + pause_s
    config = by_kind(docs, "ConfigMap")["tollgate-config"]["data"]
    assert config["TOLLGATE_METRICS_HOST"] == "0.0.0.0"
    for name in ("tollgate-worker", "tollgate-relay"):
        if name not in deployments:
            continue
        (c,) = deployments[name]["spec"]["template"]["spec"]["containers"]
        port = {p["name"]: p["containerPort"] for p in c["ports"]}["metrics"]
        assert str(port) == config["TOLLGATE_METRICS_PORT"]
        assert c["livenessProbe"]["tcpSocket"]["port"] == "metrics"


def test_the_image_is_built_from_every_installed_package() -> None:
    # The image installs what it copies: a package the wheel lists but the Containerfile leaves
    # out is missing in the container (`cli/` once was, and the image's `tollgate` could not
    # start). The long tier builds and runs the image; this holds the list in every run.
    import tomllib

    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    containerfile = (REPO / "deploy" / "Containerfile").read_text()
    setuptools = config["tool"]["setuptools"]
    folders = [p.rstrip("*") for p in setuptools["packages"]["find"]["include"]]
    for folder in [*folders, *setuptools["package-dir"].values()]:
        assert f"COPY {folder} /src/{folder}\n" in containerfile, folder
